"""Structured output, tool calls and reasoning over real HTTP, on one stack serving the
agent checkpoint (tests/checkpoints.py: a random NemotronH with a BPE vocabulary and a
template that renders tools, calls and thinking as NemotronH's does), with
`--tool-call-parser qwen3_coder --reasoning-parser nemotron_v3` and compact JSON.

The model is random, so what it writes is noise unless a grammar holds it: every
output here that must parse is constrained, and the checks are that it parses, validates
and ends by itself (`finish_reason` stop, never length). What these tests cannot see: a
grammar too loose for its schema (jsonschema validates every output, so a loose
grammar fails only when the model strays into what it allows), and parsers on
unconstrained text from a real model (the parser tests feed them text directly).
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
from pathlib import Path

import jsonschema
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from custody.up import Stack
from shared.placement import Placement
from shared.redis_server import PrivateRedis
from shared.session_ids import scoped_session_id
from shared.streams import placement_key
from tests.checkpoints import reference
from tests.services_harness import agent_settings, call, kill_executor_during, metrics, start_stack

THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# thinking on (the template's default): the reply reasons first, for at most this many
# tokens before the executor forces the end of its reasoning (the random model never
# ends it itself), then answers under the constraint
THINKING_ON = {"thinking_budget": 12}
THINKING = {"thinking-off": THINKING_OFF, "thinking-on": THINKING_ON}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def stack(agent_stack: Stack) -> Stack:
    return agent_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")


@pytest.fixture(scope="module")
def aclient(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")


def ask(client: openai.OpenAI, **extra: object):
    messages = [{"role": "user", "content": "Grüße aus Köln"}]
    args = {"model": "m", "messages": messages, "max_tokens": 200, "extra_body": THINKING_OFF}
    return client.chat.completions.create(**(args | extra))


# ---- structured output ----
def test_the_stack_serves_its_moe_checkpoint_as_transformers_generates(stack, agent_checkpoint):
    """The agent checkpoint is a MoE hybrid (tests/checkpoints.py), served through the
    services as `custody up --model` serves it: greedy tokens equal transformers'."""
    import torch

    _, ref = reference(agent_checkpoint)
    prompt = [5, 17, 40, 3, 99, 12, 64, 8]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    served = call(stack.settings.port, "/generate", body)["output_ids"]
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert served == out[0, len(prompt) :].tolist()


def reasoned(message: object, thinking: str) -> None:
    """Thinking on, the reply reasoned first, and its reasoning stayed out of the answer;
    off, it did not reason."""
    reasoning = getattr(message, "reasoning_content", None)
    assert (reasoning is not None) == (thinking == "thinking-on"), message


@pytest.mark.parametrize("thinking", THINKING)
def test_a_json_schema_response_parses_validates_and_stops(client, thinking):
    schema = WEATHER["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    for seed in range(3):
        reply = ask(
            client, response_format=fmt, temperature=1.0, seed=seed, extra_body=THINKING[thinking]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
        reasoned(choice.message, thinking)


def test_json_object_regex_choice_and_ebnf_hold(client, stack):
    # any object is unbounded: a random model may nest past max_tokens, so some seed
    # that stops is looked for, and what it wrote must be an object
    for seed in range(8):
        obj = ask(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed)
        if obj.choices[0].finish_reason == "stop":
            break
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = ask(client, extra_body=THINKING_OFF | {"guided_choice": ["ja", "nein", "ÇA"]})
    assert choice.choices[0].message.content in ("ja", "nein", "ÇA")
    port = stack.settings.port
    for field, source, pattern in [
        ("regex", r"[a-f]{2,4}-\d{3}", r"[a-f]{2,4}-\d{3}"),
        ("ebnf", 'root ::= "x" [0-9] [0-9]?', r"x[0-9][0-9]?"),
    ]:
        body = {
            "text": "hello",
            "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, field: source},
        }
        out = call(port, "/generate", body)
        assert re.fullmatch(pattern, out["text"]), (field, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "objec",
        ),
        ({"guided_regex": "a("}, "parenthesis"),
        ({"guided_grammar": 'root ::= "a" |'}, "ebnf"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one"),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_serves_on(stack, extra, named):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra
    with pytest.raises(urllib.error.HTTPError) as refused:
        call(stack.settings.port, "/v1/chat/completions", body)
    assert refused.value.code == 400
    assert named in refused.value.read().decode()
    ok = call(
        stack.settings.port,
        "/v1/chat/completions",
        body
        | {
            "guided_regex": None,
            "guided_choice": None,
            "guided_grammar": None,
            "guided_json": None,
            "response_format": None,
        },
    )
    assert ok["choices"][0]["finish_reason"] in ("length", "stop")


# Bounded JSON schemas: every string has maxLength, every array maxItems, numbers are
# bounded, objects closed, depth <= 3; so the longest output is bounded too.
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(st.sampled_from(["a", "b", 1, None]), min_size=1, max_size=3, unique=True),
    ),
)


def _object(children):
    return st.dictionaries(
        st.from_regex(r"[a-z]{1,5}", fullmatch=True), children, min_size=1, max_size=3
    ).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props)[: max(1, len(props) - 1)],
            "additionalProperties": False,
        }
    )


def _array(children):
    return st.builds(
        lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3)
    )


SCHEMAS = (
    st.recursive(LEAVES, lambda c: st.one_of(_object(c), _array(c)), max_leaves=6)
    .filter(lambda s: _depth(s) <= 3 and longest(s) < 3000)  # within the context
    .map(
        lambda s: (
            s
            if s.get("type") == "object"
            else {
                "type": "object",
                "properties": {"v": s},
                "required": ["v"],
                "additionalProperties": False,
            }
        )
    )
)


def _depth(schema: dict) -> int:
    inner = list(schema.get("properties", {}).values()) + (
        [schema["items"]] if "items" in schema else []
    )
    return 1 + max((_depth(s) for s in inner), default=0)


def longest(schema: dict) -> int:
    """The most bytes compact JSON matching `schema` can take (a token spells at least
    one byte, so also the most tokens): a string character escaped as \\uXXXX is 6."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (longest(schema["items"]) + 2)
    fields = schema["properties"].items()
    return 2 + sum(len(json.dumps(k).encode()) + 4 + longest(v) for k, v in fields)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.lists(SCHEMAS, min_size=8, max_size=8))
def test_generated_schemas_give_valid_json_that_stops(stack, schemas):
    """200 schemas (25 examples of 8, sent at once): each output validates and ended by
    itself (a length stop fails: each request's max_tokens is above the longest output
    its schema allows in compact form, `longest`)."""

    async def one(aclient: openai.AsyncOpenAI, schema: dict, seed: int):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        reply = await aclient.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=longest(schema) + 1,  # and the stop token
            temperature=1.0,
            seed=seed,
            response_format=fmt,
            extra_body=THINKING_OFF,
        )
        return reply.choices[0]

    async def run():
        url = f"http://127.0.0.1:{stack.settings.port}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none") as aclient:
            return await asyncio.gather(*(one(aclient, s, i) for i, s in enumerate(schemas)))

    for schema, choice in zip(schemas, asyncio.run(run()), strict=True):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


# ---- tool calls ----
@pytest.mark.parametrize("thinking", THINKING)
def test_required_tool_calls_parse_and_match_their_schemas(client, thinking):
    for seed in range(3):
        reply = ask(
            client,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            extra_body=THINKING[thinking],
        )
        choice = reply.choices[0]
        reasoned(choice.message, thinking)
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call_ in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": CLOCK}[call_.function.name]
            jsonschema.validate(
                json.loads(call_.function.arguments), tool["function"]["parameters"]
            )
            assert call_.type == "function" and call_.id.startswith("call_")


@pytest.mark.parametrize("thinking", THINKING)
def test_a_named_tool_choice_calls_that_tool_once(client, thinking):
    named = {"type": "function", "function": {"name": "get_time"}}
    extra = {"temperature": 1.0, "seed": 3, "extra_body": THINKING[thinking]}
    reply = ask(client, tools=[WEATHER, CLOCK], tool_choice=named, **extra)
    assert reply.choices[0].finish_reason == "tool_calls"
    reasoned(reply.choices[0].message, thinking)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET", "PST")


@pytest.mark.parametrize("thinking", THINKING)
def test_streamed_tool_calls_assemble_in_the_clients_accumulator(client, thinking):
    """`chat.completions.stream()` puts OpenAI's tool-call deltas together: its final
    message must equal the unstreamed reply's (same seed), reasoning included."""
    args = {
        "model": "m",
        "messages": [{"role": "user", "content": "wetter?"}],
        "max_tokens": 200,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": THINKING[thinking],
    }
    whole = client.chat.completions.create(**args).choices[0]
    reasoning = ""
    with client.chat.completions.stream(**args) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                reasoning += getattr(event.chunk.choices[0].delta, "reasoning_content", "") or ""
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert got == want and all(c.id.startswith("call_") for c in final.message.tool_calls)


def test_tool_results_go_back_through_the_template(client, stack):
    first = ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    calls = first.choices[0].message.tool_calls
    messages = [
        {"role": "user", "content": "Grüße aus Köln"},
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "sonnig"} for c in calls),
    ]
    tokens = call(stack.settings.port, "/tokenize", {"messages": messages, "tools": [WEATHER]})
    assert tokens["count"] > 0
    again = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        extra_body=THINKING_OFF,
    )
    assert again.choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_content_and_none_parses_nothing(client):
    reply = ask(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_reasoning_is_split_from_the_answer(client):
    """Thinking on: the prompt opens <think>, so the reply's text before </think> is
    reasoning, and a grammar holds the answer after it. The random model never closes
    the block itself: the default budget (half of max_tokens) ends it."""
    args = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 2,
        "extra_body": {"guided_grammar": "root ::= [0-9]{2}"},
    }
    reply = client.chat.completions.create(**args)
    message = reply.choices[0].message
    assert message.reasoning_content and reply.choices[0].finish_reason == "stop", message
    assert reply.usage.completion_tokens <= 20 + len("</think>") + 2
    assert re.fullmatch(r"[0-9]{2}", message.content), message
    with client.chat.completions.stream(**args) as stream:
        reasoning = content = ""
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                delta = event.chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


# ---- faults: a constrained request rebuilds its matcher from its output ----
LONG = {"regex": r"[a-z]{300}"}  # long enough for a kill to land mid-decode


def generate(port: int, text: str, extra: dict, session: str | None = None) -> dict:
    body: dict = {"text": text, "sampling_params": {"max_new_tokens": 320, **extra}}
    if session is not None:
        body["session_params"] = {"id": session}
    return call(port, "/generate", body)


def test_a_constrained_request_survives_an_executor_kill(stack):
    """Greedy: the run the kill interrupted re-prefills its prompt and output (the
    executor's new life replays the output into a new matcher) and ends as the run
    without the fault did."""
    port = stack.settings.port
    clean = generate(port, "Köln", LONG)
    body = {"text": "Köln", "sampling_params": {"max_new_tokens": 320, **LONG}}
    faulted = kill_executor_during(stack, port, "/generate", body)
    assert re.fullmatch(LONG["regex"], faulted["text"])
    assert faulted["text"] == clean["text"]
    assert faulted["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_constrained_turn_after_hibernation_matches_one_without(stack):
    port = stack.settings.port
    texts = []
    for hibernate in (False, True):
        sid = call(port, "/open_session", {})
        generate(port, "Grüße", {"max_new_tokens": 6}, session=sid)
        if hibernate:
            assert call(port, "/place_session", {"session_id": sid, "tier": "host"})
        texts.append(generate(port, " und", {"regex": r"[0-9]{5,40}"}, session=sid)["text"])
        call(port, "/close_session", {"session_id": sid})
    assert re.fullmatch(r"[0-9]{5,40}", texts[0]) and texts[0] == texts[1]


# ---- sessions by header ----
def header_turns(port: int) -> dict[str, float]:
    return {
        labels[0][1]: value
        for (name, labels), value in metrics(port).items()
        if name == "custody_header_session_turns_total"
    }


def chat_ids(port: int, messages: list[dict], headers: dict[str, str]) -> dict:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0.0} | THINKING_OFF
    return call(port, "/v1/chat/completions", body, headers=headers)


def test_a_session_header_binds_turns_and_each_equals_the_stateless_answer(stack):
    """Opened, resumed (its state reused: cached_tokens at least the turn before's
    prompt), and re-seeded by another conversation; every answer the stateless one."""
    port, header = stack.settings.port, {"X-Session-ID": "conv-a"}
    before = header_turns(port)
    messages = [{"role": "user", "content": "Grüße"}]
    prompts = []
    for step in range(3):
        bound = chat_ids(port, messages, header)
        plain = chat_ids(port, messages, {})
        assert bound["choices"][0]["message"] == plain["choices"][0]["message"], step
        if prompts:
            assert bound["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompts[-1]
        prompts.append(bound["usage"]["prompt_tokens"])
        reply = bound["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": f"und {step}"},
        ]
    other = [{"role": "user", "content": "ein anderes Gespräch"}]
    assert chat_ids(port, other, header)["choices"] == chat_ids(port, other, {})["choices"]
    after = header_turns(port)
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in gained.items() if v} == {"opened": 1, "resumed": 2, "reseeded": 1}


def test_behind_the_router_a_header_session_lives_on_one_replica(agent_checkpoint):
    """Two replicas: the router places the header's session in the directory on its
    first turn, and every later turn goes there (never a second copy). Its own Redis:
    its replica 0 must not fence the module's stack, which is replica 0 too."""
    with PrivateRedis(appendonly=False) as server:
        check_header_session_behind_router(server.url, agent_checkpoint)


def check_header_session_behind_router(redis_url: str, agent_checkpoint: Path) -> None:
    routed = start_stack(agent_settings(redis_url, agent_checkpoint, replicas=2))
    try:
        port = routed.settings.port
        messages = [{"role": "user", "content": "hallo"}]
        for step in range(4):
            reply = chat_ids(port, messages, {"X-Session-ID": "conv-r"})
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"weiter {step}"},
            ]
        ports = [routed.layout[f"scheduler-{i}"][1].port for i in range(2)]
        opened = [header_turns(p).get("opened", 0) for p in ports]
        resumed = [header_turns(p).get("resumed", 0) for p in ports]
        assert sorted(opened) == [0, 1] and sorted(resumed) == [0, 3]
        assert opened.index(1) == resumed.index(3)
        # the directory names that replica: a router without it would route later turns
        # by prefix alone, and a second copy could open wherever that pointed
        client = redis.Redis.from_url(redis_url)
        placed = Placement.decode(client.get(placement_key(scoped_session_id(None, "conv-r"))))
        assert placed is not None and placed.replica == str(opened.index(1))
    finally:
        routed.stop()


def test_a_session_keeps_exact_with_reasoning_the_template_truncates_later(stack):
    """NemotronH's template empties a reply's <think> block once a user message follows
    it (truncate_history_thinking), so each turn after a reasoning reply renders that
    reply differently. The session turn still equals the stateless request (no 409), and
    resumes from the state the turn before kept at its reply's start: its cached tokens
    reach at least where the two turns' prompts part (what any reply's rendering shares
    with the prompt; the generation prompt's opened <think> block is not in it). The
    reasoning is the budget's (half of max_tokens), longer than the message after it
    once emptied: the session's record must still order its messages' ends."""
    port = stack.settings.port
    ebnf = "root ::= [0-9]{2}"
    sid = call(port, "/open_session", {})
    messages = [{"role": "user", "content": "Grüße"}]
    prompts = []
    for turn in range(3):
        body = {"messages": messages, "max_tokens": 30, "temperature": 1.0, "seed": turn}
        body["guided_grammar"] = ebnf
        got = call(port, "/v1/chat/completions", body | {"session_id": sid})
        plain = call(port, "/v1/chat/completions", body)
        assert got["choices"][0]["message"] == plain["choices"][0]["message"], turn
        tokens = call(port, "/tokenize", {"messages": messages})["tokens"]
        if prompts:
            parted = next(
                i for i, (a, b) in enumerate(zip(prompts[-1], tokens, strict=False)) if a != b
            )
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= parted, turn
        prompts.append(tokens)
        reply = got["choices"][0]["message"]
        assert reply["reasoning_content"] and reply["content"]
        messages += [
            {
                "role": "assistant",
                "content": reply["content"],
                "reasoning_content": reply["reasoning_content"],
            },
            {"role": "user", "content": f"und weiter {turn}"},
        ]


def test_a_thinking_budget_bounds_the_reasoning_of_an_unconstrained_reply(client):
    """Without a budget the random model reasons to max_tokens (it never closes the
    block); with one, the block ends there and the rest of the reply is answer."""
    args = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    args |= {"temperature": 1.0, "seed": 5}
    free = client.chat.completions.create(**args).choices[0]
    assert free.finish_reason == "length" and not free.message.content
    bounded = client.chat.completions.create(**args, extra_body={"thinking_budget": 5})
    message = bounded.choices[0].message
    assert message.reasoning_content and message.content, message
    assert len(
        client.chat.completions.create(**args | {"max_tokens": 5})
        .choices[0]
        .message.reasoning_content
    ) >= len(message.reasoning_content)
