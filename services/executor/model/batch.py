"""One forward step's rows, as the executor runs them: the `StepRow`s it decoded.

Each row brings its own tokens, where they start, the KV token indices of its whole
context, the Mamba slot its state is read from and the one the new state is written to
(the same slot for an update in place) and, optionally, a snapshot slot and the length
at which to snapshot. Rows of one token (decode) are run together; longer rows (prefill chunks)
one at a time, since their lengths differ. The batch makes the rows' tensors, once.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from shared.messages.forward import StepRow


def host_tensor(ints: np.ndarray) -> torch.Tensor:
    """int64 on the host, as the model indexes with (a copy: the wire's arrays are
    read-only)."""
    return torch.from_numpy(ints.astype(np.int64))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a host sync: pinned memory, asynchronous copy on the
    current (compute) stream. On CPU, the tensor itself."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ForwardBatch:
    def __init__(self, rows: list[StepRow], device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self.kv = [host_tensor(r.kv_indices) for r in rows]  # per row, on the host
        lengths = [len(r.tokens) for r in rows]
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        tokens = host_tensor(np.concatenate([r.tokens for r in rows]))
        self.token_ids = to_device(tokens, device)
        self.decode = [i for i, n in enumerate(lengths) if n == 1]
        self.prefill = [i for i, n in enumerate(lengths) if n > 1]
        to = lambda xs: to_device(torch.tensor(xs, dtype=torch.long), device)  # noqa: E731
        # all-decode steps (the common case) address their tokens by a slice, not a gather
        only_decode = len(self.decode) == len(rows)
        self.decode_positions = (
            slice(0, len(rows)) if only_decode else to([self.offsets[i] for i in self.decode])
        )
        self.decode_slots = to([rows[i].mamba_slot for i in self.decode])
        self.decode_out_slots = to([rows[i].mamba_out for i in self.decode])
        # KV rows written this step, in token order
        new_kv = [kv[r.start :] for kv, r in zip(self.kv, rows, strict=True)]
        self.new_kv = to_device(torch.cat(new_kv), device)
        self.last_positions = to([self.offsets[i + 1] - 1 for i, r in enumerate(rows) if r.sample])
        self._decode_context: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """KV indices of the decode rows' contexts, padded to the longest with the sink
        index 0, and the mask of real positions: built once, used by every attention layer."""
        if self._decode_context is None:
            kv = [self.kv[i] for i in self.decode]
            idx = to_device(pad_sequence(kv, batch_first=True), self.device)
            ends = to_device(torch.tensor([len(k) for k in kv]), self.device)
            mask = torch.arange(idx.shape[1], device=self.device)[None, :] < ends[:, None]
            self._decode_context = (idx, mask)
        return self._decode_context

    def span(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])
