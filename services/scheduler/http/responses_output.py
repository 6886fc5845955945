"""The replies of `/v1/responses`: the response object (`response`), built from the
turn's finished request by the one function that also builds the copy its session
stores, and its stream (`events`), the Responses API's typed events pulled from the core
as the steps bring tokens. Item ids derive from the response id and the tool call ids,
so the streamed items and the final object name the same items."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.scheduler.http.responses_input import ResponsesRequest
from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor

if TYPE_CHECKING:
    from services.scheduler.http.openai_routes import ChatPlan


@dataclass(frozen=True)
class Envelope:
    """What a response object repeats of its request, whatever its output."""

    id: str
    model: str
    body: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        b = self.body
        form = b.text.format if b.text and b.text.format else None
        reasoning = b.reasoning
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "status": status,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "error": None,
            "model": self.model,
            "previous_response_id": b.previous_response_id,
            "instructions": b.instructions,
            "output": output,
            "tools": [_tool(t) for t in b.tools or ()],
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None,
            "truncation": "disabled",
            "text": {"format": _format(form)},
            "reasoning": {
                "effort": None if reasoning is None else reasoning.effort,
                "summary": None,
            },
            "store": b.stored,
            "background": False,
            "service_tier": "default",
            "metadata": b.metadata or {},
            "safety_identifier": None,
            "prompt_cache_key": None,
            "user": b.user,
            "usage": usage,
        }


def _tool(tool: dict) -> dict:
    """A function tool as a response object lists it."""
    out = {"type": "function", "name": tool.get("name"), "strict": tool.get("strict", False)}
    out["description"] = tool.get("description")
    out["parameters"] = tool.get("parameters")
    return out


def _format(form: Any) -> dict:
    if form is None or form.type == "text":
        return {"type": "text"}
    if form.type == "json_object":
        return {"type": "json_object"}
    # the Open Responses document types the echoed schema as null: it is not repeated
    out = {"type": "json_schema", "name": form.name or "response", "schema": None}
    return out | {"strict": bool(form.strict), "description": form.description}


def usage(r: Request) -> dict:
    """`cached_tokens`: the prompt tokens the turn did not compute, resumed from its
    session's state or the prefix cache."""
    prompt, output = len(r.prompt), len(r.output)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": r.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def status(r: Request) -> str:
    reason = r.finish_reason
    return "incomplete" if reason is not None and reason.type == "length" else "completed"


def output_items(rid: str, message: dict) -> list[dict]:
    """A reply's output items: its reasoning, its text, then each function call."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(rid, message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(message_item(rid, message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        f = call["function"]
        items.append(call_item(call["id"], f["name"], f["arguments"], "completed"))
    return items


def reasoning_item(rid: str, text: str, state: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": content} | (
        {"status": state}
    )


def message_item(rid: str, text: str | None, state: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message",
        "id": f"msg_{rid}",
        "status": state,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, state: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": state,
    }


def finished(envelope: Envelope, message: dict, r: Request) -> dict:
    """The response object of the finished turn `r` whose reply is the chat message
    `message`: what the route answers, what its stream's last event carries, and what
    its session stores."""
    return envelope.response(status(r), output_items(envelope.id, message), usage(r))


@dataclass
class Open:
    """The output item a stream is writing: its index and kind, and what it holds."""

    index: int
    kind: str  # "reasoning", "message" or "function_call"
    text: str = ""
    call: dict = field(default_factory=dict)


class EventWriter:
    """A stream's events, numbered in order (`sequence_number`), its items opened and
    closed as the chat deltas of the reply (text/assistant_reply.py) arrive."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope, self.sequence = envelope, 0
        self.open: Open | None = None
        self.items = 0

    def event(self, kind: str, **fields: Any) -> tuple[str, dict]:
        out = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return kind, out

    def delta(self, delta: dict) -> list[tuple[str, dict]]:
        out = []
        if delta.get("reasoning_content"):
            out += self._into("reasoning")
            self.open.text += delta["reasoning_content"]
            out.append(self._item_event("response.reasoning.delta", delta["reasoning_content"]))
        if delta.get("content"):
            out += self._into("message")
            self.open.text += delta["content"]
            out.append(self._item_event("response.output_text.delta", delta["content"]))
        for call in delta.get("tool_calls") or ():
            f = call.get("function") or {}
            if call.get("id"):
                out += self._close()
                out += self._into("function_call", {"id": call["id"], "name": f.get("name", "")})
            if f.get("arguments") and self.open is not None and self.open.kind == "function_call":
                self.open.text += f["arguments"]
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._id(),
                        output_index=self.open.index,
                        delta=f["arguments"],
                    )
                )
        return out

    def _id(self) -> str:
        o = self.open
        if o.kind == "function_call":
            return f"fc_{o.call['id']}"
        return f"{'rs' if o.kind == 'reasoning' else 'msg'}_{self.envelope.id}"

    def _item_event(self, kind: str, delta: str) -> tuple[str, dict]:
        return self.event(
            kind,
            item_id=self._id(),
            output_index=self.open.index,
            content_index=0,
            delta=delta,
            **({"logprobs": []} if kind == "response.output_text.delta" else {}),
        )

    def _into(self, kind: str, call: dict | None = None) -> list[tuple[str, dict]]:
        """Events that open an item of `kind` unless it is the one open."""
        if self.open is not None and self.open.kind == kind and kind != "function_call":
            return []
        out = self._close()
        self.open = Open(self.items, kind, call=call or {})
        self.items += 1
        index, rid = self.open.index, self.envelope.id
        if kind == "reasoning":
            item = reasoning_item(rid, "", "in_progress") | {"content": []}
        elif kind == "message":
            item = message_item(rid, None, "in_progress")
        else:
            item = call_item(call["id"], call["name"], "", "in_progress")
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind != "function_call":
            part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._id(),
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return out

    def _close(self) -> list[tuple[str, dict]]:
        """The events that end the item open, if any."""
        o = self.open
        if o is None:
            return []
        self.open, out, rid, ids = None, [], self.envelope.id, {"output_index": o.index}
        if o.kind == "function_call":
            item = call_item(o.call["id"], o.call["name"], o.text, "completed")
            done = self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                **ids,
                name=o.call["name"],
                arguments=o.text,
            )
            out.append(done)
        else:
            message = o.kind == "message"
            item = (
                message_item(rid, o.text, "completed")
                if message
                else (reasoning_item(rid, o.text, "completed"))
            )
            kind = "response.output_text.done" if message else "response.reasoning.done"
            extra = {"logprobs": []} if message else {}
            out.append(
                self.event(kind, item_id=item["id"], **ids, content_index=0, text=o.text, **extra)
            )
            part = text_part(o.text) if message else {"type": "reasoning_text", "text": o.text}
            out.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    **ids,
                    content_index=0,
                    part=part,
                )
            )
        out.append(self.event("response.output_item.done", **ids, item=item))
        return out

    def end(self, final: dict) -> list[tuple[str, dict]]:
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*self._close(), self.event(kind, response=final)]


async def events(
    door: FrontDoor,
    turns: list[Turn],
    envelope: Envelope,
    plan: ChatPlan,
) -> AsyncIterator[tuple[str, dict]]:
    """The stream of one response: created, in progress, its items as they grow, then
    completed (or incomplete: the output budget ran out) with the whole object."""
    writer, started = EventWriter(envelope), envelope.response("in_progress", [], None)
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    last: Request | None = None
    async with aclosing(plan.deltas(door, turns)) as deltas:
        async for r, delta in deltas:
            last = r
            for event in writer.delta(delta):
                yield event
    if last is not None:
        for event in writer.end(finished(envelope, plan.reply_message(last), last)):
            yield event
