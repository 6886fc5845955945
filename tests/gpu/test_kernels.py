"""The Triton slot kernels (kernels/slot_ops.py) compiled for the GPU, against the torch
fallback run on a host copy of the same tensors: identical bytes after the same clears
and copies, in float32 and bfloat16, with NaN payloads and infinities among the copied
values and rows longer than one block (BLOCK); and 64-bit offsets, on a uint8 tensor
whose layer stride is past 2**31 elements (about 6.4 GB of device memory), sampled near
the end of its second layer, where a 32-bit offset would wrap.

What this cannot catch: a race between the kernels and other work on other streams
(test_stream_order.py), sizes past the ones here (a stride past 2**63 elements), and
the kernels' speed. The large tensor is sampled, not compared whole: a stray write far
from the sampled positions (inside the tensor) would pass unseen.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.slot_ops import BLOCK, clear_slots, copy_slots, triton_enabled

CLEARS = [2, 7]
SOURCES, DESTINATIONS = [1, 3, 6], [4, 5, 8]
# float32 bit patterns: quiet and signalling NaNs with payloads, negative NaN, infinities
F32_SPECIALS = [0x7FC0_1234, 0x7F80_0001, 0xFFC0_0BAD, 0x7F80_0000, 0xFF80_0000]
BF16_SPECIALS = [0x7FC1, 0x7F81, 0xFFC3, 0x7F80, 0xFF80]


@pytest.fixture(autouse=True)
def compiled_kernels() -> None:
    """The kernels must be compiled for the device: under the interpreter (chosen when
    Triton is imported) the CUDA tensors would go through it, and nothing here would
    test what a GPU runs."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1: no compiled kernels"


def signed(pattern: int, bits: int) -> int:
    """A bit pattern as the signed integer of `bits` bits that holds it."""
    return pattern - (1 << bits) if pattern >= 1 << (bits - 1) else pattern


def state_tensors(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """A conv-like and an SSM-like state tensor, [layers, slots, ...], seeded, the SSM's
    rows 2,400 elements long (over two blocks of 1,024 and a part); every special value
    planted in each source slot, in a cleared one and in the untouched slot 0, one of
    them in the last, partial block of the row."""
    g = torch.Generator().manual_seed(11)
    conv = torch.randn(3, 9, 6, 3, generator=g).to(dtype)
    ssm = torch.randn(3, 9, 4, 6, 100, generator=g).to(dtype)
    assert ssm[0, 0].numel() > 2 * BLOCK
    bits, specials = (32, F32_SPECIALS) if dtype == torch.float32 else (16, BF16_SPECIALS)
    as_int = torch.int32 if bits == 32 else torch.int16
    for t in (conv, ssm):
        flat = t.view(as_int).view(t.shape[0], t.shape[1], -1)  # the same memory
        row = flat.shape[2]
        for slot in [*SOURCES, CLEARS[0], 0]:
            for i, pattern in enumerate(specials):
                value = signed(pattern, bits)
                flat[i % t.shape[0], slot, (i * 5 + slot) % row] = value
                flat[(i + 1) % t.shape[0], slot, row - 1 - i] = value
    return [conv.to(device), ssm.to(device)]


def apply(tensors: list[torch.Tensor], device: torch.device) -> None:
    index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    clear_slots(tensors, index(CLEARS))
    copy_slots(tensors, index(SOURCES), index(DESTINATIONS))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernels_write_the_fallbacks_bytes(cuda: torch.device, dtype: torch.dtype):
    on_device = state_tensors(dtype, cuda)
    on_host = [t.cpu() for t in on_device]
    assert all(triton_enabled(t) for t in on_device)
    assert not any(triton_enabled(t) for t in on_host)  # the host copy takes the fallback
    apply(on_device, cuda)
    torch.cuda.synchronize()
    apply(on_host, torch.device("cpu"))
    for got, expected in zip(on_device, on_host, strict=True):
        assert same_bytes(got.cpu(), expected), f"{tuple(got.shape)}: bytes differ"
    # the ops did something: a destination holds its source's bytes, specials included,
    # and a cleared slot is zero in every layer
    before = state_tensors(dtype, torch.device("cpu"))
    for got, old in zip(on_device, before, strict=True):
        host = got.cpu()
        assert same_bytes(host[:, 8], old[:, 6]) and not same_bytes(host[:, 8], old[:, 8])
        assert not host[:, 2].view(torch.uint8).any() and not host[:, 7].view(torch.uint8).any()
        assert same_bytes(host[:, 1], old[:, 1])  # a source is left as it was
        assert host[:, 4].isnan().any() and host[:, 4].isinf().any()  # copied from slot 1


ROW = 2**30 + 7  # [2 layers, 3 slots, ROW] uint8: a layer stride of 3 * ROW > 2**31


def sampled_positions() -> list[int]:
    """Positions in a row: its first blocks, its middle, its last (partial) block."""
    return [0, 1, BLOCK - 1, BLOCK, ROW // 2, ROW - BLOCK - 3, ROW - 8, ROW - 2, ROW - 1]


def filler(layer: int, slot: int) -> int:
    return 100 + 10 * layer + slot


def marker(layer: int, slot: int, position: int) -> int:
    return (layer * 31 + slot * 7 + position * 13) % 251 + 1  # never 0


def test_offsets_past_two_to_the_31_elements_are_computed_in_64_bits(cuda: torch.device):
    """Every slot filled with its own byte, markers at sampled positions; clear slot 1 and
    copy slot 0 to slot 2, in both layers. Layer 1 starts 3 * ROW > 2**31 elements in, and
    slot 2 of layer 0 at 2 * ROW > 2**31: a 32-bit offset would wrap there. The tensor is
    freed (and the cache emptied) whatever the outcome: a failed check is reported after,
    so its traceback holds no frame that holds the tensor."""
    t = torch.empty((2, 3, ROW), dtype=torch.uint8, device=cuda)
    failure = ""
    try:
        assert t.stride(0) > 2**31 and 2 * t.stride(1) > 2**31 and triton_enabled(t)
        check_huge(t, cuda)
    except AssertionError as err:
        failure = str(err) or "assertion failed"
    finally:
        del t
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if failure:
        pytest.fail(failure)


def check_huge(t: torch.Tensor, cuda: torch.device) -> None:
    positions = sampled_positions()
    where = torch.tensor(positions, device=cuda)
    for layer in range(2):
        for slot in range(3):
            t[layer, slot].fill_(filler(layer, slot))
            marks = [marker(layer, slot, p) for p in positions]
            t[layer, slot, where] = torch.tensor(marks, dtype=torch.uint8, device=cuda)
    clear_slots([t], torch.tensor([1], device=cuda))
    copy_slots([t], torch.tensor([0], device=cuda), torch.tensor([2], device=cuda))
    torch.cuda.synchronize()
    unmarked = torch.tensor([ROW // 3, ROW - BLOCK - 1], device=cuda)
    for layer in range(2):
        source = [marker(layer, 0, p) for p in positions]
        assert t[layer, 0, where].tolist() == source, f"layer {layer}: the source changed"
        assert not t[layer, 1, where].any(), f"layer {layer}: slot 1 not cleared"
        assert t[layer, 2, where].tolist() == source, f"layer {layer}: slot 2 is no copy"
        fill = filler(layer, 0)
        got = t[layer, :, unmarked].tolist()
        assert got == [[fill, fill], [0, 0], [fill, fill]], f"layer {layer}: filler {got}"
