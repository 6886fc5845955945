"""A front's run of one move, as a machine: `first()` gives the first effect to perform,
`advance(result)` the run after it and the next effect, until there is none and
`outcome` says how the move went. The front (fronts/migration.py) performs the effects
one at a time, renewing its lease on the move meanwhile; the model checker performs them
against its model of the directory and the replicas.

The steps (docs/protocol.md, docs/scaleout.md "Moving a session"):
- a fresh move reads the placement: gone (placed nowhere, or not naming the source) drops
  the source's stale listing; placed elsewhere or already moving fails; else it is begun
  (listed, then compare-and-set into transit);
- carried: the source (if registered) stops its turns and persists its state
  (`migrate_out`), the target opens it at epoch + 1 under this attempt's nonce
  (`migrate_in`), then the placement flips to the target (commit);
- a step that fails before the flip undoes the move (abort: back to the source at the
  same epoch), and a dead source whose proven records do not name the session drops it;
- settled: every replica the final placement does not name closes its copy, a source
  given the session back takes turns again, and the move is unlisted only once every
  registered replica answered (else it stays listed, and a front settles it again once
  its lease runs out);
- taken over (its front's lease ran out): settled as the placement now stands if that
  is no longer in transit, undone if the target is not ready, else carried from its
  first step (each step is safe to repeat).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shared.placement import Move, Placement

ABSENT = "absent"  # a call's result when its replica is not registered now


# ---- effects: what the driver performs, and what each gives back ----
@dataclass(frozen=True)
class Read:
    """The session's placement now -> Placement | None."""


@dataclass(frozen=True)
class Unlisted:
    """The source's listing of a session it no longer has goes -> None."""


@dataclass(frozen=True)
class Begin:
    """List the move, then compare-and-set the placement into transit -> bool."""


@dataclass(frozen=True)
class CallOut:
    """`migrate_out` on the source -> its status, or ABSENT when not registered."""


@dataclass(frozen=True)
class CallIn:
    """`migrate_in` on the target -> (status, whether its state came)."""


@dataclass(frozen=True)
class Commit:
    """Compare-and-set from in transit to the target at epoch + 1 -> bool."""


@dataclass(frozen=True)
class Abort:
    """Compare-and-set from in transit back to the source -> bool."""


@dataclass(frozen=True)
class DropLost:
    """Remove the in-transit placement (and the source's listing) of a session no
    record names -> None."""


@dataclass(frozen=True)
class Release:
    """`replica` closes its copy (`migrate_done`), or takes turns again (`cancel`:
    `migrate_cancel`) -> whether it answered (True when it is not registered: it
    settles from the directory itself once back)."""

    replica: str
    cancel: bool


@dataclass(frozen=True)
class Unlist:
    """The move leaves `custody:moves` -> None."""


Effect = Read | Unlisted | Begin | CallOut | CallIn | Commit | Abort | DropLost | Release | Unlist


@dataclass(frozen=True)
class MoveRun:
    """One front's run of one move, at one point of it (see the module's doc): a value,
    so the model checker can hold, compare and branch it. `advance` gives the next run
    and the effect to perform."""

    move: Move
    fresh: bool  # begin it (its epoch comes from the placement read); else taken over
    target_ready: bool = True  # (taken over) its target is ready: carry it on
    stage: str = "read"  # the effect whose result comes next; "over" once it ended
    source_absent: bool = False  # the source was not registered at `migrate_out`
    settling: tuple[Release, ...] = ()  # releases still to ask, in order
    answered: bool = True  # every release asked so far was answered
    settled_as: str | None = None  # the outcome once settled
    outcome: str | None = None  # state, history, failed, gone; None: only settled

    @classmethod
    def fresh_move(cls, sid: str, source: str, target: str, nonce: str) -> MoveRun:
        return cls(Move(sid, source, target, 0, nonce), fresh=True)

    def first(self) -> Effect:
        return Read()

    def advance(self, result: object) -> tuple[MoveRun, Effect | None]:
        """The run after the last effect gave `result`, and its next effect (None: the
        run is over, `outcome` says how it went)."""
        return STEPS[self.stage](self, result)

    @property
    def over(self) -> bool:
        return self.stage == "over"


Next = tuple[MoveRun, Effect | None]


def _to(run: MoveRun, stage: str, effect: Effect, **changes: Any) -> Next:
    return replace(run, stage=stage, **changes), effect


def _end(run: MoveRun, outcome: str | None) -> Next:
    return replace(run, stage="over", outcome=outcome), None


def _read(run: MoveRun, placement: Placement | None) -> Next:
    move = run.move
    if not run.fresh:
        if placement != move.in_transit:
            return _settle(run, placement, None)
        return _carry(run) if run.target_ready else _undo(run)
    if placement is None or not placement.names(move.source):
        # closed, or moved on, while the source still lists it
        return _to(run, "unlisted", Unlisted(), outcome="gone")
    if placement.replica != move.source or placement.moving_to:
        return _end(run, "failed")
    begun = Move(move.sid, move.source, move.target, placement.epoch, move.nonce)
    return _to(run, "begin", Begin(), move=begun)


def _begun(run: MoveRun, begun: bool) -> Next:
    return _carry(run) if begun else _end(run, "failed")


def _carry(run: MoveRun) -> Next:
    return _to(run, "out", CallOut())


def _out(run: MoveRun, status: object) -> Next:
    if status not in (200, ABSENT):
        return _undo(run)
    return _to(run, "in", CallIn(), source_absent=status == ABSENT)


def _in(run: MoveRun, answer: tuple[int, bool]) -> Next:
    status, has_state = answer
    if status == 404 and run.source_absent:
        return _to(run, "dropped", DropLost(), outcome="gone")
    if status != 200:
        return _undo(run)
    return _to(run, "commit", Commit(), settled_as="state" if has_state else "history")


def _committed(run: MoveRun, committed: bool) -> Next:
    if not committed:  # taken over by another front, which finishes it
        return _end(run, "failed")
    return _settle(run, run.move.after, run.settled_as)


def _undo(run: MoveRun) -> Next:
    return _to(run, "abort", Abort())


def _undone(run: MoveRun, undone: bool) -> Next:
    return _settle(run, run.move.before, "failed") if undone else _end(run, "failed")


def _settle(run: MoveRun, placement: Placement | None, outcome: str | None) -> Next:
    """Each replica of the move as `placement` leaves it, then unlisted if all
    answered."""
    move, releases = run.move, []
    for replica in (move.source, move.target):
        if placement == move.before and replica == move.source:
            releases.append(Release(replica, cancel=True))
        elif placement is None or not placement.names(replica):
            releases.append(Release(replica, cancel=False))
    settling = replace(run, settling=tuple(releases), answered=True, settled_as=outcome)
    return _next_release(settling)


def _released(run: MoveRun, answered: bool) -> Next:
    return _next_release(replace(run, answered=run.answered and answered))


def _next_release(run: MoveRun) -> Next:
    if run.settling:
        return _to(run, "release", run.settling[0], settling=run.settling[1:])
    if run.answered:
        return _to(run, "unlist", Unlist())
    return _end(run, run.settled_as)  # listed still: settled again once its lease ends


def _dropped(run: MoveRun, _: object) -> Next:
    return _to(run, "unlist", Unlist(), settled_as="gone")


def _unlisted(run: MoveRun, _: object) -> Next:
    return _end(run, run.settled_as if run.outcome is None else run.outcome)


def _source_unlisted(run: MoveRun, _: object) -> Next:
    return _end(run, "gone")


STEPS: dict[str, Callable[[MoveRun, Any], Next]] = {
    "read": _read,
    "unlisted": _source_unlisted,
    "begin": _begun,
    "out": _out,
    "in": _in,
    "commit": _committed,
    "abort": _undone,
    "release": _released,
    "dropped": _dropped,
    "unlist": _unlisted,
}
