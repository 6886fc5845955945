"""Tenancy over real HTTP against the real services on the test Redis: with API keys on,
a key acts only on its own requests and sessions, rids are per key and unguessable, the
operator key alone reaches across keys and flushes the cache, a session keeps its owner
across a scheduler SIGKILL, and a Redis password never reaches the printed line."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import redis

from custody.up import Stack
from shared import streams
from shared.redact import masked_url
from shared.redis_server import free_port
from shared.session_ids import scoped_session_id
from tests.services_harness import stack_settings, start_stack

HEX32 = re.compile(r"^[0-9a-f]{32}$")
LONG = 3000  # tokens: seconds of decoding, so a request outlives the calls made meanwhile


@pytest.fixture(scope="module")
def keyed(redis_url: str) -> Iterator[Stack]:
    redis.Redis.from_url(redis_url).flushdb()
    running = start_stack(
        stack_settings(
            redis_url,
            api_keys="alpha,beta",
            admin_api_keys="root",
            context_len=4096,
            kv_pages=4096,
        )
    )
    yield running
    running.stop()


def post(port: int, path: str, body: dict, key: str | None) -> tuple[int, object, dict]:
    """Status, JSON body and headers of one call (any status)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data), dict(resp.getheaders())


def generation(n: int, rid: str | None = None, stream: bool = False, sid: str | None = None):
    body: dict = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
        "stream": stream,
    }
    if rid is not None:
        body["rid"] = rid
    if sid is not None:
        body["session_params"] = {"id": sid}
    return body


class Stream(threading.Thread):
    """A streamed /generate read event by event in the background."""

    def __init__(self, port: int, key: str, rid: str | None = None) -> None:
        super().__init__(daemon=True)
        self.port, self.key, self.rid = port, key, rid
        self.events: list[dict] = []
        self.started_streaming = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        conn.request("POST", "/generate", json.dumps(generation(LONG, self.rid, True)), headers)
        resp = conn.getresponse()
        try:
            while line := resp.readline():
                if line.startswith(b"data: {"):
                    self.events.append(json.loads(line[len(b"data: ") :]))
                    self.started_streaming.set()
        finally:
            self.started_streaming.set()  # also when it failed: the test sees no events
            conn.close()

    def wait_streaming(self) -> None:
        assert self.started_streaming.wait(60) and self.events

    @property
    def last(self) -> dict:
        return self.events[-1]["meta_info"]


def test_a_key_acts_only_on_its_own_requests(keyed):
    port = keyed.settings.port
    a_named, b_named, a_plain = (
        Stream(port, "alpha", "a"),
        Stream(port, "beta", "a"),
        Stream(port, "alpha"),
    )
    for s in (a_named, b_named, a_plain):
        s.start()
        s.wait_streaming()
    assert a_named.last["id"] == b_named.last["id"] == "a"  # two keys, one rid, at once
    status, body, _ = post(port, "/generate", generation(2, "a"), "alpha")
    assert status == 409 and "already in use" in body["error"]["message"]
    assert post(port, "/generate", generation(2, "a"), "root")[0] == 200  # rids are per key
    victim = a_plain.last["id"]
    assert HEX32.match(victim)
    assert post(port, "/abort_request", {"rid": victim}, "beta")[0] == 200
    assert post(port, "/abort_request", {"abort_all": True}, "beta")[0] == 200
    b_named.join(30)
    assert not b_named.is_alive() and b_named.last["finish_reason"]["type"] == "abort"
    seen = (len(a_named.events), len(a_plain.events))
    time.sleep(0.5)
    assert a_named.is_alive() and a_plain.is_alive()  # B's aborts left A's requests running
    assert len(a_named.events) > seen[0] and len(a_plain.events) > seen[1]
    assert post(port, "/abort_request", {"rid": "a"}, "alpha")[0] == 200  # A's own rid
    a_named.join(30)
    assert a_named.last["finish_reason"]["type"] == "abort" and a_plain.is_alive()
    other = Stream(port, "beta", "b")
    other.start()
    other.wait_streaming()
    assert post(port, "/abort_request", {"abort_all": True}, "root")[0] == 200  # every key
    for s in (a_plain, other):
        s.join(30)
        assert not s.is_alive() and s.last["finish_reason"]["type"] == "abort"
    assert a_plain.last["id"] == victim and other.last["id"] == "b"


def test_server_made_rids_are_random_128_bit(keyed):
    port = keyed.settings.port
    ids = []
    for _ in range(6):
        status, body, _ = post(port, "/generate", generation(2), "alpha")
        assert status == 200
        ids.append(body["meta_info"]["id"])
    assert all(HEX32.match(i) for i in ids) and len(set(ids)) == len(ids)
    status, body, _ = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "beta")
    assert status == 200 and re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    status, body, _ = post(port, "/generate", {**generation(2), "rid": 7}, "alpha")
    assert status == 400


@pytest.mark.parametrize("path", ["/flush_cache", "/reset_prefix_cache"])
def test_operator_routes_need_an_operator_key(keyed, path):
    port = keyed.settings.port
    assert post(port, path, {}, None)[0] == 401
    assert post(port, path, {}, "nope")[0] == 401
    status, body, _ = post(port, path, {}, "alpha")
    assert status == 403 and body["error"]["type"] == "permission_error"
    status, body, _ = post(port, path, {}, "root")
    assert status == 200 and body["flushed"] is True


def stored_record(client: redis.Redis, sid: str, history: int) -> dict:
    """The session's durable record once the store holds `history` tokens of it."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        raw = client.hget(streams.SINGLE.session(sid), "record")
        if raw is not None:
            rec = msgpack.unpackb(raw, raw=False)
            if len(rec["history"]) // 4 == history:
                return rec | {"raw": raw}
        time.sleep(0.1)
    raise AssertionError(f"the store never held {history} tokens of {sid}")


def test_a_session_keeps_its_owner_across_a_scheduler_restart(keyed):
    port = keyed.settings.port
    status, sid, _ = post(port, "/open_session", {"session_id": "owned"}, "alpha")
    assert status == 200
    assert post(port, "/generate", generation(4, sid=sid), "alpha")[0] == 200
    alpha = hashlib.sha256(b"alpha").hexdigest()
    stored = scoped_session_id(alpha, sid)  # the store knows it by its scoped id
    rec = stored_record(redis.Redis.from_url(keyed.settings.redis_url), stored, 3 + 4)
    assert rec["tenant"] == alpha
    assert b"alpha" not in rec["raw"]  # the owner's hash, never its key
    keyed.kill("scheduler")
    deadline = time.monotonic() + 60
    while keyed.restarts["scheduler"] == 0 and time.monotonic() < deadline:
        keyed.supervise_once()
        time.sleep(0.2)
    keyed.wait_healthy()
    for path, body in (
        ("/generate", generation(2, sid=sid)),
        ("/close_session", {"session_id": sid}),
    ):
        status, reply, _ = post(port, path, body, "beta")
        assert status == 404 and reply["error"]["type"] == "session_not_found", (path, reply)
    status, after, _ = post(port, "/generate", generation(3, sid=sid), "alpha")
    assert status == 200 and after["meta_info"]["prompt_tokens"] == 3 + 4 + 3
    assert post(port, "/close_session", {"session_id": sid}, "alpha")[0] == 200


def test_each_key_has_its_own_session_names(keyed):
    """Two keys both open "same"; a key never learns whether another's session exists:
    its miss is the answer a name nobody opened gets."""
    port = keyed.settings.port
    for key in ("alpha", "beta"):
        assert post(port, "/open_session", {"session_id": "same"}, key)[:2] == (200, "same")
    assert post(port, "/generate", generation(4, sid="same"), "alpha")[0] == 200
    status, reply, _ = post(port, "/generate", {**generation(2, sid="same")}, "beta")
    assert status == 200 and reply["meta_info"]["prompt_tokens"] == 3  # its own, empty one
    assert post(port, "/open_session", {"session_id": "alphas"}, "alpha")[0] == 200
    for path, body in (
        ("/generate", generation(2, sid="alphas")),
        ("/close_session", {"session_id": "alphas"}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "session_id": "alphas"}),
    ):
        held = post(port, path, body, "beta")
        never = post(port, path, json.loads(json.dumps(body).replace("alphas", "nobody")), "beta")
        assert held[0] == never[0] == 404, (path, held, never)
        assert (
            held[1]["error"]["message"].replace("alphas", "nobody") == never[1]["error"]["message"]
        )
    assert post(port, "/open_session", {"session_id": "alphas"}, "beta")[0] == 200
    status, reply, _ = post(port, "/generate", generation(2, sid="alphas"), "alpha")
    assert status == 200 and reply["meta_info"]["prompt_tokens"] == 3  # alpha's untouched
    for key, sid in (("alpha", "same"), ("beta", "same"), ("alpha", "alphas"), ("beta", "alphas")):
        assert post(port, "/close_session", {"session_id": sid}, key)[0] == 200
    status, reply, _ = post(port, "/open_session", {"session_id": "a~" + "0" * 32}, "alpha")
    assert status == 400 and "session_id" in reply["error"]["message"]


def cached(port: int, key: str, prompt: list[int], salt: str | None = None) -> int:
    body: dict = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
    if salt is not None:
        body["cache_salt"] = salt
    status, reply, _ = post(port, "/generate", body, key)
    assert status == 200, reply
    return reply["meta_info"]["cached_tokens"]


def test_cached_prefixes_serve_their_own_key_or_a_shared_salt(keyed):
    """A prompt alpha cached is recomputed for beta (no hit, so no timing or count tells
    beta what alpha sent), unless both send the same `cache_salt`."""
    port = keyed.settings.port
    mine, ours = list(range(150, 214)), list(range(30, 94))
    assert cached(port, "alpha", mine) == 0
    assert cached(port, "alpha", mine) > 0
    assert cached(port, "beta", mine) == 0
    assert cached(port, "beta", mine) > 0  # its own copy now
    assert cached(port, "alpha", ours, "team") == 0
    assert cached(port, "beta", ours, "team") > 0
    assert cached(port, "beta", ours) == 0  # unsalted: beta's own namespace
    assert post(port, "/generate", {**generation(2), "cache_salt": ""}, "alpha")[0] == 400


def test_a_redis_password_is_masked_where_printed():
    assert masked_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert masked_url("redis://u:s3cret@h/0?password=s3cret") == "redis://u:***@h/0?password=***"
    assert masked_url("redis://s3cret@h/0") == "redis://***@h/0"
    assert masked_url("redis://h:6379/0") == "redis://h:6379/0"
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"  # nobody listens: it only prints
    ports = [f"--{name}={free_port()}" for name in ("port", "store-port", "executor-metrics-port")]
    up = subprocess.Popen(
        [sys.executable, "-m", "custody.cli", "up", "--redis-url", url, *ports],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = up.stdout.readline()
        time.sleep(2)  # the services try that Redis and log their failures meanwhile
    finally:
        up.terminate()
        _, err = up.communicate(timeout=30)
    assert "redis: redis://user:***@127.0.0.1:" in line, line
    assert "s3cret" not in line + err


@pytest.mark.parametrize("module", ["services.scheduler.main", "services.router.main"])
def test_api_keys_without_operator_keys_are_refused_at_start(module: str):
    """Without an operator key every migration would be refused (401) and the store's
    histories left open: a service refuses to start, naming the fix."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--api-keys", "alpha"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--admin-api-keys" in done.stderr, done.stderr[-2000:]


def ask(port: int, method: str, path: str, body: dict | None, key: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_a_key_reaches_only_its_own_stored_responses(keyed):
    """Another key's response id is the same 404 as an unknown one, whatever it asks:
    get, list its input, continue it (append or fork) or delete it."""
    port, turn = keyed.settings.port, {"max_output_tokens": 4}
    status, first = ask(port, "POST", "/v1/responses", turn | {"input": "hallo"}, "alpha")
    assert status == 200, first
    status, second = ask(
        port,
        "POST",
        "/v1/responses",
        turn | {"input": "und?", "previous_response_id": first["id"]},
        "alpha",
    )
    assert status == 200, second
    for rid in (first["id"], second["id"]):
        path = f"/v1/responses/{rid}"
        continued = turn | {"input": "meins", "previous_response_id": rid}
        for method, where, body in (
            ("GET", path, None),
            ("GET", f"{path}/input_items", None),
            ("POST", "/v1/responses", continued),
            ("DELETE", path, None),
        ):
            status, answer = ask(port, method, where, body, "beta")
            assert status == 404, (method, where, answer)
    assert ask(port, "GET", f"/v1/responses/{first['id']}", None, "alpha")[0] == 200
    assert ask(port, "DELETE", f"/v1/responses/{first['id']}", None, "alpha")[0] == 200
    assert ask(port, "DELETE", f"/v1/responses/{second['id']}", None, "alpha")[0] == 200
    assert ask(port, "GET", f"/v1/responses/{second['id']}", None, "alpha")[0] == 404
