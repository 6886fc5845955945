"""One forward step's rows, as the executor runs them: the `StepRow`s it decoded.

Each row brings its own tokens, where they start, the KV token indices of its whole
context, the Mamba slot its state is read from and the one the new state is written to
(the same slot for an update in place) and, optionally, a snapshot slot and the length
at which to snapshot. Rows of one token (decode) are run together, as `DecodeRows`;
longer rows (prefill chunks) one at a time, since their lengths differ. The batch makes
the rows' tensors, once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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


@dataclass(frozen=True)
class DecodeRows:
    """The one-token rows of a step as tensors, one entry per row: all the decode path
    reads, so the same arithmetic runs eagerly or compiled (compiled_decode.py).

    A row without a snapshot writes its snapshot to the sink slot 0, and rows added to
    fill a compiled batch size read and write only the sink (slot 0, KV index 0, a
    context of that one index): one shape of arithmetic for every row, and no real
    slot is touched by a row that is not real. The sink only ever holds finite values
    (a padding row attends to one real position), so a real row's masked-out context
    entries, which point at it, never bring a NaN into its output."""

    tokens: torch.Tensor  # [R] the token each row feeds
    slots: torch.Tensor  # [R] Mamba slot read
    out_slots: torch.Tensor  # [R] Mamba slot written
    snapshot_slots: torch.Tensor  # [R] snapshot written after the token; the sink if none
    context: torch.Tensor  # [R, L] KV indices of each context, padded with the sink
    mask: torch.Tensor  # [R, L] which context entries are real
    new_kv: torch.Tensor  # [R] the KV index of each row's new position

    @classmethod
    def of(cls, rows: list[StepRow], device: torch.device, padded_to: int = 0) -> DecodeRows:
        """`padded_to`: rows of the sink appended up to that many; contexts are padded to
        at least two entries (so a context length never specialises at 1)."""
        count = max(len(rows), padded_to)
        kv = [r.kv_indices for r in rows]
        ends = np.ones(count, dtype=np.int64)  # a sink row's context: index 0 alone
        ends[: len(rows)] = [len(k) for k in kv]
        context = np.zeros((count, max(2, int(ends.max()))), dtype=np.int64)
        for i, k in enumerate(kv):
            context[i, : len(k)] = k
        mask = np.arange(context.shape[1])[None, :] < ends[:, None]
        columns = np.zeros((5, count), dtype=np.int64)  # the sink's rows: all zero
        columns[:, : len(rows)] = np.array(
            [
                (
                    r.tokens[0],
                    r.mamba_slot,
                    r.mamba_out,
                    r.snapshot_slot if r.snapshot_len == r.end else 0,
                    r.kv_indices[r.start],
                )
                for r in rows
            ],
            dtype=np.int64,
        ).T.reshape(5, len(rows))
        tokens, slots, outs, snaps, new_kv = (
            to_device(t, device) for t in torch.from_numpy(columns)
        )
        return cls(
            tokens,
            slots,
            outs,
            snaps,
            context=to_device(torch.from_numpy(context), device),
            mask=to_device(torch.from_numpy(mask), device),
            new_kv=new_kv,
        )


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
        self.decode_rows = (
            DecodeRows.of([rows[i] for i in self.decode], device) if self.decode else None
        )
        # KV rows written this step, in token order
        new_kv = [kv[r.start :] for kv, r in zip(self.kv, rows, strict=True)]
        self.new_kv = to_device(torch.cat(new_kv), device)
        # the positions whose logits sample, in row order: a row's last, or all of a
        # verify row's (each verifies the draft after it; the last gives one more token)
        self.sample_positions = to(
            [
                p
                for i, r in enumerate(rows)
                if r.sample
                for p in range(self.offsets[i + 1] - 1 - r.drafts, self.offsets[i + 1])
            ]
        )

    def span(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])
