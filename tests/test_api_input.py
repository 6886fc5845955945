"""Typed, range-checked input at the HTTP edge, over real HTTP against the real services:
the inputs a hostile user found (a seed past 64 bits, a token id past int64, a lone
surrogate, a bad parameter on a streamed request) are JSON 4xx answers that change
nothing; explicit output limits that overrun the context are refused naming both numbers;
fields custody does not implement are ignored; /openapi.json documents every route; and a
fault in a handler is a JSON 500 with a request id, also after a stream began."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket

import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from services.scheduler.http.errors import errors
from services.scheduler.http.events import EventStream
from shared.placement import ROUTED_EPOCH_HEADER
from shared.redis_server import free_port
from shared.tokenizer import BYTE_VOCAB as VOCAB  # the built-in model's
from tests.services_harness import POOLS, call, ledger_when_idle, stack_settings, start_stack

CONTEXT = POOLS["context_len"]


@pytest.fixture(scope="module")
def stack(redis_url):
    """One stack for the module: every test here leaves it as it found it."""
    redis.Redis.from_url(redis_url).flushdb()
    running = start_stack(stack_settings(redis_url))
    yield running
    running.stop()


def post(port: int, path: str, body: bytes | dict) -> tuple[int, str, bytes]:
    """Status, Content-Type and body, read with http.client: the status line is the
    first thing the server sent, so a 4xx here means no 200 headers went out before it."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def refusal(port: int, path: str, body: bytes | dict, status: int = 400) -> str:
    code, kind, raw = post(port, path, body)
    assert (code, kind.split(";")[0]) == (status, "application/json"), (code, kind, raw[:300])
    return json.loads(raw)["error"]["message"]


def generate(ids: list[int], **sampling: object) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, **sampling}}


def test_seed_is_bounded_to_64_bits_and_the_scheduler_keeps_serving(stack):
    port = stack.settings.port
    epoch = call(port, "/health")["executor"]
    message = refusal(port, "/generate", generate([1, 2, 3], seed=2**70, temperature=1.0))
    assert "sampling_params.seed" in message and "2**64 - 1" in message
    assert "seed" in refusal(port, "/v1/completions", {"prompt": "x", "seed": 2**64})
    assert "seed" in refusal(port, "/generate", generate([1], seed=-1))
    top = call(port, "/generate", generate([1, 2, 3], seed=2**64 - 1, temperature=1.0))
    assert len(top["output_ids"]) == 2
    done = call(port, "/v1/completions", {"prompt": "x", "seed": 2**64 - 1, "max_tokens": 2})
    assert done["usage"]["completion_tokens"] <= 2
    assert call(port, "/health")["executor"] == epoch
    assert all(child.poll() is None for child in stack.children.values())


def test_values_no_layer_can_hold_get_json_400s(stack):
    port = stack.settings.port
    assert "input_ids[1]" in refusal(port, "/generate", generate([1, 2**63]))
    assert "input_ids[0]" in refusal(port, "/generate", generate([VOCAB]))
    assert "prompt" in refusal(port, "/v1/completions", {"prompt": [2**64]})
    lone = b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'
    assert "surrogate" in refusal(port, "/generate", lone)
    chat = b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}'
    assert "surrogate" in refusal(port, "/v1/chat/completions", chat)
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        raw = f'{{"input_ids": [1], "sampling_params": {{"temperature": {value}}}}}'.encode()
        refusal(port, "/generate", raw)
        refusal(port, "/v1/completions", f'{{"prompt": "x", "top_p": {value}}}'.encode())
    assert "temperature" in refusal(port, "/generate", generate([1], temperature=100.5))
    assert "top_k" in refusal(port, "/generate", generate([1], top_k=0))
    assert "stop_token_ids" in refusal(port, "/generate", generate([1], stop_token_ids=[1] * 257))
    # SGLang's JSON kit sends an id past the vocabulary: accepted, and it never matches
    plain = call(port, "/generate", generate([5, 6], max_new_tokens=8, ignore_eos=True))
    past = generate([5, 6], max_new_tokens=8, ignore_eos=True, stop_token_ids=[119690])
    assert call(port, "/generate", past)["output_ids"] == plain["output_ids"]
    # (ignore_eos: sampled at temperature 1, the reply may end at EOS within 2 tokens)
    completion = {"prompt": [5, 6], "max_tokens": 2, "stop_token_ids": [119690], "ignore_eos": True}
    # a reasoning budget where no reasoning parser marks where reasoning ends
    budget = {"messages": [{"role": "user", "content": "x"}], "thinking_budget": 4}
    assert "thinking_budget" in refusal(port, "/v1/chat/completions", budget)
    assert call(port, "/v1/completions", completion)["choices"][0]["finish_reason"] == "length"
    assert "stop" in refusal(port, "/generate", generate([1], stop=["x"] * 17))
    assert "stop[0]" in refusal(port, "/generate", generate([1], stop=["x" * 257]))
    assert "context length" in refusal(port, "/generate", generate([1] * CONTEXT))
    assert "exactly one" in refusal(port, "/generate", {"text": "a", "input_ids": [1]})
    assert "$.n" in refusal(port, "/v1/completions", {"prompt": "x", "n": 17})


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/generate", generate([1, 2], temperature="x"), 400),
        ("/generate", {"input_ids": [1], "session_params": {"id": "nobody"}}, 404),
        ("/generate", generate([1] * (CONTEXT - 2), max_new_tokens=5), 400),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -3}, 400),
    ],
)
def test_a_streamed_request_is_refused_before_its_200_headers(stack, path, body, status):
    refusal(stack.settings.port, path, {**body, "stream": True}, status)


def test_an_explicit_limit_past_the_context_names_both_numbers(stack):
    """/generate refuses as SGLang's tokenizer manager does (input + budget past the
    context, in its words); the OpenAI routes as vLLM's (reaching it)."""
    port = stack.settings.port
    prompt = [7] * 1000
    message = refusal(port, "/generate", generate(prompt, max_new_tokens=CONTEXT - 999))
    said = (f"total of {CONTEXT + 1} tokens", "1000 tokens from the input", f"{CONTEXT} tokens")
    assert all(part in message for part in said), message
    message = refusal(port, "/v1/completions", {"prompt": prompt, "max_tokens": 24})
    assert "max_tokens 24" in message and "1000" in message
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT - 1}
    assert "max_completion_tokens" in refusal(port, "/v1/chat/completions", chat)
    # no limit: the route's default, cut to the room the context leaves
    fits = call(port, "/generate", {"input_ids": prompt, "sampling_params": {"ignore_eos": True}})
    assert fits["meta_info"]["completion_tokens"] == 16
    edge = [7] * (CONTEXT - 5)
    cut = call(port, "/generate", {"input_ids": edge, "sampling_params": {"ignore_eos": True}})
    assert cut["meta_info"]["completion_tokens"] == 5
    view = ledger_when_idle(stack)
    assert view["violations"] == [] and view["leaked"] == {}


def test_a_session_turn_past_its_room_gets_fewer_tokens_on_generate_and_a_400_on_openai(stack):
    """SGLang checks a turn's budget against its new input only, then clamps it to the
    room the history leaves: the 10th turn of a long session asking for more than that
    room ends with finish_reason length. The OpenAI route counts the history and refuses,
    naming it."""
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "overrun"})
    history = 0
    for i in range(9):
        body = generate([3 + i] * 100, max_new_tokens=8, ignore_eos=True)
        history += 100 + len(
            call(port, "/generate", body | {"session_params": {"id": sid}})["output_ids"]
        )
    room = CONTEXT - history - 10
    text = {"prompt": [4] * 10, "max_tokens": room + 5, "session_id": sid}
    message = refusal(port, "/v1/completions", text)
    assert f"{history} of session history + 10 new" in message and "max_tokens" in message
    turn = generate([4] * 10, max_new_tokens=room + 50, ignore_eos=True)
    tenth = call(port, "/generate", turn | {"session_params": {"id": sid}})
    assert tenth["meta_info"]["prompt_tokens"] == history + 10
    assert tenth["meta_info"]["completion_tokens"] == room
    assert tenth["meta_info"]["finish_reason"]["type"] == "length"
    call(port, "/close_session", {"session_id": sid})
    view = ledger_when_idle(stack)
    assert view["violations"] == [] and view["leaked"] == {}


def test_unknown_fields_are_ignored_and_unimplemented_ones_refused_unless_neutral(stack):
    """Fields that change nothing custody computes are ignored; fields that would change
    the output and that custody does not implement are accepted at their neutral value
    (clients send defaults) and otherwise refused naming the field, never ignored."""
    port = stack.settings.port
    sid = call(
        port,
        "/open_session",
        {"session_id": "ignored", "capacity_of_str_len": 1000, "streaming": True, "x": [1]},
    )
    sglang = {
        **generate([1, 2, 3], json_schema=None, logit_bias={}, n=1, min_new_tokens=0),
        "session_params": {"id": sid, "rid": None, "offset": 0},
        "lora_path": "adapter",
        "logprob_start_len": 0,
        "custom_logit_processor": None,
        "no_such_field": {"nested": [1, 2]},
    }
    assert len(call(port, "/generate", sglang)["output_ids"]) == 2
    neutral = {"logit_bias": {}, "echo": False, "best_of": 1, "response_format": {"type": "text"}}
    openai = {"max_tokens": 2, "user": "u", "service_tier": "auto", **neutral}
    assert call(port, "/v1/completions", {"prompt": "hi", **openai})["usage"]
    chat = {"messages": [{"role": "user", "content": "hi", "name": "n"}], "tools": [], **openai}
    assert call(port, "/v1/chat/completions", chat)["usage"]["completion_tokens"] <= 2
    for path, body, field in [
        ("/generate", generate([1], logit_bias={"5": -100}), "sampling_params.logit_bias"),
        ("/generate", generate([1], min_new_tokens=3), "sampling_params.min_new_tokens"),
        ("/generate", generate([1], stop_regex=["a+"]), "sampling_params.stop_regex"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": -100}}, "logit_bias"),
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
    ]:
        status, _, raw = post(port, path, body)
        assert status == 400 and f"{field} is not implemented" in raw.decode(), (path, field)
    call(port, "/close_session", {"session_id": sid, "extra": 1})
    assert ledger_when_idle(stack)["leaked"] == {}


def test_openapi_document_covers_every_route(stack):
    doc = call(stack.settings.port, "/openapi.json")
    assert doc["openapi"].startswith("3.1")
    routes = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == {
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/liveness"),
        ("GET", "/admin/idle_sessions"),
        ("GET", "/metrics"),
        ("GET", "/get_model_info"),
        ("GET", "/model_info"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("GET", "/tokenizer_info"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/open_session"),
        ("POST", "/fork_session"),
        ("POST", "/close_session"),
        ("POST", "/place_session"),
        ("POST", "/abort_request"),
        ("GET", "/flush_cache"),
        ("POST", "/flush_cache"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/generate"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/{response_id}"),
        ("GET", "/v1/responses/{response_id}/input_items"),
        ("POST", "/v1/responses/compact"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/admin/migrate_out"),
        ("POST", "/admin/migrate_in"),
        ("POST", "/admin/migrate_done"),
        ("POST", "/admin/migrate_cancel"),
    }
    schemas = doc["components"]["schemas"]
    ids = schemas["GenerateRequest"]["properties"]["input_ids"]["anyOf"][0]
    assert ids["maxItems"] == CONTEXT - 1 and ids["items"]["exclusiveMaximum"] == VOCAB
    seed = schemas["GenerateSamplingParams"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (0, 2**64 - 1)
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        reply = doc["paths"][path]["post"]["responses"]
        assert "text/event-stream" in reply["200"]["content"]
        assert reply["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorReply")


def test_a_fault_in_a_handler_is_a_json_500_with_its_request_id(caplog):
    """The middleware alone, in an aiohttp app over real HTTP: no product route can be
    made to fail on purpose without a hook for it."""

    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("broken on purpose")

    async def broken_mid_stream(request: web.Request) -> web.StreamResponse:
        stream = EventStream(request)
        await stream.send({"text": "first"})
        raise RuntimeError("broken after the headers")

    async def scenario() -> None:
        app = web.Application(middlewares=[errors])
        app.router.add_post("/broken", broken)
        app.router.add_post("/stream", broken_mid_stream)
        async with TestServer(app) as server, ClientSession() as client:
            async with client.post(server.make_url("/broken")) as resp:
                assert resp.status == 500 and resp.content_type == "application/json"
                detail = (await resp.json())["error"]
            assert detail["type"] == "internal_error" and detail["request_id"]
            assert any(detail["request_id"] in r.getMessage() for r in caplog.records)
            async with client.post(server.make_url("/stream")) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                events = [
                    line.removeprefix("data: ")
                    for line in (await resp.text()).splitlines()
                    if line.startswith("data: ")
                ]
            assert json.loads(events[0]) == {"text": "first"} and events[-1] == "[DONE]"
            assert json.loads(events[1])["error"]["type"] == "internal_error"
            async with client.get(server.make_url("/broken")) as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "POST"
                assert "error" in await resp.json()
            async with client.post(server.make_url("/nowhere")) as resp:
                assert resp.status == 404 and "error" in await resp.json()

    with caplog.at_level(logging.ERROR, logger="custody.scheduler.http"):
        asyncio.run(scenario())


def test_redis_unreachable_in_a_handler_is_a_503_to_retry():
    """A handler whose Redis call fails (a real client, to a port nothing listens on):
    a dependency away for a moment, answered 503 with Retry-After, never a 500 (the fault
    campaign saw a close answered 500 when Redis reset its connection)."""

    async def reads_redis(_: web.Request) -> web.Response:
        client = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
        try:
            await client.get("custody:placement:x")
        finally:
            await client.aclose()
        return web.json_response(True)

    async def scenario() -> None:
        app = web.Application(middlewares=[errors])
        app.router.add_post("/close", reads_redis)
        async with (
            TestServer(app) as server,
            ClientSession() as client,
            client.post(server.make_url("/close")) as resp,
        ):
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert (await resp.json())["error"]["type"] == "dependency_unavailable"

    asyncio.run(scenario())


def test_a_request_aiohttps_parser_refuses_gets_a_json_error(stack):
    """A header line without a colon never reaches the app: still the API's JSON shape."""
    with socket.create_connection(("127.0.0.1", stack.settings.port), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400"
    assert b"application/json" in head
    assert "message" in json.loads(body)["error"]


def test_openai_nulls_mean_defaults_and_n_must_be_an_integer(stack):
    """OpenAI's schema lets every optional field be null: null means the default. `n`
    is an integer: JSON `true` is not 1."""
    port = stack.settings.port
    nulls = {"max_tokens": None, "temperature": None, "top_p": None, "seed": None}
    reply = call(port, "/v1/completions", {"prompt": "hi", **nulls, "stop": None})
    ended = reply["choices"][0]["finish_reason"] == "stop"  # an eos may come sooner
    assert reply["usage"]["completion_tokens"] == 16 or ended  # the completions default
    chat = {"messages": [{"role": "user", "content": "hi"}], **nulls, "max_tokens": 3}
    assert call(port, "/v1/chat/completions", chat)["usage"]["completion_tokens"] <= 3
    status, _, body = post(port, "/v1/completions", {"prompt": "hi", "n": True})
    assert status == 400 and b"n" in body


def events(port: int, body: dict) -> list[dict]:
    """The JSON events of a streamed /generate, up to [DONE]."""
    status, kind, raw = post(port, "/generate", body | {"stream": True})
    assert (status, kind.split(";")[0]) == (200, "text/event-stream"), raw[:300]
    lines = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_any_nesting_depth_is_a_json_400_even_in_an_unknown_field(stack):
    port = stack.settings.port
    deep = b'{"input_ids": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "too deeply" in refusal(port, "/generate", deep)
    assert "too deeply" in refusal(port, "/v1/completions", b'{"a":' * 3000 + b"1" + b"}" * 3000)
    assert call(port, "/generate", generate([1, 2]))["output_ids"]


def test_session_ids_are_matched_whole_and_never_dot_or_dot_dot(stack):
    port = stack.settings.port
    for bad in ("abc\n", ".", "..", "a/b", ""):
        refusal(port, "/open_session", {"session_id": bad})
    sid = call(port, "/open_session", {"session_id": "..."})  # dots with others: an id
    assert sid == "..." and call(port, "/close_session", {"session_id": sid}) is True


def test_a_logprob_stream_is_cumulative_as_sglang_s_and_capped(stack):
    """Each chunk carries every logprob so far, equal to the unstreamed reply's at the
    end; a streamed request over the cap is a 400 naming it, before anything streams."""
    port = stack.settings.port
    body = generate([5, 6, 7], max_new_tokens=6, ignore_eos=True) | {
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    chunks = events(port, body)
    whole = call(port, "/generate", body)
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    last, full = chunks[-1]["meta_info"], whole["meta_info"]
    assert last["output_token_logprobs"] == full["output_token_logprobs"]
    assert last["output_top_logprobs"] == full["output_top_logprobs"]
    over = body | {"sampling_params": {"max_new_tokens": 400}, "top_logprobs_num": 10}
    message = refusal(port, "/generate", over | {"stream": True})
    assert "4096" in message and "4400" in message
    assert call(port, "/generate", generate([1, 2]))["output_ids"]


def test_health_is_readiness_liveness_is_separate_and_health_generate_generates(stack):
    port = stack.settings.port
    assert call(port, "/health")["status"] == "ok"
    assert call(port, "/liveness") == {"status": "alive"}
    assert call(port, "/health_generate")["status"] == "ok"


def epoch_turn(port: int, sid: str, routed: str) -> tuple[int, bytes]:
    """A session turn carrying the placement epoch a front routed it by."""
    body = json.dumps(generate([5, 6], temperature=0) | {"session_params": {"id": sid}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json", ROUTED_EPOCH_HEADER: routed}
        conn.request("POST", "/generate", body.encode(), headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_turn_routed_at_another_placement_epoch_is_refused_and_retryable(stack):
    """A front sends the epoch it routed by (protocol/copies.py, `routed_to`): a turn
    delayed past a move must not run on a copy at another epoch."""
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "routed-epoch"})
    try:
        status, raw = epoch_turn(port, sid, "2")  # this copy is at the first epoch
        assert status == 503 and "placement epoch 2" in json.loads(raw)["error"]["message"]
        status, raw = epoch_turn(port, sid, "two")
        assert status == 400 and ROUTED_EPOCH_HEADER in json.loads(raw)["error"]["message"]
        status, raw = epoch_turn(port, sid, "1")
        assert status == 200 and len(json.loads(raw)["output_ids"]) == 2
    finally:
        assert call(port, "/close_session", {"session_id": sid}) is True


def test_a_batch_whose_later_item_cannot_queue_is_refused_whole(stack):
    """The second prompt's logprob start lies past its end, which only queueing finds:
    the first, queued a moment before, is taken back, and nothing is left running."""
    port = stack.settings.port
    body = {
        "input_ids": [[1, 2, 3, 4, 5], [1, 2]],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": [0, 10],
    }
    assert "logprob_start_len" in refusal(port, "/generate", body)
    assert call(port, "/server_info")["internal_states"][0]["requests"] == 0
    assert ledger_when_idle(stack)["counts"]["req"]["request"] == 0
