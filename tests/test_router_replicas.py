"""The router on a real Redis: a replica keeps one object across registration reads, so
a request in flight while the table is read ends on the object that counts it (a new
object per read left +1 of load behind for every such request); an open while Redis is
away is a clear 503 that leaves no session behind; a request a replica dropped after it
was sent is a 502 whose outcome is unknown, never a 503 to retry."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import redis
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from custody.up import Stack
from fronts.replicas import Opening, ReplicaTable
from shared import streams
from shared.config import Settings
from shared.placement import Placement
from shared.redis_client import connect_async
from shared.redis_server import PrivateRedis, free_port
from tests.services_harness import stack_settings, start_stack


def register(client: redis.Redis, rid: str, **load: int) -> None:
    entry = {"url": "http://r", "executor": True, "running": 0, "queued": 0, "sessions": 0}
    entry |= {"epoch": "e1", "opened": 0, "tenants": {}} | load | {"at": time.time()}
    client.sadd(streams.REPLICAS, rid)
    client.set(streams.Keys(rid).alive, json.dumps(entry))


def test_requests_and_opens_in_flight_across_a_read_end_where_they_count(
    redis_url: str, redis_client: redis.Redis
):
    async def scenario() -> None:
        table = ReplicaTable(await connect_async(redis_url), period=0.1)
        register(redis_client, "0")
        await table.refresh()
        replica = table.live["0"]
        replica.in_flight += 1  # a request sent ...
        opening = Opening(None)
        replica.placed.append(opening)  # ... and an open running
        register(redis_client, "0", running=1)
        await table.refresh()  # read while both are in flight
        assert table.live["0"] is replica and replica.running == 1
        replica.in_flight -= 1
        replica.placed.remove(opening)
        assert (table.live["0"].load, table.live["0"].sessions) == (1, 0)
        redis_client.delete(streams.Keys("0").alive)
        await table.refresh()
        assert "0" not in table.live
        register(redis_client, "0")
        await table.refresh()
        assert table.live["0"] is replica and replica.load == 0  # back: the same object
        await table.client.aclose()

    asyncio.run(scenario())


def test_an_answered_open_counts_until_it_settles_whatever_the_replica_s_clock(
    redis_url: str, redis_client: redis.Redis
):
    """The per-key limits count this router's recent opens beside the registrations
    read; a replica whose wall clock runs an hour ahead made the router drop them at the
    next read (it compared the two machines' clocks), so a key passed its limit."""

    async def scenario() -> None:
        table = ReplicaTable(await connect_async(redis_url), period=0.1, settle=0.5)
        register(redis_client, "0")
        await table.refresh()
        table.live["0"].placed.append(Opening("tenant-a", time.monotonic()))
        entry = json.loads(redis_client.get(streams.Keys("0").alive))
        entry["at"] = time.time() + 3600  # the replica's clock, an hour ahead
        redis_client.set(streams.Keys("0").alive, json.dumps(entry))
        await table.refresh()
        assert table.live["0"].sessions_of("tenant-a") == 1
        await asyncio.sleep(0.6)
        await table.refresh()  # the registrations read now have it (none here: 0)
        assert table.live["0"].sessions_of("tenant-a") == 0
        await table.client.aclose()

    asyncio.run(scenario())


def test_a_numbered_open_counts_once_from_the_first_registration_that_has_it(
    redis_url: str, redis_client: redis.Redis
):
    """An answered open counted time-only counted twice (in the registration and beside
    it) for three heartbeats, so an open near a limit was refused though a session was
    free; numbered by its replica, it leaves the count at the first registration of the
    same scheduler that counts it, and never before."""

    async def scenario() -> None:
        table = ReplicaTable(await connect_async(redis_url), period=0.1, settle=3600)
        register(redis_client, "0", opened=4)
        await table.refresh()
        replica = table.live["0"]
        replica.placed.append(Opening("tenant-a", time.monotonic(), ("e1", 5)))
        replica.placed.append(Opening("tenant-a", time.monotonic(), ("e0", 9)))
        register(redis_client, "0", opened=4)  # written before the open: not in it
        await table.refresh()
        assert replica.sessions_of("tenant-a") == 2
        tenants = {"tenant-a": 1}
        register(redis_client, "0", opened=5, sessions=1, tenants=tenants)
        await table.refresh()
        # one counted by the registration, the other (from a scheduler since replaced)
        # kept until `settle` has passed
        assert (replica.sessions_of("tenant-a"), replica.sessions) == (2, 2)
        assert [o.mark for o in replica.placed] == [("e0", 9)]
        replica.answered(Opening("tenant-a", time.monotonic(), ("e1", 5)))
        assert replica.sessions == 2  # its answer came after the registration that has it
        await table.client.aclose()

    asyncio.run(scenario())


def test_an_open_while_redis_is_away_is_a_503_and_leaves_nothing_behind():
    """Redis stopped while an open runs: the placement cannot be written, the replica
    opens the session once Redis is back, and the router answers 503 (the directory is
    unavailable) and releases that copy, so no session is left open without a home."""
    with PrivateRedis(appendonly=True) as server:
        stack = start_stack(stack_settings(server.url, replicas=2))
        try:
            port = stack.settings.port
            server.stop()
            assert sessions_open(stack) == 0  # a replica's metrics are served with Redis away
            answer: dict = {}
            opening = threading.Thread(target=lambda: answer.update(open_answer(port)))
            opening.start()
            time.sleep(1.0)
            server.start()
            opening.join(60)
            assert answer == {"status": 503, "type": "directory_unavailable"}, answer
            deadline = time.monotonic() + 20
            while sessions_open(stack) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert sessions_open(stack) == 0
            deadline = time.monotonic() + 30  # opens work again once replicas re-register
            while open_answer(port)["status"] != 200:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        finally:
            stack.stop()


def open_answer(port: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/open_session", data=b"{}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return {"status": resp.status}
    except urllib.error.HTTPError as err:
        return {"status": err.code, "type": json.loads(err.read())["error"]["type"]}


def sessions_open(stack: Stack) -> int:
    """Sessions open on every replica, as each replica's metrics count them."""
    total = 0
    for i in ("0", "1"):
        text = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{stack.layout[f'scheduler-{i}'][1].port}/metrics"
            )
            .read()
            .decode()
        )
        for family in text_string_to_metric_families(text):
            if family.name == "custody_sessions_open":
                total += int(sum(s.value for s in family.samples))
    return total


def test_a_turn_the_replica_dropped_after_it_was_sent_is_a_502_never_a_retry(
    redis_url: str, redis_client: redis.Redis
):
    """The replica read the turn and hung up before answering (killed mid-turn): the
    turn may be in the session's history, so the router answers 502 `outcome_unknown`
    without Retry-After. It answered 503 `replica_unavailable` with Retry-After, and a
    client that retried on it ran on a history longer than it was told (the fault
    campaign's `store_lag`: stale turns)."""
    received: list[str] = []

    async def hang_up(request: web.Request) -> web.Response:
        await request.read()
        received.append(request.path)
        request.transport.close()
        return web.Response()

    replica_port, router_port = free_port(), free_port()
    loop = asyncio.new_event_loop()
    replica = web.AppRunner(web.Application())
    replica.app.router.add_post("/generate", hang_up)

    async def start() -> None:
        await replica.setup()
        await web.TCPSite(replica, "127.0.0.1", replica_port).start()

    loop.run_until_complete(start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    register(redis_client, "0", url=f"http://127.0.0.1:{replica_port}")
    redis_client.set(streams.placement_key("s1"), Placement("0").encode())
    settings = Settings(port=router_port, redis_url=redis_url, replica_dead_seconds=60.0)
    router = subprocess.Popen(
        [sys.executable, "-m", "services.router.main"], env={**os.environ, **settings.to_env()}
    )
    try:
        body = json.dumps({"text": "hi", "session_params": {"id": "s1"}}).encode()
        deadline = time.monotonic() + 30
        while True:
            req = urllib.request.Request(f"http://127.0.0.1:{router_port}/generate", data=body)
            try:
                urllib.request.urlopen(req, timeout=30)
            except urllib.error.HTTPError as err:
                status, headers, kind = err.code, err.headers, json.loads(err.read())
                break
            except OSError:  # the router is not listening yet
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert (status, kind["error"]["type"]) == (502, "outcome_unknown"), kind
        assert "Retry-After" not in headers
        assert received == ["/generate"]  # sent once, not again elsewhere
    finally:
        router.terminate()
        router.wait(10)
        loop.call_soon_threadsafe(loop.stop)
        redis_client.delete(streams.placement_key("s1"), streams.Keys("0").alive)
        redis_client.srem(streams.REPLICAS, "0")


def test_a_router_with_no_ready_replica_is_not_ready():
    """A router alone (no replica registered) would answer every request 503: its
    `/health` says so (503, Retry-After, what it waits for) while `/liveness` is 200, so
    a readiness probe sends it nothing; before, `/health` was 200 with 0 replicas."""
    with PrivateRedis() as server:
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "services.router.main", "--redis-url", server.url],
            env={**os.environ, "CUSTODY_PORT": str(port)},
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/liveness", timeout=5)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the router never came up"
                    time.sleep(0.2)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                raise AssertionError("/health answered 200 with no replica")
            except urllib.error.HTTPError as refused:
                body = json.loads(refused.read())
                assert refused.code == 503 and refused.headers["Retry-After"] == "1"
                assert body["ready"] == 0 and body["waiting_for"] == ["replica"], body
        finally:
            router.terminate()
            router.wait(30)
