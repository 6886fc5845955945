"""The router's edge bounds what one request costs it, as the scheduler's does: it checks
a request before any bookkeeping (a 300,000-element `rid` list made it write Redis once
per element, 35 s of blocked loop), reads at most the scheduler's 8 MiB, refuses any
nesting depth and any bad session id as JSON 4xx, times out slow clients, aborts the
upstream request of a client that hangs up, shows replica addresses to operators only,
passes SGLang's incremental stream through, and adds up what every replica's flush kept.
One stack of two replicas, with API keys and `--incremental-streaming-output`, for the
module."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from custody.up import Stack
from shared import streams
from shared.http_limits import MAX_BODY
from shared.session_ids import scoped_session_id
from tests.services_harness import stack_settings, start_stack
from tests.test_limits import closed_after

USER, OPERATOR = "edge-user", "edge-operator"
KEYS = (USER, OPERATOR)  # an operator key is a key of its own too
READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def edge(redis_url: str) -> Iterator[Stack]:
    redis.Redis.from_url(redis_url).flushdb()
    settings = stack_settings(
        redis_url,
        replicas=2,
        api_keys=USER,
        admin_api_keys=OPERATOR,
        read_timeout_seconds=READ_TIMEOUT,
        incremental_streaming_output=True,
        replica_dead_seconds=3.0,
        replica_forget_seconds=2.0,
    )
    running = start_stack(settings)
    yield running
    running.stop()


def send(
    port: int, method: str, path: str, body: bytes | dict | None = None, key: str = USER
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request(method, path, data, headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def refused(port: int, path: str, body: bytes | dict, status: int = 400) -> dict:
    code, headers, raw = send(port, "POST", path, body)
    assert (code, headers["Content-Type"].split(";")[0]) == (status, "application/json"), raw
    return json.loads(raw)["error"]


def answer(port: int, path: str, body: dict) -> dict:
    code, _, raw = send(port, "POST", path, body)
    assert code == 200, raw
    return json.loads(raw)


def turn(ids: list[int], n: int = 3, **extra: object) -> dict:
    sampling = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}
    return {"input_ids": ids, "sampling_params": sampling} | extra


def test_a_huge_rid_list_is_refused_without_a_redis_write_per_element(edge: Stack):
    port, client = edge.settings.port, redis.Redis.from_url(edge.settings.redis_url)
    rids = [f"r{i}" for i in range(300_000)]
    error = refused(port, "/generate", {"input_ids": [[1, 2]] * 2, "rid": rids})
    assert error["type"] == "invalid_request_error"
    assert not list(client.scan_iter(match=streams.request_key("*")))
    assert answer(port, "/generate", turn([1, 2]))["output_ids"]


def test_a_body_over_8_mib_is_a_json_413_and_any_depth_a_json_400(edge: Stack):
    port = edge.settings.port
    big = b'{"input_ids": [1], "pad": "' + b"x" * MAX_BODY + b'"}'
    assert refused(port, "/generate", big, 413)["type"] == "request_too_large"
    deep = b'{"input_ids": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "too deeply" in refused(port, "/generate", deep)["message"]


def test_a_bad_session_id_is_refused_before_it_names_a_placement(edge: Stack):
    port, client = edge.settings.port, redis.Redis.from_url(edge.settings.redis_url)
    for bad in ("abc\n", ".", ".."):
        assert refused(port, "/open_session", {"session_id": bad})["type"] == "session_invalid"
        assert not client.exists(streams.placement_key(bad))


def test_two_keys_open_one_name_through_the_router_as_two_sessions(edge: Stack):
    """Placements are kept per key (the name scoped as the replica scopes it): each key's
    turns find its own session, wherever each was placed."""
    port, client = edge.settings.port, redis.Redis.from_url(edge.settings.redis_url)
    ids = [scoped_session_id(hashlib.sha256(k.encode()).hexdigest(), "one") for k in KEYS]
    for key in KEYS:
        code, _, raw = send(port, "POST", "/open_session", {"session_id": "one"}, key)
        assert (code, json.loads(raw)) == (200, "one")
    assert all(client.exists(streams.placement_key(sid)) for sid in ids)
    for n, key in enumerate(KEYS, 1):
        for _ in range(n):  # USER takes one turn, OPERATOR two
            code, _, raw = send(
                port, "POST", "/generate", turn([5, 6], session_params={"id": "one"}), key
            )
            assert code == 200, raw
        assert json.loads(raw)["meta_info"]["prompt_tokens"] == 2 + (n - 1) * (2 + 3)
    for key in KEYS:
        assert send(port, "POST", "/close_session", {"session_id": "one"}, key)[0] == 200
    deadline = time.monotonic() + 10
    while any(client.exists(streams.placement_key(sid)) for sid in ids):
        assert time.monotonic() < deadline, "a closed session's placement stayed"
        time.sleep(0.1)


def test_health_shows_replica_addresses_to_an_operator_only(edge: Stack):
    port = edge.settings.port
    code, _, raw = send(port, "GET", "/health", key="")
    public = json.loads(raw)
    assert code == 200 and public["ready"] == 2
    assert all("url" not in r for r in public["replicas"].values()), public
    code, _, raw = send(port, "GET", "/health", key=OPERATOR)
    assert all(r["url"].startswith("http://") for r in json.loads(raw)["replicas"].values())
    assert send(port, "GET", "/liveness", key="")[0] == 200
    assert send(port, "GET", "/health_generate", key="")[0] == 200


def flushed(port: int) -> tuple[int, int]:
    """What a flush at `port` kept: (KV pages, Mamba states)."""
    code, _, raw = send(port, "POST", "/flush_cache", {}, OPERATOR)
    assert code == 200, raw
    reply = json.loads(raw)
    assert reply["flushed"] is True
    return reply["kv_pages_kept"], reply["mamba_slots_kept"]


def test_a_flush_through_the_router_adds_up_what_every_replica_kept(edge: Stack):
    """A session opened on each replica directly (where the router would place one is
    its own choice): the router's answer to a flush counts what every replica kept for
    them, not the first's alone; once they close, each replica keeps what it kept
    before."""
    port = edge.settings.port
    replicas = json.loads(send(port, "GET", "/health", key=OPERATOR)[2])["replicas"]
    direct = [int(r["url"].rsplit(":", 1)[1]) for r in replicas.values()]
    before = [flushed(p) for p in direct]
    sids = []
    for i, replica in enumerate(direct):
        sid = answer(replica, "/open_session", {"session_id": f"kept-{i}"})
        prompt = list(range(3 + i, 67 + i))  # 64 tokens of its own
        answer(replica, "/generate", turn(prompt, session_params={"id": sid}))
        sids.append((replica, sid))
    kept = [flushed(p) for p in direct]
    assert all(k[0] > b[0] and k[1] > b[1] for k, b in zip(kept, before, strict=True))
    assert flushed(port) == (sum(k[0] for k in kept), sum(k[1] for k in kept))
    for replica, sid in sids:
        answer(replica, "/close_session", {"session_id": sid})
    assert [flushed(p) for p in direct] == before


def test_a_slow_client_is_cut_off_at_the_router(edge: Stack):
    port = edge.settings.port
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        took = closed_after(s, head * 8, 0.3)
    assert took >= READ_TIMEOUT, took
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head + b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n")
        closed_after(s, b" " * 400, 0.3)


def running(edge: Stack) -> int:
    """Requests running or queued on every replica, from their /metrics."""
    total = 0
    for name, (_, settings) in edge.layout.items():
        if name.startswith("scheduler-"):
            raw = send(settings.port, "GET", "/metrics")[2]
            for line in raw.decode().splitlines():
                if line.startswith(("custody_requests_running", "custody_requests_queued")):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_a_client_that_hangs_up_aborts_its_request_upstream(edge: Stack):
    """Not streamed: the router's handler is cancelled with the client's connection, and
    its upstream request with it; the replica aborts the turn, so the session's history
    does not grow by it (before, the turn ran to its limit and the session kept all 900
    tokens though nobody read them)."""
    port = edge.settings.port
    code, _, _ = send(port, "POST", "/open_session", {"session_id": "left"})
    assert code == 200
    body = json.dumps(turn([3, 4, 5], n=900, session_params={"id": "left"})).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 30
    while running(edge) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    s.close()
    deadline = time.monotonic() + 60
    while running(edge):
        assert time.monotonic() < deadline, "the request ran on after its client left"
        time.sleep(0.1)
    after = answer(port, "/generate", turn([6], n=1, session_params={"id": "left"}))
    assert after["meta_info"]["prompt_tokens"] == 1  # the abandoned turn left no history
    assert send(port, "POST", "/close_session", {"session_id": "left"})[0] == 200


def test_an_incremental_stream_carries_only_what_is_new(edge: Stack):
    """`--incremental-streaming-output`: each chunk's output ids and logprobs are the
    new ones; joined, they are the unstreamed reply's."""
    port = edge.settings.port
    body = turn([9, 8, 7], n=6, return_logprob=True)
    whole = answer(port, "/generate", body)
    code, _, raw = send(port, "POST", "/generate", body | {"stream": True})
    assert code == 200
    events = [x.removeprefix(b"data: ") for x in raw.split(b"\n\n") if x]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(x) for x in events[:-1]]
    assert len(chunks) > 1
    ids = [t for c in chunks for t in c["output_ids"]]
    logprobs = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert ids == whole["output_ids"]
    assert logprobs == whole["meta_info"]["output_token_logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_other_clients_are_served_while_a_huge_body_is_refused(edge: Stack):
    """The refusals above cost the router bounded work: a client's turn sent while an
    over-sized body streams in is answered."""
    port = edge.settings.port
    served: dict = {}
    big = b'{"input_ids": [1], "pad": "' + b"x" * (MAX_BODY + 1) + b'"}'
    sending = threading.Thread(
        target=lambda: served.update(big=send(port, "POST", "/generate", big))
    )
    sending.start()
    assert answer(port, "/generate", turn([1, 2, 3]))["output_ids"]
    sending.join(60)
    assert served["big"][0] == 413


def test_a_registration_not_signed_with_the_cluster_secret_gets_nothing(edge: Stack):
    """Anything that can write Redis could register its own address, the least loaded,
    and collect every key the router forwards; unsigned, it is never chosen."""
    client = redis.Redis.from_url(edge.settings.redis_url)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    entry = {
        "url": f"http://127.0.0.1:{listener.getsockname()[1]}",
        "executor": True,
        "running": 0,
        "queued": 0,
        "sessions": 0,
        "tenants": {},
        "at": time.time(),
        "epoch": "forged",
        "sig": "0" * 64,
    }
    try:
        client.sadd(streams.REPLICAS, "evil")
        client.set(streams.Keys("evil").alive, json.dumps(entry), ex=30)
        time.sleep(1.5)  # the router reads registrations every 0.5 s
        for _ in range(6):
            assert answer(edge.settings.port, "/generate", turn([1, 2]))["output_ids"]
            answer(edge.settings.port, "/open_session", {})
        with pytest.raises(TimeoutError):
            listener.accept()  # no request (and no key) was sent there
        raw = send(edge.settings.port, "GET", "/metrics")[2]
        assert b"custody_router_unverified_registrations_total" in raw
    finally:
        client.delete(streams.Keys("evil").alive)
        client.srem(streams.REPLICAS, "evil")
        listener.close()


def test_re_homing_drops_what_no_placement_names_instead_of_retrying_it(edge: Stack):
    """A dead replica's list names a session whose placement is gone (closed, its
    removal lost): re-homing drops the member; it retried the move every read, forever."""
    client = redis.Redis.from_url(edge.settings.redis_url)
    ghost = streams.Keys("ghost")
    client.sadd(streams.REPLICAS, "ghost")
    client.sadd(ghost.placed, "closed-long-ago")
    try:
        deadline = time.monotonic() + 30
        while client.sismember(ghost.placed, "closed-long-ago"):
            assert time.monotonic() < deadline, "the member was kept"
            time.sleep(0.2)
    finally:
        client.delete(ghost.placed)
        client.srem(streams.REPLICAS, "ghost")


def test_a_replica_dead_long_enough_is_forgotten_by_router_and_store(edge: Stack):
    """Ids made up per container pile up: one dead for --replica-forget-seconds, with
    nothing placed on it, leaves the replica set, and the store stops its consumer."""
    client = redis.Redis.from_url(edge.settings.redis_url)
    client.sadd(streams.REPLICAS, "gone-container")
    store = edge.settings.store_port

    def consumed() -> set[str]:
        raw = send(store, "GET", "/ledger/replicas", key=OPERATOR)[2]
        return set(json.loads(raw)["replicas"])

    deadline = time.monotonic() + 20
    while "gone-container" not in consumed():
        assert time.monotonic() < deadline, "the store never consumed it"
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while client.sismember(streams.REPLICAS, "gone-container") or "gone-container" in consumed():
        assert time.monotonic() < deadline, "a dead replica's id was kept"
        time.sleep(0.3)
    assert {"0", "1"} <= consumed()  # the live ones stay
