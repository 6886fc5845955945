"""custody's NemotronH against transformers' NemotronHForCausalLM on the same weights."""

import pytest
import torch

from services.executor.runner import ModelRunner
from shared.deferred_ops import DeferredOps
from tests.executor.oracle import (
    all_logits,
    build_reference,
    ours,
    pools_for,
    reference_logits,
    row,
    scattered_kv,
)

TOL = 1e-4
g = torch.Generator().manual_seed(1)
SEQ = torch.randint(0, 96, (70,), generator=g).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron_h")
    ref = build_reference(directory)
    return ref, ours(directory)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_one_shot_prefill(models, page_size):
    ref, model = models
    pools = pools_for(model, page_size)
    (kv,) = scattered_kv([len(SEQ)], page_size, seed=page_size)
    (got,) = all_logits(model, pools, [row(SEQ, 0, kv, 1)])
    expected = reference_logits(ref, SEQ)
    assert expected.abs().max() > 0.5  # the oracle is not comparing near-zero noise
    assert max_diff(got, expected) <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_b_three_uneven_chunks(models, page_size):
    ref, model = models
    pools = pools_for(model, page_size)
    (kv,) = scattered_kv([len(SEQ)], page_size, seed=3)
    outs = []
    for lo, hi in ((0, 13), (13, 50), (50, 70)):
        (part,) = all_logits(model, pools, [row(SEQ[lo:hi], lo, kv, 2)])
        outs.append(part)
    assert max_diff(torch.cat(outs), reference_logits(ref, SEQ)) <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_c_32_decode_steps(models, page_size):
    ref, model = models
    pools = pools_for(model, page_size)
    (kv,) = scattered_kv([len(SEQ)], page_size, seed=4)
    all_logits(model, pools, [row(SEQ[:38], 0, kv, 3)])
    for t in range(38, 70):
        (step,) = all_logits(model, pools, [row(SEQ[t : t + 1], t, kv, 3)])
        assert max_diff(step[0], reference_logits(ref, SEQ[: t + 1])[-1]) <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_d_ragged_batch_mixing_prefill_and_decode(models, page_size):
    ref, model = models
    pools = pools_for(model, page_size)
    seqs = [SEQ[:9], SEQ[5:40], SEQ[20:51], SEQ[::2]]
    kvs = scattered_kv([len(s) for s in seqs], page_size, seed=10)
    # rows 0 and 2 already hold all but their last token: they decode
    all_logits(model, pools, [row(seqs[0][:-1], 0, kvs[0], 1), row(seqs[2][:-1], 0, kvs[2], 3)])
    rows = [
        row(seqs[0][-1:], len(seqs[0]) - 1, kvs[0], 1),
        row(seqs[1], 0, kvs[1], 2),
        row(seqs[2][-1:], len(seqs[2]) - 1, kvs[2], 3),
        row(seqs[3], 0, kvs[3], 4),
    ]
    got = all_logits(model, pools, rows)
    for i, s in enumerate(seqs):
        expected = reference_logits(ref, s)
        assert max_diff(got[i], expected[-len(got[i]) :]) <= TOL, f"row {i}"


@pytest.mark.parametrize("page_size", [1, 16])
def test_e_continuation_after_a_deferred_copy_with_scattered_kv(models, page_size):
    ref, model = models
    pools = pools_for(model, page_size)
    runner = ModelRunner(model, pools)
    (kv,) = scattered_kv([len(SEQ)], page_size, seed=7)
    all_logits(model, pools, [row(SEQ[:45], 0, kv, 5)])
    ops = DeferredOps()
    ops.copy(5, 2)  # the state moves to slot 2; slot 5 is then scribbled over
    runner.apply_ops(ops)
    pools.ssm[:, 5].normal_()
    pools.conv[:, 5].normal_()
    (rest,) = all_logits(model, pools, [row(SEQ[45:], 45, kv, 2)])
    assert max_diff(rest, reference_logits(ref, SEQ)[45:]) <= TOL


def test_snapshot_inside_a_chunk_equals_the_state_at_that_length(models):
    ref, model = models
    pools = pools_for(model, 4)
    (kv,) = scattered_kv([len(SEQ)], 4, seed=8)
    all_logits(model, pools, [row(SEQ[:40], 0, kv, 1, snapshot_slot=6, snapshot_len=28)])
    (rest,) = all_logits(model, pools, [row(SEQ[28:40], 28, kv, 6)])  # resume from the snapshot
    assert max_diff(rest, reference_logits(ref, SEQ[:40])[28:]) <= TOL
