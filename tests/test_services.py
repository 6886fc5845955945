"""The three services as separate processes on a real Redis: end to end through HTTP,
and an executor killed with SIGKILL in the middle of a turn."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import redis

from custody.up import Stack
from shared import streams
from shared.config import Settings
from shared.messages.forward import decode_step
from tests.services_harness import (
    POOLS,
    assert_clean,
    call,
    kill_executor_during,
    ledger_when_idle,
    one_shot,
)


def test_three_sessions_four_turns_equal_one_shot_generations(stack):
    port = stack.settings.port
    sids = [call(port, "/open_session", {"session_id": f"s{i}"}) for i in range(3)]
    histories = {sid: [] for sid in sids}
    for k in range(4):
        outs = {}

        def turn(sid, k=k, outs=outs):
            text_ids = [(7 * k + 13 * int(sid[1:]) + j) % 256 for j in range(5 + k)]
            outs[sid] = (
                text_ids,
                call(
                    port,
                    "/generate",
                    {
                        "input_ids": text_ids,
                        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
                        "session_params": {"id": sid},
                    },
                ),
            )

        threads = [threading.Thread(target=turn, args=(sid,)) for sid in sids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sid, (text_ids, out) in outs.items():
            prompt = histories[sid] + text_ids
            assert out["output_ids"] == one_shot(prompt, 6), (sid, k)
            assert out["meta_info"]["cached_tokens"] == (len(histories[sid]) - 1 if k else 0)
            histories[sid] = prompt + out["output_ids"]
    for sid in sids:
        call(port, "/close_session", {"session_id": sid})
    assert_clean(stack)  # the prefix cache emptied first


def test_the_next_step_is_on_the_stream_while_the_one_before_runs(stack):
    """Pipelining, seen on the wire: decode steps are planned on top of the step in
    flight (`after`) and feed its sampled token as a future token."""
    prompt = list(range(3, 20))
    out = call(
        stack.settings.port,
        "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
    )
    assert out["output_ids"] == one_shot(prompt, 8)
    client = redis.Redis.from_url(stack.settings.redis_url)
    steps = [decode_step(f[b"m"]) for _, f in client.xrevrange(streams.SINGLE.forward, count=8)]
    rows = [(s, r) for s in steps for r in s.rows]
    mine = [(s, r) for s, r in rows if r.rid == out["meta_info"]["id"]]
    future = [(s, r) for s, r in mine if r.future]
    assert len(future) >= 6, [(s.step, s.after, r.future) for s, r in mine]
    for s, r in future:
        assert s.after == s.step - 1 and r.tokens.tolist() == [-1]
        assert r.mamba_slot != r.mamba_out


def test_an_executor_killed_mid_turn_loses_nothing(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "crash"})
    first = call(
        port,
        "/generate",
        {
            "input_ids": list(range(1, 40)),
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            "session_params": {"id": sid},
        },
    )
    history = list(range(1, 40)) + first["output_ids"]
    turn = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        "session_params": {"id": sid},
    }
    out = kill_executor_during(stack, port, "/generate", turn)
    # retried transparently: the same tokens as without the crash
    assert out["output_ids"] == one_shot([*history, 5, 6, 7], 900)
    history += [5, 6, 7] + out["output_ids"]
    after = call(
        port,
        "/generate",
        {
            "input_ids": [9],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "session_params": {"id": sid},
        },
    )
    assert after["output_ids"] == one_shot([*history, 9], 4)
    call(port, "/close_session", {"session_id": sid})
    view = ledger_when_idle(stack)
    assert view["violations"] == [] and view["leaked"] == {}


def test_a_killed_session_store_catches_up(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "s"})
    call(
        port,
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4},
            "session_params": {"id": sid},
        },
    )
    stack.kill("session-store")
    for k in range(3):  # ownership keeps moving while the store is down
        call(
            port,
            "/generate",
            {
                "input_ids": [4 + k],
                "sampling_params": {"max_new_tokens": 4},
                "session_params": {"id": sid},
            },
        )
    call(port, "/close_session", {"session_id": sid})
    deadline = time.monotonic() + 60
    while stack.restarts["session-store"] == 0 and time.monotonic() < deadline:
        stack.supervise_once()
        time.sleep(0.2)
    view = None
    while time.monotonic() < deadline:
        try:
            view = ledger_when_idle(stack)
            if view["counts"] and view["counts"]["req"]["free"] == POOLS["max_running_requests"]:
                break
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.3)
    assert view is not None
    assert_clean(stack)  # the prefix cache emptied first


def test_a_redis_restart_loses_nothing(tmp_path):
    settings = Settings.ephemeral(
        redis_url="",
        heartbeat_seconds=0.2,
        executor_timeout_seconds=1.5,
        **POOLS,
    )
    stack = Stack(settings).start_all()
    try:
        stack.wait_healthy()
        port = settings.port
        sid = call(port, "/open_session", {"session_id": "r"})
        first = call(
            port,
            "/generate",
            {
                "input_ids": list(range(1, 30)),
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
                "session_params": {"id": sid},
            },
        )
        history = list(range(1, 30)) + first["output_ids"]
        result = {}

        def long_turn():
            try:
                result["out"] = call(
                    port,
                    "/generate",
                    {
                        "input_ids": [3, 4],
                        "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
                        "session_params": {"id": sid},
                    },
                )
            except urllib.error.HTTPError as err:  # failing cleanly is allowed too
                result["error"] = (err.code, json.loads(err.read()))

        worker = threading.Thread(target=long_turn)
        worker.start()
        time.sleep(0.4)
        stack.redis.stop()
        time.sleep(1.0)
        stack.redis.start()
        deadline = time.monotonic() + 120
        while worker.is_alive() and time.monotonic() < deadline:
            stack.supervise_once()
            time.sleep(0.2)
        worker.join(timeout=1)
        if "out" in result:
            assert result["out"]["output_ids"] == one_shot([*history, 3, 4], 600)
            history += [3, 4] + result["out"]["output_ids"]
        else:
            assert 400 <= result["error"][0] < 600 and "error" in result["error"][1]
        stack.wait_healthy()
        after = call(
            port,
            "/generate",
            {
                "input_ids": [8],
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                "session_params": {"id": sid},
            },
        )
        assert after["output_ids"] == one_shot([*history, 8], 3)
        call(port, "/close_session", {"session_id": sid})
        view = ledger_when_idle(stack)
        assert view["violations"] == [] and view["leaked"] == {}
    finally:
        stack.stop()


def test_a_killed_scheduler_is_rebuilt_from_the_session_store(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "keep"})
    history: list[int] = []
    for ids in ([1, 2, 3, 4, 5, 6], [7, 8]):
        out = call(
            port,
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
                "session_params": {"id": sid},
            },
        )
        history += ids + out["output_ids"]
    time.sleep(0.5)  # let the store apply the last records
    record = call(stack.settings.store_port, f"/sessions/{sid}")
    assert record["history_tokens"] == len(history) and record["row"] is not None
    stack.kill("scheduler")  # between turns
    deadline = time.monotonic() + 60
    while stack.restarts["scheduler"] == 0 and time.monotonic() < deadline:
        stack.supervise_once()
        time.sleep(0.2)
    stack.wait_healthy()
    out = call(
        port,
        "/generate",
        {
            "input_ids": [9, 10],
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            "session_params": {"id": sid},
        },
    )
    assert out["meta_info"]["cached_tokens"] == len(history) - 1  # it kept its cache
    assert out["output_ids"] == one_shot([*history, 9, 10], 5)
    call(port, "/close_session", {"session_id": sid})
    assert_clean(stack)  # the prefix cache emptied first
