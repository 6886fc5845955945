"""Edge worker processes (`--api-workers`, services/scheduler/edge/) in a real stack: the
scheduler's children serve the public port, forward what is the core's (sessions, admin
and store routes), and are replaced when they die, leaving nothing running in the core.

What it can catch: a worker that does not start or is not replaced; a route or a session
request a worker drops or answers differently from the core; a worker's death leaving
its requests running, or slots owned (the store's ledger, assert_clean). What it cannot:
which worker the kernel hands a connection (SO_REUSEPORT), so cross-worker decisions are
shown at the link's level (test_edge_link.py), as is that a dropped link aborts its
requests rather than letting them run to their end."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from custody.up import Stack
from tests.services_harness import assert_clean, call, metric_sum, stack_settings, start_stack


@pytest.fixture(scope="module")
def two_workers(redis_url: str) -> Iterator[Stack]:
    running = start_stack(stack_settings(redis_url, api_workers=2))
    yield running
    running.stop()


def workers_of(stack: Stack) -> list[int]:
    pid = stack.children["scheduler"].pid
    listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in map(int, listed):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"services.scheduler.edge.worker" in cmdline:
            found.append(child)
    return sorted(found)


def until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def serving(port: int) -> bool:
    try:
        return call(port, "/liveness", timeout=2)["status"] == "alive"
    except OSError:
        return False


def generate(port: int, i: int) -> dict:
    body = {"input_ids": [3, i % 50 + 1, 7], "sampling_params": {"max_new_tokens": 5}}
    return call(port, "/generate", body)


def test_the_edge_runs_in_worker_processes_and_forwards_what_is_the_core_s(two_workers):
    port = two_workers.settings.port
    until(lambda: len(workers_of(two_workers)) == 2)
    with ThreadPoolExecutor(8) as pool:  # over many connections: both workers take some
        replies = list(pool.map(lambda i: generate(port, i), range(24)))
    assert all(r["meta_info"]["completion_tokens"] == 5 for r in replies)
    one_shot = generate(port, 4)
    sid = call(port, "/open_session", {"capacity_of_str_len": 1000})  # forwarded
    turn = {"input_ids": [3, 5, 7], "sampling_params": {"max_new_tokens": 5}}
    first = call(port, "/generate", turn | {"session_params": {"id": sid}})
    assert first["output_ids"] == one_shot["output_ids"]  # a session's turn, in the core
    info = call(port, "/get_server_info")
    assert info["internal_states"][0]["requests"] == 0
    assert call(port, "/close_session", {"session_id": sid}) is True
    assert_clean(two_workers)


def test_a_killed_worker_is_replaced_and_its_requests_end(two_workers):
    port = two_workers.settings.port
    until(lambda: len(workers_of(two_workers)) == 2)
    streams = []
    for _ in range(4):  # on as many connections; some land on each worker
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 1000}}
        conn.request("POST", "/generate", json.dumps(body | {"stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # decoding
        streams.append(conn)
    before = workers_of(two_workers)
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    until(
        lambda: len(workers_of(two_workers)) == 2 and not set(workers_of(two_workers)) & set(before)
    )
    until(lambda: serving(port))  # the new workers took the port
    until(lambda: call(port, "/get_server_info")["internal_states"][0]["requests"] == 0)
    for conn in streams:
        conn.close()
    assert generate(port, 1)["meta_info"]["completion_tokens"] == 5
    assert metric_sum(port, "custody_edge_worker_exits_total") == len(before)  # each counted
    assert_clean(two_workers)
