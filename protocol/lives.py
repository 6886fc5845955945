"""A replica's lives, as decisions: the order in which a new life starts, what it takes
back of each recorded session, and its lease on its sessions. The scheduler performs
them (services/scheduler/main.py, runtime/session_rebuild.py, runtime/registration.py);
the model checker applies the same ones to its model replicas (tests/protocol/world.py).

**Starting a life** (`START`, in order; docs/protocol.md says why each comes where it
does):
1. register: fence earlier lives and write the registration. From here the fronts see
   the replica alive, so none begins re-homing it, and the session store sees a new
   life, which is what lets it decide a gap the last life left (a store waiting for a
   life that waits for the store would wait for ever);
2. wait until no front is re-homing it: a front that took the re-homing key before the
   registration moves the sessions, and what it moves must not be taken back;
3. read the ownership stream's end, before this life writes anything: the records proof's
   target (shared/records_proof.py);
4. wait for the proof, a bounded while; past it the recorded sessions are pending (they
   answer 503) until it comes, and the life goes on;
5. read the directory and take back what it gives to this replica (`take_back`).

**The lease.** A replica renews it with every registration it writes, measured from when
the write was *sent*: a write sent before a pause that reaches Redis after it does not
extend the lease past the pause, so a replica paused while the fronts re-homed its
sessions finds its lease over when it wakes, and serves nothing until it has checked its
sessions against the directory. The lease ends before any front may call the replica
dead (`ReplicaLease`: the margin)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from shared.placement import Placement


class Step(enum.Enum):
    REGISTER = "register"
    AWAIT_REHOMING = "await re-homing"
    READ_STREAM_END = "read the stream's end"
    AWAIT_PROOF = "await the records proof"
    TAKE_BACK = "take back"


START = (
    Step.REGISTER,
    Step.AWAIT_REHOMING,
    Step.READ_STREAM_END,
    Step.AWAIT_PROOF,
    Step.TAKE_BACK,
)


class Taken(enum.Enum):
    """What a new life does with a session it has a record of."""

    SERVES = "serves"  # taken back, taking turns
    MOVING = "moving"  # taken back leaving: the front finishing its move decides where
    ARRIVING = "arriving"  # taken back as the arrival of the move in transit here
    CLOSED = "closed"  # not this replica's any more: recorded closed here


def take_back(placed: Placement | None, replica: str, routed: bool, arrival: str) -> Taken:
    """A recorded session, as the directory places it now: one placed on another replica
    moved while this one was down, unless it is the arrival (`arrival`: the attempt that
    brought it, as recorded) of the very attempt in transit here now, which the front
    may commit any moment; one a front placed (`routed`) that is placed nowhere was
    closed elsewhere after it moved; one opened straight on this scheduler has no
    placement and is kept. Taken back otherwise, it would be a second live copy, and the
    arrival not taken back would leave a committed session with none."""
    if placed is None:
        return Taken.CLOSED if routed else Taken.SERVES
    if placed.replica != replica:
        if placed.moving_to == replica and placed.attempt and arrival == placed.attempt:
            return Taken.ARRIVING
        return Taken.CLOSED
    return Taken.MOVING if placed.moving_to else Taken.SERVES


class ReplicaLease:
    """The lease, on the replica's own monotonic `clock` (never compared with another
    machine's). A front calls a replica dead once its registration has been missing for
    `dead_seconds`; the registration expires three heartbeats after it was written, and
    a front reads registrations at least once a heartbeat. So no front re-homes a session
    earlier than `dead_seconds` + 2 heartbeats after the last write that reached Redis,
    and this lease ends `dead_seconds` - 1 heartbeat after that write was *sent*: a
    margin of 3 heartbeats, for the two clocks' rates and a check's distance from its act.
    A pause (SIGSTOP, a stall, a partition from Redis) longer than the lease ends it:
    fenced until the replica has written its registration again and checked every
    session it holds against the directory (runtime/directory_check.py)."""

    def __init__(
        self, dead_seconds: float, heartbeat_seconds: float, clock: Callable[[], float]
    ) -> None:
        self.seconds = max(dead_seconds - heartbeat_seconds, heartbeat_seconds)
        self.clock = clock
        self.renewed_at: float | None = None  # when the last renewing write was sent
        self.fenced = False  # lapsed; not yet checked against the directory

    def current(self) -> bool:
        """Whether this replica may serve its sessions now."""
        return (
            not self.fenced
            and self.renewed_at is not None
            and self.clock() - self.renewed_at < self.seconds
        )

    def lapsed_at(self, sent: float) -> bool:
        """Whether a registration sent at `sent` finds the lease ended (never at the
        first write of this life, which comes before it reads what it holds)."""
        return self.renewed_at is not None and sent - self.renewed_at >= self.seconds

    def renew(self, sent: float) -> None:
        """A registration sent at `sent` reached Redis, and nothing is left to check."""
        self.renewed_at, self.fenced = sent, False
