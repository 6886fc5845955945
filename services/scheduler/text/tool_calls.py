"""Tool calls in a model's own words: the formats custody parses (`--tool-call-parser`,
with vLLM's and SGLang's names) and the grammar that makes a model write them.

- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>…
  </function>\\n</tool_call>`, what the NemotronH MoE releases write (values are text;
  a parameter the tool's schema does not type as a string is read as JSON when it is).
- `nemotron_json`: `<TOOLCALL>[{"name": …, "arguments": {…}}, …]</TOOLCALL>`, the dense
  Nemotron-Nano-v2 format.
- `hermes`: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>` per call.

A reply is cut into text and calls (`split`); a call that does not parse stays text, as
the model wrote it. With `tool_choice` `required` or a named function, the output is
constrained (`call_grammar`) to calls of that format and nothing else, each call's
arguments matching its tool's `parameters` schema, so even a weak model's calls parse.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ParserName = Literal["qwen3_coder", "nemotron_json", "hermes"]


# whitespace in a row inside a constrained call: the XML form puts newlines around each
# value, and a weak model would otherwise pad a call past any token limit
MAX_WHITESPACE = 2


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI carries it

    def openai(self, call_id: str, index: int | None = None) -> dict:
        """The call as an OpenAI message's `tool_calls` item (a stream's with `index`)."""
        item: dict[str, Any] = {} if index is None else {"index": index}
        item |= {"id": call_id, "type": "function"}
        return item | {"function": {"name": self.name, "arguments": self.arguments}}


def call_id(rid: str, index: int) -> str:
    """The id of a reply's call `index`: the same wherever the reply is rendered (its
    answer, its stream, the session's record of it), so a client sending it back
    matches."""
    return "call_" + hashlib.sha256(f"{rid}:{index}".encode()).hexdigest()[:24]


Piece = str | ToolCall  # a reply is text and calls, in order


@dataclass(frozen=True)
class Format:
    """Where a parser's calls begin and end in the text."""

    start: str
    end: str


FORMATS: dict[str, Format] = {
    "qwen3_coder": Format("<tool_call>", "</tool_call>"),
    "nemotron_json": Format("<TOOLCALL>", "</TOOLCALL>"),
    "hermes": Format("<tool_call>", "</tool_call>"),
}


class ToolParser:
    def __init__(self, name: ParserName, tools: list[dict]) -> None:
        self.name, self.format = name, FORMATS[name]
        self.schemas = {
            t["function"]["name"]: t["function"].get("parameters") or {}
            for t in tools
            if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        }

    def split(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """`text` cut into text and the calls it holds; and how much of it is settled:
        with `final` False (a stream) a call not yet closed, or a tail that may begin
        one, is left for later (the count stops before it)."""
        pieces: list[Piece] = []
        at, start, end = 0, self.format.start, self.format.end
        while True:
            begin = text.find(start, at)
            if begin < 0:
                tail = text[at:]
                keep = len(tail) if final else len(tail) - partial_marker(tail, start)
                if keep:
                    pieces.append(tail[:keep])
                return _merged(pieces), at + keep
            close = text.find(end, begin + len(start))
            if close < 0:
                if final:
                    pieces.append(text[at:])
                    return _merged(pieces), len(text)
                if begin > at:
                    pieces.append(text[at:begin])
                return _merged(pieces), begin
            if begin > at:
                pieces.append(text[at:begin])
            block = text[begin : close + len(end)]
            calls = self._calls(text[begin + len(start) : close])
            pieces += calls if calls is not None else [block]
            at = close + len(end)

    def _calls(self, inner: str) -> list[ToolCall] | None:
        """The calls of one block between the markers; None if it does not parse."""
        try:
            if self.name == "qwen3_coder":
                return self._xml_calls(inner)
            data = json.loads(inner, strict=False)  # arguments are written out strictly
            items = data if self.name == "nemotron_json" else [data]
            if not isinstance(items, list) or not items:
                return None
            return [_json_call(item) for item in items]
        except (ValueError, TypeError, KeyError):
            return None

    def _xml_calls(self, inner: str) -> list[ToolCall] | None:
        functions = _FUNCTION.findall(inner)
        if not functions:
            return None
        calls = []
        for name, body in functions:
            schema = self.schemas.get(name, {}).get("properties") or {}
            args = {key: _xml_value(value, schema.get(key)) for key, value in _PARAM.findall(body)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls

    def call_grammar(self, tools: list[dict], parallel: bool) -> dict:
        """An xgrammar structural tag matching one or more calls (one if not `parallel`)
        of `tools` in this parser's format, and nothing else."""
        names = [t["function"]["name"] for t in tools]
        tags = [self._tag(name, self.schemas[name]) for name in names]
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": ", " if self.name == "nemotron_json" else "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        if self.name == "nemotron_json":
            calls = {
                "type": "sequence",
                "elements": [_const("<TOOLCALL>["), calls, _const("]</TOOLCALL>")],
            }
        return {"type": "structural_tag", "format": calls}

    def _tag(self, name: str, schema: dict) -> dict:
        if self.name == "qwen3_coder":
            begin, style = f"<tool_call>\n<function={name}>\n", "qwen_xml"
            end = "\n</function>\n</tool_call>"
        elif self.name == "hermes":
            begin = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
            end, style = "}\n</tool_call>", "json"
        else:
            begin, end, style = '{"name": ' + json.dumps(name) + ', "arguments": ', "}", "json"
        schema = schema or {"type": "object"}
        content = {
            "type": "json_schema",
            "json_schema": schema,
            "style": style,
            "max_whitespace_cnt": MAX_WHITESPACE,
        }
        return {"type": "tag", "begin": begin, "content": content, "end": end}


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _json_call(item: Any) -> ToolCall:
    name, args = item["name"], item.get("arguments", item.get("parameters", {}))
    if not isinstance(name, str):
        raise TypeError("a call's name is not a string")
    if isinstance(args, str):
        args = json.loads(args, strict=False)
    if not isinstance(args, dict):
        raise TypeError("a call's arguments are not an object")
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _xml_value(raw: str, schema: Any) -> Any:
    """A parameter's text, whitespace around it dropped (the XML form lets a model put
    any there), as its value: a string where the schema says string (or says nothing
    and the text is not JSON), else the JSON it spells."""
    value = raw.strip()
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def partial_marker(tail: str, marker: str) -> int:
    """How many characters at the end of `tail` may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-n:]):
            return n
    return 0


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent texts joined."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out
