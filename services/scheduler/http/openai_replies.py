"""The replies of the OpenAI routes, one function per form: `whole` for a completion or
chat completion answered at once, `chunks` for its stream, pulled from the core as its
steps bring tokens; the envelope (`Reply`) and the accounting (`usage`) both share."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from services.scheduler.http.logprobs import echoed_prompt, joined
from services.scheduler.http.logprobs import openai as openai_logprobs
from services.scheduler.http.stream_cursor import new_chunks, output_text
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Request
from services.scheduler.records.turn import Turn
from services.scheduler.runtime.front_door import FrontDoor
from services.scheduler.text.assistant_reply import ReplyParser, ReplyStream
from shared.tokenizer import Tokenizer


def usage(reqs: list[Request], n: int) -> dict:
    """Of all choices (`n` per prompt): each prompt counted once (as OpenAI counts it),
    the completions summed; `cached_tokens`: per prompt the fewest any of its choices
    reused, summed."""
    by_prompt = [reqs[i : i + n] for i in range(0, len(reqs), n)]
    prompt = sum(len(group[0].prompt) for group in by_prompt)
    completion = sum(len(r.output) for r in reqs)
    cached = sum(min(r.cached_tokens for r in group) for group in by_prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sglext(cached: int) -> dict:
    """SGLang's extension field with `cached_tokens_details`: custody counts every reused
    token as `device` (a session's state brought back from a lower tier is on the device
    before its turn runs)."""
    return {"cached_tokens_details": {"device": cached, "host": 0}}


def accounting(reqs: list[Request], n: int, details: bool) -> dict:
    """A reply's `usage` and, with `details`, its `sglext` of the same cached count."""
    spent = usage(reqs, n)
    cached = spent["prompt_tokens_details"]["cached_tokens"]
    return {"usage": spent} | ({"sglext": sglext(cached)} if details else {})


def ending(req: Request) -> FinishReason | None:
    """Why `req` ended; None while it runs (a stream's chunk before its last)."""
    return req.finish_reason if req.done else None


class Reply:
    """The envelope of one completion or chat completion, whole or as chunks."""

    def __init__(
        self, rid: str, chat: bool, stream: bool, model: str, parser: ReplyParser | None = None
    ) -> None:
        """`parser`: a chat reply's reasoning and tool calls (chat_tools.py); None: its
        text is its content."""
        self.rid, self.chat, self.stream, self.model = rid, chat, stream, model
        self.parser = parser
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def choice(
        self, text: str, logprobs: dict | None, reason: FinishReason | None, index: int = 0
    ) -> dict:
        """`logprobs`: of the tokens the choice (or chunk) covers; None when not asked.
        `reason`: why it ended (None: a chunk of a choice still running), given as
        OpenAI's `finish_reason` (`stop`, `length`, or `abort` for an aborted request, as
        vLLM reports it) and SGLang's `matched_stop` (the stop token id or string)."""
        ended = {
            "finish_reason": None if reason is None else reason.type,
            "matched_stop": None if reason is None else reason.matched,
        }
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs} | ended
        part = "message" if reason is not None and not self.stream else "delta"
        message = {part: {"role": "assistant", "content": text}, "logprobs": logprobs}
        return {"index": index} | ended | message

    def parsed_choice(
        self, rid: str, text: str, logprobs: dict | None, reason: FinishReason, index: int
    ) -> dict:
        """A whole chat choice through the parser: `finish_reason` `tool_calls` when
        the model called tools and stopped by itself."""
        message, called = self.parser.message(rid, text)
        choice = self.choice(text, logprobs, reason, index)
        if called and reason.type == "stop":
            choice["finish_reason"] = "tool_calls"
        return choice | {"message": message}

    def delta_chunks(
        self, stream: ReplyStream, r: Request, text: str, logprobs: dict | None, index: int
    ) -> list[dict]:
        """A streamed chat choice's chunks for its reply so far (`text`), through the
        parser; the last carries the finish reason once it ended."""
        reason = ending(r)
        deltas = stream.deltas(text, reason is not None)
        if reason is not None or not deltas:
            deltas.append({})
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = self.choice("", logprobs if i == 0 else None, reason if last else None, index)
            if last and reason is not None and stream.called and reason.type == "stop":
                choice["finish_reason"] = "tool_calls"
            chunks.append(choice | {"delta": delta | ({"role": "assistant"} if i == 0 else {})})
        return chunks

    def body(self, choices: list[dict], **extra: object) -> dict:
        kind = f"{self.kind}.chunk" if self.stream else self.kind
        head = {"id": self.rid, "object": kind, "created": self.created, "model": self.model}
        return head | {"choices": choices} | extra


def echoed(
    tokenizer: Tokenizer,
    r: Request,
    head: str | None,
    text: str,
    chat: bool,
    start: int = 0,
    end: int | None = None,
    offset: int = 0,
) -> tuple[str, dict | None]:
    """A choice's (or chunk's) text and the logprobs of output tokens [start, end), the
    first `offset` characters into the choice's text; with `head` (the echoed prompt),
    the prompt's text and logprobs come first."""
    lps = openai_logprobs(tokenizer, r, chat, start, end, offset)
    if head is None:
        return text, lps
    if lps is not None:
        lps = joined(echoed_prompt(tokenizer, r), lps, 0)
    return head + text, lps


@dataclass(frozen=True)
class Choices:
    """A completion or chat completion decoded and checked (openai_routes.py): its
    turns, `n` per prompt in prompt order, and how its reply is built."""

    turns: list[Turn]
    reply: Reply
    echoes: list[str | None]  # each choice's echoed prompt (completions' echo)
    n: int
    details: bool  # SGLang's `sglext` with the cached tokens
    include_usage: bool  # a stream's last chunk carries `usage`
    running: bool  # vLLM's continuous usage: each chunk its choice's usage so far


def whole(tokenizer: Tokenizer, call: Choices, done: list[Request]) -> dict:
    """The reply once every choice ended."""
    reply, choices = call.reply, []
    for i, (r, echo) in enumerate(zip(done, call.echoes, strict=True)):
        text, lps = echoed(tokenizer, r, echo, output_text(r), reply.chat, offset=len(echo or ""))
        if reply.parser is None:
            choices.append(reply.choice(text, lps, r.finish_reason, i))
        else:
            choices.append(reply.parsed_choice(r.rid, text, lps, r.finish_reason, i))
    return reply.body(choices, **accounting(done, call.n, call.details))


async def chunks(door: FrontDoor, call: Choices) -> AsyncIterator[dict]:
    """The stream: each choice's new text and the logprobs of the tokens that arrived
    since its chunk before; with an echo, a choice's first chunk begins with the prompt
    (its text and logprobs), as vLLM's does; with `details`, its finishing chunk carries
    its `sglext` (SGLang's); with `running`, each chunk its choice's `usage` so far; with
    `include_usage`, a last chunk of no choices carries the reply's."""
    tokenizer, reply = door.tokenizer, call.reply
    heads = list(call.echoes)
    parsed: list[ReplyStream | None] = [None] * len(call.turns)
    ended: list[Request | None] = [None] * len(call.turns)
    async with aclosing(new_chunks(door, call.turns)) as news:
        async for index, r, chunk in news:
            ended[index] = r
            extra = {"sglext": sglext(r.cached_tokens)} if call.details and r.done else {}
            if call.running:
                extra["usage"] = usage([r], 1)
            if reply.parser is not None:
                parsed[index] = parsed[index] or ReplyStream(reply.parser, r.rid)
                lps = openai_logprobs(tokenizer, r, True, chunk.start, chunk.end, 0)
                for choice in reply.delta_chunks(parsed[index], r, chunk.text, lps, index):
                    yield reply.body([choice], **extra)
                continue
            sent = len(chunk.text) - len(chunk.delta)  # text_offset counts from there
            offset = sent + len(call.echoes[index] or "")
            text, lps = echoed(
                tokenizer, r, heads[index], chunk.delta, reply.chat, chunk.start, chunk.end, offset
            )
            heads[index] = None
            yield reply.body([reply.choice(text, lps, ending(r), index)], **extra)
    if call.include_usage:
        done = [r for r in ended if r is not None]
        yield reply.body([], **accounting(done, call.n, call.details))
