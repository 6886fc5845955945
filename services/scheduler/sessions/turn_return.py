"""How a turn's state returns to its session, the three ways it can: as the turn left it
(`keep_finished`), as it was when the turn began (`back_to_start`: the rollback copy every
turn takes), or at a chat reply's start (`keep_reply_start`, docs/ownership.md); for a
chat reply re-encoded, `keep_reencoded` takes the best of the last two. Each moves
slots only; `SessionManager` records what the session then holds."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.allocators import handover
from services.scheduler.allocators.pools import Pools
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.ownership.errors import PoolExhausted
from services.scheduler.ownership.lease import new_lease
from services.scheduler.records.request import Request


def keep_finished(pools: Pools, req: Request) -> None:
    """The session takes the finished turn's state, its KV trimmed to what was computed
    (an over-allocated tail: scenario S5, docs/scenarios.md)."""
    session, start = req.session, req.turn_start
    pools.kv.free_tail(req.slots.row.slot, req.computed, "trim")
    if start is not None and start.rollback is not None:
        start.rollback.release("turn_done")
    session.slots = handover.save(pools, req.slots, session.owner)
    session.cache_node, req.cache_node = req.cache_node, None


def back_to_start(pools: Pools, req: Request) -> None:
    """The session takes back its state copied at the turn's start (the turn's state and
    KV past that point are freed)."""
    session, start = req.session, req.turn_start
    pools.kv.free_tail(req.slots.row.slot, start.cached_len, "rollback")
    session.slots = handover.save(pools, req.slots, session.owner, start.rollback)
    session.cache_node, req.cache_node = req.cache_node, None


def keep_reencoded(
    pools: Pools,
    cache: RadixCache,
    req: Request,
    at_reply_start: bool,
    keep_boundary: Callable[[Request], None] | None,
) -> tuple[int, bool]:
    """A chat reply the session cannot keep as generated (chat_log.py): the state returns
    at the reply's start if `at_reply_start` and the turn's snapshot is there (with
    `keep_boundary` given the page-aligned snapshot before it), else at the turn's start.
    Returns the positions the session then holds (0: none, the turn had no state to
    return to; the caller releases its slots) and whether they end at the reply's
    start."""
    kept = keep_reply_start(pools, cache, req, keep_boundary) if at_reply_start else None
    if kept is not None:
        return kept, True
    start = req.turn_start
    if start is None or start.rollback is None:
        return 0, False
    back_to_start(pools, req)
    return start.cached_len, False


def keep_reply_start(
    pools: Pools,
    cache: RadixCache,
    req: Request,
    keep_boundary: Callable[[Request], None] | None,
) -> int | None:
    """The session keeps the turn's state at its chat reply's start: its track snapshot
    there moves to the session, the turn's working state and the KV past it are freed.
    First, a session that may branch gives `keep_boundary` the snapshot at the page
    boundary before it, the turn's kept boundary (the one at the reply start lies inside
    a page, where no cache node ends). Returns the positions kept; None, nothing moved,
    when the snapshot is not there (not taken, or not the latest) or no slot can refill
    the track."""
    session, start, track = req.session, req.turn_start, req.slots.track
    snap = track.latest_snapshot()
    if snap is None or snap.seq_len != req.reply_start:
        return None
    if not pools.mamba.free_count:  # the track refills the slot it gives
        cache.evict_mamba(1)  # the cache gives way, as for a donation to it
    try:
        kept = track.donate_latest(session.owner, "reply_start")
    except PoolExhausted:
        return None
    if start is not None and start.rollback is not None:
        start.rollback.release("turn_done")
    if keep_boundary is not None:  # the turn can no longer go back to its start
        keep_boundary(req)
    pools.kv.free_tail(req.slots.row.slot, kept.seq_len, "reply_start")
    state = new_lease(pools.mamba, session.owner, kept.slot)
    session.slots = handover.save(pools, req.slots, session.owner, state)
    session.cache_node, req.cache_node = req.cache_node, None
    return kept.seq_len
