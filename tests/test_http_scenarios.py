"""The streaming-session scenarios of docs/scenarios.md through the HTTP API
of the real services (S5, trimming an over-allocated tail, has no HTTP trigger and is
covered on the scheduler core; S11 is the end-to-end test of test_services.py)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error

import pytest

from tests.services_harness import (
    POOLS,
    assert_clean,
    call,
    capacities,
    one_shot,
    stack_settings,
    start_stack,
)

GREEDY = {"ignore_eos": True}


def gen(port: int, ids: list[int], sid: str | None, n: int, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    if sid is not None:
        body["session_params"] = {"id": sid}
    return call(port, "/generate", body)


def refused(port: int, body: dict, path: str = "/generate") -> tuple[int, str]:
    try:
        call(port, path, body)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]["message"]
    raise AssertionError("accepted")


def stream_first_chunk_then_disconnect(port: int, body: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/generate", json.dumps(body | {"stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event arrived: the turn is decoding
    conn.sock.close()
    conn.close()


def test_s1_s2_s9_inheritance_rejections_and_append_only(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "s1", "streaming": True})  # S9: append-only
    t1 = gen(port, [1, 2, 3, 4, 5], sid, 12)
    assert t1["meta_info"]["cached_tokens"] == 0
    code, message = refused(
        port,
        {
            "input_ids": [6],
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": -1},
        },
    )
    assert code == 400 and "max_new_tokens" in message
    code, message = refused(port, {"input_ids": [7] * 2000, "session_params": {"id": sid}})
    assert code == 400 and f"context length {POOLS['context_len']}" in message
    for rewrite in ({"offset": 2}, {"replace": True}, {"drop_previous_output": True}):
        code, message = refused(port, {"input_ids": [8], "session_params": {"id": sid, **rewrite}})
        assert code == 400 and "append-only" in message
    t2 = gen(port, [9, 10], sid, 12)
    assert t2["meta_info"]["cached_tokens"] == 5 + 12 - 1
    assert t2["meta_info"]["prompt_tokens"] == 5 + 12 + 2
    assert t2["output_ids"] == one_shot([1, 2, 3, 4, 5, *t1["output_ids"], 9, 10], 12)
    # a turn naming an earlier turn would branch: refused naming rid, never appended
    earlier = {"id": sid, "rid": t1["meta_info"]["id"]}
    code, message = refused(port, {"input_ids": [11], "session_params": earlier})
    assert code == 400 and "session_params.rid" in message and t2["meta_info"]["id"] in message
    # the latest turn's rid (SGLang's kit sends it) and offset 0 cut nothing: appended
    latest = {"id": sid, "rid": t2["meta_info"]["id"], "offset": 0}
    t3 = call(
        port,
        "/generate",
        {
            "input_ids": [11],
            "session_params": latest,
            "sampling_params": {"max_new_tokens": 4, **GREEDY},
        },
    )
    history = [1, 2, 3, 4, 5, *t1["output_ids"], 9, 10, *t2["output_ids"], 11]
    assert t3["meta_info"]["prompt_tokens"] == len(history)
    assert t3["output_ids"] == one_shot(history, 4)
    call(port, "/close_session", {"session_id": sid})
    assert_clean(stack)


def test_s3_s4_aborted_turns_keep_what_they_should(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "s3"})
    # S3: the first turn aborted mid-decode (by an abort request) leaves an empty session
    worker = threading.Thread(target=lambda: gen(port, [1, 2, 3], sid, 800, rid="first"))
    worker.start()
    time.sleep(0.3)
    call(port, "/abort_request", {"rid": "first"})
    worker.join(timeout=60)
    t = gen(port, [4, 5], sid, 4)
    assert t["meta_info"]["prompt_tokens"] == 2 and t["meta_info"]["cached_tokens"] == 0
    history = [4, 5, *t["output_ids"]]
    # S4: the next turn dies with its client; the session keeps its cache
    stream_first_chunk_then_disconnect(
        port,
        {
            "input_ids": [6, 7],
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 800, **GREEDY},
        },
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            t3 = gen(port, [8, 9], sid, 5)
            break
        except urllib.error.HTTPError as err:  # 409 until the aborted turn has ended
            assert err.code == 409
            time.sleep(0.1)
    assert t3["meta_info"]["prompt_tokens"] == len(history) + 2
    assert t3["meta_info"]["cached_tokens"] >= len(history) - 1
    assert t3["output_ids"] == one_shot([*history, 8, 9], 5)
    call(port, "/close_session", {"session_id": sid})
    assert_clean(stack)


@pytest.mark.parametrize("logprobs", [False, True])
def test_s6_concurrency(stack, logprobs):
    port = stack.settings.port
    for round_ in range(10):
        sids = [call(port, "/open_session", {}) for _ in range(6)]
        histories = {sid: [] for sid in sids}
        for k in range(5):
            outs, errors = {}, []

            def turn(sid, k=k, outs=outs, errors=errors, round_=round_):
                try:
                    ids = [(round_ + 3 * k + j) % 250 + 1 for j in range(3)]
                    body = {
                        "input_ids": ids,
                        "session_params": {"id": sid},
                        "sampling_params": {"max_new_tokens": 3, **GREEDY},
                    }
                    if logprobs:
                        body["return_logprob"] = True
                    outs[sid] = (ids, call(port, "/generate", body))
                except Exception as err:
                    errors.append(repr(err))

            threads = [threading.Thread(target=turn, args=(sid,)) for sid in sids]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert errors == []
            for sid, (ids, out) in outs.items():
                histories[sid] += ids + out["output_ids"]
                if logprobs:
                    lps = out["meta_info"]["output_token_logprobs"]
                    assert [t for _, t, _ in lps] == out["output_ids"] and all(
                        lp <= 0 for lp, _, _ in lps
                    )
        for sid in sids:
            call(port, "/close_session", {"session_id": sid})
        assert call(port, "/health")["status"] == "ok"
    assert_clean(stack)


@pytest.fixture
def paged_stack(redis_url, redis_client):
    running = start_stack(
        stack_settings(
            redis_url,
            page_size=16,
            context_len=512,
            kv_pages=256,
            chunk_size=32,
            max_step_tokens=96,
            track_interval=16,
        )
    )
    yield running
    running.stop()


def test_s7_abort_heavy_chunked_prefill(paged_stack):
    port = paged_stack.settings.port
    sids = [call(port, "/open_session", {"session_id": f"p{i}"}) for i in range(4)]
    for i, sid in enumerate(sids):
        gen(port, [(i * 7 + j) % 250 + 1 for j in range(40)], sid, 4)
    prefix = [(j * 3) % 250 + 1 for j in range(50)]
    for r in range(8):
        threads = []
        for i, sid in enumerate(sids):
            rid = f"t{r}-{i}"
            threads.append(
                threading.Thread(
                    target=lambda s=sid, rid=rid, i=i, r=r: _quiet(
                        gen, port, [(r + i + j) % 250 + 1 for j in range(20)], s, 6, rid=rid
                    )
                )
            )
        for j in range(2):
            threads.append(
                threading.Thread(target=lambda j=j, r=r: gen(port, [*prefix, r, j], None, 3))
            )
        for th in threads:
            th.start()
        time.sleep(0.05)
        for i in range(r % 2, 4, 2):
            call(port, "/abort_request", {"rid": f"t{r}-{i}"})
        for th in threads:
            th.join()
        for sid in sids:
            code, message = refused(port, {"input_ids": [1] * 600, "session_params": {"id": sid}})
            assert code == 400 and "context length 512" in message
            recovery = gen(port, [5, 6, 7], sid, 2)
            assert recovery["meta_info"]["cached_tokens"] > 0, (
                r,
                sid,
                call(paged_stack.settings.store_port, "/ledger")["counts"],
            )
        for i, sid in enumerate(sids):
            if call(paged_stack.settings.store_port, f"/sessions/{sid}")["history_tokens"] > 380:
                call(port, "/close_session", {"session_id": sid})
                sids[i] = call(port, "/open_session", {})
                gen(port, [(r + j) % 250 + 1 for j in range(40)], sids[i], 4)
    for sid in sids:
        call(port, "/close_session", {"session_id": sid})
    call(port, "/flush_cache", {})
    assert_clean(paged_stack)


def _quiet(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except urllib.error.HTTPError:
        return None


def test_s8_close_during_a_turn_and_s10_counted_once(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "s8"})
    gen(port, [1, 2, 3], sid, 3)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=gen(port, [4, 5], sid, 300)))
    worker.start()
    time.sleep(0.3)
    view = call(stack.settings.store_port, "/ledger")  # S10: mid-turn, every slot counted once
    for pool, counts in view["counts"].items():
        assert sum(counts.values()) == capacities(stack.settings)[pool]
    assert call(port, "/close_session", {"session_id": sid}) is True
    code, message = refused(port, {"input_ids": [6], "session_params": {"id": sid}})
    assert code == 404 and "closed" in message
    worker.join(timeout=60)
    assert len(result["out"]["output_ids"]) == 300  # the running turn was not cut short
    code, _ = refused(port, {"input_ids": [6], "session_params": {"id": sid}})
    assert code == 404
    assert_clean(stack)
