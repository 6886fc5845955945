"""An Anthropic Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`)
read as the chat request it amounts to, as responses_input.py reads a Responses one: its
`system` a system message, its blocks chat messages (a user message's tool results
`tool` messages before its text, an assistant's thinking its `reasoning_content` and
its tool uses `tool_calls`), its tools, tool choice, thinking switch, stop sequences and
structured output (`output_format`) their chat counterparts. The chat route's machinery
(templates, tool-call and reasoning parsers, constraints, header sessions) then runs it
unchanged, and a reply sent back as the client got it (messages_output.py) is the chat
message its session stored.

What custody does not serve is refused by name (400), never ignored: image and document
blocks (the model reads text), server tools, and a conversation that ends with the
assistant's message (prefill). `cache_control`, on the request or on any block, is the
turn's retention hint (docs/tiers.md; the last one given counts), with custody's
`retention_priority` beside it. Accepted and ignored: `metadata`, a tool result's
`is_error` (a chat tool message has no such field), a thinking block's `signature`
and a redacted thinking block (nothing a template can render).
"""

# No `from __future__ import annotations`: msgspec must see the annotations as objects.

import json
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from services.scheduler.http.schema_types import (
    MAX_STOPS,
    CacheControl,
    RetentionPriority,
    StopString,
    Temperature,
    TopP,
)
from services.scheduler.records.sampling import InvalidRequest

Name = Annotated[str, Meta(min_length=1)]
TEXT_ONLY = "{} blocks are not served: this model reads text only"


class Block(Struct, tag_field="type", kw_only=True):
    """A content block; `cache_control` (a retention hint) is accepted on every one."""

    cache_control: CacheControl | None = None


class TextBlock(Block, tag="text"):
    text: str


class ToolUseBlock(Block, tag="tool_use"):
    id: Name
    name: Name
    input: dict[str, Any]


class ThinkingBlock(Block, tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Block, tag="redacted_thinking"):
    data: str = ""


class ImageBlock(Block, tag="image"):
    def __post_init__(self) -> None:
        raise ValueError(TEXT_ONLY.format("image"))


class DocumentBlock(Block, tag="document"):
    def __post_init__(self) -> None:
        raise ValueError(TEXT_ONLY.format("document"))


class ToolResultBlock(Block, tag="tool_result"):
    tool_use_id: Name
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None


ContentBlock = (
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ImageBlock
    | DocumentBlock
)


class Message(Struct):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Struct, kw_only=True):
    """A client tool; Anthropic's server tools (web search, code execution...) are not
    served."""

    name: Name
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or absent
    cache_control: CacheControl | None = None

    def __post_init__(self) -> None:
        if self.type not in (None, "custom"):
            raise ValueError(
                f"tools of type {self.type!r} are not served: only client tools "
                "(name, description, input_schema)"
            )
        if self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs its input_schema")


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def __post_init__(self) -> None:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice {"type": "tool"} needs the name of the tool')


class ThinkingConfig(Struct, kw_only=True):
    """The template's thinking switch; `adaptive`: on, bounded by the server's budget."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('thinking {"type": "enabled"} needs its budget_tokens')


class OutputFormat(Struct, kw_only=True):
    """Anthropic's structured outputs: the reply's text follows the JSON schema."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class MessagesRequest(Struct, kw_only=True):
    """The body of `POST /v1/messages` (`max_tokens` required there) and of
    `/v1/messages/count_tokens`; unknown fields are ignored, as Anthropic's clients send
    fields newer than any server."""

    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOPS)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_format: OutputFormat | None = None
    cache_control: CacheControl | None = None  # a retention hint
    retention_priority: RetentionPriority | None = None  # custody's: the hint's priority

    def retention(self) -> CacheControl | None:
        """The turn's retention hint: the request's, else the last block's that has one."""
        if self.cache_control is not None:
            return self.cache_control
        blocks = [*(self.system if isinstance(self.system, list) else ()), *(self.tools or ())]
        for message in self.messages:
            blocks += message.content if isinstance(message.content, list) else ()
        hinted = [b.cache_control for b in blocks if b.cache_control is not None]
        return hinted[-1] if hinted else None

    def __post_init__(self) -> None:
        if self.messages[-1].role != "user":
            raise ValueError(
                "the last message must be the user's: continuing the assistant's "
                "(prefill) is not served"
            )
        budget = self.thinking.budget_tokens if self.thinking else None
        if budget is not None and self.max_tokens is not None and budget >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")


def chat_body(body: MessagesRequest, budgets: bool) -> dict:
    """The chat completion request `body` amounts to. `budgets`: the server bounds a
    reply's reasoning (its prompt opens the block); elsewhere `budget_tokens` is left
    out, a target as Anthropic's own is, not a refusal."""
    messages = system_messages(body.system)
    for i, message in enumerate(body.messages):
        if message.role == "user":
            messages += user_messages(i, message.content)
        else:
            messages.append(assistant_message(i, message.content))
    chat: dict[str, Any] = {"messages": messages}
    for field in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream"):
        value = getattr(body, field)
        if value is not None:
            chat[field] = value
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.output_format is not None:
        spec = {"name": "output", "schema": body.output_format.schema, "strict": True}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    if body.tools:
        chat["tools"] = [chat_tool(tool) for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = chat_tool_choice(choice)
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    thinking = body.thinking
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking.type != "disabled"}
        if budgets and thinking.budget_tokens is not None:
            chat["thinking_budget"] = thinking.budget_tokens
    return chat


def chat_tool(tool: Tool) -> dict:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def system_messages(system: str | list[TextBlock] | None) -> list[dict]:
    if not system:
        return []
    texts = [system] if isinstance(system, str) else [block.text for block in system]
    return [{"role": "system", "content": text_content(texts)}]


def user_messages(i: int, content: str | list[Block]) -> list[dict]:
    """A user message's tool results (each a `tool` message), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for block in content:
        if isinstance(block, ToolResultBlock):
            output = block.content
            text = output if isinstance(output, str) else text_content([b.text for b in output])
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise InvalidRequest(
                f"messages[{i}] is the user's and holds a {kind(block)} block: a user "
                "message holds text and tool_result blocks"
            )
    if texts or not results:
        results.append({"role": "user", "content": text_content(texts)})
    return results


def assistant_message(i: int, content: str | list[Block]) -> dict:
    """An assistant message as the chat route gives its reply: `content` null beside
    tool calls when it says nothing, `reasoning_content` only when it reasoned."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, reasoning, calls = [], "", []
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning += block.thinking
        elif isinstance(block, ToolUseBlock):
            function = {
                "name": block.name,
                "arguments": json.dumps(block.input, ensure_ascii=False),
            }
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlock):
            raise InvalidRequest(
                f"messages[{i}] is the assistant's and holds a {kind(block)} block: an "
                "assistant message holds text, thinking and tool_use blocks"
            )
    message: dict[str, Any] = {"role": "assistant", "content": text_content(texts)}
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def text_content(texts: list[str]) -> str | list[dict]:
    """Text blocks as a chat message's content: one as its text, more as text parts
    (the template joins them, or loops over them)."""
    if len(texts) <= 1:
        return "".join(texts)
    return [{"type": "text", "text": text} for text in texts]


def kind(block: Block) -> str:
    return block.__struct_config__.tag
