"""The model checker's small world of the session protocol (docs/protocol.md): one session
on two replicas, fronts running moves of it, clients' turns, the replicas' directory
checks, and faults. Its fronts run the production machine (protocol/moves.py) and its
replicas apply the production decisions (protocol/copies.py); what is modelled is what
those call: the directory's compare-and-sets (redis_model.py, held to the real scripts
by test_redis_model.py), a replica's handlers of the admin calls, the store's records.

A state is a value (`World`); `moves(world)` lists every transition enabled in it, each
named, with the state it leads to. Faults (at most `World.faults_left` per trace): a
call's request lost (not applied, the front sees a 503), its reply lost (applied, the
front sees a 503), or delayed (the front sees a 503; the request is delivered at any
later moment); a front's work on a move stalled past its lease (another front takes the
move over while the first goes on); a front that dies mid-move.

What it does not model yet: replica deaths and restarts (lives), the replica's lease
and fencing, the store's gaps and records proof, placement notices and the fronts'
memory, opens and closes. See docs/protocol.md for what the bound covers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from protocol import copies
from protocol.moves import (
    Abort,
    Begin,
    CallIn,
    CallOut,
    Commit,
    DropLost,
    Effect,
    MoveRun,
    Read,
    Release,
    Unlist,
    Unlisted,
)
from shared.placement import Move, Placement
from tests.protocol import redis_model

REPLICAS = ("a", "b")
SID = "s"
CALLS = (CallOut, CallIn, Release)  # effects that are HTTP calls to a replica


@dataclass(frozen=True)
class Copy:
    """A replica's copy of the session (the fields protocol/copies.py reads), with the
    turns its history holds."""

    epoch: int
    history: tuple[int, ...] = ()
    routed: bool = True
    moving: bool = False
    arrival: str = ""


@dataclass(frozen=True)
class Run:
    """A front's run of a move and the effect it waits on (None: not asked yet)."""

    front: str
    run: MoveRun
    effect: Effect


@dataclass(frozen=True)
class Late:
    """A delayed request: delivered later, its reply to nobody."""

    move: Move
    effect: Effect


@dataclass(frozen=True)
class World:
    placed: Placement | None = Placement("a", 1)  # noqa: RUF009 (a frozen value)
    listed: tuple[tuple[Move, bool], ...] = ()  # (move, its front's lease still holds)
    copies: tuple[Copy | None, ...] = (Copy(1), None)
    records: tuple[tuple[int, ...] | None, ...] = ((), None)  # what the store holds of each
    acked: tuple[int, ...] = ()  # turns answered to their client
    runs: tuple[Run, ...] = ()
    late: tuple[Late, ...] = ()
    moves_left: int = 2  # moves a front may still begin
    turns_left: int = 2
    faults_left: int = 3
    nonces: int = 0  # nonces handed out

    def copy(self, replica: str) -> Copy | None:
        return self.copies[REPLICAS.index(replica)]

    def with_copy(self, replica: str, copy: Copy | None) -> World:
        i = REPLICAS.index(replica)
        return replace(self, copies=(*self.copies[:i], copy, *self.copies[i + 1 :]))

    def with_record(self, replica: str, history: tuple[int, ...]) -> World:
        i = REPLICAS.index(replica)
        return replace(self, records=(*self.records[:i], history, *self.records[i + 1 :]))


@dataclass(frozen=True)
class Rules:
    """The decisions the world applies: production's, or a planted bug's."""

    same_attempt: Callable[[Any, str], bool] = copies.same_attempt
    # a replica's leaving copy takes turns again once the directory gives it back (an undo
    # whose cancel was lost)
    restores_undone: bool = True
    unlist_unanswered: bool = False  # a release not answered is taken as answered


Transition = tuple[str, World, bool]  # (what happened, the state after, whether a fault)


def moves(world: World, rules: Rules) -> Iterator[Transition]:
    """Every transition enabled in `world`."""
    yield from _begins(world)
    for i, held in enumerate(world.runs):
        yield from _performs(world, i, held, rules)
    yield from _take_overs(world)
    for j, late in enumerate(world.late):
        after = _apply(
            replace(world, late=world.late[:j] + world.late[j + 1 :]), late.move, late.effect, rules
        )[0]
        yield f"late {type(late.effect).__name__} of {_name(late.move)} delivered", after, False
    yield from _turns(world)
    for replica in REPLICAS:
        after = _directory_check(world, replica, rules)
        if after != world:
            yield f"{replica} checks the directory", after, False


def _name(move: Move) -> str:
    return f"{move.source}->{move.target}@{move.epoch}#{move.nonce}"


def _begins(world: World) -> Iterator[Transition]:
    """A front begins a move once it runs no other (the bound: a drain or a re-homing
    moves a session at a time); a move left listed, waiting for a taker-over, does not
    stop it."""
    if world.moves_left == 0 or world.runs:
        return
    if world.placed is None or world.placed.moving_to:
        return
    source = world.placed.replica
    target = next(r for r in REPLICAS if r != source)
    nonce = f"n{world.nonces + 1}"
    run = MoveRun.fresh_move(SID, source, target, nonce)
    started = replace(
        world,
        runs=(*world.runs, Run("f1", run, run.first())),
        moves_left=world.moves_left - 1,
        nonces=world.nonces + 1,
    )
    yield f"f1 begins a move {source}->{target} ({nonce})", started, False


def _performs(world: World, i: int, held: Run, rules: Rules) -> Iterator[Transition]:
    """The run's pending effect performed (and its faults)."""
    rest = world.runs[:i] + world.runs[i + 1 :]
    move, effect = held.run.move, held.effect
    what = f"{held.front} {type(effect).__name__} {_name(move)}"
    applied, result = _apply(replace(world, runs=rest), move, effect, rules)
    yield what, _continue(applied, held, result, rules), False
    if world.faults_left == 0:
        return
    faulted = replace(world, runs=rest, faults_left=world.faults_left - 1)
    if isinstance(effect, CALLS):
        failed = _failure(effect)
        yield f"{what}: request lost", _continue(faulted, held, failed, rules), True
        applied, _ = _apply(faulted, move, effect, rules)
        yield f"{what}: reply lost", _continue(applied, held, failed, rules), True
        delayed = replace(faulted, late=(*faulted.late, Late(move, effect)))
        yield f"{what}: delayed", _continue(delayed, held, failed, rules), True
    else:  # Redis answers or the front dies: its move, listed, waits for a taker-over
        yield f"{held.front} dies before {type(effect).__name__}", _unheld(faulted, move), True
    yield f"{held.front} stalls past its lease on {_name(move)}", _lapse(world, move), True


def _failure(effect: Effect) -> object:
    if isinstance(effect, CallIn):
        return (503, False)
    if isinstance(effect, Release):
        return False
    return 503


def _continue(world: World, held: Run, result: object, rules: Rules) -> World:
    """The run after its effect gave `result`: waiting on its next effect, or over (a
    move it leaves listed is no longer renewed: its lease runs out)."""
    if rules.unlist_unanswered and isinstance(held.effect, Release):
        result = True
    run, effect = held.run.advance(result)
    if effect is not None:
        return replace(world, runs=(*world.runs, Run(held.front, run, effect)))
    return _unheld(world, run.move)


def _unheld(world: World, move: Move) -> World:
    """No run holds `move` any more (over, or its front died): its lease is no longer
    renewed, and runs out."""
    if any(other.run.move == move for other in world.runs):
        return world
    return replace(world, listed=tuple((m, live and m != move) for m, live in world.listed))


def _lapse(world: World, move: Move) -> World:
    listed = tuple((m, live and m != move) for m, live in world.listed)
    return replace(world, listed=listed, faults_left=world.faults_left - 1)


def _take_overs(world: World) -> Iterator[Transition]:
    """A front takes over a listed move whose lease ran out (one at a time)."""
    for k, (move, live) in enumerate(world.listed):
        if live:
            continue
        listed = (*world.listed[:k], (move, True), *world.listed[k + 1 :])
        run = MoveRun(move, fresh=False, target_ready=True)
        taken = replace(world, listed=listed, runs=(*world.runs, Run("f2", run, run.first())))
        yield f"f2 takes over {_name(move)}", taken, False


def _turns(world: World) -> Iterator[Transition]:
    """A client's turn, served by the copy the directory names, if it serves."""
    placed = world.placed
    if world.turns_left == 0 or placed is None or placed.moving_to:
        return
    copy = world.copy(placed.replica)
    if copy is None or copy.moving:
        return
    turn = len(world.acked) + 1
    history = (*copy.history, turn)
    served = world.with_copy(placed.replica, replace(copy, history=history))
    served = served.with_record(placed.replica, history)
    served = replace(served, acked=(*world.acked, turn), turns_left=world.turns_left - 1)
    yield f"turn {turn} on {placed.replica} (history {list(copy.history)})", served, False


def _directory_check(world: World, replica: str, rules: Rules) -> World:
    """The replica settles its copy a move left in doubt, as the directory says."""
    copy = world.copy(replica)
    if copy is None or not (copy.moving or copy.arrival):
        return world
    if copies.released(copy, world.placed, replica):
        return world.with_copy(replica, None)
    if copies.settled_here(copy, world.placed, replica):
        moving = copy.moving and not rules.restores_undone
        return world.with_copy(replica, replace(copy, moving=moving, arrival=""))
    return world


def _apply(world: World, move: Move, effect: Effect, rules: Rules) -> tuple[World, object]:
    """`effect` performed on the world: the directory's scripts, a replica's handlers."""
    placed = world.placed
    match effect:
        case Read():
            return world, placed
        case Unlisted() | DropLost():
            return world, None
        case Begin():
            listed = replace(world, listed=(*world.listed, (move, True)))
            if placed == move.before:
                return replace(listed, placed=move.in_transit), True
            return replace(listed, listed=world.listed), False
        case Commit() | Abort():
            if placed != move.in_transit:
                return world, False
            return replace(
                world, placed=move.after if isinstance(effect, Commit) else move.before
            ), True
        case Unlist():
            return replace(world, listed=tuple(e for e in world.listed if e[0] != move)), None
        case CallOut():
            copy = world.copy(move.source)
            if copy is None:
                return world, 404
            leaving = world.with_copy(move.source, replace(copy, moving=True))
            return leaving.with_record(move.source, copy.history), 200
        case CallIn():
            return _arrive(world, move, rules)
        case Release(replica=replica, cancel=True):
            copy = world.copy(replica)
            if copy is not None:
                world = world.with_copy(replica, replace(copy, moving=False))
            return world, True
        case Release(replica=replica, cancel=False):
            if copies.may_close(placed, replica):
                world = world.with_copy(replica, None)
            return world, True
    raise AssertionError(f"no model of {effect!r}")


def _swap(world: World, old: Placement, new: Placement) -> tuple[World, bool]:
    """The directory's compare-and-set, as its model has it (redis_model.py)."""
    current = None if world.placed is None else world.placed.encode()
    value, answer, _ = redis_model.swap("s", current, old.encode(), new.encode())
    return replace(world, placed=Placement.decode(value)), bool(answer)


def _arrive(world: World, move: Move, rules: Rules) -> tuple[World, object]:
    target, epoch = move.target, move.epoch + 1
    if not copies.takes_arrival(world.placed, move.source, epoch, target, move.nonce):
        return world, (409, False)
    here = world.copy(target)
    if rules.same_attempt(here, move.nonce):
        return world, (200, True)
    history = world.records[REPLICAS.index(move.source)] or ()
    return world.with_copy(target, Copy(epoch, history, arrival=move.nonce)), (200, True)
