"""One row of a planned forward step: the row as the step message carries it (what the
step computes for one request, and the per-step facts completion must use: which
snapshot goes where, at what length, which working slot holds the result), plus what
only the scheduler needs. A request keeps the rows of its steps in flight."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.messages.forward import StepRow
from shared.messages.sampling import Penalties


@dataclass
class RowPlan:
    wire: StepRow  # sent as it is: the step message holds this very row
    prefill: bool  # computing prompt (or re-prefilling after a retract), not decoding
    step: int  # the step it is a row of
    dropped: bool = False  # its request ended or was re-queued while the step was in flight

    # The wire row's facts, read as the plan's own (one shape: no copies).
    @property
    def rid(self) -> str:
        return self.wire.rid

    @property
    def tokens(self) -> np.ndarray:
        """Fed at positions start..end-1."""
        return self.wire.tokens

    @property
    def start(self) -> int:
        return self.wire.start

    @property
    def end(self) -> int:
        return self.wire.end

    @property
    def mamba_slot(self) -> int:
        """The state is read from here."""
        return self.wire.mamba_slot

    @property
    def mamba_out(self) -> int:
        """And written here."""
        return self.wire.mamba_out

    @property
    def snapshot_slot(self) -> int:
        """0: no snapshot this step."""
        return self.wire.snapshot_slot

    @property
    def snapshot_len(self) -> int:
        return self.wire.snapshot_len

    @property
    def sample(self) -> bool:
        """The row produces a token."""
        return self.wire.sample

    @property
    def future(self) -> bool:
        """Tokens[0] is the token the step before samples."""
        return self.wire.future

    @property
    def drafts(self) -> int:
        """How many of its tokens are drafts to verify (0: a plain row)."""
        return self.wire.drafts

    @property
    def penalties(self) -> Penalties | None:
        return self.wire.penalties

    @property
    def owner(self) -> int:
        return self.wire.owner

    @property
    def track_owner(self) -> int:
        return self.wire.track_owner

    @property
    def session_owner(self) -> int:
        return self.wire.session_owner
