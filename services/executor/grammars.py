"""Constrained decoding on the executor: compiled grammars, one matcher per constrained
request, and the token mask each constrained row samples under.

Why here: the executor samples every token, so a row's mask always comes from its real
last token, pipelined steps included, and no mask crosses the wire
(shared/messages/grammar.py says how the scheduler rebuilds a matcher it cannot see).
Grammars are compiled once per distinct spec into a bounded cache, on the check thread
when the scheduler asks before admitting a request (`serve_checks`), so the step loop
finds them compiled; a step that names a spec the cache lost (an executor restart, an
eviction) compiles it on the loop, counted in `custody_grammar_compiles_total`.

The matchers are a cache too, bounded, keyed by request: a row that starts one replays
the request's output into it; a row that finds none, or one that took a different number
of tokens than the row says, refuses the step naming the row (the scheduler re-queues
the request, whose re-prefill starts its matcher again).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import redis
import torch
import xgrammar as xgr
from prometheus_client import Counter, Histogram

from services.executor.reasoning_budget import ReasoningBudget, reasoning_grammar
from shared import streams
from shared.config import Settings
from shared.messages.grammar import (
    GrammarSpec,
    GrammarVerdict,
    ReasoningPrefix,
    RowGrammar,
    decode_check,
)
from shared.model_config import ModelConfig
from shared.retry import Retry

log = logging.getLogger("custody.executor")
COMPILES = Counter(
    "custody_grammar_compiles_total",
    "grammars compiled, by where: check (before admission, off the step loop) or step",
    ["where"],
)
COMPILE_SECONDS = Histogram("custody_grammar_compile_seconds", "compiling one grammar")
MASK_SECONDS = Histogram(
    "custody_grammar_mask_seconds", "filling one step's token masks (all its constrained rows)"
)
COMPILED_CAPACITY = 256  # distinct specs kept compiled
REPLY_TTL_SECONDS = 60  # an answer nobody read expires


class GrammarRefused(ValueError):
    """A constrained row the matchers cannot serve (the step is refused, naming it)."""


def tokenizer_info(model_dir: Path | None, tokenizer: str, vocab: int, eos: Sequence[int]):
    """xgrammar's view of the vocabulary: the checkpoint's tokenizer.json as transformers
    loads it (what SGLang and vLLM give xgrammar), or the byte tokenizer's bytes. None:
    no tokenizer, so no text and no grammar (ids-only)."""
    stops = sorted(eos)
    if model_dir is None or tokenizer == "byte":
        # the byte tokenizer: bytes, then its specials and any padding, which spell nothing
        vocab_bytes = [bytes([i]) for i in range(256)] + [b""] * (vocab - 256)
        return xgr.TokenizerInfo(
            vocab_bytes, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=stops
        )
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(path))
    return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=stops)


def grammars_for(settings: Settings, cfg: ModelConfig) -> Grammars:
    """The grammars of the model `settings` serve: its vocabulary, stop ids, and room
    for a matcher per running request twice over (ended ones age out)."""
    info = tokenizer_info(settings.model, settings.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    return Grammars(info, 2 * settings.max_running_requests)


@dataclass
class _Matcher:
    key: str
    matcher: xgr.GrammarMatcher
    accepted: int  # output tokens taken, the reasoning's included
    budget: ReasoningBudget | None = None

    def take(self, token: int) -> bool:
        """The row's next output token; False if its grammar refuses it."""
        self.accepted += 1
        if self.budget is not None:
            self.budget.take(token)
        return self.matcher.accept_token(token)


class Grammars:
    def __init__(self, info: xgr.TokenizerInfo | None, max_matchers: int) -> None:
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False) if info else None
        self.vocab = info.vocab_size if info else 0
        self.compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.matchers: OrderedDict[str, _Matcher] = OrderedDict()
        self.max_matchers = max_matchers
        self.lock = threading.Lock()  # the check thread and the step loop share the cache

    # ---- compiling ----
    def compile(self, spec: GrammarSpec, where: str) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache, else compiled now); a
        ValueError says why a spec does not compile."""
        key = spec.grammar_key
        with self.lock:
            hit = self.compiled.get(key)
            if hit is not None:
                self.compiled.move_to_end(key)
                return hit
        if self.compiler is None:
            raise ValueError("this model runs ids-only (no tokenizer.json): no grammar")
        started = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as err:  # xgrammar's errors name the fault; all are the spec's
            raise ValueError(f"the {spec.kind} does not compile: {_reason(err)}") from err
        COMPILE_SECONDS.observe(time.perf_counter() - started)
        COMPILES.labels(where).inc()
        with self.lock:
            self.compiled[key] = compiled
            while len(self.compiled) > COMPILED_CAPACITY:
                self.compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        grammar = _grammar(spec)
        if spec.reasoning is not None:
            grammar = xgr.Grammar.concat(reasoning_grammar(spec.reasoning.close), grammar)
        return self.compiler.compile_grammar(grammar)

    def close_tokens(self, prefix: ReasoningPrefix) -> None:
        """The tokens the executor forces must spell the marker the grammar waits for."""
        ids, special = prefix.close_ids, set(self.info.special_token_ids)
        spelled = b"".join(self.token_bytes[t] for t in ids if t < self.vocab)
        if spelled != prefix.close.encode() or max(ids) >= self.vocab or special & set(ids):
            raise ValueError(
                f"the reasoning end {prefix.close!r} is not spelled by tokens a grammar may "
                f"choose ({list(ids)})"
            )

    def check(self, spec: GrammarSpec) -> str | None:
        """None if `spec` compiles, else why not."""
        try:
            self.compile(spec, "check")
            if spec.reasoning is not None:  # a grammar compiled before, by another spec
                self.close_tokens(spec.reasoning)
        except ValueError as err:
            return str(err)
        return None

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """What each token spells, as xgrammar reads it (a reasoning budget watches for
        its end marker in these)."""
        return list(self.info.decoded_vocab) if self.info is not None else []

    # ---- masking ----
    def masks(self, rows: Sequence) -> torch.Tensor | None:
        """The allowed tokens of each sampling row (`rows`: StepRows that sample), as a
        bool tensor [rows, vocab]; None when no row is constrained. Starts or checks each
        constrained row's matcher first; GrammarRefused names a row that cannot go on."""
        constrained = [(j, r) for j, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab)  # all allowed
        forced: list[tuple[int, int]] = []
        for j, row in constrained:
            held = self._matcher(row.rid, row.grammar)
            if held.matcher.is_terminated():  # a row its request dropped: left free
                continue
            token = None if held.budget is None else held.budget.forced()
            if token is None:
                held.matcher.fill_next_token_bitmask(bitmask, j)
            else:
                forced.append((j, token))
        allowed = unpack_bitmask(bitmask, self.vocab)
        for j, token in forced:  # the reasoning ran out of budget: its end, token by token
            allowed[j] = False
            allowed[j, token] = True
        MASK_SECONDS.observe(time.perf_counter() - started)
        return allowed

    def validate(self, rows: Sequence) -> None:
        """Before anything runs: each constrained row's grammar compiles (a starting row)
        or its matcher is here and has taken the tokens the row says (GrammarRefused)."""
        for row in rows:
            if row.grammar is None:
                continue
            if row.grammar.starts:
                try:
                    self.compile(row.grammar.spec, "step")
                except ValueError as err:
                    raise GrammarRefused(f"row {row.rid}: {err}") from err
            else:
                self._matcher(row.rid, row.grammar)

    def _matcher(self, rid: str, grammar: RowGrammar) -> _Matcher:
        if grammar.starts:
            return self._start(rid, grammar)
        with self.lock:
            held = self.matchers.get(rid)
            if held is not None:
                self.matchers.move_to_end(rid)
        if held is None or held.key != grammar.key:
            raise GrammarRefused(f"row {rid}: no matcher for its grammar (not started here)")
        if held.accepted != grammar.accepted:
            raise GrammarRefused(
                f"row {rid}: its matcher took {held.accepted} tokens, the row expects "
                f"{grammar.accepted}"
            )
        return held

    def _start(self, rid: str, grammar: RowGrammar) -> _Matcher:
        """A new matcher for `rid`, with the request's output so far replayed into it."""
        spec = grammar.spec
        compiled = self.compile(spec, "step")
        prefix = spec.reasoning
        budget = None if prefix is None else ReasoningBudget(prefix, self.token_bytes)
        held = _Matcher(grammar.key, xgr.GrammarMatcher(compiled), 0, budget)
        for i, token in enumerate(grammar.replay.tolist()):
            if not held.take(token):
                raise GrammarRefused(f"row {rid}: output token {i} ({token}) breaks its grammar")
        with self.lock:
            self.matchers[rid] = held
            self.matchers.move_to_end(rid)
            while len(self.matchers) > self.max_matchers:
                self.matchers.popitem(last=False)
        return held

    def accept(self, rows: Sequence, tokens: Sequence[int]) -> list[str]:
        """Each constrained row's matcher takes the token it sampled; returns the rows
        whose grammar ended with it. An ended matcher stays (counting) until evicted: a
        row of its request may be in the next step already, which the scheduler drops."""
        ended: list[str] = []
        for row, token in zip(rows, tokens, strict=True):
            if row.grammar is None:
                continue
            held = self.matchers[row.rid]  # masks() started or found it
            if held.matcher.is_terminated():
                held.accepted += 1
                continue  # ended before: a pipelined row its request has dropped
            if not held.take(int(token)):  # the mask forbade it: a bug
                log.error("row %s sampled %d, which its grammar refuses", row.rid, token)
            if held.matcher.is_terminated():
                ended.append(row.rid)
        return ended

    # ---- the check thread ----
    def serve_checks(
        self, client: redis.Redis, keys: streams.Keys, retry: Retry, stopped: threading.Event
    ) -> None:
        """Answer the scheduler's compile checks until `stopped` (a thread of its own:
        compiling releases the GIL, so the step loop goes on). Any fault, Redis away or
        one of the thread's own, is counted, logged (rate-limited) and waited out with
        backoff: a thread that died would leave every constrained request a 503."""
        while not stopped.is_set():
            try:
                popped = client.blpop([keys.grammar_checks], timeout=1)
                if popped is not None:
                    self._answer(client, popped[1])
            except redis.TimeoutError:
                continue  # a read that outlasted its socket's timeout: nothing came
            except Exception as err:
                retry.wait_sync(err)
                continue
            retry.ok()

    def _answer(self, client: redis.Redis, raw: bytes) -> None:
        try:
            check = decode_check(raw)
        except Exception as err:  # a malformed check: nobody can be answered
            log.error("refused a malformed grammar check: %s", err)
            return
        verdict = GrammarVerdict(error=self.check(check.spec))
        pipe = client.pipeline(transaction=False)
        pipe.rpush(check.reply, msgspec.msgpack.encode(verdict))
        pipe.expire(check.reply, REPLY_TTL_SECONDS)
        pipe.execute()


# xgrammar 0.2.8 writes a JSON string's character as a class that lets through what
# strict JSON in UTF-8 cannot hold: a string with maxLength (or minLength) takes control
# characters, which JSON forbids unescaped; every string takes the three-byte encoding of
# a UTF-16 surrogate (U+D800-U+DFFF), invalid UTF-8, which decodes as three replacement
# characters (one character the grammar counted becomes three: past a maxLength). Both
# classes are replaced with one that excludes them.
LOOSE_CHARACTERS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
STRICT_CHARACTER = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec's own constraint as an xgrammar grammar (not yet compiled)."""
    if spec.kind == "json_schema":
        schema = xgr.Grammar.from_json_schema(
            spec.source, any_whitespace=spec.any_whitespace, strict_mode=True
        )
        return xgr.Grammar.from_ebnf(_strict_strings(str(schema)))
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.source)
    return xgr.Grammar.from_structural_tag(spec.source)


def _strict_strings(ebnf: str) -> str:
    for loose in LOOSE_CHARACTERS:
        ebnf = ebnf.replace(loose, STRICT_CHARACTER)
    return ebnf


def _reason(err: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err)).strip()


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed int32 words [rows, ceil(vocab / 32)] as bools [rows, vocab]
    (bit i of word w: token 32 w + i)."""
    words = bitmask.numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))
