"""Batched Mamba slot clears and copies across every layer of a state tensor.

A state tensor is laid out `[layers, slots, ...]`; one op moves one slot's row in all
layers. On a GPU one Triton program runs one op (all layers, in blocks), so a whole
step's ops are a single launch per tensor on the compute stream, with no host sync. The
torch fallback (CPU, or no Triton) does the same with two index operations. Both write
identical bytes: a copy is a copy. Set TRITON_INTERPRET=1 (before import) to run the
Triton kernels on CPU, as the tests do.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without Triton uses the fallback
    triton = None

BLOCK = 1024


def triton_enabled(tensor: torch.Tensor) -> bool:
    """Triton on CUDA tensors, or anywhere under the Triton interpreter."""
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _layer_offset(layer, layer_stride):
        """Where a layer starts, in elements, in 64 bits: a pool of a large model holds
        more than 2**31 elements, where a 32-bit product would wrap and point outside it."""
        return tl.cast(layer, tl.int64) * layer_stride

    @triton.jit
    def _copy_rows(
        base, src_ptr, dst_ptr, n_layers, layer_stride, slot_stride, row_size, BLOCK: tl.constexpr
    ):
        op = tl.program_id(0)
        src = tl.load(src_ptr + op).to(tl.int64)
        dst = tl.load(dst_ptr + op).to(tl.int64)
        for layer in range(n_layers):
            layer_base = base + _layer_offset(layer, layer_stride)
            for start in range(0, row_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < row_size
                row = tl.load(layer_base + src * slot_stride + offs, mask=mask)
                tl.store(layer_base + dst * slot_stride + offs, row, mask=mask)

    @triton.jit
    def _clear_rows(
        base, dst_ptr, n_layers, layer_stride, slot_stride, row_size, BLOCK: tl.constexpr
    ):
        op = tl.program_id(0)
        dst = tl.load(dst_ptr + op).to(tl.int64)
        for layer in range(n_layers):
            layer_base = base + _layer_offset(layer, layer_stride)
            for start in range(0, row_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < row_size
                zeros = tl.zeros([BLOCK], dtype=base.dtype.element_ty)
                tl.store(layer_base + dst * slot_stride + offs, zeros, mask=mask)


def _geometry(t: torch.Tensor) -> tuple[int, int, int, int]:
    if not t.is_contiguous():
        raise ValueError("slot ops need a contiguous [layers, slots, ...] tensor")
    return t.shape[0], t.stride(0), t.stride(1), t[0, 0].numel()


def clear_slots(tensors: list[torch.Tensor], slots: torch.Tensor) -> None:
    """Zero `slots` (int64, on the tensors' device) in every layer of every tensor."""
    if slots.numel() == 0:
        return
    for t in tensors:
        if triton_enabled(t):
            layers, layer_stride, slot_stride, row = _geometry(t)
            _clear_rows[(slots.numel(),)](
                t, slots, layers, layer_stride, slot_stride, row, BLOCK=BLOCK
            )
        else:
            t[:, slots] = 0


def copy_slots(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slot src[i] to dst[i] in every layer. No slot may be both a source and a
    destination (validated by the caller), so the copies are independent."""
    if src.numel() == 0:
        return
    for t in tensors:
        if triton_enabled(t):
            layers, layer_stride, slot_stride, row = _geometry(t)
            _copy_rows[(src.numel(),)](
                t, src, dst, layers, layer_stride, slot_stride, row, BLOCK=BLOCK
            )
        else:
            t[:, dst] = t[:, src]
