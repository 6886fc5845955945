"""Background loops survive every Redis error class (shared/retry.py).

The helper itself: what it calls a dependency fault and what a fault of the loop itself,
its backoff, its bounded logging, its counter. Then a live stack of two replicas (two
schedulers, two executors, the store, the router) through two windows in which the test
Redis refuses writes: an OOM under `maxmemory`, and READONLY while it is made a replica.
Each must leave every process running, the replicas registered again, a request served
and the faults counted on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import (
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from custody.up import Stack
from fronts.replicas import ReplicaTable
from shared import streams
from shared.redis_server import PrivateRedis, free_port
from shared.retry import Retry, background_faults
from tests.services_harness import call, health, stack_settings, start_stack

LOG = logging.getLogger("custody.test-retry")
DEPENDENCY = [
    ResponseError("OOM command not allowed when used memory > 'maxmemory'."),
    ReadOnlyError("You can't write against a read only replica."),
    ClusterDownError("The cluster is down"),
    TryAgainError("Multiple keys request during rehashing of slot"),
    MovedError("3999 127.0.0.1:6381"),
    redis.TimeoutError("Timeout reading from socket"),
    redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
    ConnectionRefusedError(111, "Connection refused"),
    TimeoutError("timed out"),
    OSError(113, "No route to host"),
]
OWN = [ValueError("bad entry"), KeyError("url"), AttributeError("'NoneType' object")]


def retry(**options: object) -> Retry:
    return Retry("test_loop", LOG, **options)


@pytest.mark.parametrize("err", DEPENDENCY, ids=lambda e: type(e).__name__)
def test_every_redis_and_network_error_is_a_dependency_fault_logged_without_traceback(
    err: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOG.name):
        retry().failed(err)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert type(err).__name__ in record.getMessage()


@pytest.mark.parametrize("err", OWN, ids=lambda e: type(e).__name__)
def test_any_other_exception_is_a_fault_of_the_loop_logged_with_its_traceback(
    err: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOG.name):
        retry().failed(err)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info[1] is err


def test_the_backoff_doubles_to_its_ceiling_with_jitter_and_a_success_resets_it() -> None:
    r = retry(first=0.2, ceiling=2.0)
    for base in (0.2, 0.4, 0.8, 1.6, 2.0, 2.0):
        assert base / 2 <= r.failed(OSError()) <= base
    at_ceiling = {r.failed(OSError()) for _ in range(20)}
    assert all(1.0 <= d <= 2.0 for d in at_ceiling) and len(at_ceiling) > 1  # jittered
    r.ok()
    assert 0.1 <= r.failed(OSError()) <= 0.2
    assert r.faults == 27 and r.streak == 1


def test_logging_is_bounded_per_kind_and_says_how_many_lines_it_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    r = retry(log_every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=LOG.name):
        for _ in range(5):
            r.failed(ResponseError("OOM"))
        r.failed(ValueError("bad"))  # a fault of the loop is not held back by Redis's
        now[0] = 105.0
        r.failed(ResponseError("OOM"))
        r.failed(ValueError("bad"))
        assert len(caplog.records) == 2
        now[0] = 110.5
        r.failed(ResponseError("OOM"))
    first, own, later = caplog.records
    assert "more since" not in first.getMessage() and own.exc_info is not None
    assert "5 more since the last line" in later.getMessage()
    assert r.faults == 9


def test_every_fault_is_counted_by_loop_and_the_series_is_there_before_any() -> None:
    registry = CollectorRegistry()
    counter = background_faults(registry)
    beat, serve = Retry("beat", LOG, counter), Retry("serve", LOG, counter)

    def count(loop: str) -> float | None:
        return registry.get_sample_value("custody_background_faults_total", {"loop": loop})

    assert count("beat") == 0.0 and count("serve") == 0.0
    beat.failed(ResponseError("OOM"))
    beat.failed(ValueError("bad"))
    serve.failed(OSError())
    assert (count("beat"), count("serve")) == (2.0, 1.0)
    assert b'custody_background_faults_total{loop="beat"} 2.0' in generate_latest(registry)
    by_replica = CollectorRegistry()  # the store's: by loop and replica
    store = background_faults(by_replica, ("loop", "replica"))
    Retry("store_consume", LOG, store, labels=("1",)).failed(OSError())
    sample = {"loop": "store_consume", "replica": "1"}
    assert by_replica.get_sample_value("custody_background_faults_total", sample) == 1.0


def test_a_loop_survives_its_own_faults_and_still_ends_when_cancelled() -> None:
    """ReplicaTable.run over a client that is not one: every refresh is a fault of the
    loop, counted and retried; a cancel (a BaseException) still ends it."""
    registry = CollectorRegistry()
    counter = background_faults(registry)

    async def scenario() -> float | None:
        task = asyncio.create_task(ReplicaTable(None, 0.01).run(counter))
        await asyncio.sleep(0.5)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return registry.get_sample_value(
            "custody_background_faults_total", {"loop": "router_replicas"}
        )

    assert asyncio.run(scenario()) >= 2


# --- a live stack --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two(redis_url: str) -> Iterator[Stack]:
    """Two replicas and a router, for every test below (not `redis_client`: it would
    flush the database under the running stack)."""
    redis.Redis.from_url(redis_url).flushdb()
    running = start_stack(stack_settings(redis_url, replicas=2))
    yield running
    running.stop()
    redis.Redis.from_url(redis_url).flushdb()


Samples = list[tuple[dict[str, str], float]]


def faults(port: int) -> Samples:
    """The custody_background_faults_total samples on a service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "custody_background_faults_total"
    ]


def total(samples: Samples, **labels: str) -> float:
    return sum(v for found, v in samples if labels.items() <= found.items())


def scrape(stack: Stack) -> dict[str, Samples]:
    """Every service's samples, by child name."""
    ports = {"router": stack.settings.port, "session-store": stack.settings.store_port}
    for i in ("0", "1"):
        own = stack.layout[f"scheduler-{i}"][1]
        ports[f"scheduler-{i}"], ports[f"executor-{i}"] = own.port, own.executor_metrics_port
    return {name: faults(port) for name, port in ports.items()}


def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


ALIVE = [streams.Keys(i).alive for i in ("0", "1")]


def survives(stack: Stack, client: redis.Redis, window: Callable[[], None]) -> None:
    """Run `window` (Redis refusing writes for longer than a registration lives; it must
    restore Redis) and check the stack came through it: both registrations lapsed
    within it and were written again after, every process is the one it was, and a
    request is served."""
    pids = {name: child.pid for name, child in stack.children.items()}
    window()
    until("both registrations written again", lambda: all(client.exists(k) for k in ALIVE))
    assert all(c.poll() is None for c in stack.children.values()), stack.children
    assert {n: c.pid for n, c in stack.children.items()} == pids
    assert set(stack.restarts.values()) == {0}
    port = stack.settings.port
    until("both replicas ready at the router", lambda: health(port).get("ready") == 2)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert len(call(port, "/generate", body, timeout=60)["output_ids"]) == 3


def grew(before: dict[str, Samples], after: dict[str, Samples], name: str, **labels: str) -> bool:
    return total(after[name], **labels) > total(before[name], **labels)


def test_every_service_serves_its_loops_faults_with_its_labels(two: Stack) -> None:
    """Each loop's series is there from its start, labelled as the rest of its service's
    samples: a replica's scheduler and executor label everything with their replica, the
    store each sample with the replica it is about, the router nothing."""
    found = {
        name: {(labels["loop"], labels.get("replica")) for labels, _ in samples}
        for name, samples in scrape(two).items()
    }
    assert found["router"] == {(loop, None) for loop in ROUTER_LOOPS}
    for i in ("0", "1"):
        loops = {"registration", "step_loop", "scheduler_start"}
        assert found[f"scheduler-{i}"] == {(loop, i) for loop in loops}
        loops = {"executor_read", "executor_write", "executor_heartbeat", "grammar_checks"}
        assert found[f"executor-{i}"] == {(loop, i) for loop in loops}
    discover = ("store_discover", two.settings.replica)
    assert found["session-store"] == {discover, ("store_consume", "0"), ("store_consume", "1")}


# (placement_changes: every front hears the placement notices, fronts/front.py)
ROUTER_LOOPS = {
    "router_replicas",
    "prefix_feed",
    "placement_changes",
    "move_takeover",
    "router_bookkeeping",
}


def test_an_oom_window_ends_no_loop_and_no_process(two: Stack, redis_url: str) -> None:
    """`maxmemory 1`: Redis refuses every write with OOM; before shared/retry.py, the
    registration loops ended and the executors exited."""
    client = redis.Redis.from_url(redis_url)

    def oom() -> None:
        old = client.config_get("maxmemory*")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        try:
            started = time.monotonic()
            until("the registrations to lapse", lambda: not any(map(client.exists, ALIVE)))
            time.sleep(max(0.0, 3.5 - (time.monotonic() - started)))
        finally:
            client.config_set("maxmemory", old["maxmemory"])
            client.config_set("maxmemory-policy", old["maxmemory-policy"])

    before = scrape(two)
    survives(two, client, oom)
    after = scrape(two)
    for i in ("0", "1"):
        assert grew(before, after, f"scheduler-{i}", loop="registration", replica=i)
        assert grew(before, after, f"executor-{i}", loop="executor_heartbeat", replica=i)


def test_a_readonly_window_ends_no_loop_and_no_process_and_keeps_the_data(
    two: Stack, redis_url: str
) -> None:
    """`REPLICAOF` a master that is not there: Redis refuses every write, and every
    blocking stream read of a group, with READONLY (as after a failover), keeping its
    data; `REPLICAOF NO ONE` ends it."""
    client = redis.Redis.from_url(redis_url)
    client.set("custody:test:kept", "yes")
    steps = {k: client.xlen(k) for k in (streams.Keys(i).forward for i in ("0", "1"))}

    def refused() -> bool:
        try:
            client.set("custody:test:probe", 1)
        except ReadOnlyError:
            return True
        return False

    def readonly() -> None:
        client.replicaof("127.0.0.1", free_port())
        try:
            until("writes refused", refused)
            time.sleep(2.5)
        finally:
            client.replicaof("NO", "ONE")

    before = scrape(two)
    survives(two, client, readonly)
    after = scrape(two)
    assert client.get("custody:test:kept") == b"yes"
    assert all(client.xlen(k) >= n for k, n in steps.items())  # the streams kept too
    for i in ("0", "1"):
        assert grew(before, after, f"scheduler-{i}", loop="registration", replica=i)
        assert grew(before, after, f"executor-{i}", loop="executor_read", replica=i)
        assert grew(before, after, "session-store", loop="store_consume", replica=i)


def test_a_stack_started_before_its_redis_waits_for_it_without_a_restart() -> None:
    """Each service's start-up meets a Redis that is not up yet (or restarting) as its
    loops do: it waits. Before, the executor and the store exited and were restarted by
    their supervisor, each exit counted as a crash (a chaos soak's 'unexplained' executor
    restarts were these)."""
    later = PrivateRedis(appendonly=False)
    stack = Stack(stack_settings(later.url))
    try:
        stack.start_all()
        time.sleep(3)  # every service is in its start-up by now, Redis still down
        assert {name: child.poll() for name, child in stack.children.items()} == dict.fromkeys(
            stack.children
        )
        later.start()
        stack.wait_healthy(timeout=120)
        assert stack.restarts == dict.fromkeys(stack.restarts, 0)
        reply = call(
            stack.settings.port,
            "/generate",
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
        )
        assert len(reply["output_ids"]) == 2
    finally:
        stack.stop()
        later.close()


def test_a_loop_whose_cancellation_a_library_swallowed_still_ends():
    """redis-py can swallow a CancelledError that arrives mid-command; the loop's next
    `Retry.ok()` (or `wait`) raises it again, so a shutdown awaiting the loop ends. Without
    `honour_cancellation` this loop would run until the wait below gave up."""

    async def swallowing_loop(retry: Retry) -> None:
        for _ in range(300):  # bounded, so without the guard this test fails, not hangs
            with contextlib.suppress(asyncio.CancelledError):  # a library that swallows it
                await asyncio.sleep(0.01)
            retry.ok()

    async def go() -> None:
        task = asyncio.create_task(swallowing_loop(Retry("test", logging.getLogger("t"))))
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1)
        assert task in done and task.cancelled()

    asyncio.run(go())
