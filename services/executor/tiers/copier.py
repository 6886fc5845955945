"""Copies along axis 1 (token index or Mamba slot) between the device's pools and the
host tier's tensors, vectorised: one gather, one transfer, one scatter per tensor.

On CUDA the copies run on a stream of their own, ordered against the compute stream at
both ends of a step's moves: they start after everything already queued there (the
forward that last wrote what a hibernate reads), and the compute stream's next work
(this step's forward, which may write the device pages a hibernate read, and reads what
a restore wrote) waits for them through an event. A device -> host copy gathers on the
device, lands in a pinned staging buffer without blocking, and is scattered into the
host tensors by the CPU once the copy stream has reached it. A host -> device copy
gathers on the CPU into pinned staging, crosses without blocking and is scattered on the
device; the staging buffer is not reused before the copy that reads it has run (the
caching host allocator records it on the copy stream). So the GPU never touches the
host tensors themselves, and the CPU reads or writes them only between such points.

On a CPU executor device and host share one memory: plain index copies.
"""

from __future__ import annotations

import contextlib

import torch


class Copier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.compute: torch.cuda.Stream | None = None

    def begin(self) -> None:
        """Copies queued from now on come after the work queued on the compute stream."""
        if self.stream is not None:
            self.compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(self.compute)

    def end(self) -> None:
        """The compute stream's next work comes after every copy queued so far."""
        if self.stream is not None and self.compute is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            self.compute.wait_event(done)
            self.compute = None

    def host_ready(self) -> None:
        """Before the CPU reads or writes host tensors: no queued copy is still due."""
        if self.stream is not None:
            self.stream.synchronize()

    def copy(
        self,
        src: list[torch.Tensor],
        src_index: torch.Tensor,
        dst: list[torch.Tensor],
        dst_index: torch.Tensor,
    ) -> int:
        """`d[:, dst_index] = s[:, src_index]` for each pair (int64 CPU indices);
        returns the bytes moved."""
        moved = 0
        context = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with context:
            for s, d in zip(src, dst, strict=True):
                values = self._carry(s, src_index, d.device)
                d.index_copy_(1, dst_index.to(d.device, non_blocking=True), values)
                moved += values.numel() * values.element_size()
        return moved

    def _carry(self, src: torch.Tensor, index: torch.Tensor, to: torch.device) -> torch.Tensor:
        """`src[:, index]`, on device `to`."""
        if src.device == to:
            return src.index_select(1, index.to(src.device))
        shape = (src.shape[0], len(index), *src.shape[2:])
        staged = torch.empty(shape, dtype=src.dtype, pin_memory=True)
        if to.type == "cpu":  # device -> host: the CPU scatters it next, so wait for it
            assert self.stream is not None
            staged.copy_(src.index_select(1, index.to(src.device)), non_blocking=True)
            self.stream.synchronize()
            return staged
        torch.index_select(src, 1, index, out=staged)  # host -> device
        return staged.to(to, non_blocking=True)
