"""A CPU model of what the executor does to device state, for scheduler tests.

KV cells hold (token, position); a Mamba slot holds a rolling hash of the tokens fed
through it. A step applies its deferred ops, writes KV through the plan's indices and
writes each row's new state from its read slot to its write slot, filling a future token
with what the step before sampled for that row, exactly as the executor does to tensors.
Dropped rows (requests that ended while the step was in flight) are run too, as the
executor runs them: their writes must land where they harm nobody. The
"model" then samples from what it read: the state hash and every KV cell of the row's
context. A wrong slot, a stale copy or a KV index pointing at another row's data changes
the token, so equality with a one-shot reference proves the bookkeeping, not just lists.

Tier moves run first, in the executor's order (shared/messages/tiers.py), over a host
tier shaped like the device (KV cells and state slots) and a disk of blobs keyed by disk
slot; a blob named in `corrupt` fails its check at a load, as a damaged file would.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from services.executor.page_tables import PageTables
from services.scheduler.allocators.pools import Pools
from services.scheduler.engine.step import StepPlan
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepResult
from shared.messages.tiers import MOVE_ORDER, TierMove

MOD = (1 << 61) - 1
_WEIGHTS = np.random.default_rng(12345).integers(1, 1 << 20, size=1 << 16)


def mix(h: int, token: int) -> int:
    return (h * 1_000_003 + int(token) + 1) % MOD


def state_of(tokens) -> int:
    h = 0
    for t in tokens:
        h = mix(h, t)
    return h


def next_token(h: int, kv_tokens: np.ndarray, kv_positions: np.ndarray, vocab: int) -> int:
    k = int(((kv_tokens * 7919 + kv_positions) * _WEIGHTS[kv_positions]).sum())
    return (h ^ k) % vocab


def reference(
    prompt: list[int], max_new: int, vocab: int, stops: Collection[int] = ()
) -> list[int]:
    """One-shot greedy generation over `prompt`, no cache, no sessions; it ends after
    `max_new` tokens or a token of `stops` (kept, as a request's output keeps it)."""
    seq = list(prompt)
    h = state_of(seq)
    out = []
    while len(out) < max_new:
        pos = np.arange(len(seq))
        token = next_token(h, np.asarray(seq), pos, vocab)
        out.append(token)
        if token in stops:
            break
        seq.append(token)
        h = mix(h, token)
    return out


class DataModelExecutor:
    def __init__(
        self, pools: Pools, vocab: int, sequence_of: Callable[[str], np.ndarray] | None = None
    ) -> None:
        cfg = pools.config
        cells = (cfg.kv_pages + 1) * cfg.page_size
        self.kv_tokens = np.full(cells, -1, dtype=np.int64)
        self.kv_positions = np.full(cells, -1, dtype=np.int64)
        self.state = np.zeros(cfg.mamba_slots + 1, dtype=np.int64)
        host_cells = (cfg.host_kv_pages + 1) * cfg.page_size
        self.host_tokens = np.full(host_cells, -1, dtype=np.int64)
        self.host_positions = np.full(host_cells, -1, dtype=np.int64)
        self.host_state = np.zeros(cfg.host_mamba_slots + 1, dtype=np.int64)
        self.blobs: dict[int, tuple] = {}  # disk slot -> (sid, tokens, KV tokens, positions, state)
        self.corrupt: set[int] = set()  # disk slots whose blob fails its check
        self.failed: list[int] = []  # tier moves of the last step that did not happen
        self.page_size = cfg.page_size
        self.vocab = vocab
        self.sequence_of = sequence_of  # when given, each row's starting state is checked
        self.rows_checked = 0
        self.sampled: dict[str, int] = {}  # by the last step run: the next one's future tokens
        # the executor's own page tables: rows arrive as deltas, as on the wire
        self.tables = PageTables(cfg.page_size, cells, cfg.max_running_requests)

    def apply_ops(self, plan: StepPlan) -> None:
        apply_to_arrays(plan.ops, self.state)

    def run(self, plan: StepPlan, contexts: list[np.ndarray] | None = None) -> dict[str, int]:
        """Run `plan`; `contexts`: each row's whole context when it was planned, which
        its KV delta and the page tables here must give back exactly."""
        wires, tables = self.tables.resolve([r.wire for r in plan.rows])
        self.tables.commit(tables)
        for row, context in zip(wires, contexts or [[]] * len(wires), strict=True):
            assert contexts is None or np.array_equal(row.kv_indices, context), row.rid
        self.move(plan.moves, plan.discards)
        self.apply_ops(plan)
        out = {}
        for plan_row, row in zip(plan.rows, wires, strict=True):
            assert row.mamba_slot > 0 and row.mamba_out > 0
            h = int(self.state[row.mamba_slot])
            if self.sequence_of is not None and not plan_row.dropped:
                expected = state_of(self.sequence_of(row.rid)[: row.start])
                assert h == expected, f"{row.rid} starts from a wrong state at {row.start}"
                self.rows_checked += 1
            tokens = row.tokens.copy()
            if row.future:
                tokens[0] = self.sampled[row.rid]
            new = row.written_kv
            self.kv_tokens[new] = tokens
            self.kv_positions[new] = np.arange(row.start, row.end)
            after = []  # the state after each position
            for i, token in enumerate(tokens):
                h = mix(h, token)
                after.append(h)
                if row.snapshot_slot and row.start + i + 1 == row.snapshot_len:
                    self.state[row.snapshot_slot] = h
            for j, slot in enumerate(row.spec_slots.tolist()):
                self.state[slot] = after[j]
            self.state[row.mamba_out] = h
            if row.sample:
                out[row.rid] = self._sample(row, tokens, after)
        self.sampled = {rid: got if isinstance(got, int) else got[-1] for rid, got in out.items()}
        return out

    def _sample(self, row, tokens: np.ndarray, after: list[int]) -> int | list[int]:
        """The row's token, or a verify row's: greedy acceptance of its drafts, each
        judged by the position before it, then the token after the last accepted."""
        idx = row.kv_indices  # the whole context, as the page tables resolved it
        if not row.drafts:
            return next_token(after[-1], self.kv_tokens[idx], self.kv_positions[idx], self.vocab)
        got = []
        first = len(tokens) - row.drafts - 1  # the position that judges the first draft
        for i in range(first, len(tokens)):
            ctx = idx[: row.start + i + 1]
            token = next_token(after[i], self.kv_tokens[ctx], self.kv_positions[ctx], self.vocab)
            got.append(token)
            if i + 1 == len(tokens) or token != tokens[i + 1]:
                break
        return got

    def move(self, moves: list[TierMove], discards: list[int]) -> None:
        """Delete `discards`, then run the moves kind by kind, in the executor's order."""
        for slot in discards:
            self.blobs.pop(slot, None)
            self.corrupt.discard(slot)
        self.failed = []
        order = sorted(range(len(moves)), key=lambda i: MOVE_ORDER.index(moves[i].kind))
        for i in order:
            m = moves[i]
            if m.kind == "spill":
                cells = self._cells(m.src_pages, m.tokens)
                self.blobs[m.dst_slot] = (
                    m.sid,
                    m.tokens,
                    self.host_tokens[cells].copy(),
                    self.host_positions[cells].copy(),
                    int(self.host_state[m.src_slot]),
                )
                continue
            if m.kind == "load":
                blob = self.blobs.get(m.src_slot)
                if m.src_slot in self.corrupt or blob is None or blob[:2] != (m.sid, m.tokens):
                    self.failed.append(i)
                    continue
                cells = self._cells(m.dst_pages, m.tokens)
                self.host_tokens[cells], self.host_positions[cells] = blob[2], blob[3]
                self.host_state[m.dst_slot] = blob[4]
                continue
            to_host = m.kind == "hibernate"
            src = (self.kv_tokens, self.kv_positions, self.state)
            dst = (self.host_tokens, self.host_positions, self.host_state)
            if not to_host:
                src, dst = dst, src
            a, b = self._cells(m.src_pages, m.tokens), self._cells(m.dst_pages, m.tokens)
            dst[0][b], dst[1][b] = src[0][a], src[1][a]
            dst[2][m.dst_slot] = src[2][m.src_slot]

    def _cells(self, pages: np.ndarray, tokens: int) -> np.ndarray:
        """The KV cells of positions 0..tokens-1 on `pages`."""
        ps = self.page_size
        return (pages[:, None] * ps + np.arange(ps)).ravel()[:tokens]


def apply_to_arrays(ops: DeferredOps, *states: np.ndarray) -> None:
    """Apply `ops` to arrays whose first axis is the slot (a CPU model of the executor's
    pools, for tests that check the data effect, not just the lists)."""
    for state in states:
        ops.validate(state.shape[0])
        if ops.clears:
            state[np.asarray(ops.clears)] = 0
        if ops.copies:
            src, dst = np.asarray(ops.copies).T
            state[dst] = state[src]


def result_of(
    plan: StepPlan, sampled: dict[str, int | list[int]], failed: list[int] | None = None
) -> StepResult:
    """The executor's reply to `plan` that sampled `sampled` (a verify row: its tokens),
    as the step driver (`EngineCore.complete`) takes it from the wire."""
    each = [[got] if isinstance(got, int) else got for got in sampled.values()]
    tokens = [t for got in each for t in got]
    return StepResult.of(
        "",
        plan.step_id,
        "",
        list(sampled),
        tokens,
        [0.0] * len(tokens),
        failed_moves=failed,
        counts=[len(got) for got in each],
    )
