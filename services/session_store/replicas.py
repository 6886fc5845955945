"""The store's consumers: one per replica of the stack, each with its own ledger.

Every replica (a scheduler and its executor) ships its ownership and forward streams under
its own Redis names (shared/streams.py `Keys`), so the store keeps one independent ledger
per replica, each with its own write checker and checkpoint: a replica's steps are only
ever checked against that replica's slots. The replicas are the store's own
`settings.replica` and every id the schedulers registered in `streams.REPLICAS`, re-read
about once a second, so a replica started after the store gets its consumer then.

Each consumer runs in its own loop, its blocking reads in a thread: one replica's busy
stream delays no other replica's ledger, and a fault while applying one replica's
entries (counted in `faults` by replica, logged) stops nothing, not even that replica's
loop, which retries. Redis away or refusing (any error class) is waited out by every
loop; each loop's faults are counted in `loop_faults` (shared/retry.py), by loop and
replica, which the store's /metrics serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import redis

from services.session_store.consumer import OwnershipConsumer
from shared import streams
from shared.metrics_labels import LABEL
from shared.retry import DEPENDENCY_FAULTS, Retry, background_faults

log = logging.getLogger("custody.session_store")

# A stable name: a restarted store resumes its own pending entries first. One name serves
# every replica, as each replica's streams have their own consumer group.
CONSUMER_NAME = "session-store-1"
DISCOVER_SECONDS = 1.0
# a dead consumer's entries are taken over once idle this long, looked for this often
# (not with every poll: a round trip a step for what a restart leaves now and then)
STALE_IDLE_MS, STALE_CLAIM_SECONDS = 10_000, 2.0
# After a read that found entries, a busy replica's loop waits this long before the next,
# so one read, one write check and one transaction take several steps' entries (at 10 ms
# steps, about five) instead of one step's each: the store's CPU and round trips per step
# fall by that much. The ledger lags a busy replica by at most this; nothing waits on it
# that closely (a move waits up to seconds for the store's proof of the records).
BATCH_SECONDS = 0.05


class ReplicaConsumers:
    """The consumers by replica id, and the loops that feed them."""

    def __init__(self, client: redis.Redis, own: str) -> None:
        self.client, self.own = client, own
        # The store's own replica is there from the start: its /ledger answers at once.
        self.consumers: dict[str, OwnershipConsumer] = {own: self._consumer(own)}
        self.faults: Counter[str] = Counter()  # faults not Redis's survived, by replica
        self.loop_faults = background_faults(None, ("loop", LABEL))  # yielded by metrics.py
        self._loops: dict[str, asyncio.Task] = {}

    def _consumer(self, replica: str) -> OwnershipConsumer:
        return OwnershipConsumer(self.client, CONSUMER_NAME, keys=streams.Keys(replica))

    def registered(self) -> set[str]:
        """The replicas to consume: the store's own and every registered id (anything in
        the set that is not a replica id is no replica's and is passed over)."""
        ids = {raw.decode("utf-8", "replace") for raw in self.client.smembers(streams.REPLICAS)}
        return {self.own} | {r for r in ids if streams.REPLICA_ID.fullmatch(r)}

    async def discover(self) -> None:
        """Stop the consumer of each replica that left the replica set; build one for
        each newly registered replica (reading its checkpoint) and start its loop. One
        that fails to build is counted and tried again next time; Redis away or refusing
        is raised, once the loops of those built are started."""
        unavailable: Exception | None = None
        registered = await asyncio.to_thread(self.registered)
        for replica in sorted(self.consumers.keys() - registered):  # forgotten (a router)
            loop = self._loops.pop(replica, None)
            if loop is not None:
                loop.cancel()
            del self.consumers[replica]
            log.info("replica %s left the replica set: its consumer stops", replica)
        for replica in sorted(registered - self.consumers.keys()):
            try:
                self.consumers[replica] = await asyncio.to_thread(self._consumer, replica)
            except DEPENDENCY_FAULTS as err:
                unavailable = err
                break  # the loops of those built are started all the same
            except Exception:
                log.exception("replica %s: cannot start consuming its streams", replica)
                self.faults[replica] += 1
        for replica in self.consumers.keys() - self._loops.keys():
            loop = self._consume(replica)
            self._loops[replica] = asyncio.create_task(loop, name=f"ledger-{replica}")
        if unavailable is not None:
            raise unavailable

    async def run_forever(self) -> None:
        """Discover replicas about once a second, forever; a fault is counted, logged
        and retried after a backoff. The replicas' loops end with it."""
        retry = Retry("store_discover", log, self.loop_faults, labels=(self.own,))
        try:
            while True:
                try:
                    await self.discover()
                except Exception as err:
                    await retry.wait(err)
                    continue
                retry.ok()
                await asyncio.sleep(DISCOVER_SECONDS)
        finally:
            for task in self._loops.values():
                task.cancel()
            self._loops.clear()

    async def _consume(self, replica: str) -> None:
        """One replica's loop: read, apply, report what its ledger found, forever."""
        consumer = self.consumers[replica]
        led = consumer.ledger
        reported = led.found.total()  # those loaded were logged before
        retry = Retry(
            "store_consume", log, self.loop_faults, labels=(replica,), about=f"replica {replica}"
        )
        claimed = 0.0  # when it last looked for a dead consumer's entries
        while True:
            try:
                if await asyncio.to_thread(consumer.poll, 500):
                    await asyncio.sleep(BATCH_SECONDS)
                if time.monotonic() - claimed > STALE_CLAIM_SECONDS:
                    await asyncio.to_thread(consumer.claim_stale, STALE_IDLE_MS)
                    claimed = time.monotonic()
            except DEPENDENCY_FAULTS as err:
                await retry.wait(err)
            except Exception as err:  # a bad entry must not stop the ledger: say so, go on
                self.faults[replica] += 1
                await retry.wait(err)
            else:
                retry.ok()
            new = led.found.total() - reported
            for v in led.violations[-new:] if new else []:
                log.error(
                    "replica %s: ownership violation %s on %s %s: %s",
                    replica,
                    v.kind,
                    v.pool,
                    v.slots,
                    v.detail,
                )
            reported += new
