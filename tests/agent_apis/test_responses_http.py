"""The OpenAI Responses API, driven by the official `openai` client on the agent stack
(tests/agent_apis/conftest.py `agent_stack`: a random NemotronH with a BPE vocabulary, a template
that reasons and renders tools as NemotronH's does, `--tool-call-parser qwen3_coder
--reasoning-parser nemotron_v3`). Every reply and stream event is validated against the
Open Responses specification's OpenAPI document (tests/data/openresponses/), and its
compliance cases are re-expressed here: basic, streaming, system prompt, multi-turn,
tool calling plain and streamed (with a forced `tool_choice`, so a random model calls
the tool), and an image input refused by name.

The model is random: replies that must stop by themselves are held by a grammar
(`text.format`), and greedy answers are compared, never read. What these tests can
catch: a reply or event the specification refuses, a conversation that does not resume
its session's state (`cached_tokens` below the previous turn's context), a fork that
resumes nothing, an id that outlives its `DELETE` or dies with a child's, another
tenant's id answered. What they cannot: faults (tests/test_responses_faults.py)."""

from __future__ import annotations

import http.client
import json

import jsonschema
import openai
import pytest

from custody.up import Stack
from tests.openresponses_spec import event_errors, response_errors

YES_NO = {
    "type": "json_schema",
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"w": {"enum": ["ja", "nein"]}},
        "required": ["w"],
        "additionalProperties": False,
    },
    "strict": True,
}
# thinking off, greedy, held by the grammar: each reply stops by itself, as its
# canonical tokens, so its session keeps it as generated
TURN = {
    "model": "m",
    "instructions": "Antworte kurz.",
    "max_output_tokens": 40,
    "temperature": 0.0,
    "reasoning": {"effort": "none"},
    "text": {"format": YES_NO},
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}


@pytest.fixture(scope="module")
def client(agent_stack: Stack) -> openai.OpenAI:
    base = f"http://127.0.0.1:{agent_stack.settings.port}/v1"
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0)


def valid(response: openai.types.responses.Response) -> dict:
    """The response as it came, checked against the specification."""
    body = response.model_dump(mode="json", exclude_unset=True, by_alias=True)
    assert response_errors(body) == [], response_errors(body)
    return body


def context(r: openai.types.responses.Response) -> int:
    return r.usage.input_tokens + r.usage.output_tokens


def cached(r: openai.types.responses.Response) -> int:
    return r.usage.input_tokens_details.cached_tokens


def test_basic_system_prompt_and_multi_turn_input(client):
    """The compliance suite's basic, system-prompt and multi-turn cases: each completed,
    with output, as the specification shapes it."""
    r = client.responses.create(**TURN, input="Hallo")
    valid(r)
    assert r.status == "completed" and r.instructions == "Antworte kurz."
    assert json.loads(r.output_text)["w"] in ("ja", "nein")
    assert r.usage.total_tokens == context(r)
    system = [
        {"role": "system", "content": "Du bist ein Pirat."},
        {"role": "user", "content": "Sag hallo."},
    ]
    turns = [
        {"role": "user", "content": "Ich heiße Ada."},
        {"role": "assistant", "content": "Hallo Ada."},
        {"role": "user", "content": "Wie heiße ich?"},
    ]
    for items in (system, turns):
        r = client.responses.create(**TURN, input=items)
        assert valid(r)["status"] == "completed" and r.output_text


def test_a_five_turn_conversation_resumes_its_state_and_a_fork_its_branch(client):
    """Each turn resumes all but the last generated token of the turn before (that
    token was sampled, never computed); a fork from turn 2 resumes at least turn 2's
    prompt, the boundary the prefix cache kept when turn 2 began its reply."""
    chain = [client.responses.create(**TURN, input="Plane eine Reise")]
    for step in range(4):
        r = client.responses.create(
            **TURN, input=f"und dann {step}?", previous_response_id=chain[-1].id
        )
        valid(r)
        assert cached(r) >= context(chain[-1]) - 1, (step, cached(r), context(chain[-1]))
        chain.append(r)
    fork = client.responses.create(
        **TURN, input="lieber ans Meer", previous_response_id=chain[1].id
    )
    assert fork.previous_response_id == chain[1].id
    assert cached(fork) >= chain[1].usage.input_tokens >= cached(chain[1])
    # the fork's branch continues too, and so does the first branch after it
    deeper = client.responses.create(**TURN, input="und?", previous_response_id=fork.id)
    assert cached(deeper) >= context(fork) - 1
    again = client.responses.create(**TURN, input="weiter", previous_response_id=chain[-1].id)
    assert (
        again.output_text
        == client.responses.create(
            **TURN, input="weiter", previous_response_id=chain[-1].id, store=False
        ).output_text
    )


def test_thinking_on_resumes_up_to_the_reply_start(client):
    """With reasoning, the template empties an earlier reply's reasoning, so a turn keeps
    its state at its reply's start: the next resumes the previous prompt but the
    generation prompt's last token (the opened reasoning, rendered otherwise once a reply
    follows)."""
    turn = TURN | {"reasoning": {"effort": "low"}}
    first = client.responses.create(**turn, input="Plane eine Reise")
    assert first.output[0].type == "reasoning"
    with client.responses.stream(
        **turn, input="und dann?", previous_response_id=first.id
    ) as events:
        kinds = []
        for event in events:
            body = event.model_dump(mode="json", exclude_unset=True, by_alias=True)
            assert event_errors(body) == [], body
            kinds.append(body["type"])
        second = events.get_final_response()
    assert "response.reasoning.delta" in kinds and "response.output_text.delta" in kinds
    valid(second)
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert cached(second) >= first.usage.input_tokens - 1


def test_retrieve_input_items_and_delete(client):
    first = client.responses.create(**TURN, input="eins")
    second = client.responses.create(
        **TURN, input=[{"role": "user", "content": "zwei"}], previous_response_id=first.id
    )
    got = client.responses.retrieve(second.id)
    assert valid(got)["output"] == valid(second)["output"]
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["zwei"]
    # a deleted response with a child: named no more, its child's conversation goes on
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**TURN, input="drei", previous_response_id=first.id)
    third = client.responses.create(**TURN, input="drei", previous_response_id=second.id)
    assert cached(third) >= context(second) - 1
    for r in (second, third):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(third.id)


def test_streaming_events_follow_the_specification(client):
    first = client.responses.create(**TURN, input="Hallo")
    seen = []
    with client.responses.stream(**TURN, input="und?", previous_response_id=first.id) as stream:
        for event in stream:
            body = event.model_dump(mode="json", exclude_unset=True, by_alias=True)
            assert event_errors(body) == [], (body, event_errors(body))
            seen.append(body)
        final = stream.get_final_response()
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    kinds = [e["type"] for e in seen]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
    assert deltas == final.output_text
    stored = client.responses.retrieve(final.id)
    valid(stored)
    assert [i.id for i in stored.output] == [i.id for i in final.output]
    assert stored.output_text == final.output_text
    assert cached(final) >= context(first) - 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_calling_with_a_forced_choice(client, stream):
    turn = TURN | FORCED | {"text": {"format": {"type": "text"}}, "max_output_tokens": 200}
    if stream:
        with client.responses.stream(**turn, input="Wetter in Köln?") as events:
            for event in events:
                body = event.model_dump(mode="json", exclude_unset=True, by_alias=True)
                assert event_errors(body) == [], body
            r = events.get_final_response()
    else:
        r = client.responses.create(**turn, input="Wetter in Köln?")
    valid(r)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the tool's answer goes back as an item, continuing the stored response (with the
    # same tools, which the template renders first: `none` calls none this time)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sonnig"}
    tools = {"tools": [WEATHER], "tool_choice": "none"}
    after = client.responses.create(**TURN, **tools, input=[output], previous_response_id=r.id)
    valid(after)
    print("tool round", r.usage, cached(after))
    assert cached(after) >= r.usage.input_tokens


def test_what_is_not_served_is_refused_by_name(client):
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    message = [{"role": "user", "content": [{"type": "input_text", "text": "was?"}, image]}]
    cases = [
        ({"input": message}, "input_image"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ]
    for extra, named in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="m", **extra)
        assert named in str(refused.value), (named, refused.value)
    for unknown in ("resp_nosuch_00", "nonsense", "resp_" + "a" * 300 + "_1"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unknown)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(**TURN, input="x", previous_response_id=unknown)


def test_cancel_and_compact_are_refused_by_name(client, agent_stack):
    port = agent_stack.settings.port
    for path in ("/v1/responses/resp_x_1/cancel", "/v1/responses/compact"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", path, "{}", {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 400 and path.rsplit("/", 1)[1] in body["error"]["message"]
