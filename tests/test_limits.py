"""Limits over real HTTP against the real services on the test Redis: open sessions
(global and per key: 429), the waiting queue (503 with Retry-After), and slow clients
(a head or body sent slower than the read timeout, an idle keep-alive connection) cut
off while a generation longer than the read timeout is served whole."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from custody.up import Stack
from tests.services_harness import stack_settings, start_stack
from tests.test_tenancy import Stream, generation, post

READ_TIMEOUT, KEEPALIVE = 1.0, 3.0
IDLE_TIMEOUT = 4.0  # --session-idle-timeout: a session opened without its own timeout
LONG = 600.0  # the timeout of sessions a test keeps


@pytest.fixture(scope="module")
def limited(redis_url: str) -> Iterator[Stack]:
    redis.Redis.from_url(redis_url).flushdb()
    running = start_stack(
        stack_settings(
            redis_url,
            api_keys="alpha,beta,gamma",
            admin_api_keys="op",
            max_sessions=3,
            max_sessions_per_key=2,
            max_running_requests=1,
            max_queued_requests=1,
            read_timeout_seconds=READ_TIMEOUT,
            keepalive_seconds=KEEPALIVE,
            session_idle_timeout=IDLE_TIMEOUT,
            context_len=4096,
            kv_pages=4096,
        )
    )
    yield running
    running.stop()


def test_sessions_are_limited_per_key_and_in_all(limited):
    port = limited.settings.port
    for sid in ("a1", "a2"):
        assert post(port, "/open_session", {"session_id": sid, "timeout": LONG}, "alpha")[0] == 200
    status, body, _ = post(port, "/open_session", {"session_id": "a3"}, "alpha")
    assert status == 429 and "--max-sessions-per-key" in body["error"]["message"]
    assert post(port, "/open_session", {"session_id": "b1", "timeout": LONG}, "beta")[0] == 200
    status, body, _ = post(port, "/open_session", {"session_id": "g1"}, "gamma")
    assert status == 429 and "3 sessions are open" in body["error"]["message"]
    assert body["error"]["type"] == "session_limit"
    assert post(port, "/close_session", {"session_id": "a1"}, "alpha")[0] == 200
    assert post(port, "/open_session", {"session_id": "g1", "timeout": LONG}, "gamma")[0] == 200
    for sid, key in (("a2", "alpha"), ("b1", "beta"), ("g1", "gamma")):
        assert post(port, "/close_session", {"session_id": sid}, key)[0] == 200


def get(port: int, path: str, key: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_a_session_nobody_touches_closes_after_the_idle_timeout(limited):
    """An agent that crashed never closes its session: the default idle timeout does,
    counted; meanwhile an operator sees it among the idle sessions with its age, and a
    refused open says how many of the open sessions are idle."""
    port = limited.settings.port
    assert post(port, "/open_session", {"session_id": "kept", "timeout": LONG}, "alpha")[0] == 200
    assert post(port, "/open_session", {"session_id": "orphan"}, "beta")[0] == 200
    assert post(port, "/open_session", {"session_id": "third", "timeout": LONG}, "gamma")[0] == 200
    status, body, _ = post(port, "/open_session", {"session_id": "late"}, "alpha")
    assert status == 429 and "of them idle for over" in body["error"]["message"], body
    status, idle = get(port, "/admin/idle_sessions", "op")
    assert status == 200 and idle["idle_timeout"] == IDLE_TIMEOUT and idle["open"] == 3
    listed = {s["session_id"].split("~")[0]: s for s in idle["sessions"]}
    assert listed["orphan"]["timeout"] == IDLE_TIMEOUT and listed["kept"]["timeout"] == LONG
    assert all(s["idle_seconds"] >= 0 for s in idle["sessions"])
    assert get(port, "/admin/idle_sessions", "alpha")[0] == 403
    deadline = time.monotonic() + 30
    while any(
        s["session_id"].startswith("orphan~")
        for s in get(port, "/admin/idle_sessions", "op")[1]["sessions"]
    ):
        assert time.monotonic() < deadline, "the orphan outlived its idle timeout"
        time.sleep(0.5)  # watched without a turn: a turn is a use, and restarts its timeout
    assert post(port, "/generate", generation(1, sid="orphan"), "beta")[0] == 404
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    assert re.search(r'^custody_sessions_expired_total\{replica="0"\} [1-9]', text, re.M), text
    assert post(port, "/open_session", {"session_id": "late"}, "alpha")[0] == 200  # room again
    for sid, key in (("kept", "alpha"), ("third", "gamma"), ("late", "alpha")):
        assert post(port, "/close_session", {"session_id": sid}, key)[0] == 200


def queued(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    return float(re.search(r'^custody_requests_queued\{replica="0"\} (\S+)$', text, re.M).group(1))


def test_a_full_queue_is_a_503_with_retry_after(limited):
    port = limited.settings.port
    running = Stream(port, "alpha")  # the only running slot
    running.start()
    running.wait_streaming()
    waiting = threading.Thread(target=post, args=(port, "/generate", generation(2), "beta"))
    waiting.start()
    deadline = time.monotonic() + 30
    while queued(port) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    status, body, headers = post(port, "/generate", generation(2), "gamma")
    assert status == 503 and headers["Retry-After"] == "1", (status, body)
    assert body["error"]["type"] == "overloaded" and "retry" in body["error"]["message"]
    status, _, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2}, "gamma")
    assert status == 503
    assert post(port, "/abort_request", {"abort_all": True}, "alpha")[0] == 200
    running.join(30)
    waiting.join(60)
    assert not waiting.is_alive() and running.last["finish_reason"]["type"] == "abort"
    assert post(port, "/generate", generation(2), "gamma")[0] == 200  # drained


def closed_after(sock: socket.socket, trickle: bytes, gap: float) -> float:
    """Send `trickle` a byte every `gap` seconds until the server closes the connection;
    the seconds that took."""
    start = time.monotonic()
    sock.settimeout(gap)
    for byte in trickle:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError("the server kept a slow client")


def test_slow_clients_are_cut_off_and_generation_is_not(limited):
    port = limited.settings.port
    result: dict = {}

    def long_generation() -> None:
        started = time.monotonic()
        # long enough to outlast the read timeout on any machine (600 tokens took 0.93 s
        # once planning got faster): the point is a generation longer than it, served
        result["reply"] = post(port, "/generate", generation(4000), "alpha")
        result["seconds"] = time.monotonic() - started

    served = threading.Thread(target=long_generation)
    served.start()
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alpha\r\n" * 4
    with socket.create_connection(("127.0.0.1", port)) as s:
        took = closed_after(s, head, 0.2)
    assert READ_TIMEOUT <= took < KEEPALIVE, took  # the read timeout, not the keep-alive
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /open_session HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alpha\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        took = closed_after(s, b" " * 200, 0.2)
    assert READ_TIMEOUT <= took < KEEPALIVE, took
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(KEEPALIVE * 3)
        reply = s.recv(65536)
        idle = time.monotonic()
        while s.recv(65536):
            pass
        took = time.monotonic() - idle
    assert reply.startswith(b"HTTP/1.1 200") and KEEPALIVE - 0.5 <= took < KEEPALIVE * 2, took
    served.join(120)
    status, body, _ = result["reply"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"
    assert result["seconds"] > READ_TIMEOUT  # longer than the read timeout, served whole
