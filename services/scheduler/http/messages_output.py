"""The replies of `/v1/messages`: the Message object (`finished`), built from the turn's
finished request by one function, as responses_output.py builds a response, and its
stream (`events`), Anthropic's named events pulled from the core as the steps bring
tokens: the content blocks open and close as the chat deltas of the reply
(text/assistant_reply.py) arrive, and the last event carries the stop reason and usage
of the same finished request.

A reply's blocks are its reasoning (`thinking`, with an empty signature: nothing is
signed here), its text, then each tool call (`tool_use`, ids the chat route's), so the
client sends back the chat message the session stored. Usage is Anthropic's:
`input_tokens` the prompt tokens computed, `cache_read_input_tokens` those resumed from
the session's state or the prefix cache."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor

if TYPE_CHECKING:
    from services.scheduler.http.openai_routes import ChatPlan

Event = tuple[str, dict]


@dataclass(frozen=True)
class Envelope:
    """What a Message repeats whatever its content: its id and the model's name."""

    id: str
    model: str

    def message(
        self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict
    ) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }


def usage(r: Request) -> dict:
    cached = r.cached_tokens
    return {
        "input_tokens": len(r.prompt) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(r.output),
    }


def stop(r: Request, called: bool) -> tuple[str, str | None]:
    """The stop reason and the stop sequence that ended the reply, if one did."""
    reason = r.finish_reason
    if reason is not None and reason.type == "length":
        return "max_tokens", None
    if reason is not None and isinstance(reason.matched, str):
        return "stop_sequence", reason.matched
    return ("tool_use" if called else "end_turn"), None


def content(reply: dict) -> list[dict]:
    """A reply (a chat message, `ChatPlan.reply_message`) as content blocks."""
    blocks = []
    if reply.get("reasoning_content"):
        blocks.append(thinking_block(reply["reasoning_content"]))
    if reply.get("content"):
        blocks.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        f = call["function"]
        blocks.append(tool_use_block(call["id"], f["name"], json.loads(f["arguments"])))
    return blocks


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def finished(envelope: Envelope, reply: dict, r: Request) -> dict:
    """The Message of the finished turn `r` whose reply is `reply`."""
    reason, sequence = stop(r, bool(reply.get("tool_calls")))
    return envelope.message(content(reply), reason, sequence, usage(r))


def event(kind: str, **fields: object) -> Event:
    return kind, {"type": kind} | fields


class BlockWriter:
    """A stream's content blocks, indexed in order: a thinking or text block stays open
    while its kind of delta goes on, a tool call is a block of its own."""

    def __init__(self) -> None:
        self.open: str | None = None  # the open block's type
        self.index = -1

    def delta(self, delta: dict) -> list[Event]:
        out = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start(thinking_block(""))
            out.append(self._delta("thinking_delta", thinking=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta("text_delta", text=delta["content"]))
        for call in delta.get("tool_calls") or ():
            f = call["function"]
            if call.get("id"):
                out += self._start(tool_use_block(call["id"], f["name"], {}))
            if f.get("arguments"):
                out.append(self._delta("input_json_delta", partial_json=f["arguments"]))
        return out

    def _delta(self, kind: str, **fields: str) -> Event:
        return event("content_block_delta", index=self.index, delta={"type": kind} | fields)

    def _start(self, block: dict) -> list[Event]:
        out = self.close()
        self.open, self.index = block["type"], self.index + 1
        return [*out, event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[Event]:
        """The event that ends the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]


async def events(
    door: FrontDoor, turns: list[Turn], envelope: Envelope, plan: ChatPlan
) -> AsyncIterator[Event]:
    """The stream of one Message: `message_start` once the turn brought its first news
    (so a refusal at queueing is still a plain 4xx, and the usage is the turn's), its
    blocks as they grow, then `message_delta` with the stop reason and the whole usage,
    and `message_stop`."""
    writer, last = BlockWriter(), None
    async with aclosing(plan.deltas(door, turns)) as deltas:
        async for r, delta in deltas:
            if last is None:
                yield event("message_start", message=envelope.message([], None, None, usage(r)))
            last = r
            for item in writer.delta(delta):
                yield item
    final = finished(envelope, plan.reply_message(last), last)
    for item in writer.close():
        yield item
    ending = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield event("message_delta", delta=ending, usage=final["usage"])
    yield event("message_stop")
