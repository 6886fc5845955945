"""The router's view of the replicas: every id ever registered (`streams.REPLICAS`) and
the registration each live one keeps under its expiring key (address, whether its
executor is up, its load). Re-read every `period`; between reads the router adds the
requests it has sent and not yet seen answered, so a burst does not pile onto one
replica before the next read, and the opens it sent that no registration read has
counted yet, so the session limits count each open session once."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import Counter

from shared import streams
from shared.registration_auth import verified
from shared.retry import Retry

log = logging.getLogger("custody.router")


@dataclass(eq=False)
class Opening:
    """An open this router sent to a replica, counted beside its registration until a
    registration read has it: exactly, when the replica numbered it (`mark`) and the
    registration of that scheduler counts that many opens; by time (`settle` after it
    was answered) when the answer had no number or that scheduler has been replaced."""

    tenant: str | None
    answered: float = math.inf  # on this router's monotonic clock; inf while it runs
    mark: tuple[str, int] | None = None  # (scheduler epoch, the open's number there)

    def counted_by(self, replica: Replica, settled_before: float) -> bool:
        if self.mark is not None and self.mark[0] == replica.epoch:
            return self.mark[1] <= replica.opened
        return self.answered < settled_before


@dataclass
class Replica:
    id: str
    url: str
    executor: bool  # its scheduler has a live executor
    running: int
    queued: int
    registered_sessions: int  # open on it when it wrote its registration
    epoch: str = ""  # its scheduler's, as registered
    opened: int = 0  # opens that scheduler had answered when it wrote its registration
    draining: bool = False  # an operator drains it: nothing new is placed on it
    in_flight: int = 0  # requests this router sent it that have not ended
    tenants: dict[str, int] = field(default_factory=dict)  # open sessions by key, registered
    # this router's opens on it that no registration read has counted yet
    placed: list[Opening] = field(default_factory=list)
    warmed: str | None = None  # the scheduler epoch this router's connections were opened to

    @property
    def load(self) -> int:
        return self.running + self.queued + self.in_flight

    @property
    def sessions(self) -> int:
        """Open on it: as registered, plus this router's opens the registration read
        does not count yet (never missed; counted twice only where `Opening` falls back
        to time)."""
        return self.registered_sessions + len(self.placed)

    def answered(self, opening: Opening) -> None:
        """Count `opening`, answered by this replica, until a registration read has it:
        the last one read may have already (written while the answer was on its way)."""
        if not opening.counted_by(self, settled_before=-math.inf):
            self.placed.append(opening)

    def sessions_of(self, tenant: str) -> int:
        """Open on it for the key whose hash is `tenant`, counted as `sessions` is."""
        return self.tenants.get(tenant, 0) + sum(o.tenant == tenant for o in self.placed)


REGISTERED = (  # what a registration read sets; the rest is this router's own count
    "url",
    "executor",
    "running",
    "queued",
    "registered_sessions",
    "epoch",
    "opened",
    "tenants",
    "draining",
)


class ReplicaTable:
    def __init__(
        self,
        client: aioredis.Redis,
        period: float,
        secret: str = "",
        settle: float = 1.5,
    ) -> None:
        """`period`: between reads; `secret`: the cluster secret registrations must be
        signed with (none: any); `settle`: how long after an open is answered every
        registration read counts an open its answer did not number (a few of the
        replicas' heartbeats: `Opening`)."""
        self.client, self.period, self.secret, self.settle = client, period, secret, settle
        # opens the router's connections to a replica before it counts as ready (the
        # router sets its proxy's; None: nothing to open)
        self.warm: Callable[[Replica], Awaitable[None]] | None = None
        self.unverified = 0  # registrations read and refused: not signed with the secret
        self._refused: set[str] = set()
        self.live: dict[str, Replica] = {}
        self.known: list[str] = []  # every replica id ever registered
        self._all: dict[str, Replica] = {}  # every replica seen, live or not
        self.last_read = -math.inf  # when a read last succeeded (monotonic clock)

    async def refresh(self) -> None:
        """Read every registration. A replica keeps its one `Replica` object for the
        router's life, updated in place: requests in flight count on the object they were
        sent with, so a new object per read would leave their ends on a stale one."""
        ids = sorted(m.decode() for m in await self.client.smembers(streams.REPLICAS))
        self.known = ids
        live: dict[str, Replica] = {}
        for rid in ids:  # one key each: on a cluster they live on different slots
            raw = await self.client.get(streams.Keys(rid).alive)
            if raw is None:
                continue
            try:
                entry = json.loads(raw)
                if not verified(self.secret, rid, entry):
                    self.unverified += 1
                    if rid not in self._refused:  # logged once per replica id
                        self._refused.add(rid)
                        log.error(
                            "replica %s: registration not signed with the cluster secret; "
                            "skipped (no request, and no key, is sent to it)",
                            rid,
                        )
                    continue
                fresh = Replica(
                    rid,
                    str(entry["url"]),
                    bool(entry["executor"]),
                    int(entry["running"]),
                    int(entry["queued"]),
                    int(entry["sessions"]),
                    str(entry["epoch"]),
                    int(entry["opened"]),
                    tenants={str(k): int(v) for k, v in entry["tenants"].items()},
                )
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                log.error("replica %s: unreadable registration (%s); skipped", rid, err)
                continue
            fresh.draining = bool(await self.client.exists(streams.Keys(rid).draining))
            live[rid] = self._update(fresh)
        cold = [r for r in live.values() if r.executor and r.warmed != r.epoch]
        await asyncio.gather(*(self._warm(r) for r in cold))
        self.live = live
        self.last_read = time.monotonic()

    async def _warm(self, replica: Replica) -> None:
        """Open this router's connections to a replica (or a new life of one) before it
        is ready: requests then do not pay for the connect."""
        if self.warm is not None:
            await self.warm(replica)
        replica.warmed = replica.epoch

    def _update(self, fresh: Replica) -> Replica:
        replica = self._all.setdefault(fresh.id, fresh)
        if replica is not fresh:
            for name in REGISTERED:
                setattr(replica, name, getattr(fresh, name))
            # no clock of another machine is compared with this one's
            settled_before = time.monotonic() - self.settle
            replica.placed = [
                o for o in replica.placed if not o.counted_by(replica, settled_before)
            ]
        return replica

    async def run(self, faults: Counter | None = None) -> None:
        """Read the registrations every `period`, forever; a fault is counted in
        `faults`, logged and retried (shared/retry.py)."""
        retry = Retry("router_replicas", log, faults)
        while True:
            try:
                await self.refresh()
            except Exception as err:
                await retry.wait(err)
                continue
            retry.ok()
            await asyncio.sleep(self.period)

    def ready(self) -> list[Replica]:
        """Live replicas with an executor, whose connections are open: they answer
        requests."""
        return [r for r in self.live.values() if r.executor and r.warmed == r.epoch]

    def placeable(
        self, excluding: str | None = None, only: Collection[str] | None = None
    ) -> list[Replica]:
        """Ready replicas that take new work (not drained); of the ids in `only`, if
        given (a gateway's subset of endpoints)."""
        return [
            r
            for r in self.ready()
            if not r.draining and r.id != excluding and (only is None or r.id in only)
        ]

    def least_loaded(
        self, excluding: str | None = None, only: Collection[str] | None = None
    ) -> Replica | None:
        """The placeable replica with the least load; among equals the one with the
        fewest sessions, then one at random."""
        ready = self.placeable(excluding, only)
        if not ready:
            return None
        least = min((r.load, r.sessions) for r in ready)
        return random.choice([r for r in ready if (r.load, r.sessions) == least])
