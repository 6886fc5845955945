"""The tool-call formats and the reasoning split, without a server: each parser against
text written in its format; each format's forced-call grammar against the parser (the
built-in model in process, constrained by the grammar, must write calls the parser
reads back, arguments valid against the tool's schema); and a stream's deltas against
the whole reply, over every way of cutting the text into chunks (hypothesis)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from custody.inprocess import InProcess
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.text.assistant_reply import ReplyParser, ReplyStream
from services.scheduler.text.reasoning import ReasoningParser
from services.scheduler.text.tool_calls import ToolCall, ToolParser
from shared.config import Settings
from shared.messages.grammar import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
CALLS = {
    "hermes": '<tool_call>\n{"name": "weather", "arguments": {"city": "Köln", "days": 2}}\n'
    "</tool_call>",
    "nemotron_json": '<TOOLCALL>[{"name": "weather", "arguments": {"city": "Köln", '
    '"days": 2}}]</TOOLCALL>',
    "qwen3_coder": "<tool_call>\n<function=weather>\n<parameter=city>\nKöln\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
}
WANT = ToolCall("weather", json.dumps({"city": "Köln", "days": 2}, ensure_ascii=False))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_parser_reads_its_format_and_keeps_the_text_around(name):
    parser = ToolParser(name, TOOLS)
    pieces, settled = parser.split("Gern. " + CALLS[name] + " Fertig", final=True)
    assert pieces == ["Gern. ", WANT, " Fertig"] and settled > 0


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_block_that_does_not_parse_stays_text(name):
    parser = ToolParser(name, TOOLS)
    start, end = parser.format.start, parser.format.end
    broken = f"{start}kein json{end}"
    assert parser.split(broken, final=True)[0] == [broken]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_stream_holds_back_an_open_call_and_a_partial_marker(name):
    parser = ToolParser(name, TOOLS)
    text = "ok " + CALLS[name]
    for cut in range(len(text)):
        pieces, settled = parser.split(text[:cut], final=False)
        shown = "".join(p for p in pieces if isinstance(p, str))
        assert shown == text[: min(cut, 3)][: len(shown)] and settled <= max(cut, 0)
        assert not any(isinstance(p, ToolCall) for p in pieces)
    assert parser.split(text, final=False)[0] == ["ok ", WANT]


@pytest.fixture(scope="module")
def runtime() -> InProcess:
    return InProcess(Settings.ephemeral(compile=False))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_forced_call_grammar_makes_calls_the_parser_reads(runtime, name):
    parser = ToolParser(name, TOOLS)
    tag = parser.call_grammar(TOOLS, parallel=False)
    spec = GrammarSpec(kind="structural_tag", source=json.dumps(tag))
    requests = [
        Request(
            f"{name}{seed}",
            np.array([72, 105]),
            SamplingParams(max_new_tokens=300, temperature=1.0, seed=seed, grammar=spec),
        )
        for seed in range(4)
    ]
    for r in requests:
        runtime.engine.submit(r)
    runtime.run_until_idle()
    for r in requests:
        text = bytes(t for t in r.output if t < 256).decode("utf-8", errors="replace")
        pieces, _ = parser.split(text, final=True)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        assert r.finish_reason.type == "stop", text
        assert calls and not any(p.strip() for p in pieces if isinstance(p, str)), text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA)


REPLIES = st.lists(
    st.sampled_from(
        ["<think>", "</think>", "denk ", "ja", "\n", CALLS["qwen3_coder"], "<tool", "_call>", "ü"]
    ),
    max_size=8,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(
    REPLIES,
    st.lists(st.integers(0, 400), max_size=6),
    st.sampled_from(["nemotron_v3", "qwen3", "deepseek_r1"]),
)
def test_a_streams_deltas_add_up_to_the_whole_reply(text, cuts, reasoning):
    parser = ReplyParser(
        ReasoningParser(reasoning, thinking=True), ToolParser("qwen3_coder", TOOLS)
    )
    stream = ReplyStream(parser, "rid")
    deltas = []
    for cut in sorted({min(c, len(text)) for c in cuts}):
        deltas += stream.deltas(text[:cut], final=False)
    deltas += stream.deltas(text, final=True)
    message, _ = parser.message("rid", text)
    reasoning_text = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert reasoning_text == (message["reasoning_content"] or "")
    assert content.strip() == (message["content"] or "").strip()
    assert [c["id"] for c in calls] == [c["id"] for c in message.get("tool_calls", [])]
