"""A Responses API request (`POST /v1/responses`, docs/api.md "Responses") read as the
chat request it amounts to: its `instructions` a system message, its input items chat
messages after the conversation its `previous_response_id` ends, its `tools`,
`tool_choice`, `text.format` and `reasoning.effort` their chat counterparts. The chat
route's machinery (templates, tool-call and reasoning parsers, constraints, sessions)
then runs it unchanged.

What custody does not serve is refused by name (400), never ignored: `background`,
`truncation: "auto"`, image, file and audio inputs, item references, tools other than
functions, and `include` values other than the reasoning text it returns anyway.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.scheduler.http.schema_types import CacheControl, RetentionPriority
from services.scheduler.records.sampling import InvalidRequest

# `include` values whose content every reply carries already
INCLUDED = frozenset({"reasoning.encrypted_content", "message.output_text.logprobs"})
REASONING_OFF = frozenset({"none", "minimal"})  # efforts that turn the thinking switch off
EFFORTS = REASONING_OFF | {"low", "medium", "high", "xhigh"}


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    """The body of `POST /v1/responses`; unknown fields are ignored, as OpenAI's
    clients send fields newer than any server."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    session_id: str | None = None  # custody's: names the session of a new conversation
    cache_control: CacheControl | None = None  # custody's: a retention hint (retention.py)
    retention_priority: RetentionPriority | None = None

    def __post_init__(self) -> None:
        if not self.input:
            raise ValueError("input must be a text or a list of items, not empty")
        if self.background:
            raise ValueError("background responses are not served: send background false")
        if self.truncation == "auto":
            raise ValueError(
                'truncation "auto" is not served: a conversation past the '
                'context length is refused; send truncation "disabled"'
            )
        if self.top_logprobs:
            raise ValueError("top_logprobs is not served on /v1/responses")
        unserved = sorted(set(self.include or ()) - INCLUDED)
        if unserved:
            raise ValueError(f"include values not served: {unserved}")
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError("metadata holds at most 16 keys")
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None and effort not in EFFORTS:
            raise ValueError(f"reasoning.effort must be one of {sorted(EFFORTS)}")
        if self.previous_response_id is not None and self.session_id is not None:
            raise ValueError(
                "session_id names a new conversation's session; with "
                "previous_response_id the conversation's own is used"
            )

    @property
    def stored(self) -> bool:
        return self.store is not False


def chat_body(body: ResponsesRequest, conversation: list[dict]) -> dict:
    """The chat completion request `body` amounts to after `conversation` (the messages
    its previous response ends); the new messages are `new_messages(body)`."""
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    chat: dict[str, Any] = {"messages": system + conversation + new_messages(body.input)}
    for field in ("model", "temperature", "top_p", "parallel_tool_calls", "stream"):
        value = getattr(body, field)
        if value is not None:
            chat[field] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [chat_tool(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    form = body.text.format if body.text else None
    if form is not None and form.type != "text":
        chat["response_format"] = response_format(form)
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in REASONING_OFF}
    return chat


def chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise InvalidRequest(
            f"tools[{i}] of type {tool.get('type')!r} is not served: only function tools"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest("tool_choice must be auto, none, required or a function")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequest('tool_choice must be {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(form: TextFormat) -> dict:
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.schema is None:
        raise InvalidRequest("text.format json_schema needs its schema")
    spec = {"name": form.name or "response", "schema": form.schema}
    if form.strict is not None:
        spec["strict"] = form.strict
    return {"type": "json_schema", "json_schema": spec}


def new_messages(items: str | list[dict]) -> list[dict]:
    """The chat messages of a request's input items: a function call joins the
    assistant message before it (one reply may say something and call tools), a
    reasoning item becomes the next assistant message's `reasoning_content`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": _role(i, item), "content": _text(i, item.get("content"))}
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function"}
            call["function"] = {"name": _string(i, item, "name")}
            call["function"]["arguments"] = _string(i, item, "arguments")
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(i, output)
            messages.append(
                {"role": "tool", "tool_call_id": _string(i, item, "call_id"), "content": content}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise InvalidRequest(f"input[{i}] of type {kind!r} is not served")
    return messages


def _role(i: int, item: dict) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(f"input[{i}].role must be user, assistant, system or developer")
    return "system" if role == "developer" else role


def _string(i: int, item: dict, field: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise InvalidRequest(f"input[{i}].{field} must be a string")
    return value


def _text(i: int, content: Any) -> str:
    """A message's content as the text the model reads; other inputs refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}].content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(
                f"input[{i}] holds an {kind} part: this model reads text only, so "
                "image, file and audio inputs are not served"
            )
        elif kind != "refusal":
            raise InvalidRequest(f"input[{i}].content holds a part of type {kind!r}")
    return "".join(texts)


def to_json(value: Any) -> bytes:
    return msgspec.json.encode(value)
