"""One session store, one independent ledger per replica: every registered replica's
ownership stream is consumed into its own ledger, concurrently, a fault in one replica's
consumer stops no other, and the HTTP routes and metrics say which replica is which."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import redis
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.runtime.event_shipper import EventShipper
from services.session_store.service import StoreService, build_app
from shared import streams
from shared.config import Settings
from shared.messages.envelope import I4, array
from shared.messages.ownership import SessionRecord, encode_record
from tests.engine.driver import Driver


class Replica:
    """A scheduler's ledger shipping to one replica's ownership stream."""

    def __init__(self, client: redis.Redis, replica: str) -> None:
        self.client, self.keys = client, streams.Keys(replica)
        self.driver = Driver(kv_pages=64, mamba_slots=8, context=64)
        self.shipper = EventShipper(self.driver.pools.ledger, epoch=f"e-{replica}")
        self.publish(self.shipper.snapshot())

    def publish(self, message: bytes) -> None:
        self.client.xadd(self.keys.ownership, {"m": message})

    def allocate(self, n: int, ship: bool = True) -> None:
        """`n` Mamba slots to one request, shipped (or lost on the way: a gap)."""
        owner = self.driver.pools.ledger.new_owner(OwnerKind.REQUEST, f"r{time.monotonic_ns()}")
        for _ in range(n):
            self.driver.pools.mamba.alloc_one(owner)
        message, _ = self.shipper.batch()
        if ship:
            self.publish(message)


async def until(what: str, done: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_every_registered_replica_has_its_own_ledger(redis_url, redis_client):
    own, a, b = (Replica(redis_client, r) for r in ("0", "a", "b"))
    redis_client.sadd(streams.REPLICAS, "a", "b", "not}a{replica")
    own.allocate(1)
    a.allocate(3)
    b.allocate(2, ship=False)  # lost: b's next message comes after a gap
    b.allocate(1)
    store = StoreService(Settings(redis_url=redis_url))

    async def scenario() -> None:
        task = asyncio.create_task(store.replicas.run_forever())
        consumers = store.replicas.consumers
        await until("three ledgers", lambda: set(consumers) == {"0", "a", "b"})
        await until("a's events", lambda: consumers["a"].ledger.events_applied == 3)
        await until("b's gap", lambda: consumers["b"].ledger.found["gap"] == 1)
        await until("own events", lambda: consumers["0"].ledger.events_applied == 1)
        assert consumers["0"].ledger.found.total() == consumers["a"].ledger.found.total() == 0

        # A fault in a's consumer: counted for a, and b's ledger goes on.
        def broken(*_: object) -> int:
            raise RuntimeError("broken on purpose")

        consumers["a"].poll = broken
        b.publish(b.shipper.snapshot())
        b.allocate(2)
        await until("b after a's fault", lambda: consumers["b"].ledger.events_applied == 2)
        await until("a's faults", lambda: store.replicas.faults["a"] > 0)
        assert store.replicas.faults["b"] == 0
        task.cancel()
        await http_checks(store)

    asyncio.run(scenario())


async def http_checks(store: StoreService) -> None:
    async with TestServer(build_app(store)) as server, ClientSession() as client:

        async def get(path: str) -> tuple[int, dict | str]:
            async with client.get(server.make_url(path)) as resp:
                body = await (
                    resp.json() if resp.content_type == "application/json" else resp.text()
                )
                return resp.status, body

        status, own = await get("/ledger")
        assert (
            status == 200 and own["events_applied"] == 1 and own["counts"]["mamba"]["request"] == 1
        )
        status, view = await get("/ledger?replica=a")
        assert status == 200 and view["counts"]["mamba"]["request"] == 3
        assert view["consumer_faults"] > 0
        status, view = await get("/ledger?replica=nowhere")
        assert status == 404 and view["error"]["type"] == "not_found"
        status, every = await get("/ledger/replicas")
        assert status == 200 and set(every["replicas"]) == {"0", "a", "b"}
        assert every["replicas"]["0"] == own
        assert every["replicas"]["b"]["violations_total"] == {"gap": 1}
        status, text = await get("/metrics")
        assert status == 200
        found = samples(text)
        assert found and all(labels.get("replica") in {"0", "a", "b"} for _, labels, _ in found)
        value = {(n, tuple(sorted(labels.items()))): v for n, labels, v in found}
        assert value[("custody_ledger_violations", (("kind", "gap"), ("replica", "b")))] == 1
        assert value[("custody_ledger_violations", (("kind", "gap"), ("replica", "a")))] == 0
        assert value[("custody_ledger_events_applied", (("replica", "a"),))] == 3
        assert re.search(r'^custody_ledger_leaked_slots\{pool="mamba",replica="0"\}', text, re.M)
        await session_checks(store, get)


async def session_checks(store: StoreService, get: Callable) -> None:
    """A session is read from the replica the placement directory names, else the store's
    own replica's."""
    client = store.client
    for replica, sid in (("b", "placed"), ("0", "unplaced")):
        history = array([1, 2, 3] if replica == "b" else [4, 5], I4)
        record = SessionRecord(sid=sid, history=history)
        client.hset(streams.Keys(replica).session(sid), "record", encode_record(record))
    client.set(streams.placement_key("placed"), "b")
    status, body = await get("/sessions/placed")
    assert status == 200 and body["history"] == [1, 2, 3]
    status, body = await get("/sessions/unplaced")
    assert status == 200 and body["history"] == [4, 5]
    client.set(streams.placement_key("unplaced"), "a")  # placed elsewhere: not there
    status, body = await get("/sessions/unplaced")
    assert status == 404 and body["error"]["type"] == "not_found"
