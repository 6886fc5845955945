"""What a chat request's `tools`, `tool_choice` and thinking switch make of its reply:
how it is parsed (text/assistant_reply.py, with the server's `--tool-call-parser` and
`--reasoning-parser`), for `tool_choice` `required` or a named function the grammar its
calls must follow (text/tool_calls.py), and the reasoning any constraint comes after
(`Thinking`). vLLM's rules: `auto` needs a parser; `none` renders the tools but parses
no call; a named function must be a tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.text.assistant_reply import ReplyParser
from services.scheduler.text.reasoning import CLOSE, ReasoningParser
from services.scheduler.text.tool_calls import ToolParser
from shared.config import Settings
from shared.messages.grammar import GrammarSpec, ReasoningPrefix
from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class Thinking:
    """A chat reply that reasons before it answers: the prompt opened its reasoning block
    (`deepseek_r1`, `nemotron_v3` with thinking on), so a constraint holds only after
    the block closes, and the block closes by the budget: the request's
    `thinking_budget`, else the server's `--thinking-budget` but at most half the
    reply's tokens, so a model that never closes it still answers (the executor forces
    the end, services/executor/reasoning_budget.py)."""

    close_ids: tuple[int, ...]  # the tokenizer's encoding of the block's end
    budget: int | None  # the request's; None: the server's default
    default: int

    def constrain(self, grammar: GrammarSpec | None, max_tokens: int) -> GrammarSpec | None:
        """`grammar` after the reasoning; a request that only bounds its reasoning gets
        any text after it. None: nothing to hold."""
        if grammar is None and self.budget is None:
            return None
        budget = self.budget if self.budget is not None else min(self.default, max_tokens // 2)
        prefix = ReasoningPrefix(close=CLOSE, close_ids=self.close_ids, budget=budget)
        return msgspec.structs.replace(grammar or ANY_TEXT, reasoning=prefix)


ANY_TEXT = GrammarSpec(
    kind="structural_tag",
    source=json.dumps({"type": "structural_tag", "format": {"type": "any_text"}}),
)


def chat_parsing(
    settings: Settings, body: Any, tokenizer: Tokenizer
) -> tuple[ReplyParser | None, GrammarSpec | None, Thinking | None]:
    """The reply's parser (None: the reply is content alone), the tool-call grammar
    (None: unconstrained by tools), and its reasoning before any constraint (None: a
    constraint holds from the reply's first token)."""
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
    reasoning = thinking = None
    if settings.reasoning_parser:
        switch = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
        reasoning = ReasoningParser(settings.reasoning_parser, switch)
        if reasoning.opened_by_prompt and not reasoning.off:
            close = tuple(tokenizer.encode(CLOSE, add_special_tokens=False))
            thinking = Thinking(close, body.thinking_budget, settings.thinking_budget)
    if body.thinking_budget is not None and (reasoning is None or not reasoning.opened_by_prompt):
        raise InvalidRequest(
            "thinking_budget needs a reasoning block the prompt opens (--reasoning-parser "
            f"deepseek_r1 or nemotron_v3; this server's: {settings.reasoning_parser or 'none'})"
        )
    parser = ToolParser(settings.tool_call_parser, tools) if tools and mode != "none" else None
    grammar = None
    if parser is not None and mode in ("required", "named"):
        chosen = tools if mode == "required" else [_named(choice, tools)]
        parallel = mode == "required" and body.parallel_tool_calls is not False
        tag = parser.call_grammar(chosen, parallel)
        grammar = GrammarSpec(kind="structural_tag", source=json.dumps(tag))
    if reasoning is None and parser is None:
        return None, grammar, thinking
    return ReplyParser(reasoning, parser), grammar, thinking


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
