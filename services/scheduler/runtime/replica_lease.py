"""A replica's right to serve its sessions: a lease it renews with every registration
it writes, which ends before any router may declare it dead and move its sessions.

A router calls a replica dead once its registration has been missing for
`replica_dead_seconds`; the registration expires three heartbeats after it was written,
and a router reads registrations at least once a heartbeat. So no router re-homes a
session earlier than `replica_dead_seconds` + 2 heartbeats after the last write that
reached Redis. This replica stops serving `replica_dead_seconds` - 1 heartbeat after it
*sent* that write (before it reached Redis): the margin is 3 heartbeats. Only this
replica's own monotonic clock is read, never a comparison of two machines' clocks; what
the margin must absorb is the two clocks' rates and a check's distance from its act.

A pause (SIGSTOP, a stall, a partition from Redis) longer than the lease ends it: the
replica is fenced. It stays fenced until it has written its registration again and
checked every session it holds against the placement directory (directory_check.py),
releasing each one that moved or was closed elsewhere meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable


class ReplicaLease:
    def __init__(
        self,
        dead_seconds: float,
        heartbeat_seconds: float,
        clock: Callable[[], float] = time.monotonic,
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
