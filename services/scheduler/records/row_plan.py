"""One row of a planned forward step: what the step computes for one request, and the
per-step facts completion must use (which snapshot goes where, at what length, which
working slot holds the result). A request keeps the rows of its steps in flight."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.records.sampling import SamplingParams


@dataclass
class RowPlan:
    rid: str
    tokens: np.ndarray  # fed this step, at positions start .. start + len - 1
    start: int
    kv_indices: np.ndarray  # KV token indices of positions [0, start + len(tokens))
    mamba_slot: int  # the working slot the state is read from
    mamba_out: int  # the working slot the state after this step is written to
    snapshot_slot: int  # 0: no snapshot this step
    snapshot_len: int  # the state after this many positions goes to snapshot_slot
    sample: bool  # this row produces a token
    prefill: bool  # computing prompt (or re-prefilling after a retract), not decoding
    params: SamplingParams
    future: bool = False  # tokens[0] is the one the step before samples for this request
    # Ledger owner ids the row writes for, named on the wire for the session store's check.
    owner: int = 0  # the request: mamba_out and the KV of start..end are its
    track_owner: int = 0  # snapshot_slot is its track's
    session_owner: int = 0  # the session whose turn this is (its rollback copy), or 0
    dropped: bool = False  # its request ended or was re-queued while the step was in flight

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)
