"""The Triton slot kernels, run by the Triton interpreter on CPU, against the torch
fallback: identical bytes, in float32 and bfloat16. The interpreter is chosen at import
time, so the kernels run in a child process with TRITON_INTERPRET=1."""

import os
import subprocess
import sys
import textwrap

import torch

from kernels.slot_ops import clear_slots, copy_slots, triton_enabled

CHECK = textwrap.dedent(
    """
    import os, torch
    from kernels.slot_ops import clear_slots, copy_slots, triton_enabled

    def tensors():
        g = torch.Generator().manual_seed(0)
        conv = torch.randn(3, 9, 6, 3, generator=g)
        ssm = torch.randn(3, 9, 2, 4, 300, generator=g)  # rows longer than one block
        conv[1, 4, 0, 0] = float("nan")
        ssm[2, 6, 1, 1, 5] = float("inf")
        half = torch.randn(3, 9, 6, 3, generator=g).to(torch.bfloat16)  # --dtype bfloat16
        return [conv, ssm, half]

    clears, src, dst = torch.tensor([2, 7]), torch.tensor([1, 3, 6]), torch.tensor([4, 5, 8])
    assert triton_enabled(torch.zeros(1))
    by_triton = tensors()
    clear_slots(by_triton, clears)
    copy_slots(by_triton, src, dst)
    os.environ["TRITON_INTERPRET"] = "0"
    assert not triton_enabled(torch.zeros(1))
    by_torch = tensors()
    clear_slots(by_torch, clears)
    copy_slots(by_torch, src, dst)
    for a, b in zip(by_triton, by_torch):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "bytes differ"
    assert torch.equal(by_torch[1][:, 8].view(torch.int32), tensors()[1][:, 6].view(torch.int32))
    print("identical")
    """
)


def test_triton_kernels_under_the_interpreter_write_the_fallbacks_bytes():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical" in done.stdout


def test_fallback_clears_then_copies_in_every_layer(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_enabled(torch.zeros(1))
    t = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    expected = t.clone()
    clear_slots([t], torch.tensor([1]))
    copy_slots([t], torch.tensor([2]), torch.tensor([4]))
    expected[:, 1] = 0
    expected[:, 4] = expected[:, 2]
    assert torch.equal(t, expected)


OFFSETS = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl
    from kernels.slot_ops import _layer_offset

    @triton.jit
    def where(out, layer, layer_stride):
        tl.store(out, _layer_offset(layer, layer_stride))

    out = torch.zeros(1, dtype=torch.int64)
    # An 8B-class hybrid's SSM pool: 2**30 elements a layer; layer 3 starts past 2**31.
    where[(1,)](out, 3, 2**30)
    print(int(out[0]))
    """
)


def test_triton_slot_kernels_address_layers_past_2_to_the_31_elements():
    """The layer offset the kernels use is computed in 64 bits (checked on the offset
    arithmetic itself: a pool that large does not fit in this machine's memory)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-c", OFFSETS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == 3 * 2**30
