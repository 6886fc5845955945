"""An assistant reply as OpenAI's chat API gives it: `reasoning_content` (reasoning.py),
`content`, and `tool_calls` (tool_calls.py), whole, or as the deltas of a stream.

A stream re-reads the reply's whole text at each chunk and sends what became settled
since the chunk before: reasoning and answer text as they come, a tool call once it is
closed (a first delta with its id and name, then its arguments), as OpenAI streams
them and as the openai client's accumulator and the Agents SDK put them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.text.reasoning import ReasoningParser
from services.scheduler.text.tool_calls import ToolCall, ToolParser, call_id


@dataclass(frozen=True)
class ReplyParser:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None

    def parts(self, text: str, final: bool) -> tuple[str, list[str | ToolCall]]:
        """The reasoning and the answer's pieces (text and calls) settled so far."""
        if self.reasoning is None:
            reasoning, answer = "", text
        else:
            split = self.reasoning.split(text, final)
            reasoning, answer = split.reasoning, split.answer
        if self.tools is None:
            return reasoning, [answer] if answer else []
        return reasoning, self.tools.split(answer, final)[0]

    def message(self, rid: str, text: str) -> tuple[dict, bool]:
        """The whole reply of request `rid` as a chat message (null fields left out, as
        a client sends it back); and whether it holds tool calls."""
        reasoning, pieces = self.parts(text, final=True)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        content = "".join(p for p in pieces if isinstance(p, str))
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = [c.openai(call_id(rid, i)) for i, c in enumerate(calls)]
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        return message, bool(calls)


@dataclass
class ReplyStream:
    """What one streamed choice has sent so far."""

    parser: ReplyParser
    rid: str
    reasoning_sent: int = 0
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)

    def deltas(self, text: str, final: bool) -> list[dict]:
        """The deltas that bring the client from what was sent to `text` (the reply so
        far; `final`: all of it)."""
        reasoning, pieces = self.parser.parts(text, final)
        out: list[dict] = []
        if len(reasoning) > self.reasoning_sent:
            out.append({"reasoning_content": reasoning[self.reasoning_sent :]})
            self.reasoning_sent = len(reasoning)
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        if len(content) > self.content_sent and content.strip():
            out.append({"content": content[self.content_sent :]})
            self.content_sent = len(content)
        for index in range(len(self.call_ids), len(calls)):
            self.call_ids.append(call_id(self.rid, index))
            first = calls[index].openai(self.call_ids[-1], index)
            first["function"] = {"name": calls[index].name, "arguments": ""}
            out.append({"tool_calls": [first]})
            arguments = {"index": index, "function": {"arguments": calls[index].arguments}}
            out.append({"tool_calls": [arguments]})
        return out

    @property
    def called(self) -> bool:
        return bool(self.call_ids)
