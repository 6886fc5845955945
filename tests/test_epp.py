"""The endpoint picker over real processes and a real Redis: two replicas, three pickers
(two alike, one with a session limit of 1), and a Python stand-in for Envoy playing the
ext_proc protocol against them (custody/bench/envoy.py), then forwarding each request to
the endpoint picked. What can fail here: a session's turn sent to a replica that does
not hold it (its cached tokens and its outputs against one-shot show it), a pick outside
the gateway's subset, a refusal with the wrong status, a stream the picker does not
survive, the served endpoint not read back. What cannot: Envoy's own behaviour (no
Envoy binary runs), and a cluster's (none is here).

The last test is the rolling-update drill: a replica drained as its pod's preStop hook
drains it (`custody drain` against the picker's HTTP port) while its sessions are open;
every turn after it must resume from the state moved, with outputs equal to one-shot."""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import redis
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from custody.bench.envoy import Envoy
from custody.up import Stack, layout
from shared import streams
from shared.config import Settings
from shared.http_limits import MAX_BODY
from shared.placement import Placement
from shared.redis_server import free_port
from tests.services_harness import stack_settings
from tests.test_replicas import one_shots

PICKERS = ("epp-a", "epp-b", "epp-limited")
INPUT, OUTPUT = 8, 8


def _with_pickers(settings: Settings) -> dict[str, tuple[str, Settings]]:
    children = layout(settings)
    for name in PICKERS:
        own = dataclasses.replace(
            settings,
            epp_port=free_port(),
            epp_health_port=free_port(),
            epp_http_port=free_port(),
            max_sessions=1 if name == "epp-limited" else settings.max_sessions,
        )
        children[name] = ("services.epp.main", own)
    return children


def _serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
            return answer.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _sees_every_replica(stack: Stack, name: str) -> bool:
    """The picker's own view (its /health counts the replicas it would pick): serving
    alone means one registration read succeeded, which may predate a replica's executor,
    and a picker that sees one replica places every open there."""
    url = f"http://127.0.0.1:{stack.layout[name][1].epp_http_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return json.loads(answer.read())["ready"] >= stack.settings.replicas
    except (OSError, ValueError):
        return False


def wait_serving(stack: Stack, name: str, timeout: float = 60) -> None:
    port = stack.layout[name][1].epp_health_port
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.supervise_once()
        if _serving(port) and _sees_every_replica(stack, name):
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} never became ready with every replica")


@pytest.fixture(scope="module")
def gateway(redis_url: str, module_redis_client: redis.Redis) -> Iterator[Stack]:
    settings = stack_settings(redis_url, replicas=2, session_header="X-Session-ID")
    stack = Stack(settings, plan=_with_pickers).start_all()
    try:
        stack.wait_healthy()
        for name in PICKERS:
            wait_serving(stack, name)
        yield stack
    finally:
        stack.stop()


def limited_open(stack: Stack, path: str, name: str, timeout: float = 10):
    """An open through epp-limited once it sees the session an earlier open holds. A
    picker counts the sessions of the replicas' last registrations (one a heartbeat), so
    an open sent right after another may pass before that one is seen: it is closed and
    sent again, until refused or `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        with envoy(stack, "epp-limited") as gate:
            answer = gate.send(path, {"session_id": name})
            if answer.status != 200 or time.monotonic() > deadline:
                return answer
            assert gate.send("/close_session", {"session_id": name}).body is True
        time.sleep(0.2)


def envoy(stack: Stack, name: str) -> Envoy:
    return Envoy(f"127.0.0.1:{stack.layout[name][1].epp_port}")


def endpoint_of(stack: Stack, replica: str) -> str:
    return f"127.0.0.1:{stack.layout[f'scheduler-{replica}'][1].port}"


def home(client: redis.Redis, sid: str) -> str:
    return Placement.decode(client.get(streams.placement_key(sid))).replica


def placed_sid(client: redis.Redis, name: str) -> str:
    """The scoped id of the session the client named `name` (placed, so listed)."""
    prefix = streams.placement_key("")
    keys = [k.decode() for k in client.scan_iter(prefix + "*" + name)]
    assert len(keys) == 1, keys
    return keys[0].removeprefix(prefix)


def turn_body(sid: str, ids: list[int]) -> dict:
    return {
        "input_ids": ids,
        "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True, "temperature": 0},
    }


def run_turns(
    stack: Stack,
    sids: list[str],
    history: dict[str, list[int]],
    rng: np.random.Generator,
    pickers: tuple[str, ...] = PICKERS[:2],
    resumed: set[str] | None = None,
) -> None:
    """One turn of every session, alternating `pickers`; each of `resumed` (default:
    all) must resume from its state where it is placed."""
    for i, sid in enumerate(sids):
        ids = rng.integers(0, 256, INPUT).tolist()
        with envoy(stack, pickers[i % len(pickers)]) as gate:
            answer = gate.send("/generate", turn_body(sid, ids))
        assert answer.status == 200, answer.body
        assert answer.endpoint == endpoint_of(stack, home(stack_client(stack), sid))
        if resumed is None or sid in resumed:
            assert answer.body["meta_info"]["cached_tokens"] >= len(history[sid]) - 16
        history[sid] += ids + answer.body["output_ids"]


def stack_client(stack: Stack) -> redis.Redis:
    return redis.Redis.from_url(stack.settings.redis_url)


def drain(stack: Stack, replica: str) -> dict:
    """`replica` drained as its pod's preStop hook drains it: `custody drain` against
    picker epp-a's HTTP port; the counts it printed."""
    url = f"http://127.0.0.1:{stack.layout['epp-a'][1].epp_http_port}"
    drained = subprocess.run(
        [sys.executable, "-m", "custody.cli", "drain", "--replica", replica, "--url", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drained.returncode == 0, drained.stdout + drained.stderr
    return json.loads(drained.stdout.strip().splitlines()[-1])


def restart(stack: Stack, name: str) -> None:
    stack.kill(name)
    stack.start(name)
    wait_serving(stack, name)


def test_sessions_stay_on_their_replica_across_turns_pickers_and_a_restart(gateway):
    client, rng = stack_client(gateway), np.random.default_rng(3)
    sids = []
    for i in range(4):
        with envoy(gateway, PICKERS[i % 2]) as gate:
            opened = gate.send("/open_session", {})  # named by the picker: body rewritten
        assert opened.status == 200, opened.body
        sid = opened.body
        assert opened.endpoint == endpoint_of(gateway, home(client, sid))
        assert opened.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": opened.endpoint}}
        sids.append(sid)
    assert {home(client, sid) for sid in sids} == {"0", "1"}  # by load: both used
    history: dict[str, list[int]] = {sid: [] for sid in sids}
    for t in range(3):
        if t == 2:
            restart(gateway, "epp-a")  # a new picker: the directory still places them
        run_turns(gateway, sids, history, rng)
    expected = one_shots([history[sid][:-OUTPUT] for sid in sids])
    assert [history[sid][-OUTPUT:] for sid in sids] == expected
    for sid in sids:
        with envoy(gateway, "epp-b") as gate:
            assert gate.send("/close_session", {"session_id": sid}).body is True
    deadline = time.monotonic() + 5  # a close's placement goes once it is answered
    keys = [streams.placement_key(sid) for sid in sids]
    while client.exists(*keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client.exists(*keys)


def test_a_session_named_by_header_is_placed_on_its_first_request_and_kept(gateway):
    client = stack_client(gateway)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"X-Session-ID": "by-header"}
    with envoy(gateway, "epp-a") as gate:
        first = gate.send("/v1/chat/completions", body, headers)
    sid = placed_sid(client, "by-header")
    assert first.endpoint == endpoint_of(gateway, home(client, sid))
    for name in ("epp-b", "epp-a"):
        with envoy(gateway, name) as gate:
            assert gate.send("/v1/chat/completions", body, headers).endpoint == first.endpoint


def test_the_subset_hint_narrows_every_choice(gateway):
    client = stack_client(gateway)
    one = endpoint_of(gateway, "1")
    plain = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    with envoy(gateway, "epp-a") as gate:
        for _ in range(4):
            answer = gate.send("/generate", plain, subset=[one])
            assert answer.status == 200 and answer.endpoint == one
        nowhere = gate.send("/generate", plain, subset=["10.255.0.1:1"])
        assert nowhere.status == 503 and nowhere.headers.get("retry-after") == "1"
        assert gate.send("/generate", plain, subset=[]).status == 503
        opened = gate.send("/open_session", {"session_id": "subset"}, subset=[one])
        assert opened.endpoint == one
        sid = placed_sid(client, "subset")
        assert home(client, sid) == "1"
        elsewhere = gate.send(
            "/generate", turn_body("subset", [4]), subset=[endpoint_of(gateway, "0")]
        )
        assert elsewhere.status == 503, elsewhere.body  # never served off its replica
        assert gate.send("/close_session", {"session_id": "subset"}).body is True


def test_a_picker_sheds_opens_past_the_session_limit_with_429(gateway):
    with envoy(gateway, "epp-a") as gate:
        held = gate.send("/open_session", {"session_id": "held"})
    assert held.status == 200
    refused = limited_open(gateway, "/open_session", "one-too-many")
    assert refused.status == 429 and refused.endpoint is None
    assert "--max-sessions" in refused.body["error"]["message"]
    with envoy(gateway, "epp-a") as gate:
        assert gate.send("/close_session", {"session_id": "held"}).body is True


def test_the_served_endpoint_is_read_back(gateway):
    http = gateway.layout["epp-b"][1].epp_http_port

    def served(match: str) -> float:
        return metric_sum_labelled(http, "custody_epp_served_total", match)

    before = served("other"), served("picked")
    plain = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
    with envoy(gateway, "epp-b") as gate:
        assert gate.send("/generate", plain).status == 200
        assert gate.send("/generate", plain, served="10.255.0.9:30000").status == 200
    assert (served("other"), served("picked")) == (before[0] + 1, before[1] + 1)


def metric_sum_labelled(port: int, name: str, match: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    prefix = f'{name}{{match="{match}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_bad_streams_and_bodies_get_their_own_answer_and_the_picker_lives(gateway):
    port = gateway.layout["epp-a"][1].epp_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_grpc.ExternalProcessorStub(channel)
        stray = ext.ProcessingRequest(request_body=ext.HttpBody(body=b"x", end_of_stream=True))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Process(iter([stray]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with envoy(gateway, "epp-a") as gate:
        huge = gate.send("/generate", {"text": "x" * MAX_BODY})
        assert huge.status == 413
        assert gate.send("/flush_cache", {}).status == 501  # every replica: not one endpoint
        bad = gate.send("/open_session", {"session_id": "no spaces allowed"})
        assert bad.status == 400
        plain = {"input_ids": [7], "sampling_params": {"max_new_tokens": 1}}
        assert gate.send("/generate", plain).status == 200


def post(
    stack: Stack, child: str, path: str, body: dict, headers: list[tuple[str, str]]
) -> tuple[int, dict]:
    """(status, JSON answer) of `body` POSTed straight to `child`, every header pair sent
    as given (a repeated header once per copy)."""
    raw = json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", stack.layout[child][1].port, timeout=60)
    try:
        connection.putrequest("POST", path)
        for key, value in [("content-type", "application/json"), *headers]:
            connection.putheader(key, value)
        connection.putheader("content-length", str(len(raw)))
        connection.endheaders(raw)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def test_a_doubled_session_header_is_refused_by_picker_router_and_replica_alike(gateway):
    """Envoy passes both copies on; a picker reading the last and a replica the first
    would each hold a different session, one of them never placed. Every hop refuses."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    doubled = [("X-Session-ID", "first-copy"), ("X-Session-ID", "second-copy")]
    with envoy(gateway, "epp-a") as gate:
        refused = gate.send("/v1/chat/completions", body, doubled)
    assert refused.status == 400 and refused.endpoint is None, refused.body
    assert refused.body["error"]["type"] == "invalid_request_error"
    for child in ("router", "scheduler-0"):
        status, answer = post(gateway, child, "/v1/chat/completions", body, doubled)
        assert status == 400, (child, answer)
        assert answer["error"]["type"] == "invalid_request_error"
        assert "X-Session-ID header is sent 2 times" in answer["error"]["message"]
    placed = stack_client(gateway).scan_iter(streams.placement_key("") + "*-copy*")
    assert not list(placed)


def test_a_percent_encoded_open_is_an_open_placed_and_limited(gateway):
    """Envoy passes the path on undecoded and the replica's routes match it decoded:
    `/%6Fpen_session` opens a session there, so the picker places it and holds it to
    the session limit (epp-limited's 1, held by the header session an earlier test of
    this module left open), and `/%63lose_session` takes its placement back."""
    client = stack_client(gateway)
    with envoy(gateway, "epp-a") as gate:
        opened = gate.send("/%6Fpen_session", {"session_id": "encoded-open"})
    assert opened.status == 200, opened.body
    sid = placed_sid(client, "encoded-open")
    assert opened.endpoint == endpoint_of(gateway, home(client, sid))
    refused = limited_open(gateway, "/%6Fpen_session", "encoded-too-many")
    assert refused.status == 429 and refused.endpoint is None, refused.body
    with envoy(gateway, "epp-b") as gate:
        assert gate.send("/%63lose_session", {"session_id": "encoded-open"}).body is True
    deadline = time.monotonic() + 5  # a close's placement goes once it is answered
    while client.exists(streams.placement_key(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client.exists(streams.placement_key(sid))


def test_rolling_update_drill_moves_every_session_with_its_state(gateway, capsys):
    """The pod of the replica holding most of the drill's sessions is replaced (which
    one: placed by load, after the module's earlier tests): its preStop hook drains it
    through the picker; every session turns on, resumed from the state moved, equal to
    one-shot; then it stops."""
    client, rng = stack_client(gateway), np.random.default_rng(11)
    sids = []
    for i in range(6):
        with envoy(gateway, PICKERS[i % 2]) as gate:
            sids.append(gate.send("/open_session", {}).body)
    homes = [home(client, sid) for sid in sids]
    gone = max(("0", "1"), key=homes.count)
    kept = "1" if gone == "0" else "0"
    on_drained = [sid for sid, at in zip(sids, homes, strict=True) if at == gone]
    history: dict[str, list[int]] = {sid: [] for sid in sids}
    run_turns(gateway, sids, history, rng)
    # the drain moves every session placed there, those the module's earlier tests left
    # open too (with their state, or from history), so only the drill's own are exact
    placed = client.smembers(streams.Keys(gone).placed)
    started = time.monotonic()
    outcome = drain(gateway, gone)
    seconds = time.monotonic() - started
    assert outcome["failed"] == 0 and outcome["state"] >= len(on_drained), outcome
    assert outcome["state"] + outcome["history"] + outcome["gone"] == len(placed), outcome
    assert all(home(client, sid) == kept for sid in sids)
    with envoy(gateway, "epp-b") as gate:  # the draining replica takes nothing new
        late = [gate.send("/open_session", {}).body for _ in range(2)]
    assert [home(client, sid) for sid in late] == [kept, kept]
    for name in (f"executor-{gone}", f"scheduler-{gone}"):  # the pod stops
        gateway.kill(name)
        del gateway.children[name]
    for _ in range(2):
        run_turns(gateway, sids, history, rng)
    expected = one_shots([history[sid][:-OUTPUT] for sid in sids])
    assert [history[sid][-OUTPUT:] for sid in sids] == expected
    with capsys.disabled():
        print(
            f"\nrolling-update drill: {len(on_drained)} sessions on the drained replica; moved "
            f"with state {outcome['state']}, re-homed from history {outcome['history']}, "
            f"failed {outcome['failed']}, lost 0; drain took {seconds:.2f} s"
        )
