"""A replica's decisions about its copy of a session, from the directory's placement: the
rules its scheduler applies (runtime/directory_check.py, runtime/front_door.py,
sessions/manager.py) and the model checker applies to its model replicas.

A copy is what a replica holds of a session: the placement epoch it holds it at, whether
a front placed it (`routed`), whether it is leaving (`moving`: no turn starts) and, for
a copy a move brought, that attempt's nonce (`arrival`, "" once the directory confirmed
it here)."""

from __future__ import annotations

from typing import Protocol

from shared.placement import Placement


class Copy(Protocol):
    epoch: int
    routed: bool
    moving: bool
    arrival: str


def released(copy: Copy, placed: Placement | None, replica: str) -> bool:
    """Whether the directory no longer gives the session to `replica` at the copy's
    epoch, so the copy goes: placed nowhere though a front placed it (closed, or moved and
    closed, elsewhere), placed on another replica and not moving here, moving here by
    another attempt than the one that brought this copy (a copy left from before, or by
    an undone attempt), or placed here at a newer epoch (it moved away and back: this
    copy is stale)."""
    if placed is None:
        return copy.routed
    if not placed.names(replica):
        return True
    if placed.replica != replica:  # moving here: only this very attempt's arrival belongs
        other_attempt = bool(placed.attempt) and copy.arrival != placed.attempt
        return copy.epoch != placed.epoch + 1 or other_attempt  # (no attempt: an older front)
    return placed.epoch > copy.epoch


def unaware_of_move(copy: Copy, placed: Placement | None, replica: str) -> bool:
    """Whether the directory moves the session off `replica` while its copy was never
    told (not `moving`: the move found the replica unregistered, its lease lapsed, and
    carries its records instead). Such a copy must not take turns: a replica whose lease
    lapsed stays fenced until the move has ended and the copy can be settled."""
    return (
        placed is not None
        and placed.replica == replica
        and placed.moving_to is not None
        and not copy.moving
    )


def settled_here(copy: Copy, placed: Placement | None, replica: str) -> bool:
    """Whether the directory places the session here at the copy's epoch with no move
    under way: a copy a move left in doubt is settled (an arrival confirmed; a leaving
    copy whose move was undone takes turns again)."""
    return placed == Placement(replica, copy.epoch)


def close_stands(copy: Copy, placed: Placement | None, replica: str) -> bool:
    """Whether a close of the copy, once its record is on the ownership stream, closed the
    session: the directory places it nowhere, or here at the copy's epoch with no move
    under way. Otherwise a front moved the session (it found `replica` unregistered: a
    pause, a partition) while the close's record was on its way, from a record that may
    not have had the close; the copy it placed is the session now, and the close must be
    made again there, never answered here (the client would hold a session closed that
    lives on, and the front that closed it would take its new placement away)."""
    return placed is None or settled_here(copy, placed, replica)


def takes_arrival(
    placed: Placement | None, source: str, epoch: int, replica: str, attempt: str
) -> bool:
    """Whether `replica` may open a session arriving from `source` at `epoch` by move
    attempt `attempt`: only while the directory has that very attempt in transit from
    `source` at `epoch` - 1 to `replica` right now, so a request of an attempt undone
    since (delayed, retried late, or carried by a front that took an undone attempt
    over) opens nothing."""
    return placed == Placement(source, epoch - 1, replica, attempt)


def same_attempt(copy: Copy | None, nonce: str) -> bool:
    """Whether the copy held is the one this very attempt of the move brought (a retry's,
    or a front's that took the move over): it stays. Any other copy is stale (left by an
    attempt never settled: an undone move leaves the same epoch, so only the nonce tells
    two attempts apart) and is replaced from the current record."""
    return copy is not None and bool(nonce) and copy.arrival == nonce


def may_close(placed: Placement | None, replica: str) -> bool:
    """Whether `replica` may close its copy on a front's word (`migrate_done`): not while
    the directory places the session there or is moving it there."""
    return placed is None or not placed.names(replica)


def routed_to(copy: Copy, routed_epoch: int | None) -> bool:
    """Whether a request a front routed by the placement at `routed_epoch` (None: sent
    straight to this replica, by no front) is for this copy: only at its epoch. A request
    routed before a move and delayed past it (a paused front, a slow link) may reach a
    copy the session has since left, or one an attempt in transit brought: a turn run
    there would be missing from the copy the session ends on. (A copy answers a turn
    only if, besides, it is not leaving: the session manager refuses that.)"""
    return routed_epoch in (None, copy.epoch)
