"""One row of a planned forward step: the row as the step message carries it (what the
step computes for one request, and the per-step facts completion must use: which
snapshot goes where, at what length, which working slot holds the result), plus what
only the scheduler needs. A request keeps the rows of its steps in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.messages.forward import StepRow


@dataclass
class RowPlan:
    wire: StepRow  # sent as it is: the step message holds this very row
    prefill: bool  # computing prompt (or re-prefilling after a retract), not decoding
    dropped: bool = False  # its request ended or was re-queued while the step was in flight

    def __getattr__(self, name: str) -> Any:
        """The wire row's facts (rid, tokens, start, kv_indices, slots, sample, future,
        owners, end) read as the plan's own, so the row has one shape: no copies."""
        if name == "wire" or name.startswith("__"):
            raise AttributeError(name)  # not set yet (copying, unpickling): no recursion
        return getattr(self.wire, name)
