"""The model checker's small world of the session protocol (docs/protocol.md): sessions
(one, or two sharing the replicas) on two replicas that live, die, pause and start
again; fronts moving them (a drain's moves, a take-over of a move whose lease ran out,
the re-homing of a dead replica); clients' turns; the session store applying each
replica's records, with gaps. Its fronts run the production machine of a move
(protocol/moves.py), its replicas apply the production decisions about their copies
(protocol/copies.py) and lives (protocol/lives.py: the order a new life starts in, what
it takes back, its lease), its store decides gaps as production's does
(protocol/records.py); what is modelled is what those call: the directory's
compare-and-sets (redis_model.py, held to the real scripts by test_redis_model.py), a
replica's handlers of the admin calls, the store.

A state is a value (`World`); `moves(world, rules)` lists every transition enabled in
it, each named, with the state it leads to and who took it (a fault, a choice, or an
actor: `Transition`). Faults (at most
`World.faults_left` per trace): a call's request lost (not applied, the front sees a
503), its reply lost (applied, the front sees a 503), delayed (the front sees a 503; the
request is delivered at any later moment) or duplicated (applied, answered, and
delivered again at any later moment); a directory write refused (the front's run ends
there, as if it died) or applied twice (redis-py sends a command again after a
connection error; the front hears the second answer); a front's work on a move stalled
past its lease; a client's turn delayed (routed by the placement now, delivered at any
later moment); a replica's life crashing (its copies gone; a new life may start) or
pausing past its lease (its registration expires meanwhile), or its registration
lapsing while its lease holds (a write refused, a short stall: the fronts see it
unregistered, not yet dead, and it still serves); the records on a replica's stream lost
before the store applied them (a gap). Time passing is an event too: a
registration expiring, the store applying a replica's records.

A client whose turns are done may close its session (`Session.closes_left`): the
replica closes its copy at once, writes the close's record later (a pause may come
between: the record then lands after a front re-homed the session from the store's
older record), and answers the close only once it is recorded; the front that sent it
then takes away the placement it routed it by.

What it does not model: opens, the fronts' memory of placements (a turn or a close is
routed by the directory as it is when routed), writes to Redis other than the
directory's refused or repeated. See docs/protocol.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from protocol import copies, lives, records
from protocol.lives import ReplicaLease, Step, Taken
from protocol.moves import (
    ABSENT,
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
AT = {replica: i for i, replica in enumerate(REPLICAS)}
SIDS = ("s", "t")  # the sessions' ids, the first `len(World.sessions)` of them
CALLS = (CallOut, CallIn, Release)  # effects that are HTTP calls to a replica
History = tuple[int, ...]


class Copy(NamedTuple):
    """A replica's copy of a session (the fields protocol/copies.py reads), with the
    turns its history holds."""

    epoch: int
    history: History = ()
    routed: bool = True
    moving: bool = False
    arrival: str = ""


class Session(NamedTuple):
    """One session: its placement, each replica's copy of it, what the store holds of
    it, and its client's turns."""

    placed: Placement | None = Placement("a", 1)
    copies: tuple[Copy | None, ...] = (Copy(1), None)
    records: tuple[History | None, ...] = ((), None)  # what the store has applied
    arrivals: tuple[str, ...] = ("", "")  # the attempt each applied record was brought by
    # per replica: its latest record of the session written and not yet applied (the life
    # that wrote it, the history, the attempt that brought the copy)
    stream: tuple[tuple[int, History, str] | None, ...] = (None, None)
    lost: bool = False  # the store decided the session's records lost: session_lost
    acked: History = ()  # turns answered to its client
    delayed: tuple[str, int] | None = None  # a turn routed to (replica, epoch), not delivered
    turns_left: int = 2
    closes_left: int = 0  # closes its client may still send (once its turns are done)
    # a close a replica applied and has not answered yet: (replica, the copy it closed,
    # whether the close's record is on its stream)
    closing: tuple[str, Copy, bool] | None = None
    closed: bool = False  # its client heard its close answered
    # the placement a replica that closed its copy takes away next (a compare-and-delete)
    unplace: tuple[str, int] | None = None

    def copy(self, replica: str) -> Copy | None:
        return self.copies[AT[replica]]


class Life(NamedTuple):
    """A replica's current life: its number, whether its process runs, the next step of
    its start (`len(START)`: started), whether its own lease lets it serve, whether its
    registration is in Redis (the fronts see it alive), whether it has been missing for
    `dead_seconds` (the fronts take it for dead), and whether its recorded sessions wait
    for the records proof."""

    number: int = 1
    up: bool = True
    step: int = len(lives.START)
    lease: bool = True
    registered: bool = True
    gone: bool = False  # unregistered for `dead_seconds`: the fronts take it for dead
    pending: bool = False


class Run(NamedTuple):
    """A front's run of a move and the effect it waits on."""

    front: str
    run: MoveRun
    effect: Effect


class Late(NamedTuple):
    """A delayed request: delivered later, its reply to nobody."""

    move: Move
    effect: Effect


class World(NamedTuple):
    sessions: tuple[Session, ...] = (Session(),)
    listed: tuple[tuple[Move, bool], ...] = ()  # (move, its front's lease still holds)
    lives: tuple[Life, ...] = (Life(), Life())
    gap_life: tuple[int, ...] = (0, 0)  # the life whose records a gap left incomplete
    fenced_by: tuple[int, ...] = (1, 1)  # the life that last fenced the replica's others
    runs: tuple[Run, ...] = ()
    late: tuple[Late, ...] = ()
    rehoming: tuple[str, ...] = ()  # replicas whose re-homing key a front holds
    moves_left: int = 2  # moves a drain may still begin
    rehomes_left: int = 1  # re-homing moves a front may still begin
    faults_left: int = 3
    crashes_left: int = 0  # lives that may still end (each replica has at most two)
    nonces: int = 0  # nonces handed out

    def life(self, replica: str) -> Life:
        return self.lives[AT[replica]]

    def with_session(self, k: int, **changes: Any) -> World:
        session = self.sessions[k]._replace(**changes)
        return self._replace(sessions=_set(self.sessions, k, session))

    def with_copy(self, k: int, replica: str, copy: Copy | None) -> World:
        return self.with_session(k, copies=_set(self.sessions[k].copies, AT[replica], copy))

    def with_life(self, replica: str, **changes: Any) -> World:
        life = self.life(replica)._replace(**changes)
        return self._replace(lives=_set(self.lives, AT[replica], life))

    def written(self, k: int, replica: str, history: History) -> World:
        """`replica` puts its record of session `k` on its stream (one pending record
        stands for every unapplied one: the latest is what the store ends with)."""
        session = self.sessions[k]
        copy = session.copy(replica)
        written = (self.life(replica).number, history, "" if copy is None else copy.arrival)
        return self.with_session(k, stream=_set(session.stream, AT[replica], written))

    def proven(self, replica: str) -> bool:
        """The records proof: the store has applied every record on `replica`'s stream
        (a gap stops it until mended or decided)."""
        i = AT[replica]
        return not self.gap_life[i] and all(s.stream[i] is None for s in self.sessions)

    def serving(self, replica: str) -> bool:
        """`replica`'s life may serve: up, started, its lease current, nothing pending."""
        life = self.life(replica)
        return life.up and life.step == len(lives.START) and life.lease and not life.pending


def _set(values: tuple, i: int, value: object) -> tuple:
    return (*values[:i], value, *values[i + 1 :])


def _of(move: Move) -> int:
    return SIDS.index(move.sid)


@dataclass(frozen=True)
class Rules:
    """The decisions the world applies: production's, or a planted bug's."""

    same_attempt: Callable[[Any, str], bool] = copies.same_attempt
    # a replica's leaving copy takes turns again once the directory gives it back (an undo
    # whose cancel was lost)
    restores_undone: bool = True
    unlist_unanswered: bool = False  # a release not answered is taken as answered
    start: tuple[Step, ...] = lives.START
    proof_blocks: bool = False  # a new life waits for the records proof without bound
    # how a registration that reached Redis renews the lease (production: from when it
    # was sent)
    renew: Callable[[ReplicaLease, float], None] = ReplicaLease.renew
    routed_to: Callable[[Any, int], bool] = copies.routed_to
    # whether a `migrate_cancel` gives a leaving copy its turns back
    cancel_restores: Callable[[Any, Placement | None, str], bool] = copies.settled_here
    swap: Callable[[str, str | None, str, str], redis_model.Outcome] = redis_model.swap
    # a lapsed lease waits while a move carries any of the replica's copies unaware (not:
    # only the first session's)
    fence_every_session: bool = True
    # whether a close, recorded, is answered (production: only if the session was not
    # moved meanwhile); and whether the front that closed it then takes away only the
    # placement it routed the close by (not: whatever placement there is now)
    close_stands: Callable[[Any, Placement | None, str], bool] = copies.close_stands
    compare_on_close: bool = True
    # whether a front carries a move from the source's records without asking it
    # (`migrate_out` ABSENT): production only once it takes the source for dead (`dead`),
    # by when its lease has lapsed; not: as soon as its registration is missing, though
    # it may still serve under its lease
    carries_from_records: Callable[[Life], bool] = lambda life: dead(life)


# (what happened, the state after, who took the step): a fault (`FAULT`), a choice nobody
# must make (`CHOICE`: a client's next turn, a drain's next move), or the name of the
# actor that takes it (a front, a replica, the store for a replica, the network for a
# message in flight), which weak fairness obliges to act if it can for ever
Transition = tuple[str, World, str]
FAULT, CHOICE = "fault", "choice"


def moves(world: World, rules: Rules) -> Iterator[Transition]:
    """Every transition enabled in `world`."""
    yield from _begins(world)
    for i, held in enumerate(world.runs):
        yield from _performs(world, i, held, rules)
    yield from _take_overs(world)
    for j, late in enumerate(world.late):
        after = _apply(world._replace(late=_drop(world.late, j)), late.move, late.effect, rules)[0]
        message = f"{type(late.effect).__name__} of {_name(late.move)}"
        yield f"late {message} delivered", after, f"network: {message}"
    for k in range(len(world.sessions)):
        yield from _turns(world, k, rules)
        yield from _close_steps(world, k, rules)
    for replica in REPLICAS:
        yield from _life(world, replica, rules)
        yield from _store(world, replica)
        yield from _rehoming(world, replica)


def _drop(values: tuple, i: int) -> tuple:
    return values[:i] + values[i + 1 :]


def _name(move: Move) -> str:
    return f"{move.sid}:{move.source}->{move.target}@{move.epoch}#{move.nonce}"


def _other(replica: str) -> str:
    return next(r for r in REPLICAS if r != replica)


def _begins(world: World) -> Iterator[Transition]:
    """A drain's front begins a move once it runs no other (a drain moves a session at
    a time); a move left listed, waiting for a taker-over, does not stop it."""
    if world.moves_left == 0 or any(r.front == "f1" for r in world.runs):
        return
    for k, session in enumerate(world.sessions):
        if session.placed is None or session.placed.moving_to or session.lost:
            continue
        source = session.placed.replica
        started, nonce = _fresh(world, "f1", SIDS[k], source, _other(source))
        yield (
            f"f1 begins a move of {SIDS[k]} {source}->{_other(source)} ({nonce})",
            started._replace(moves_left=world.moves_left - 1),
            CHOICE,
        )


def _fresh(world: World, front: str, sid: str, source: str, target: str) -> tuple[World, str]:
    nonce = f"{world.nonces + 1:x}"
    run = MoveRun.fresh_move(sid, source, target, nonce)
    runs = (*world.runs, Run(front, run, run.first()))
    return world._replace(runs=runs, nonces=world.nonces + 1), nonce


def _performs(world: World, i: int, held: Run, rules: Rules) -> Iterator[Transition]:
    """The run's pending effect performed (and its faults)."""
    rest = _drop(world.runs, i)
    move, effect = held.run.move, held.effect
    what = f"{held.front} {type(effect).__name__} {_name(move)}"
    applied, result = _apply(world._replace(runs=rest), move, effect, rules)
    yield what, _continue(applied, held, result, rules), held.front
    if world.faults_left == 0:
        return
    faulted = world._replace(runs=rest, faults_left=world.faults_left - 1)
    if isinstance(effect, CALLS):
        failed = _failure(effect)
        yield f"{what}: request lost", _continue(faulted, held, failed, rules), FAULT
        applied, _ = _apply(faulted, move, effect, rules)
        yield f"{what}: reply lost", _continue(applied, held, failed, rules), FAULT
        delayed = faulted._replace(late=(*faulted.late, Late(move, effect)))
        yield f"{what}: delayed", _continue(delayed, held, failed, rules), FAULT
        applied, result = _apply(delayed, move, effect, rules)
        yield f"{what}: duplicated", _continue(applied, held, result, rules), FAULT
    else:
        # Redis refuses the write (or the front dies before it): the run ends, its move
        # listed waits for a taker-over; or the client sends it again after a reply lost
        # (redis-py retries a command on a connection error): applied twice, the front
        # hears the second answer
        yield f"Redis refuses {what}", _unheld(faulted, move), FAULT
        once, _ = _apply(faulted, move, effect, rules)
        twice, result = _apply(once, move, effect, rules)
        yield f"{what} is applied twice", _continue(twice, held, result, rules), FAULT
    yield f"{held.front} stalls past its lease on {_name(move)}", _lapse(world, move), FAULT


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
        return world._replace(runs=(*world.runs, Run(held.front, run, effect)))
    return _unheld(world, run.move)


def _unheld(world: World, move: Move) -> World:
    """No run holds `move` any more (over, or its front died): its lease is no longer
    renewed, and runs out."""
    if any(other.run.move == move for other in world.runs):
        return world
    return world._replace(listed=tuple((m, live and m != move) for m, live in world.listed))


def _lapse(world: World, move: Move) -> World:
    listed = tuple((m, live and m != move) for m, live in world.listed)
    return world._replace(listed=listed, faults_left=world.faults_left - 1)


def dead(life: Life) -> bool:
    """Whether the fronts take the replica for dead: unregistered for `dead_seconds`
    (`gone`: a crash, a pause past that). A replica whose registration merely lapsed (a
    write refused, a stall shorter than that) is not ready, but not dead: its lease,
    which ends before it could be taken for dead (protocol/lives.py `ReplicaLease`),
    may still let it serve."""
    return life.gone


def _ready(world: World, replica: str) -> bool:
    """Whether the fronts take `replica` as ready: registered, and serving."""
    return world.life(replica).registered and world.serving(replica)


def _take_overs(world: World) -> Iterator[Transition]:
    """A front takes over a listed move whose lease ran out (one at a time)."""
    for k, (move, live) in enumerate(world.listed):
        if live:
            continue
        listed = _set(world.listed, k, (move, True))
        run = MoveRun(move, fresh=False, target_ready=_ready(world, move.target))
        taken = world._replace(listed=listed, runs=(*world.runs, Run("f2", run, run.first())))
        yield f"f2 takes over {_name(move)}", taken, "f2"


def _turns(world: World, k: int, rules: Rules) -> Iterator[Transition]:
    """A client's turn of session `k`, routed to the replica the directory names at its
    epoch, and delivered there now, or (a fault) at any later moment."""
    session = world.sessions[k]
    placed = session.placed
    if session.delayed is not None:
        replica, epoch = session.delayed
        after = _deliver(world.with_session(k, delayed=None), k, replica, epoch, rules)
        yield f"the delayed turn of {SIDS[k]} reaches {replica}", after, f"network {SIDS[k]}"
    if session.closing or session.closed or session.lost or placed is None or placed.moving_to:
        return
    if session.turns_left == 0:
        yield from _closes(world, k, rules)
        return
    served = _deliver(world, k, placed.replica, placed.epoch, rules)
    if served != world:
        yield f"turn {len(session.acked) + 1} of {SIDS[k]} on {placed.replica}", served, CHOICE
    if world.faults_left and session.delayed is None:
        delayed = world.with_session(k, delayed=(placed.replica, placed.epoch))
        after = delayed._replace(faults_left=world.faults_left - 1)
        yield f"a turn of {SIDS[k]} routed to {placed.replica} is delayed", after, FAULT


def _closes(world: World, k: int, rules: Rules) -> Iterator[Transition]:
    """Its turns done, the client closes session `k`, routed to the replica the directory
    names: a copy there at that epoch that serves is closed now (no turn reaches it
    again); its record goes on the stream later (`_close_steps`), and only then is the
    close answered."""
    session = world.sessions[k]
    placed = session.placed
    copy = session.copy(placed.replica)
    if session.closes_left == 0 or not world.serving(placed.replica):
        return
    if copy is None:  # closed there already, or never arrived: 404, closed for its client
        gone = world.with_session(k, closed=True, closes_left=session.closes_left - 1)
        yield f"the client's close of {SIDS[k]} finds none on {placed.replica}", gone, CHOICE
        return
    if copy.moving or not rules.routed_to(copy, placed.epoch):
        return
    closed = world.with_copy(k, placed.replica, None)
    closed = closed.with_session(
        k,
        closing=(placed.replica, copy, False),
        closes_left=session.closes_left - 1,
        unplace=(placed.replica, copy.epoch),
    )
    yield f"the client closes {SIDS[k]} on {placed.replica}", closed, CHOICE


def _close_steps(world: World, k: int, rules: Rules) -> Iterator[Transition]:
    """A close applied on a replica whose life goes on: its record written (taken while
    the lease held, perhaps landing after a pause), then its answer; the placement it
    closed at taken away by the replica (a heartbeat's, once its lease holds); and a
    placement naming a replica that holds no copy dropped by its sweep
    (runtime/placed_sweep.py: a close whose compare-and-delete found a move in transit,
    which was then undone)."""
    session = world.sessions[k]
    placed = session.placed
    if session.unplace is not None and world.serving(session.unplace[0]):
        replica, epoch = session.unplace
        after = world.with_session(
            k, unplace=None, placed=None if placed == Placement(replica, epoch) else placed
        )
        yield f"{replica} takes away the placement of {SIDS[k]} it closed", after, replica
    if (
        placed is not None
        and not placed.moving_to
        and not session.lost
        and session.copy(placed.replica) is None
        and world.serving(placed.replica)
    ):
        swept = world.with_session(k, placed=None)
        yield f"{placed.replica}'s sweep drops {SIDS[k]}'s placement", swept, placed.replica
    if session.closing is None:
        return
    replica, copy, recorded = session.closing
    if not world.life(replica).up:
        return
    if not recorded:
        written = world.written(k, replica, None).with_session(k, closing=(replica, copy, True))
        yield f"{replica} writes the record of {SIDS[k]}'s close", written, replica
        return
    if rules.close_stands(copy, session.placed, replica):
        routed = Placement(replica, copy.epoch)
        placed = None if session.placed == routed or not rules.compare_on_close else session.placed
        answered = world.with_session(k, closing=None, closed=True, placed=placed)
        yield f"{replica} answers the close of {SIDS[k]}", answered, replica
    else:  # refused `moving`: the client closes it again, where the directory says now
        refused = world.with_session(k, closing=None, closes_left=session.closes_left + 1)
        yield f"{replica} refuses the close of {SIDS[k]}: it moved", refused, replica


def _deliver(world: World, k: int, replica: str, epoch: int, rules: Rules) -> World:
    """A turn of session `k` reaches `replica`, routed at `epoch`: served (its record
    written, its client answered) if the replica serves and its copy answers it, else
    refused (503: the client sends it again)."""
    session = world.sessions[k]
    copy = session.copy(replica)
    if session.turns_left == 0 or copy is None or not world.serving(replica):
        return world
    if copy.moving or not rules.routed_to(copy, epoch):
        return world
    turn = len(session.acked) + 1
    history = (*copy.history, turn)
    served = world.with_copy(k, replica, copy._replace(history=history))
    served = served.written(k, replica, history)
    return served.with_session(k, acked=(*session.acked, turn), turns_left=session.turns_left - 1)


def _life(world: World, replica: str, rules: Rules) -> Iterator[Transition]:
    """A replica's life: its start's steps, its heartbeat, a crash, a pause, a restart,
    and its registration expiring."""
    life = world.life(replica)
    if not life.up:
        if life.registered:
            after = world.with_life(replica, registered=False, gone=True)
            yield f"{replica}'s registration expires", after, replica
        if life.number < 2:
            after = world.with_life(replica, number=life.number + 1, up=True, step=0, lease=False)
            yield f"{replica} starts life {life.number + 1}", after, replica
        return
    if life.step < len(rules.start):
        after = _start_step(world, replica, rules.start[life.step], rules)
        if after is not None:
            what = f"{replica} life {life.number}: {rules.start[life.step].value}"
            yield what, after.with_life(replica, step=life.step + 1), replica
        return
    after = _heartbeat(world, replica, rules)
    if after != world:
        yield f"{replica} writes its registration", after, replica
    if life.pending and world.proven(replica):
        yield (
            f"{replica} takes back what waited for the proof",
            _take_back(world.with_life(replica, pending=False), replica),
            replica,
        )
    if world.faults_left == 0:
        return
    spent = world._replace(faults_left=world.faults_left - 1)
    if world.crashes_left:
        crashed = spent._replace(crashes_left=world.crashes_left - 1)
        for k, session in enumerate(world.sessions):
            crashed = crashed.with_copy(k, replica, None)
            if session.closing is not None and session.closing[0] == replica:
                # its client never heard: it closes again, where the directory says
                closes = session.closes_left + 1
                crashed = crashed.with_session(k, closing=None, closes_left=closes)
        yield (
            f"{replica} life {life.number} crashes",
            crashed.with_life(replica, up=False, lease=False, pending=False),
            FAULT,
        )
    if life.registered and life.lease:
        lease = _lease_after_pause(rules)
        paused = spent.with_life(replica, lease=lease, registered=False, gone=True)
        yield f"{replica} pauses past its lease", paused, FAULT
        unregistered = spent.with_life(replica, registered=False)
        yield f"{replica}'s registration lapses while its lease holds", unregistered, FAULT


def _lease_after_pause(rules: Rules) -> bool:
    """Whether the lease is current once the replica wakes from a pause past it, a
    registration sent just before the pause having reached Redis after it (the lease
    itself decides, on a clock the world sets)."""
    now = [0.0]
    lease = ReplicaLease(dead_seconds=3.0, heartbeat_seconds=1.0, clock=lambda: now[0])
    lease.renew(0.0)
    sent = now[0] = 1.0  # sent, and the pause begins
    now[0] = 10.0  # awake: the write has reached Redis meanwhile
    rules.renew(lease, sent)
    return lease.current()


def _start_step(world: World, replica: str, step: Step, rules: Rules) -> World | None:
    """One step of a new life's start, or None while it waits."""
    life = world.life(replica).number
    match step:
        case Step.REGISTER:  # fences earlier lives: the store may decide their gaps
            fenced = world._replace(fenced_by=_set(world.fenced_by, AT[replica], life))
            return fenced.with_life(replica, registered=True, gone=False, lease=True)
        case Step.AWAIT_REHOMING:
            return None if replica in world.rehoming else world
        case Step.READ_STREAM_END:  # the proof is taken against the stream as it is then
            return world
        case Step.AWAIT_PROOF:
            if world.proven(replica):
                return world
            return None if rules.proof_blocks else world.with_life(replica, pending=True)
        case Step.TAKE_BACK:
            if world.life(replica).pending:
                return world  # taken back once the proof comes
            return _take_back(world, replica)
    raise AssertionError(step)


def _take_back(world: World, replica: str) -> World:
    """A new life's copy of each session, from its records, as protocol/lives.py decides
    (the session store lost them: it answers session_lost, and holds no copy)."""
    for k, session in enumerate(world.sessions):
        record = session.records[AT[replica]]
        if record is None or session.lost:
            continue
        placed, arrival = session.placed, session.arrivals[AT[replica]]
        taken = lives.take_back(placed, replica, True, arrival)
        if taken is Taken.CLOSED or placed is None:
            continue
        if taken is Taken.ARRIVING:
            copy = Copy(placed.epoch + 1, record, arrival=arrival)
        else:
            copy = Copy(placed.epoch, record, moving=taken is Taken.MOVING)
        world = world.with_copy(k, replica, copy)
    return world


def _heartbeat(world: World, replica: str, rules: Rules) -> World:
    """A started life writes its registration: a lapsed lease is renewed only once every
    copy was checked against the directory (not while a front re-homes it, nor while a
    move carries a copy it never told: protocol/copies.py); then each copy a move left
    in doubt is settled as the directory says."""
    world = world.with_life(replica, registered=True, gone=False)
    if not world.life(replica).lease:
        if replica in world.rehoming:
            return world
        for session in world.sessions[: None if rules.fence_every_session else 1]:
            copy = session.copy(replica)
            if copy is not None and copies.unaware_of_move(copy, session.placed, replica):
                return world
        for k, session in enumerate(world.sessions):
            copy = session.copy(replica)
            if copy is not None and copies.released(copy, session.placed, replica):
                world = world.with_copy(k, replica, None)
        world = world.with_life(replica, lease=True)
    for k in range(len(world.sessions)):
        world = _directory_check(world, k, replica, rules)
    return world


def _directory_check(world: World, k: int, replica: str, rules: Rules) -> World:
    """The replica settles its copy of session `k` a move left in doubt, as the
    directory says."""
    session = world.sessions[k]
    copy = session.copy(replica)
    if copy is None or not (copy.moving or copy.arrival):
        return world
    if copies.released(copy, session.placed, replica):
        return world.with_copy(k, replica, None)
    if copies.settled_here(copy, session.placed, replica):
        moving = copy.moving and not rules.restores_undone
        return world.with_copy(k, replica, copy._replace(moving=moving, arrival=""))
    return world


def _store(world: World, replica: str) -> Iterator[Transition]:
    """The session store: applies a replica's records (of every session, in one go);
    records lost before it did (a gap); a gap mended by the full set its life ships once
    its sessions are taken back, or, once a later life fenced that one in (nothing can
    mend it now), decided (protocol/records.py): a session it held a record of and the
    directory places there is lost."""
    i = AT[replica]
    gap = world.gap_life[i]
    pending = [s.stream[i] for s in world.sessions]
    if any(p is not None for p in pending) and not gap:
        applied = world
        for k, written in enumerate(pending):
            if written is not None:
                session = applied.sessions[k]
                applied = applied.with_session(
                    k,
                    records=_set(session.records, i, written[1]),
                    arrivals=_set(session.arrivals, i, written[2]),
                )
        yield f"the store applies {replica}'s records", _unstreamed(applied, i), f"store {replica}"
        if world.faults_left:
            life = min(p[0] for p in pending if p is not None)  # the oldest unapplied
            lost = world._replace(gap_life=_set(world.gap_life, i, life))
            lost = _unstreamed(lost, i)._replace(faults_left=world.faults_left - 1)
            yield f"{replica}'s records are lost before the store applied them", lost, FAULT
    if not gap:
        return
    life = world.life(replica)
    # a life ships its full set once it has taken back its sessions, not while they
    # wait for the proof (it cannot name them all yet)
    if life.number == gap and life.up and life.step == len(lives.START) and not life.pending:
        mended = world
        for k, session in enumerate(world.sessions):
            copy = session.copy(replica)
            mended = mended.with_session(
                k,
                records=_set(session.records, i, None if copy is None else copy.history),
                arrivals=_set(session.arrivals, i, "" if copy is None else copy.arrival),
            )
        superseded = _unstreamed(_ungapped(mended, i), i)  # older than the snapshot
        yield f"{replica}'s snapshot mends the gap", superseded, f"store {replica}"
    elif records.gap_decided(gap, world.fenced_by[i]):
        decided = world
        for k, session in enumerate(world.sessions):
            here = session.placed is not None and session.placed.replica == replica
            decided = decided.with_session(
                k,
                records=_set(session.records, i, None),
                lost=session.lost or (here and session.records[i] is not None),
            )
        yield f"the store decides {replica}'s gap lost", _ungapped(decided, i), f"store {replica}"


def _unstreamed(world: World, i: int) -> World:
    for k, session in enumerate(world.sessions):
        if session.stream[i] is not None:
            world = world.with_session(k, stream=_set(session.stream, i, None))
    return world


def _ungapped(world: World, i: int) -> World:
    return world._replace(gap_life=_set(world.gap_life, i, 0))


def _rehoming(world: World, replica: str) -> Iterator[Transition]:
    """The front holding the duties re-homes a replica it finds dead (unregistered):
    takes its re-homing key (and, the replica still unregistered, keeps it), moves the
    sessions off it to a ready replica one at a time, and lets the key go once nothing
    is left to do."""
    life = world.life(replica)
    placed_here = [
        k
        for k, s in enumerate(world.sessions)
        if s.placed is not None and s.placed.replica == replica
    ]
    if replica not in world.rehoming:
        if dead(life) and placed_here:
            after = world._replace(rehoming=(*world.rehoming, replica))
            yield f"f3 takes {replica}'s re-homing key", after, "f3"
        return
    if any(r.front == "f3" for r in world.runs):
        return
    target = _other(replica)
    for k in placed_here:
        session = world.sessions[k]
        if session.placed.moving_to or session.lost:
            continue
        if world.rehomes_left and _ready(world, target):
            started, nonce = _fresh(world, "f3", SIDS[k], replica, target)
            started = started._replace(rehomes_left=world.rehomes_left - 1)
            yield f"f3 re-homes {SIDS[k]} {replica}->{target} ({nonce})", started, "f3"
            return
    after = world._replace(rehoming=tuple(r for r in world.rehoming if r != replica))
    yield f"f3 lets {replica}'s re-homing key go", after, "f3"


def _apply(world: World, move: Move, effect: Effect, rules: Rules) -> tuple[World, object]:
    """`effect` performed on the world: the directory's scripts, a replica's handlers."""
    k = _of(move)
    placed = world.sessions[k].placed
    match effect:
        case Read():
            return world, placed
        case Unlisted() | DropLost():
            if isinstance(effect, DropLost) and placed == move.in_transit:
                world = world.with_session(k, placed=None)
            return world, None
        case Begin():  # listed, then swapped; unlisted if the swap failed
            listed = world._replace(listed=(*_unlisted(world, move), (move, True)))
            after, begun = _swap(listed, k, move.before, move.in_transit, rules)
            return (
                (after, True) if begun else (after._replace(listed=_unlisted(after, move)), False)
            )
        case Commit() | Abort():
            new = move.after if isinstance(effect, Commit) else move.before
            return _swap(world, k, move.in_transit, new, rules)
        case Unlist():
            return world._replace(listed=_unlisted(world, move)), None
        case CallOut():
            return _call_out(world, k, move, rules)
        case CallIn():
            return _arrive(world, k, move, rules)
        case Release(replica=replica, cancel=cancel):
            return _release(world, k, replica, cancel, rules)
    raise AssertionError(f"no model of {effect!r}")


def _unlisted(world: World, move: Move) -> tuple[tuple[Move, bool], ...]:
    return tuple(e for e in world.listed if e[0] != move)


def _swap(world: World, k: int, old: Placement, new: Placement, rules: Rules) -> tuple[World, bool]:
    """The directory's compare-and-set, as its model has it (redis_model.py)."""
    placed = world.sessions[k].placed
    current = None if placed is None else placed.encode()
    value, answer, _ = rules.swap(SIDS[k], current, old.encode(), new.encode())
    return world.with_session(k, placed=Placement.decode(value)), bool(answer)


def _call_out(world: World, k: int, move: Move, rules: Rules) -> tuple[World, object]:
    """`migrate_out` on the source: ABSENT when the fronts take it for dead; refused
    (503) by one unregistered but not dead, or a life that cannot answer now; else the
    copy leaves, its record written."""
    source = move.source
    if not world.life(source).registered:
        return world, ABSENT if rules.carries_from_records(world.life(source)) else 503
    if not world.serving(source):
        return world, 503
    copy = world.sessions[k].copy(source)
    if copy is None:
        return world, 404
    leaving = world.with_copy(k, source, copy._replace(moving=True))
    return leaving.written(k, source, copy.history), 200


def _arrive(world: World, k: int, move: Move, rules: Rules) -> tuple[World, object]:
    """`migrate_in` on the target: only for this attempt in transit now, from the
    source's records once proven current."""
    target, epoch, session = move.target, move.epoch + 1, world.sessions[k]
    if not world.serving(target):
        return world, (503, False)
    if not copies.takes_arrival(session.placed, move.source, epoch, target, move.nonce):
        return world, (409, False)
    if rules.same_attempt(session.copy(target), move.nonce):
        return world, (200, True)
    if not world.proven(move.source):
        return world, (503, False)
    history = session.records[AT[move.source]]
    if history is None:
        return world, (404, False)
    arrived = world.with_copy(k, target, Copy(epoch, history, arrival=move.nonce))
    return arrived.written(k, target, history), (200, True)  # recorded before it answers


def _release(
    world: World, k: int, replica: str, cancel: bool, rules: Rules
) -> tuple[World, object]:
    """`migrate_done` / `migrate_cancel`: answered (True) when the replica is not
    registered (it settles from the directory once back), refused by a life that cannot
    answer now."""
    if not world.life(replica).registered:
        return world, True
    if not world.serving(replica):
        return world, False
    session = world.sessions[k]
    copy = session.copy(replica)
    if cancel and copy is not None:
        if copy.moving and rules.cancel_restores(copy, session.placed, replica):
            world = world.with_copy(k, replica, copy._replace(moving=False))
        return world, True
    if not cancel and copies.may_close(session.placed, replica):
        return world.with_copy(k, replica, None), True
    return world, True
