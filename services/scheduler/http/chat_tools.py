"""What a chat request's `tools`, `tool_choice` and thinking switch make of its reply:
how it is parsed (text/assistant_reply.py, with the server's `--tool-call-parser` and
`--reasoning-parser`) and, for `tool_choice` `required` or a named function, the
grammar its calls must follow (text/tool_calls.py). vLLM's rules: `auto` needs a
parser; `none` renders the tools but parses no call; a named function must be a tool.
"""

from __future__ import annotations

import json
from typing import Any

from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.text.assistant_reply import ReplyParser
from services.scheduler.text.reasoning import ReasoningParser
from services.scheduler.text.tool_calls import ToolParser
from shared.config import Settings
from shared.messages.grammar import GrammarSpec


def chat_parsing(settings: Settings, body: Any) -> tuple[ReplyParser | None, GrammarSpec | None]:
    """The reply's parser (None: the reply is content alone) and the tool-call grammar
    (None: unconstrained by tools)."""
    tools, choice = body.tools or [], body.tool_choice
    check_tools(tools)
    if choice is not None and not tools:
        raise InvalidRequest("tool_choice needs tools")
    mode = _mode(choice, tools, bool(settings.tool_call_parser))
    if mode in ("auto", "required", "named") and tools and not settings.tool_call_parser:
        raise InvalidRequest(
            f"tool_choice {mode!r} needs the server's --tool-call-parser (none is set)"
        )
    kwargs = body.chat_template_kwargs or {}
    reasoning = None
    if settings.reasoning_parser:
        thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
        reasoning = ReasoningParser(settings.reasoning_parser, thinking)
    parser = ToolParser(settings.tool_call_parser, tools) if tools and mode != "none" else None
    grammar = None
    if parser is not None and mode in ("required", "named"):
        chosen = tools if mode == "required" else [_named(choice, tools)]
        parallel = mode == "required" and body.parallel_tool_calls is not False
        tag = parser.call_grammar(chosen, parallel)
        grammar = GrammarSpec(kind="structural_tag", source=json.dumps(tag))
    if reasoning is None and parser is None:
        return None, grammar
    return ReplyParser(reasoning, parser), grammar


def check_tools(tools: list[dict]) -> None:
    """Each tool a function with a name and (if any) an object schema; names unique."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name, params = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name or "<" in name or ">" in name:
            raise InvalidRequest(f"tools[{i}].function.name must be a name (no '<' or '>')")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names")


def _mode(choice: Any, tools: list[dict], parsing: bool) -> str:
    """`auto` by default when the server parses tool calls, else `none` (the tools
    still reach the template, as before any parser was set)."""
    if choice is None:
        return "auto" if tools and parsing else "none"
    if isinstance(choice, str):
        return choice
    return "named"


def _named(choice: Any, tools: list[dict]) -> dict:
    name = choice.function.name
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise InvalidRequest(f"tool_choice names {name!r}, which is not one of the tools")
