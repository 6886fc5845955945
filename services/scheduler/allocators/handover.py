"""Handing a finished turn's state to its session, and back to the next turn.

Between turns a session owns its row, its KV pages and one Mamba slot with its state;
while a turn runs, the turn's request owns them (the slot as the committed half of its
working pair). Both moves are transfers of every slot, so the
state is never held (or counted) by both, and the side that gave it up keeps only dead
leases. Track slots and speculative slots belong to a running request only and are
freed at save.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.request_slots import (
    RequestSlots,
    row_state_claims,
    take_spec_slots,
)
from services.scheduler.allocators.track_buffer import TrackSlots
from services.scheduler.allocators.working_slots import WorkingSlots
from services.scheduler.ownership.errors import PoolExhausted
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.lease import Lease, new_lease
from services.scheduler.ownership.owners import Owner, OwnerKind


@dataclass(slots=True)
class SessionSlots:
    owner: Owner  # session:<sid>
    row: Lease
    working: Lease
    borrowed: int = 0
    ready: bool = True  # False while a restore from the host tier has yet to write it

    def claims(self, pools: Pools) -> list[Claim]:
        return row_state_claims(pools, self.owner, self.row, [self.working.slot], self.borrowed)


def save(
    pools: Pools, req: RequestSlots, session: Owner, state: Lease | None = None
) -> SessionSlots:
    """request -> session: the row and the request's own KV pages move; track slots are
    freed. `state` is the Mamba state the session keeps: by default the turn's committed
    working slot (it moves too, the spares are freed); after an abort, the session's copy
    from the turn's start (then every working slot is freed)."""
    row = req.row.slot
    pages = pools.rows.row_pages(row, req.borrowed, int(pools.rows.lens[row]))
    pools.kv_pages.transfer(pages, req.owner, session, "save")
    if state is None:
        state = req.state.current.move_to(session, "save")
        for spare in req.state.spares:
            spare.release("save")
    else:
        state.check()
        for lease in req.state.leases:
            lease.release("discard")
    kept = SessionSlots(session, req.row.move_to(session, "save"), state, req.borrowed)
    new_lease(pools.mamba, req.track.owner, req.track.checked_slots()).release("save")
    req.spec.release("save")
    for owner in (req.owner, req.track.owner, req.spec.owner):
        pools.ledger.retire(owner)
    return kept


def restore(pools: Pools, sess: SessionSlots, rid: str) -> RequestSlots:
    """session -> request `rid`: the reverse of `save`, plus fresh spare working slots,
    track slots and speculative slots. All or nothing: the new slots are taken before
    anything moves."""
    need = pools.config.request_mamba_slots - 1  # the session brings its working slot
    if not pools.mamba.can_alloc(need):
        raise PoolExhausted("mamba", need, pools.mamba.free_count)
    owner = pools.ledger.new_owner(OwnerKind.REQUEST, rid)
    track_owner = pools.ledger.new_owner(OwnerKind.TRACK, rid)
    track_slots = pools.mamba.alloc(pools.config.track_slots, track_owner).tolist()
    track = TrackSlots(pools.mamba, track_owner, track_slots)
    spec = take_spec_slots(pools, pools.ledger.new_owner(OwnerKind.SPECULATIVE, rid))
    spares = [
        new_lease(pools.mamba, owner, pools.mamba.alloc_one(owner, "restore"))
        for _ in range(pools.config.working_slots - 1)
    ]
    row = sess.row.slot
    pages = pools.rows.row_pages(row, sess.borrowed, int(pools.rows.lens[row]))
    pools.kv_pages.transfer(pages, sess.owner, owner, "restore")
    return RequestSlots(
        owner,
        sess.row.move_to(owner, "restore"),
        WorkingSlots((sess.working.move_to(owner, "restore"), *spares)),
        track,
        spec,
        sess.borrowed,
    )


def close(pools: Pools, sess: SessionSlots, retire: bool = True) -> None:
    """Free everything a session holds between turns; retire the session unless it lives
    on without device state (its state was dropped under memory pressure)."""
    row = sess.row.slot
    pools.kv.free_tail(row, sess.borrowed, "close")
    pools.kv.forget(row)
    sess.working.release("close")
    sess.row.release("close")
    if retire:
        pools.ledger.retire(sess.owner)
