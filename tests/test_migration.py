"""Sessions moving between two replicas, as processes on a real Redis: a drained
replica's sessions (opened on one system prompt, so some borrow it from their replica's
prefix cache) resume from their state on the other; a replica killed whole (its
scheduler and executor SIGKILLed) has its sessions re-homed and continued from their
history; every answer equals one-shot, and neither replica's ledger leaks."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import redis

from custody.up import Stack
from shared import streams
from tests.services_harness import call, metric_sum, stack_settings, start_stack
from tests.test_replicas import OUTPUT, all_turns, home, one_shots, turn

SESSIONS, INPUT = 6, 8


def placements(client: redis.Redis, sids: list[str]) -> dict[str, str]:
    return {sid: home(client, sid) for sid in sids}


def patient_turn(port: int, sid: str, ids: list[int]) -> dict:
    """One turn, retried while its replica answers 503 (dead, or its session moving)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return turn(port, sid, ids)
        except urllib.error.HTTPError as err:
            assert err.code == 503 and time.monotonic() < deadline, err
            time.sleep(0.5)


def patient_turns(port: int, inputs: dict[str, list[int]]) -> dict[str, dict]:
    """One turn of every session at once, each patient."""
    return all_turns(port, inputs, patient_turn)


def play(port: int, sids: list[str], history: dict, rng, turns: int, resumed: bool) -> list:
    """`turns` turns of every session; each must resume from state if `resumed`."""
    metas = []
    for _ in range(turns):
        inputs = {sid: rng.integers(0, 256, INPUT).tolist() for sid in sids}
        replies = patient_turns(port, inputs)
        for sid in sids:
            meta = replies[sid]["meta_info"]
            if resumed:
                assert meta["cached_tokens"] >= len(history[sid]) - 16, (sid, meta)
            history[sid] += inputs[sid] + replies[sid]["output_ids"]
            metas.append(meta)
    return metas


def ledgers_clean(stack: Stack) -> None:
    """Both replicas' ledgers, once idle: no violation, nothing leaked; neither
    scheduler's integrity check ever failed."""
    deadline = time.monotonic() + 20
    while True:
        views = call(stack.settings.store_port, "/ledger/replicas")["replicas"]
        busy = [
            r for r, v in views.items() for c in v["counts"].values() if c["request"] or c["track"]
        ]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert set(views) == {"0", "1"}
    for view in views.values():
        assert view["violations"] == [] and view["leaked"] == {}, view
    for replica in views:
        port = stack.layout[f"scheduler-{replica}"][1].port
        assert metric_sum(port, "custody_invariant_check_failures_total") == 0, replica


def check_one_shot(sids: list[str], history: dict) -> None:
    expected = one_shots([history[sid][:-OUTPUT] for sid in sids])
    assert [history[sid][-OUTPUT:] for sid in sids] == expected


def fork(port: int, sids: list[str], history: dict, rng) -> list[dict]:
    """Each session's first turn, one after another: one system prompt, its own message."""
    system = rng.integers(0, 256, 90).tolist()
    metas = []
    for sid in sids:
        first = system + rng.integers(0, 256, INPUT).tolist()
        reply = patient_turn(port, sid, first)
        history[sid] = first + reply["output_ids"]
        metas.append(reply["meta_info"])
    return metas


def test_a_drained_replica_s_sessions_resume_from_their_state_elsewhere(redis_url, redis_client):
    """Sessions that borrow a cached prefix travel as their record and a blob of every
    page, borrowed ones included; the replica they reach holds them with no borrowed
    prefix."""
    stack = start_stack(stack_settings(redis_url, replicas=2))
    try:
        port, rng = stack.settings.port, np.random.default_rng(3)
        sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
        history = {sid: [] for sid in sids}
        firsts = dict(zip(sids, fork(port, sids, history, rng), strict=True))
        play(port, sids, history, rng, 1, resumed=True)
        on_zero = [s for s, r in placements(redis_client, sids).items() if r == "0"]
        assert any(firsts[sid]["cached_tokens"] >= 88 for sid in on_zero)  # borrowers move
        drained = call(port, "/admin/drain", {"replica": "0"})
        assert drained == {
            "replica": "0",
            "state": len(on_zero),
            "history": 0,
            "failed": 0,
            "gone": 0,
        }
        assert set(placements(redis_client, sids).values()) == {"1"}
        home = stack.layout["scheduler-1"][1].port
        with pytest.raises(urllib.error.HTTPError) as refused:  # the directory puts it here
            call(home, "/admin/migrate_done", {"session_id": sids[0]})
        assert refused.value.code == 409
        play(port, sids, history, rng, 2, resumed=True)
        check_one_shot(sids, history)
        new = call(port, "/open_session", {}).encode()
        assert new in redis_client.smembers(streams.Keys("1").placed)  # none on a drained one
        ledgers_clean(stack)
    finally:
        stack.stop()


def test_a_dead_replica_s_sessions_continue_on_the_other(redis_url, redis_client):
    stack = start_stack(stack_settings(redis_url, replicas=2, replica_dead_seconds=2.0))
    try:
        port, rng = stack.settings.port, np.random.default_rng(5)
        sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
        history = {sid: [] for sid in sids}
        play(port, sids, history, rng, 2, resumed=False)
        stack.kill("scheduler-0")
        stack.kill("executor-0")
        play(port, sids, history, rng, 1, resumed=False)  # waits out the death, re-homed
        assert set(placements(redis_client, sids).values()) == {"1"}
        play(port, sids, history, rng, 1, resumed=True)
        check_one_shot(sids, history)
        restart(stack, "scheduler-0", "executor-0")
        deadline = time.monotonic() + 15  # the store records what replica 0 gave up
        while redis_client.scard(streams.Keys("0").sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert redis_client.scard(streams.Keys("0").sessions) == 0  # nothing taken back
        ledgers_clean(stack)
    finally:
        stack.stop()


def restart(stack: Stack, *names: str) -> None:
    deadline = time.monotonic() + 90
    url = f"http://127.0.0.1:{stack.settings.port}/health"
    while time.monotonic() < deadline:
        stack.supervise_once()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if json.loads(resp.read())["ready"] == 2:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{names} did not come back")
