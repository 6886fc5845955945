"""Runs one step on the device: checks it, applies its deferred state ops, runs the
forward and samples, all in order on one compute stream.

On CUDA the step runs on a dedicated stream; the clears and copies are queued on it
right before the forward that needs them, so no copy can race a forward still writing
its source, and nothing waits on the host until the sampled tokens are read back.

Checks first, ops next, the forward last. The whole step, rows and ops (index ranges,
the sink, a slot written twice or read by one row and written by another), is checked
before the first op touches a pool, so a refused step leaves the pools bit for bit as
they were. A step failing after its checks says whether its ops ran: `ops_ran` is True
only when every op was applied and the forward or sampling failed. The scheduler needs
it: a session's turn copies the session's state into a rollback slot (a deferred op),
then updates the state in place. With `ops_ran`, the rollback copy holds the session's
state and the slot the turn read may be half written; without, the forward never ran,
so the session's own slot still holds its state and the rollback copy may hold nothing.
(On CUDA a fault in a queued op surfaces only in the forward, as `ops_ran`; but such a
fault breaks the device context, and every later step fails as well.)

A step's tier moves (services/executor/tiers/) are checked with the rest and run before
its ops; a step may consist of moves alone, with no forward. A move that fails without
failing the step (a blob that failed its check) is named in `Sampled.failed_moves`; any
other failure while moving fails the step with `ops_ran` False.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.slot_ops import clear_slots, copy_slots
from services.executor.compiled_decode import CompiledDecode
from services.executor.grammars import GrammarRefused, Grammars
from services.executor.model.batch import ForwardBatch, to_device
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools
from services.executor.page_tables import PageTables
from services.executor.refusal import BatchRefused
from services.executor.sampling import sample, score_inputs, top_logprobs
from services.executor.step_checks import check_rows, check_slots
from services.executor.tiers import no_tiers
from services.executor.tiers.checks import TierMoveRefused
from services.executor.tiers.mover import TierMover
from services.executor.verify import verify_drafts
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepResult, StepRow
from shared.messages.sampling import RowScores, Top
from shared.messages.tiers import TierMove

log = logging.getLogger("custody.executor")


class StepFailed(RuntimeError):
    """A checked step failed on the device; `ops_ran`: all its deferred ops were applied."""

    def __init__(self, cause: Exception, ops_ran: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.ops_ran = ops_ran


@dataclass
class Sampled:
    """What a step's forward gave: its answer, before it is put on the wire."""

    tokens: list[int]  # per sampling row, in row order: one, or a verify row's several
    logprobs: list[float]
    logits: torch.Tensor | None = None  # [sampling rows, vocab], when asked for
    counts: list[int] = field(default_factory=list)  # per sampling row; empty: one each
    drafts: list[list[int]] = field(default_factory=list)  # per sampling row: the head's
    failed_moves: list[int] = field(default_factory=list)  # indices in the step's moves
    top: list[Top] = field(default_factory=list)  # per sampling row, what it asked for
    scores: list[RowScores] = field(default_factory=list)  # of the rows scoring inputs
    grammar_ended: list[str] = field(default_factory=list)  # rows whose grammar ended

    def reply(
        self, executor_epoch: str, step: int, scheduler_epoch: str, rids: list[str]
    ) -> StepResult:
        """The answer to step `step` whose sampling rows are `rids`, as the wire has it:
        the one place a run step becomes a result (the service and the in-process
        runtime both answer with it)."""
        return StepResult.of(
            executor_epoch,
            step,
            scheduler_epoch,
            rids,
            self.tokens,
            self.logprobs,
            failed_moves=self.failed_moves,
            top=self.top,
            scores=self.scores,
            grammar_ended=self.grammar_ended,
            counts=self.counts,
            drafts=self.drafts,
        )

    def last_tokens(self) -> list[int]:
        """Each sampling row's last token: what a row planned on top of it feeds."""
        if not self.counts:
            return self.tokens
        ends = itertools.accumulate(self.counts)
        return [self.tokens[end - 1] for end in ends]


class ModelRunner:
    def __init__(
        self,
        model: NemotronH,
        pools: DevicePools,
        mover: TierMover | None = None,
        compiled: CompiledDecode | None = None,
        grammars: Grammars | None = None,
        max_rows: int = 1024,
    ) -> None:
        """`compiled`: the compiled decode path (steps of one-token rows), else eager;
        `grammars`: constrained decoding (None: a constrained row is refused);
        `max_rows`: the scheduler's request rows, whose page tables are kept here."""
        self.model, self.pools, self.compiled = model, pools, compiled
        sizes = pools.sizes
        kv_rows = (sizes.kv_pages + 1) * sizes.page_size
        self.tables = PageTables(sizes.page_size, kv_rows, max_rows)
        self.grammars = grammars
        self.mover = mover if mover is not None else no_tiers(pools)
        self.device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.last_ops_seconds = 0.0  # host time to queue the last step's state ops
        self.last_ops_bytes = 0  # and the bytes they move

    def execute(
        self,
        rows: list[StepRow],
        ops: DeferredOps,
        keep_logits: bool = False,
        moves: Sequence[TierMove] = (),
        discards: Sequence[int] = (),
    ) -> Sampled:
        """BatchRefused before anything ran, StepFailed after (see the module's doc).
        Rows may carry KV deltas: they run with their whole contexts (page_tables.py)."""
        rows = self.validate(rows, ops, moves, discards)
        context = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with context, torch.inference_mode():
            try:
                failed = self.mover.apply(moves, discards)
                start = time.perf_counter()
                self.apply_ops(ops)
            except Exception as err:
                raise StepFailed(err, ops_ran=False) from err
            self.last_ops_seconds = time.perf_counter() - start
            self.last_ops_bytes = (len(ops.clears) + len(ops.copies)) * (
                self.pools.bytes_per_mamba_slot()
            )
            if not rows:
                return Sampled([], [], failed_moves=failed)
            try:
                sampled = self._forward(rows, keep_logits)
            except Exception as err:
                raise StepFailed(err, ops_ran=True) from err
            sampled.failed_moves = failed
            return sampled

    def _forward(self, rows: list[StepRow], keep_logits: bool) -> Sampled:
        sampling = [r for r in rows if r.sample]
        logits, scores, hidden_of = self._logits(rows)
        if not sampling:  # a step of prefill chunks that sample nothing
            self._feed_head(rows, hidden_of, {})
            return Sampled([], [], scores=scores)
        # each sampling row's logits: one position, or a verify row's drafts + 1
        ends = list(itertools.accumulate(r.drafts + 1 for r in sampling))
        last = [end - 1 for end in ends]
        plain = [j for j, r in enumerate(sampling) if not r.drafts]
        plain_rows = [sampling[j] for j in plain]
        at_last = logits if len(last) == len(logits) else logits[last]
        plain_logits = at_last if len(plain) == len(sampling) else at_last[plain]
        allowed = self.grammars.masks(plain_rows) if self.grammars else None
        tokens, logprobs = sample(plain_logits, plain_rows, allowed)
        chosen = tokens.tolist()
        if len(plain) == len(sampling):
            got, counts, lps = chosen, [], logprobs.tolist()
        else:
            got, counts, lps = self._verified(sampling, logits, ends, chosen, logprobs.tolist())
        drafts: list[list[int]] = []
        if hidden_of:
            bounds = list(itertools.accumulate(counts or [1] * len(got)))
            each = [got[a:b] for a, b in zip([0, *bounds], bounds, strict=False)]
            emitted = dict(zip((i for i, r in enumerate(rows) if r.sample), each, strict=True))
            guesses = self._feed_head(rows, hidden_of, emitted)
            drafts = [guesses.get(i, []) for i in emitted]
        return Sampled(
            got,
            lps,
            at_last.float().cpu() if keep_logits else None,
            counts=counts,
            drafts=drafts,
            top=top_logprobs(at_last, sampling),
            scores=scores,
            grammar_ended=self.grammars.accept(plain_rows, chosen) if allowed is not None else [],
        )

    @staticmethod
    def _verified(
        sampling: list[StepRow],
        logits: torch.Tensor,
        ends: list[int],
        plain_tokens: list[int],
        plain_logprobs: list[float],
    ) -> tuple[list[int], list[int], list[float]]:
        """Every sampling row's tokens in row order, with their counts and log
        probabilities: the plain rows' as sampled, each verify row's drafts judged."""
        plain = iter(zip(plain_tokens, plain_logprobs, strict=True))
        tokens: list[int] = []
        counts: list[int] = []
        logprobs: list[float] = []
        for row, end in zip(sampling, ends, strict=True):
            if row.drafts:
                got, lps = verify_drafts(logits[end - row.drafts - 1 : end], row)
            else:
                token, lp = next(plain)
                got, lps = [token], [lp]
            tokens += got
            logprobs += lps
            counts.append(len(got))
        return tokens, counts, logprobs

    def _feed_head(
        self, rows: list[StepRow], hidden_of: dict[int, torch.Tensor], emitted: dict[int, list[int]]
    ) -> dict[int, list[int]]:
        """The MTP head over each row that feeds it (StepRow.propose), at the positions
        the row committed (a verify row's accepted ones), each with the token after it;
        returns its guesses for each sampling row's next row, by row index."""
        head = self.model.mtp
        if hidden_of and head is None:
            raise RuntimeError("rows ask for the MTP head's drafts, but the model has none")
        guesses: dict[int, list[int]] = {}
        for i, hidden in hidden_of.items():
            row = rows[i]
            tokens = row.tokens.tolist()
            after = emitted.get(i, [])
            following = after if row.drafts else [*tokens[1:], *after[:1]]
            if not following:
                continue
            m, kv = len(following), torch.from_numpy(row.kv_indices.astype("int64"))
            kv = to_device(kv, self.device)
            nxt = to_device(torch.tensor(following, dtype=torch.long), self.device)
            n = row.propose if row.sample else 0
            args = (kv[: row.start], kv[row.start : row.start + m], nxt, hidden[:m], n)
            guesses[i] = head.propose(self.model, self.pools, *args)
        return guesses

    def _logits(
        self, rows: list[StepRow]
    ) -> tuple[torch.Tensor | None, list[RowScores], dict[int, torch.Tensor]]:
        """Logits [sampling positions, vocab], in row order (a verify row's drafts + 1
        positions, any other sampling row's last; None: no row samples), the input log
        probabilities of the rows that score positions, and the final hidden states of
        the rows that feed the MTP head, by row index. With the compiled decode path,
        the one-token rows that score nothing and feed no head go through it and the rest
        (prefill chunks) eagerly: rows never interact, so a step may be split."""
        fast = self._compiled_rows(rows)
        slow = sorted(set(range(len(rows))) - set(fast))
        parts: list[torch.Tensor] = []
        scores: list[RowScores] = []
        hidden_of: dict[int, torch.Tensor] = {}
        order: list[int] = []  # the row of each part's logits, in the parts' order
        if fast:
            logits = self._compiled_logits([rows[i] for i in fast])
            keep = [j for j, i in enumerate(fast) if rows[i].sample]
            parts.append(logits if len(keep) == len(fast) else logits[keep])
            order += [fast[j] for j in keep]
        if slow:
            batch = ForwardBatch([rows[i] for i in slow], self.device)
            hidden = self.model(batch, self.pools)
            parts.append(self.model.lm_head(hidden[batch.sample_positions]))
            order += [i for i in slow if rows[i].sample for _ in range(rows[i].drafts + 1)]
            scores = [
                score_inputs(self.model.lm_head, hidden[batch.span(j)], rows[i])
                for j, i in enumerate(slow)
                if len(rows[i].scored)
            ]
            hidden_of = {i: hidden[batch.span(j)] for j, i in enumerate(slow) if rows[i].propose}
        if not order:
            return None, scores, hidden_of
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        if order != sorted(order):  # a stable sort: a verify row's positions stay in order
            logits = logits[sorted(range(len(order)), key=order.__getitem__)]
        return logits, scores, hidden_of

    def _compiled_rows(self, rows: list[StepRow]) -> list[int]:
        """The rows the compiled decode path runs: one token, nothing scored, no head fed
        (the head needs the final hidden states, which the compiled step keeps inside)."""
        if self.compiled is None:
            return []
        return [
            i
            for i, r in enumerate(rows)
            if len(r.tokens) == 1 and not len(r.scored) and not r.propose
        ]

    def _compiled_logits(self, rows: list[StepRow]) -> torch.Tensor:
        """The compiled path; if it fails, the step fails (it may have written state) and
        the executor decodes eagerly from then on: a compiled graph that broke once (a
        recompilation that cannot be done here, say) would fail every later step."""
        try:
            return self.compiled.logits(rows)
        except Exception:
            log.exception("the compiled decode step failed; decoding eagerly from now on")
            self.compiled = None
            raise

    def warm_up(self) -> None:
        """One step on the padding sink, run before the executor announces itself: the
        first real step must not pay for lazy set-up (allocations, kernel choice, the
        Triton slot kernels' compilation on a GPU), or the scheduler sees a slow first
        step. A prefill and a decode row read and write slot 0 and page 0 only, and so
        does the compilation of every decode bucket; the sink is zeroed after, so the pools
        are bit for bit as they were."""
        sink = [0, min(1, self.pools.sizes.page_size - 1)]  # KV indices of page 0
        rows = [StepRow.of([0, 0], 0, sink, 0), StepRow.of([0], 0, sink[:1], 0)]
        context = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with context, torch.inference_mode():
            if self.compiled is not None:
                try:
                    self.compiled.warm_up()
                except Exception:  # no C++ compiler, say: serve eagerly rather than crash-loop
                    log.exception("compiling the decode step failed; decoding eagerly")
                    self.compiled = None
            self._forward(rows, keep_logits=False)
            zero = to_device(torch.zeros(1, dtype=torch.long), self.device)
            copy_slots(self.pools.state_tensors, zero, zero)
            clear_slots(self.pools.state_tensors, zero)
            for kv in (self.pools.k, self.pools.v):
                kv[:, : self.pools.sizes.page_size] = 0
        if self.stream is not None:
            self.stream.synchronize()

    def apply_ops(self, ops: DeferredOps) -> None:
        """Clears, then copies, over every Mamba layer's conv and SSM state."""
        if not ops:
            return
        to = lambda xs: to_device(torch.tensor(xs, dtype=torch.long), self.device)  # noqa: E731
        clear_slots(self.pools.state_tensors, to(ops.clears))
        if ops.copies:
            src, dst = zip(*ops.copies, strict=True)
            copy_slots(self.pools.state_tensors, to(src), to(dst))

    def validate(
        self,
        rows: list[StepRow],
        ops: DeferredOps,
        moves: Sequence[TierMove] = (),
        discards: Sequence[int] = (),
    ) -> list[StepRow]:
        """Refuse, before anything runs, a step that would touch the wrong memory; the
        rows with their whole contexts, their page tables kept once all is checked."""
        if not rows and not moves and not discards:
            raise BatchRefused("a step without rows or tier moves")
        try:
            self.mover.validate(moves, discards)
        except TierMoveRefused as err:
            raise BatchRefused(f"tier moves: {err}") from err
        check_slots(rows, ops, self.pools.sizes.mamba_slots + 1)
        rows, tables = self.tables.resolve(rows)
        if rows:
            check_rows(rows, self.model.cfg.vocab_size)
            self._validate_grammars(rows)
        self.tables.commit(tables)
        return rows

    def _validate_grammars(self, rows: list[StepRow]) -> None:
        constrained = [r for r in rows if r.grammar is not None]
        if constrained and self.grammars is None:
            raise BatchRefused(f"row {constrained[0].rid}: constrained, but no grammars here")
        if constrained:
            try:
                self.grammars.validate(constrained)
            except GrammarRefused as err:
                raise BatchRefused(str(err)) from err
