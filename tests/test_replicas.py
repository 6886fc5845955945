"""Two replicas behind the router, as processes on a real Redis: sessions stay on the
replica that holds their state, across a router restart, and answer as one-shot does."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
import redis

from custody.inprocess import InProcess
from custody.up import Stack
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared import streams
from shared.config import Settings
from shared.placement import Placement
from tests.services_harness import POOLS, call, stack_settings, start_stack

SESSIONS, TURNS, INPUT, OUTPUT = 12, 4, 8, 8


@pytest.fixture
def two(redis_url: str, redis_client: redis.Redis) -> Stack:
    running = start_stack(stack_settings(redis_url, replicas=2))
    yield running
    running.stop()


def home(client: redis.Redis, sid: str) -> str:
    """The replica the placement directory puts `sid` on."""
    return Placement.decode(client.get(streams.placement_key(sid))).replica


def one_shots(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the prompts as plain requests, in one process."""
    local = InProcess(Settings(**POOLS))
    params = SamplingParams(max_new_tokens=OUTPUT, ignore_eos=True)
    reqs = [
        local.engine.submit(Request(f"x{i}", np.asarray(p), params)) for i, p in enumerate(prompts)
    ]
    local.run_until_idle()
    return [list(r.output) for r in reqs]


def turn(port: int, sid: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True, "temperature": 0},
    }
    return call(port, "/generate", body)


def all_turns(
    port: int, inputs: dict[str, list[int]], one: Callable[[int, str, list[int]], dict] = turn
) -> dict[str, dict]:
    """One turn (`one`) of every session at once."""
    replies: dict[str, dict] = {}

    def run(sid: str) -> None:
        replies[sid] = one(port, sid, inputs[sid])

    threads = [threading.Thread(target=run, args=(sid,)) for sid in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(replies) == set(inputs), "a turn failed (see its thread's error)"
    return replies


def restart_router(stack: Stack) -> None:
    stack.kill("router")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stack.supervise_once()
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{stack.settings.port}/health", timeout=2
            ) as r:
                if b'"ready": 2' in r.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the router did not come back")


def test_sessions_keep_their_replica_across_a_router_restart_and_equal_one_shot(two, redis_client):
    port = two.settings.port
    rng = np.random.default_rng(7)
    sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
    homes = {sid: home(redis_client, sid) for sid in sids}
    # placed by load, then sessions: balanced up to the registrations' staleness (an open
    # answered just after a registration that already counts it is counted twice a while)
    assert min(list(homes.values()).count(r) for r in "01") >= 4, homes
    history = {sid: [] for sid in sids}
    for t in range(TURNS):
        if t == 2:
            restart_router(two)
        inputs = {sid: rng.integers(0, 256, INPUT).tolist() for sid in sids}
        replies = all_turns(port, inputs)
        for sid in sids:
            meta = replies[sid]["meta_info"]
            if t > 0:  # resumed from the state on its replica
                assert meta["cached_tokens"] >= len(history[sid]) - 16, (sid, t, meta)
            history[sid] += inputs[sid] + replies[sid]["output_ids"]
    assert {sid: home(redis_client, sid) for sid in sids} == homes
    expected = one_shots([history[sid][:-OUTPUT] for sid in sids])
    assert [history[sid][-OUTPUT:] for sid in sids] == expected
    for sid in sids:
        assert call(port, "/close_session", {"session_id": sid}) is True
    deadline = time.monotonic() + 5  # a close's placement goes just after its answer
    keys = [streams.placement_key(sid) for sid in sids]
    while redis_client.exists(*keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not redis_client.exists(*keys)


def keyed_open(port: int, key: str) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/open_session",
        data=b"{}",
        headers={"Authorization": f"Bearer {key}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_key_s_session_limit_and_the_global_one_count_every_replica(redis_url, redis_client):
    """Each replica alone sees fewer than either limit; the router sees them all."""
    settings = stack_settings(
        redis_url,
        replicas=2,
        api_keys="k1,k2",
        admin_api_keys="op",
        max_sessions_per_key=3,
        max_sessions=5,
    )
    stack = start_stack(settings)
    try:
        port = settings.port
        assert [keyed_open(port, "k1") for _ in range(3)] == [200] * 3
        homes = [redis_client.scard(streams.Keys(r).placed) for r in ("0", "1")]
        assert sorted(homes) == [1, 2]  # no replica alone is at the limit
        assert keyed_open(port, "k1") == 429
        assert keyed_open(port, "nope") == 401  # checked at the router
        assert [keyed_open(port, "k2") for _ in range(2)] == [200] * 2  # its own count
        homes = [redis_client.scard(streams.Keys(r).placed) for r in ("0", "1")]
        assert max(homes) < 5  # no replica alone is at the global limit ...
        assert keyed_open(port, "k2") == 429  # ... which the router counts
    finally:
        stack.stop()
