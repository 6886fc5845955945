"""Session state tiers through the three services on a real Redis: sessions outnumbering
the device resume from saved state, and an executor killed during a hibernate, a spill,
a load or a restore loses nothing (a blob whose write did not finish is never used)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from custody.inprocess import InProcess
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared import streams
from shared.config import Settings
from tests.services_harness import call, health, ledger_when_idle, stack_settings, start_stack

SESSIONS, FIRST, SECOND, OUT = 240, 400, 8, 8  # histories of 408 tokens


def turn(port: int, sid: str, tokens: list[int], n: int, timeout: float = 600) -> dict:
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
        "session_params": {"id": sid},
    }
    return call(port, "/generate", body, timeout=timeout)


def one_shots(settings: Settings, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Plain generations of the same model, batched in one process: the reference."""
    local = InProcess(settings)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    reqs = [
        local.engine.submit(Request(f"r{i}", np.asarray(p), params)) for i, p in enumerate(prompts)
    ]
    local.run_until_idle()
    return [r.output for r in reqs]


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def test_240_sessions_take_a_second_turn_from_saved_state(redis_url, redis_client, tmp_path):
    """The default pools hold about 80 such histories on the device; every second turn
    still starts from its saved state (device, host or disk), never recomputing."""
    settings = Settings(
        compile=False,
        redis_url=redis_url,
        port=stack_settings(redis_url).port,
        store_port=stack_settings(redis_url).store_port,
        executor_metrics_port=stack_settings(redis_url).executor_metrics_port,
        heartbeat_seconds=0.2,
        executor_timeout_seconds=5.0,
        state_dir=tmp_path / "state",
    )
    stack = start_stack(settings)
    try:
        port = settings.port
        sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
        with ThreadPoolExecutor(16) as pool:
            firsts = list(
                pool.map(lambda i: turn(port, sids[i], tokens(FIRST, i), OUT), range(SESSIONS))
            )
            histories = [tokens(FIRST, i) + firsts[i]["output_ids"] for i in range(SESSIONS)]
            seconds = list(
                pool.map(
                    lambda i: turn(port, sids[i], tokens(SECOND, 10_000 + i), OUT), range(SESSIONS)
                )
            )
        expected = one_shots(
            Settings(compile=False),
            [histories[i] + tokens(SECOND, 10_000 + i) for i in range(SESSIONS)],
            OUT,
        )
        for i, reply in enumerate(seconds):
            assert reply["meta_info"]["cached_tokens"] >= len(histories[i]) - 16, i
            assert reply["output_ids"] == expected[i], i
        for sid in sids:
            call(port, "/close_session", {"session_id": sid})
        view = ledger_when_idle(stack)
        assert view["violations"] == [] and view["leaked"] == {}
        assert not list((tmp_path / "state" / "replica-0").glob("*.blob"))  # closed: blobs deleted
    finally:
        stack.stop()


@pytest.fixture
def drill(redis_url, redis_client, tmp_path):
    """Tiers on, each move slowed so a kill lands inside one."""
    settings = stack_settings(redis_url, state_dir=tmp_path / "state", tier_move_delay_seconds=0.4)
    stack = start_stack(settings)
    yield stack
    stack.stop()


def place(port: int, sid: str, tier: str) -> dict:
    return call(port, "/place_session", {"session_id": sid, "tier": tier}, timeout=120)


def kill_during(stack, kind: str, action) -> None:
    """Run `action` in a thread, SIGKILL the executor while a `kind` move is in flight
    (seen in the executor's own marker), restart it, wait for `action` to return."""
    client = redis.Redis.from_url(stack.settings.redis_url)
    worker = threading.Thread(target=action)
    worker.start()
    deadline = time.monotonic() + 30
    while int(client.hget(streams.SINGLE.tier_in_flight, kind) or 0) == 0:
        assert time.monotonic() < deadline, f"no {kind} was seen in flight"
        time.sleep(0.01)
    port = stack.settings.port
    old = call(port, "/health")["executor"]
    stack.kill("executor")
    while health(port).get("executor") in (old, None):  # restarted, and seen anew
        assert time.monotonic() < deadline + 60, "the executor did not come back"
        stack.supervise_once()
        time.sleep(0.1)
    worker.join(timeout=120)
    assert not worker.is_alive()


@pytest.mark.parametrize(
    ("kind", "before", "target"),
    [
        ("hibernate", None, "host"),
        ("spill", "host", "disk"),
        ("load", "disk", "host"),
        ("restore", "host", "device"),
    ],
)
def test_an_executor_killed_during_a_move_loses_nothing(drill, kind, before, target):
    port = drill.settings.port
    sid = call(port, "/open_session", {})
    first = turn(port, sid, tokens(37, 1), 5)
    history = tokens(37, 1) + first["output_ids"]
    if before is not None:
        place(port, sid, "host")
        if before == "disk":
            place(port, sid, "disk")
    kill_during(drill, kind, lambda: place(port, sid, target))
    after = turn(port, sid, [7, 8, 9], 6)
    expected = one_shots(drill.settings, [[*history, 7, 8, 9]], 6)[0]
    assert after["output_ids"] == expected
    if kind in (
        "hibernate",
        "spill",
        "restore",
    ):  # the state was on device or host, or half written
        assert after["meta_info"]["cached_tokens"] <= len(history) - 1
    else:  # the blob survives a load that never finished
        assert after["meta_info"]["cached_tokens"] == len(history) - 1
    call(port, "/close_session", {"session_id": sid})
    view = ledger_when_idle(drill)
    assert view["violations"] == [] and view["leaked"] == {}


def test_a_turn_queued_behind_a_load_never_spills_the_state_loaded_for_the_turn_ahead(
    redis_url, redis_client, tmp_path
):
    """Issue 43, finding 7: the state a queued turn's load brought to the host is not
    spilled again to load the blob of a turn queued behind it. It was: each load spilled
    the other's, the head of the queue never found its state ready, and the replica
    answered nothing more. An executor kill leaves every session with state on disk and
    the host tier empty; here two sessions are placed there, with room on the host for
    one state, and the second turn is queued while the first one's load runs."""
    settings = stack_settings(
        redis_url,
        state_dir=tmp_path / "state",
        host_state_bytes=100_000,  # one 42-token state (one host Mamba slot)
        tier_move_delay_seconds=0.4,
    )
    stack = start_stack(settings)
    try:
        port = settings.port
        sids = [call(port, "/open_session", {}) for _ in range(2)]
        histories = []
        for i, sid in enumerate(sids):
            first = turn(port, sid, tokens(37, i), 5)
            histories.append(tokens(37, i) + first["output_ids"])
            assert place(port, sid, "disk")["tier"] == "disk"
        client = redis.Redis.from_url(redis_url)
        with ThreadPoolExecutor(2) as pool:
            head = pool.submit(turn, port, sids[0], [7, 8, 9], 6, 20)
            deadline = time.monotonic() + 20
            while int(client.hget(streams.SINGLE.tier_in_flight, "load") or 0) == 0:
                assert time.monotonic() < deadline, "the head's load was never seen in flight"
                time.sleep(0.01)
            behind = pool.submit(turn, port, sids[1], [7, 8, 9], 6, 20)
            replies = [head.result(), behind.result()]
        client.close()
        expected = one_shots(settings, [[*h, 7, 8, 9] for h in histories], 6)
        assert [r["output_ids"] for r in replies] == expected
        # the head resumed from its blob (the one behind may have found no room yet, and
        # re-prefilled rather than wait)
        assert replies[0]["meta_info"]["cached_tokens"] == len(histories[0]) - 1
    finally:
        stack.stop()
