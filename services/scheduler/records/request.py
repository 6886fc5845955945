"""One request: a plain generation or one turn of a session.

The request's sequence is `prompt + output`. `computed` counts the positions whose KV
and Mamba state are done; every step feeds `sequence[planned:end]` and samples a token
when `end` reaches the end of the sequence, so prefill chunks, decode steps and the
re-prefill after a retract are one mechanism. With a step in flight, `planned` runs
ahead of `computed` by that step's rows, and when the step in flight samples, the
sequence has one more position than is known yet: the token that step will sample,
which the next step feeds as a future token (the executor fills it in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.request_slots import RequestSlots, release
from services.scheduler.cache.node import CacheNode
from services.scheduler.cache.radix_cache import RadixCache
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.records.session import Session, TurnStart
from services.scheduler.records.turn_tree import Branch
from services.scheduler.text.output import OutputText
from shared.messages.ownership import ChatEntry, ResponseEntry
from shared.messages.sampling import Top

if TYPE_CHECKING:
    from services.scheduler.records.row_plan import RowPlan


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class ChatTurn:
    """What a chat turn hands its session, prepared by the HTTP edge (which owns the
    template) so the engine never renders: the length of the session's history its new
    tokens follow (the rest of the history, past the session's state, is rendered anew:
    chat_session.py), the conversation's entries through the prompt, and `reply`, which
    gives the reply's entry, the canonical history (the conversation with the reply,
    rendered without a generation prompt and tokenized) and whether the reply renders
    the same once a message follows it; or None if that cannot be rendered."""

    base: int
    seen: int  # the history's length the turn was prepared against (a changed one: busy)
    messages: tuple[ChatEntry, ...]
    reply: Callable[[Request], tuple[ChatEntry, np.ndarray, bool] | None]
    # where any reply's rendering leaves the prompt's (the assistant's header, say): the
    # turn keeps its state there, for a reply the session cannot keep (chat_log.py)
    reply_start: int = 0
    # the response (Responses API) the turn stores as it finishes, in the record write
    # of its history (sessions/chat_log.py); None: it stores none
    stored: Callable[[Request], ResponseEntry | None] | None = None


@dataclass(eq=False)
class Request:
    rid: str
    prompt: np.ndarray
    params: SamplingParams
    session: Session | None = None
    name: str = ""  # the id its client knows it by (http/tenancy.py `Claim.shown`); "": rid
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    slots: RequestSlots | None = None
    cache_node: CacheNode | None = None  # locked cache node whose KV the row borrows
    computed: int = 0
    cached_tokens: int = 0  # positions reused, not recomputed, when it was admitted
    # a junction: where its prompt leaves the cache's KV past the deepest cached state; a
    # chunk ends there, and the state there is cached for the next request (0: none)
    checkpoint: int = 0
    # a chat turn's state kept at this prompt position (ChatTurn.reply_start); 0: none
    reply_start: int = 0
    abort_reason: str | None = None
    turn_start: TurnStart | None = None
    chat: ChatTurn | None = None  # a chat turn's conversation
    branch: Branch | None = None  # a /generate turn's place in its session's turn tree
    cache_namespace: str = ""  # whose cached prefixes it may match and feed (radix_cache.py)
    logprobs: list[float] = field(default_factory=list)  # the model's, per output token
    top_logprobs: list[Top] = field(default_factory=list)  # per output token, when asked
    # the input's: of prompt positions scored_from.. (-1: none asked), set at admission
    scored_from: int = -1
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[Top | None] = field(default_factory=list)  # when top_logprobs asks
    executor_losses: int = 0  # executor losses while its step was executing (faults.py)
    inflight: list[RowPlan] = field(default_factory=list)  # rows of steps in flight, in order
    # the executor's matcher was started in this admission (step_builder.row_grammar)
    grammar_started: bool = False
    text: OutputText | None = None  # the output as text (set by the engine with a tokenizer)
    head_drafts: list[int] = field(default_factory=list)  # the MTP head's last guesses

    @property
    def sequence(self) -> np.ndarray:
        if not self.output:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    def tokens_at(self, start: int, end: int) -> np.ndarray:
        """The sequence's tokens at positions start..end-1, without joining the whole
        prompt and output (a decoding row wants one token of them)."""
        cut = len(self.prompt)
        if start >= cut:
            return np.asarray(self.output[start - cut : end - cut], dtype=np.int64)
        if end <= cut:
            return self.prompt[start:end]
        return self.sequence[start:end]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def reusable(self) -> int:
        """The most positions the prefix cache may serve: all but the last (a match must
        leave a token to compute the next one's logits from), and with input logprobs
        none from their first position on (its logits must be computed), as SGLang."""
        limit = self.length - 1
        start = self.params.logprob_start
        return limit if start < 0 else min(limit, start)

    @property
    def planned(self) -> int:
        """Positions computed or being computed by a step in flight: the rows in flight
        run on from `computed`, each from where the one before ends (`inflight_problem`
        is the engine check's proof of it), so the last one's end."""
        return self.inflight[-1].end if self.inflight else self.computed

    def inflight_problem(self) -> str | None:
        """Unless the rows in flight run on from `computed` without a gap or overlap, what
        is wrong (`planned` relies on it)."""
        at = self.computed
        for row in self.inflight:
            if row.start != at:
                return f"request {self.rid}: a row in flight starts at {row.start}, not {at}"
            at = row.end
        return None

    @property
    def pending_tokens(self) -> int:
        """Tokens of this request that steps in flight sample, not yet known: one per
        decode row in flight (a prefill chunk samples only at the prompt's end)."""
        return len([row for row in self.inflight if row.wire.sample])

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def record(self, token: int, logprob: float | None, top: Top | None) -> None:
        """A sampled token, its log probability and its top alternatives. Kept beside the
        output, which a retract keeps: what is recorded is never sampled again."""
        self.output.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.params.top_logprobs:
            ids, lps = top if top is not None else ((), ())
            self.top_logprobs.append(([int(i) for i in ids], [float(x) for x in lps]))

    def score_inputs(self, first: int) -> None:
        """At admission: the input log probabilities run from `params.logprob_start`, or
        from `first` if later (where the positions computed begin, or a session turn's
        new input: its state is resumed, the history not computed again). The first
        listed position has none (SGLang's null: the logits before it are not computed);
        each later one is scored by the position before it. A re-admission after a
        retract computes them all again."""
        start = self.params.logprob_start
        if start < 0:
            return
        self.scored_from = max(start, first)
        n = len(self.prompt) - self.scored_from
        self.input_logprobs = [None] * n
        self.input_top = [None] * n if self.params.top_logprobs else []

    def scored(self, start: int, end: int) -> range:
        """The positions of [start, end) whose logits score the next prompt token."""
        if self.scored_from < 0:
            return range(0)
        return range(max(start, self.scored_from), min(end, len(self.prompt) - 1))

    def record_scores(self, first: int, logprobs: Sequence[float], top: Sequence[Top]) -> None:
        """The input log probabilities of positions first.. (their next tokens')."""
        at = first + 1 - self.scored_from
        self.input_logprobs[at : at + len(logprobs)] = [float(x) for x in logprobs]
        if self.input_top:
            picked = [([int(i) for i in ids], [float(x) for x in lps]) for ids, lps in top]
            self.input_top[at : at + len(picked)] = picked

    def committed_output(self) -> list[int]:
        """The output as it enters a session's history: a stop token is trimmed unless
        the request asked to keep it."""
        reason = self.finish_reason
        if reason is not None and reason.matched_token and not self.params.no_stop_trim:
            return self.output[:-1]
        return list(self.output)

    def release(self, pools: Pools, cache: RadixCache) -> None:
        """Give every slot back and unlock the cache node the row borrows from: the one
        release path, for a plain request that ends and a turn whose session had no
        state."""
        release(pools, self.slots)
        if self.cache_node is not None:
            cache.unlock(self.cache_node)
            self.cache_node = None
