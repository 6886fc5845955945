"""The model checker's model of the directory's Lua scripts (fronts/directory.py,
shared/placement.py): each a pure function of the key's value (None: no key) and the
script's arguments, giving the value after, the script's answer and the notice it
publishes (None: none). The world (world.py) moves placements only through these, and
tests/protocol/test_redis_model.py runs each script on a real Redis beside its model
over generated inputs: where they disagree, the checker explored a Redis that is not
the one custody runs on.

Below them, the leases, modelled the same way with time an argument (no clock): the
moves' sorted set (`streams.MOVES`, as `Directory`'s begin, renew, done and abandoned and
its `TAKE_OVER` script write it) and a `KeyLease`'s key (its take, `RENEW`, `RELEASE`).
The world uses none of these yet: it models leases as events."""

from __future__ import annotations

Value = str | None
Outcome = tuple[Value, int, str | None]  # (value after, answer, notice published)
Moves = tuple[tuple[str, float], ...]  # the moves' sorted set: (move, lease end), Redis's order
Lease = tuple[str | None, int | None]  # a lease key: (token, expiry in ms or None: no expiry)
NO_KEY: Lease = (None, None)


def place(key: str, value: Value, new: str) -> Outcome:
    """`PLACE`: set if absent (`SET NX`), publishing the new value."""
    if value is not None:
        return value, 0, None
    return new, 1, f"{key} {new}"


def swap(key: str, value: Value, old: str, new: str) -> Outcome:
    """`SWAP`: compare-and-set, publishing the new value; a key already at `new` answers
    done (a retried swap), publishing nothing."""
    if value == new:
        return value, 1, None
    if value != old:
        return value, 0, None
    return new, 1, f"{key} {new}"


def unplace(key: str, value: Value, old: str) -> Outcome:
    """`UNPLACE`: compare-and-delete, publishing the key alone (a removal)."""
    if value != old:
        return value, 0, None
    return None, 1, key


def listed(scores: dict[str, float]) -> Moves:
    """The sorted set holding `scores`, in the order Redis ranges it: by score, then move."""
    return tuple(sorted(scores.items(), key=lambda pair: (pair[1], pair[0])))


def begin(moves: Moves, move: str, now: float, lease: float, swapped: bool) -> Moves:
    """`Directory.begin`'s listing: listed under a lease from `now` (`ZADD`) before the
    swap, so no transit goes unlisted, and unlisted (`ZREM`) if the swap failed, even a
    move that was listed before."""
    leased = listed({**dict(moves), move: now + lease})
    return leased if swapped else done(leased, move)


def renew(moves: Moves, move: str, now: float, lease: float) -> Moves:
    """`Directory.renew` (`ZADD XX`): a lease from `now` for a move still listed only, so a
    router late to renew never lists again a move done or taken off meanwhile."""
    scores = dict(moves)
    return listed({**scores, move: now + lease}) if move in scores else moves


def done(moves: Moves, move: str) -> Moves:
    """`Directory.done` (`ZREM`)."""
    return tuple(pair for pair in moves if pair[0] != move)


def due(moves: Moves, now: float) -> tuple[str, ...]:
    """The moves whose lease ended by `now` (`ZRANGEBYSCORE -inf now`: a lease ending at
    `now` has ended), in order: those `Directory.abandoned` tries to take over."""
    return tuple(move for move, end in moves if end <= now)


def take_over(moves: Moves, move: str, now: float, until: float) -> tuple[Moves, int]:
    """`TAKE_OVER`: a move still listed whose lease ended by `now` is leased until `until`;
    one renewed, done or taken over since it was found due is left alone."""
    if move not in due(moves, now):
        return moves, 0
    return listed({**dict(moves), move: until}), 1


def abandoned(moves: Moves, now: float, lease: float) -> tuple[Moves, tuple[str, ...]]:
    """`Directory.abandoned` run alone: every move `due` taken over for a lease from `now`.
    On Redis it is one `TAKE_OVER` per move, and other routers' writes may come between
    them: that is the world's to interleave, not this function's."""
    taken = due(moves, now)
    for move in taken:
        moves, _ = take_over(moves, move, now, now + lease)
    return moves, taken


def _read(key: Lease, now_ms: int) -> Lease:
    """The key as Redis reads it at `now_ms`: absent once past its expiry (at it, there)."""
    expiry = key[1]
    return NO_KEY if expiry is not None and now_ms > expiry else key


def take_key(key: Lease, token: str, ms: int, now_ms: int) -> tuple[Lease, int]:
    """`KeyLease.held`'s take (`SET NX PX`): a key nobody holds, or whose lease ran out."""
    if _read(key, now_ms) != NO_KEY:
        return key, 0
    return (token, now_ms + ms), 1


def renew_key(key: Lease, token: str, ms: int, now_ms: int) -> tuple[Lease, int]:
    """`RENEW` (`PEXPIRE` if the key holds `token`; `ms` >= 1, as a `KeyLease`'s): a holder
    whose lease ran out, or whose key a later holder took, renews nothing."""
    key = _read(key, now_ms)
    if key[0] != token:
        return key, 0
    return (token, now_ms + ms), 1


def release_key(key: Lease, token: str, now_ms: int) -> tuple[Lease, int]:
    """`RELEASE` (`DEL` if the key holds `token`): never a later holder's key."""
    key = _read(key, now_ms)
    if key[0] != token:
        return key, 0
    return NO_KEY, 1
