"""The runner: deferred ops' data effect, refusal of bad steps before anything runs, and
whether a failing step's ops ran."""

import pytest
import torch

from services.executor.refusal import BatchRefused
from services.executor.runner import ModelRunner, StepFailed
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.messages.sampling import Penalties
from tests.executor.oracle import (
    all_logits,
    build_reference,
    ours,
    pools_for,
    reference_logits,
    row,
    scattered_kv,
)

g = torch.Generator().manual_seed(2)
A = torch.randint(0, 96, (30,), generator=g).tolist()
B = torch.randint(0, 96, (25,), generator=g).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron_h")
    return build_reference(directory), ours(directory)


def test_a_cleared_slot_starts_from_zero_state(models):
    ref, model = models
    pools = pools_for(model, 1)
    runner = ModelRunner(model, pools)
    kv_a, kv_b = scattered_kv([len(A), len(B)], 1, seed=1)
    all_logits(model, pools, [row(A, 0, kv_a, 3)])
    (dirty,) = all_logits(model, pools, [row(B, 0, kv_b, 3)])  # slot 3 still holds A's state
    assert (dirty - reference_logits(ref, B)).abs().max() > 1e-3
    all_logits(model, pools, [row(A, 0, kv_a, 3)])
    ops = DeferredOps()
    ops.clear(3)
    runner.apply_ops(ops)
    assert pools.ssm[:, 3].abs().max() == 0 and pools.conv[:, 3].abs().max() == 0
    (clean,) = all_logits(model, pools, [row(B, 0, kv_b, 3)])
    assert (clean - reference_logits(ref, B)).abs().max() <= 1e-4


def test_a_row_reads_one_slot_and_writes_another(models):
    """Prefill and decode rows leave the slot they read untouched and write to their
    output slot exactly the state an update in place would have left."""
    _, model = models
    pools = pools_for(model, 1)
    (kv,) = scattered_kv([len(A)], 1, seed=3)
    all_logits(model, pools, [row(A[:20], 0, kv, 1)])
    before = [t[:, 1].clone() for t in pools.state_tensors]
    cases = {"prefill": (A[20:28], 20), "decode": (A[20:21], 20)}
    for tokens, start in cases.values():
        (split,) = all_logits(model, pools, [row(tokens, start, kv, 1, mamba_out=5)])
        assert all(
            torch.equal(t[:, 1], b) for t, b in zip(pools.state_tensors, before, strict=True)
        )
        written = [t[:, 5].clone() for t in pools.state_tensors]
        (in_place,) = all_logits(model, pools, [row(tokens, start, kv, 1)])
        assert torch.equal(split, in_place)
        assert all(
            torch.equal(t[:, 1], w) for t, w in zip(pools.state_tensors, written, strict=True)
        )
        for t, b in zip(pools.state_tensors, before, strict=True):
            t[:, 1] = b  # back to the state after 20 positions


def test_a_copied_slot_continues_exactly_like_its_source(models):
    _, model = models
    pools = pools_for(model, 4)
    runner = ModelRunner(model, pools)
    kv_1, kv_2 = scattered_kv([len(A), len(A)], 4, seed=2)
    all_logits(model, pools, [row(A[:20], 0, kv_1, 1)])
    ops = DeferredOps()
    ops.copy(1, 6)
    runner.apply_ops(ops)
    pools.k[:, kv_2[:20]] = pools.k[:, kv_1[:20]]  # the KV of the prefix, as a shared cache would
    pools.v[:, kv_2[:20]] = pools.v[:, kv_1[:20]]
    (from_source,) = all_logits(model, pools, [row(A[20:], 20, kv_1, 1)])
    (from_copy,) = all_logits(model, pools, [row(A[20:], 20, kv_2, 6)])
    assert torch.equal(from_source, from_copy)


def bad_steps(kv: torch.Tensor) -> dict[str, tuple[list[StepRow], DeferredOps]]:
    """Steps refused by their rows carry valid ops that would change the pools if run."""
    ok = lambda **kw: StepRow.of(torch.tensor([1, 2]), 0, kv[:2], **({"mamba_slot": 1} | kw))  # noqa: E731
    fine = lambda: DeferredOps(clears=[5], copies=[(6, 7)])  # noqa: E731
    twice = DeferredOps(clears=[2], copies=[(3, 2)])
    return {
        "no rows": ([], fine()),
        "slot 0": ([ok(mamba_slot=0)], fine()),
        "slot out of range": ([ok(mamba_slot=99)], fine()),
        "same slot, two rows": ([ok(), StepRow.of(torch.tensor([3]), 0, kv[2:3], 1)], fine()),
        "destination twice": ([ok()], twice),
        "op on the sink": ([ok()], DeferredOps(clears=[5, 0])),
        "op out of range": ([ok()], DeferredOps(clears=[5], copies=[(6, 9)])),
        "source and destination": ([ok()], DeferredOps(clears=[5], copies=[(6, 7), (7, 8)])),
        "kv in the sink page": ([StepRow.of(torch.tensor([1]), 0, torch.tensor([0]), 1)], fine()),
        "kv out of range": ([StepRow.of(torch.tensor([1]), 0, torch.tensor([10**6]), 1)], fine()),
        "a delta without a table": ([StepRow.of([1], 1, kv[1:2], 1, row=3, kv_from=1)], fine()),
        "request row out of range": ([StepRow.of([1], 0, kv[:1], 1, row=5000)], fine()),
        "one request row twice": (
            [ok(row=2), StepRow.of([3], 0, kv[2:3], 2, row=2, mamba_out=3)],
            fine(),
        ),
        "token out of vocab": ([StepRow.of(torch.tensor([500]), 0, kv[:1], 1)], fine()),
        "snapshot outside the step": ([ok(snapshot_slot=4, snapshot_len=9)], fine()),
        "penalised id out of vocab": ([ok(penalties=Penalties.of(1.2, 0, 0, [900], []))], fine()),
        "penalised output out of vocab": ([ok(penalties=Penalties.of(1, 1, 0, [], [-1]))], fine()),
        "21 top logprobs": ([ok(top_logprobs=21)], fine()),
        "read a slot another row writes": (
            [ok(mamba_out=2), StepRow.of(torch.tensor([3]), 0, kv[2:3], 2, mamba_out=3)],
            fine(),
        ),
    }


def pool_tensors(pools) -> list[torch.Tensor]:
    return [pools.k, pools.v, pools.conv, pools.ssm]


@pytest.mark.parametrize("case", list(bad_steps(torch.arange(1, 4))))
def test_a_bad_step_is_refused_before_anything_runs(models, case):
    """Rows and ops are all checked before the first op: a refusal leaves every pool bit
    for bit as it was, ops included (ops_ran is False)."""
    _, model = models
    pools = pools_for(model, 1)
    runner = ModelRunner(model, pools)
    for t in pool_tensors(pools):
        t.normal_()
    before = [t.clone() for t in pool_tensors(pools)]
    rows, ops = bad_steps(torch.arange(1, 4))[case]
    with pytest.raises(BatchRefused):
        runner.execute(rows, ops)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_tensors(pools), strict=True))


def test_a_failing_forward_reports_that_the_ops_ran(models, monkeypatch):
    _, model = models
    pools = pools_for(model, 1)
    runner = ModelRunner(model, pools)
    pools.ssm.normal_()
    source = pools.ssm[:, 6].clone()
    (kv,) = scattered_kv([len(A)], 1, seed=6)

    def broken(*_: object) -> None:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(StepFailed, match="RuntimeError: the device fell over") as failed:
        runner.execute([row(A, 0, kv, 5)], DeferredOps(clears=[5], copies=[(6, 7)]))
    assert failed.value.ops_ran
    assert pools.ssm[:, 5].abs().max() == 0 and torch.equal(pools.ssm[:, 7], source)


def test_a_failing_op_reports_that_the_ops_did_not_run(models, monkeypatch):
    _, model = models
    runner = ModelRunner(model, pools_for(model, 1))
    (kv,) = scattered_kv([len(A)], 1, seed=7)

    def broken(*_: object) -> None:
        raise RuntimeError("copy kernel failed")

    monkeypatch.setattr(runner, "apply_ops", broken)
    with pytest.raises(StepFailed, match="copy kernel failed") as failed:
        runner.execute([row(A, 0, kv, 5)], DeferredOps(copies=[(6, 7)]))
    assert not failed.value.ops_ran


def test_execute_samples_greedily_and_reports_logprobs(models):
    ref, model = models
    pools = pools_for(model, 1)
    runner = ModelRunner(model, pools)
    (kv,) = scattered_kv([len(A)], 1, seed=5)
    ops = DeferredOps(clears=[2])
    result = runner.execute([row(A, 0, kv, 2)], ops, keep_logits=True)
    expected = reference_logits(ref, A)[-1]
    assert result.tokens == [int(expected.argmax())]
    assert abs(result.logprobs[0] - float(torch.log_softmax(expected, -1).max())) < 1e-4


def test_execute_returns_the_top_logprobs_a_row_asks_for(models):
    """From the raw logits whatever the sampling parameters; a row that asks for none
    gets none."""
    ref, model = models
    pools = pools_for(model, 2)
    runner = ModelRunner(model, pools)
    kv_a, kv_b = scattered_kv([len(A), len(B)], 1, seed=8)
    sampling = {"temperature": 0.7, "top_k": 3, "min_p": 0.2, "seed": 1, "top_logprobs": 5}
    penalties = Penalties.of(1.5, 1.0, 1.0, A, A[:4])
    rows = [row(A, 0, kv_a, 2, penalties=penalties, **sampling), row(B, 0, kv_b, 3)]
    result = runner.execute(rows, DeferredOps(clears=[2, 3]))
    expected = torch.log_softmax(reference_logits(ref, A)[-1], -1)
    values, ids = torch.topk(expected, 5)
    top_ids, top_lps = result.top[0]
    assert top_ids == ids.tolist() and torch.allclose(torch.tensor(top_lps), values, atol=1e-4)
    assert abs(result.logprobs[0] - float(expected[result.tokens[0]])) < 1e-4
    assert result.top[1] == ([], [])
