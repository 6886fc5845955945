"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by
Anthropic's official client, on the agent stack (tests/agent_apis/test_chat_tools_http.py: a random
NemotronH with a BPE vocabulary, `--tool-call-parser qwen3_coder --reasoning-parser
nemotron_v3`, sessions by `X-Session-ID`, the model called "m").

The model is random: only a forced tool choice makes it call a tool (its grammar makes
the input valid), and replies are compared with replies, never with expected text.
What these tests cannot see: a real model's unconstrained tool calls, and the blocks a
client other than Anthropic's sends back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator

import anthropic
import jsonschema
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer, make_mocked_request

from custody.up import Stack
from services.scheduler.http.errors import errors
from services.scheduler.http.events import send_typed_events
from services.scheduler.http.messages_input import MessagesRequest, chat_body
from services.scheduler.http.schemas import decode_body
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import SessionError
from shared.tenancy import ApiKeys, Refused, authorization
from tests.agent_apis.test_chat_tools_http import WEATHER as CHAT_WEATHER
from tests.agent_apis.test_chat_tools_http import header_turns

OFF = {"type": "disabled"}
HELLO = [{"role": "user", "content": "Grüße aus Köln"}]
# the chat tests' tool, as Anthropic's clients declare it
WEATHER = {
    "name": CHAT_WEATHER["function"]["name"],
    "description": CHAT_WEATHER["function"]["description"],
    "input_schema": CHAT_WEATHER["function"]["parameters"],
}
# greedy: Anthropic's client no longer sends temperature itself; custody still reads it
GREEDY = {"extra_body": {"temperature": 0.0}}
# the tokens of the round before's prompt a resumed round may compute again: none. A
# reply the session cannot keep as sampled (a call sampled under a grammar is seldom its
# text's canonical encoding) leaves its state at the reply's start (records/request.py
# `ChatTurn.reply_start`), which with thinking off is where that prompt ends: measured,
# each round's cached tokens are exactly the round before's prompt (362, then 556 or so),
# and the reply and the tool result are computed again. A re-seeded session resumes
# from the prefix cache instead, 2 tokens short (360): the slack would hide it.
SLACK = 0


@pytest.fixture(scope="module")
def client(agent_stack: Stack) -> anthropic.Anthropic:
    url = f"http://127.0.0.1:{agent_stack.settings.port}"
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def plain(client: anthropic.Anthropic) -> anthropic.types.Message:
    return client.messages.create(model="m", max_tokens=8, messages=HELLO, thinking=OFF, **GREEDY)


def texts(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def blocks(message: anthropic.types.Message) -> list[dict]:
    """The content as sent (a streamed message's text blocks are the client's parsed
    kind, with a `parsed_output` of their own)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in message.content]


def test_a_message_is_anthropics_with_its_usage_and_stop(client, plain):
    assert plain.id.startswith("msg_") and plain.type == "message" and plain.model == "m"
    assert [b.type for b in plain.content] == ["text"]  # thinking off: no thinking block
    u = plain.usage
    assert u.input_tokens + u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
    assert plain.stop_reason in ("max_tokens", "end_turn")
    assert (plain.stop_reason == "max_tokens") == (u.output_tokens == 8)
    # a stop sequence from its own greedy text ends the same reply there, and is named
    text = texts(plain)
    stop = text[len(text) // 2 :][:2]
    cut = client.messages.create(
        model="m",
        max_tokens=8,
        messages=HELLO,
        thinking=OFF,
        stop_sequences=[stop],
        **GREEDY,
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert texts(cut) == text[: text.index(stop)]


def test_a_streamed_message_is_its_deltas_and_the_whole_reply(client, plain):
    args = {"model": "m", "max_tokens": 8, "messages": HELLO, "thinking": OFF}
    with client.messages.stream(**args, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e.type for e in events if e.type.startswith(("message", "content_block"))]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == texts(final) == texts(plain)
    assert blocks(final) == blocks(plain) and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_a_tool_loop_resumes_its_session_by_the_header(client, agent_stack):
    """Three rounds of a forced call and its result, each sent as the client got it:
    every call's input validates, and each round resumes the session's state (its
    cached tokens reach the round before's whole prompt, less the slack)."""
    port, header = agent_stack.settings.port, {"X-Session-ID": f"msg-{secrets.token_hex(4)}"}
    before = header_turns(port)
    messages: list[dict] = [{"role": "user", "content": "Wie ist das Wetter in Köln?"}]
    prompts = []
    for _ in range(3):
        reply = client.messages.create(
            model="m",
            max_tokens=256,
            messages=messages,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            thinking=OFF,
            extra_headers=header,
        )
        assert reply.stop_reason == "tool_use", reply
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
        u = reply.usage
        print(
            "round: input",
            u.input_tokens,
            "cached",
            u.cache_read_input_tokens,
            "output",
            u.output_tokens,
        )
        if prompts:
            assert u.cache_read_input_tokens >= prompts[-1] - SLACK, (prompts, u)
        prompts.append(u.input_tokens + u.cache_read_input_tokens)
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "sonnig, 21 °C"}
        messages += [
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": [result]},
        ]
    after = header_turns(port)
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in gained.items() if v} == {"opened": 1, "resumed": 2}


def test_thinking_enabled_reasons_first_whole_and_streamed(client):
    args = {"model": "m", "max_tokens": 16, "messages": HELLO, **GREEDY}
    args["thinking"] = {"type": "enabled", "budget_tokens": 6}
    whole = client.messages.create(**args)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with client.messages.stream(**args) as stream:
        thought = "".join(
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        )
        final = stream.get_final_message()
    assert thought == whole.content[0].thinking and blocks(final) == blocks(whole)


def test_count_tokens_is_the_prompt_a_message_renders(client):
    """A conversation of every block kind, with a system prompt and tools."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}
    call["input"] = {"city": "Köln", "days": 2}
    messages = [
        HELLO[0],
        {"role": "assistant", "content": [{"type": "text", "text": "Moment."}, call]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sonnig"},
                {"type": "text", "text": "Und morgen?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    args = {"model": "m", "messages": messages, "system": "Sei kurz.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(**args, thinking=OFF).input_tokens
    reply = client.messages.create(**args, thinking=OFF, max_tokens=1)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    # the tools are part of the prompt
    assert counted > client.messages.count_tokens(model="m", messages=HELLO).input_tokens + 20


def test_refusals_are_anthropics_errors(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude", max_tokens=4, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_an_x_api_key_is_a_bearer_key():
    keys = ApiKeys("k1,k2", "")
    alone = make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "k1"})
    bearer = make_mocked_request("POST", "/v1/messages", headers={"Authorization": "Bearer k1"})
    assert keys.identify(alone) == keys.identify(bearer)
    with pytest.raises(Refused):
        keys.identify(make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "k3"}))
    # Authorization, when sent, is the key; a front's lowercase headers read the same
    both = {"Authorization": "Bearer k2", "x-api-key": "k1"}
    assert keys.identify(make_mocked_request("POST", "/v1/messages", headers=both)) != (
        keys.identify(alone)
    )
    assert authorization({"x-api-key": "k1"}) == "Bearer k1"


def test_blocks_translate_to_the_chat_messages_a_reply_is_stored_as():
    """An assistant reply sent back is the chat message the chat route gives (content
    null beside calls, reasoning its own field); tool results come before the text."""
    call = {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}
    result = {
        "type": "tool_result",
        "tool_use_id": "c1",
        "content": [{"type": "text", "text": "r"}],
    }
    body = {
        "max_tokens": 9,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 4},
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}, call]},
            {"role": "user", "content": [{"type": "text", "text": "b"}, result]},
        ],
    }
    raw = json.dumps(body).encode()
    chat = chat_body(decode_body(raw, MessagesRequest), budgets=True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "t"},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "user", "content": "b"},
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["thinking_budget"] == 4
    assert "thinking_budget" not in chat_body(decode_body(raw, MessagesRequest), budgets=False)
    prefill = (
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    )
    with pytest.raises(InvalidRequest, match="prefill"):
        decode_body(prefill, MessagesRequest)


def test_failures_are_anthropics_errors_with_custodys_statuses(caplog):
    """errors.py's middleware alone, in an aiohttp app, on routes under /v1/messages: an
    unexpected fault (before and after the stream's headers), a refusal with its own
    headers and a session's conflict; and the same fault elsewhere in OpenAI's shape."""

    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("broken on purpose")

    async def broken_mid_stream(request: web.Request) -> web.StreamResponse:
        async def events() -> AsyncIterator[tuple[str, dict]]:
            yield "message_start", {"type": "message_start"}
            raise RuntimeError("broken after the headers")

        return await send_typed_events(request, events())

    async def limited(_: web.Request) -> web.Response:
        raise Refused(429, "too many", "session_limit", {"Retry-After": "3"})

    async def busy(_: web.Request) -> web.Response:
        raise SessionError("a turn runs", "busy")

    async def scenario() -> None:
        app = web.Application(middlewares=[errors])
        for name, handler in [("broken", broken), ("limited", limited), ("busy", busy)]:
            app.router.add_post(f"/v1/messages/{name}", handler)
        app.router.add_post("/v1/messages/stream", broken_mid_stream)
        app.router.add_post("/v1/chat/broken", broken)
        async with TestServer(app) as server, ClientSession() as client:
            async with client.post(server.make_url("/v1/messages/broken")) as resp:
                assert resp.status == 500
                body = await resp.json()
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
            assert any(body["error"]["request_id"] in r.getMessage() for r in caplog.records)
            async with client.post(server.make_url("/v1/messages/stream")) as resp:
                assert resp.status == 200
                blocks = [b.split("\n") for b in (await resp.text()).strip().split("\n\n")]
            assert [b[0] for b in blocks] == ["event: message_start", "event: error"]
            error = json.loads(blocks[-1][1].removeprefix("data: "))
            assert error["type"] == "error" and error["error"]["type"] == "api_error"
            async with client.post(server.make_url("/v1/messages/limited")) as resp:
                assert (resp.status, resp.headers["Retry-After"]) == (429, "3")
                assert (await resp.json())["error"]["type"] == "rate_limit_error"
            async with client.post(server.make_url("/v1/messages/busy")) as resp:
                assert resp.status == 409
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
            async with client.post(server.make_url("/v1/chat/broken")) as resp:
                assert resp.status == 500
                assert (await resp.json())["error"]["type"] == "internal_error"

    with caplog.at_level(logging.ERROR, logger="custody.scheduler.http"):
        asyncio.run(scenario())


YES_NO = {
    "type": "json_schema",
    "schema": {
        "type": "object",
        "properties": {"w": {"enum": ["ja", "nein"]}},
        "required": ["w"],
        "additionalProperties": False,
    },
}


def whole(m: anthropic.types.Message) -> int:
    u = m.usage
    return u.input_tokens + u.cache_read_input_tokens + u.output_tokens


def test_a_five_turn_header_conversation_resumes_its_state_and_an_edit_its_branch(client):
    """Held by the grammar (`output_format`), each reply stops by itself as its
    canonical tokens, so each turn resumes all but the last token of the turn before
    (sampled, never computed); an edit of turn 3's message branches from turn 2 and
    resumes at least what turn 2 resumed (the boundary the prefix cache kept)."""
    header = {"X-Session-ID": f"five-{secrets.token_hex(4)}"}
    extra = {"temperature": 0.0, "output_format": YES_NO}
    messages: list[dict] = [{"role": "user", "content": "Plane eine Reise"}]
    turns = []

    def ask(conversation: list[dict]) -> anthropic.types.Message:
        return client.messages.create(
            model="m",
            max_tokens=40,
            messages=conversation,
            thinking=OFF,
            extra_body=extra,
            extra_headers=header,
        )

    for step in range(5):
        reply = ask(messages)
        assert reply.stop_reason == "end_turn" and json.loads(texts(reply))["w"] in ("ja", "nein")
        if turns:
            assert reply.usage.cache_read_input_tokens >= whole(turns[-1]) - 1, step
        turns.append(reply)
        messages += [
            {"role": "assistant", "content": texts(reply)},
            {"role": "user", "content": f"und dann {step}?"},
        ]
    edited = [*messages[:4], {"role": "user", "content": "lieber ans Meer"}]
    branch = ask(edited)
    assert branch.usage.cache_read_input_tokens >= turns[1].usage.cache_read_input_tokens > 0
