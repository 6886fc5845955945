"""The checks of a step that need no device: its Mamba slots and deferred ops, and its
rows once their page tables resolved them (page_tables.py). The model runner makes them
before anything runs; so does the orchestration bench's stand-in executor, which must
pay for what the executor pays for."""

from __future__ import annotations

import numpy as np

from services.executor.refusal import BatchRefused
from shared.deferred_ops import DeferredOps, DeferredOpsError
from shared.messages.forward import StepRow
from shared.messages.sampling import MAX_TOP_LOGPROBS


def check_slots(rows: list[StepRow], ops: DeferredOps, slots: int) -> None:
    """Every Mamba slot a row or an op touches lies in 1..slots-1, none is written
    twice, and no row reads a slot another row writes."""
    try:
        ops.validate(slots)
    except DeferredOpsError as err:
        raise BatchRefused(f"deferred ops: {err}") from err
    reads = [r.mamba_slot for r in rows]
    writes = [r.mamba_out for r in rows] + [r.snapshot_slot for r in rows if r.snapshot_slot]
    writes += [int(s) for r in rows for s in r.spec_slots]
    if any(not 0 < s < slots for s in reads + writes):
        raise BatchRefused(f"Mamba slots {reads + writes} must lie in 1..{slots - 1}")
    written = set(writes)
    if len(written) != len(writes):
        raise BatchRefused(f"a Mamba slot is written twice: {writes}")
    for r in rows:
        if r.mamba_slot in written and r.mamba_slot != r.mamba_out:
            raise BatchRefused(f"Mamba slot {r.mamba_slot} is read by one row, written by another")


def check_rows(rows: list[StepRow], vocab: int) -> None:
    """Rows resolved to their whole contexts: tokens, snapshots and log probabilities
    in range, and no KV index written twice (the indices' range was checked as they
    entered the page tables)."""
    for i, r in enumerate(rows):
        if len(r.tokens) == 0 or r.start < 0:
            raise BatchRefused(f"row {i}: {len(r.tokens)} tokens from position {r.start}")
        if r.snapshot_slot and not r.start < r.snapshot_len <= r.end:
            raise BatchRefused(f"row {i}: snapshot at {r.snapshot_len} outside this step")
        if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BatchRefused(f"row {i}: {r.top_logprobs} top logprobs (0..{MAX_TOP_LOGPROBS})")
        verified_alone = r.grammar is None and r.penalties is None and not r.top_logprobs
        if r.drafts and not (verified_alone and not len(r.scored)):
            raise BatchRefused(
                f"row {i}: drafts on a row with a grammar, penalties, top log probabilities "
                "or scored inputs (those rows are not verified: docs/speculative.md)"
            )
    fed = [r.tokens for r in rows] + [r.scored for r in rows]
    tokens = np.concatenate(fed + _penalty_ids(rows))
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise BatchRefused(f"token ids (fed, scored or penalised) outside [0, {vocab})")
    new = np.concatenate([r.written_kv for r in rows])
    if len(np.unique(new)) != len(new):
        raise BatchRefused("two positions of this step write the same KV index")


def _penalty_ids(rows: list[StepRow]) -> list[np.ndarray]:
    """The ids the rows' penalties count: indices into the logits, checked like tokens."""
    pens = [r.penalties for r in rows if r.penalties is not None]
    return [a for p in pens for a in (p.prompt_ids, p.output_ids)]
