"""The compiled decode path against the eager one (services/executor/compiled_decode.py):
the same steps on two copies of the same pools give logits within 1e-4, the same tokens
wherever the eager top-2 margin is at least 1e-3, the same state written to the same
slots, and no write outside the step's own slots but the sink. One compilation serves the
module (buckets 1, 2 and 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor.compiled_decode import CompiledDecode, buckets_for
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import builtin_model
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow

CPU = torch.device("cpu")
SIZES = PoolSizes(kv_pages=64, page_size=4, mamba_slots=12)
MAX_ROWS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return builtin_model()


@pytest.fixture(scope="module")
def compiled_runner(model) -> ModelRunner:
    pools = DevicePools(model.cfg, SIZES, CPU)
    runner = ModelRunner(model, pools, compiled=CompiledDecode(model, pools, MAX_ROWS))
    runner.warm_up()
    return runner


def random_pools(model, seed: int) -> DevicePools:
    pools = DevicePools(model.cfg, SIZES, CPU)
    g = torch.Generator().manual_seed(seed)
    for t in (pools.k, pools.v, pools.conv, pools.ssm):
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    return pools


def copy_into(dst: DevicePools, src: DevicePools) -> None:
    for a, b in ((dst.k, src.k), (dst.v, src.v), (dst.conv, src.conv), (dst.ssm, src.ssm)):
        a.copy_(b)


def decode_rows(count: int, position: int, snapshot_row: int | None = None) -> list[StepRow]:
    """`count` one-token rows at various context lengths; row i reads slot i+1 and writes
    slot i+5 (row 0 updates in place); `snapshot_row` also snapshots to slot 12."""
    rows = []
    for i in range(count):
        start = position + 3 * i
        kv = np.arange(4 + 60 * i, 4 + 60 * i + start + 1)
        out = i + 1 if i == 0 else i + 5
        snap = {"snapshot_slot": 12, "snapshot_len": start + 1} if i == snapshot_row else {}
        rows.append(StepRow.of([7 + i], start, kv, i + 1, mamba_out=out, **snap))
    return rows


def margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@pytest.mark.parametrize(
    ("count", "position", "snapshot_row"), [(1, 5, None), (3, 9, 1), (4, 30, 0), (2, 1, None)]
)
def test_compiled_decode_matches_eager(model, compiled_runner, count, position, snapshot_row):
    eager = ModelRunner(model, random_pools(model, count))
    compiled = compiled_runner
    copy_into(compiled.pools, eager.pools)
    rows = decode_rows(count, position, snapshot_row)
    with torch.inference_mode():
        ours = compiled.execute(rows, DeferredOps(), keep_logits=True)
        theirs = eager.execute(rows, DeferredOps(), keep_logits=True)
    assert (ours.logits - theirs.logits).abs().max() <= 1e-4
    decided = margins(theirs.logits) >= 1e-3
    assert decided.any()
    tokens = np.array(ours.tokens) == np.array(theirs.tokens)
    assert tokens[decided.numpy()].all()
    # the same state in every slot but the sink (the compiled batch's padding writes there)
    for a, b in ((compiled.pools.conv, eager.pools.conv), (compiled.pools.ssm, eager.pools.ssm)):
        assert torch.allclose(a[:, 1:], b[:, 1:], atol=1e-5)
    page = SIZES.page_size
    for a, b in ((compiled.pools.k, eager.pools.k), (compiled.pools.v, eager.pools.v)):
        assert torch.allclose(a[:, page:], b[:, page:], atol=1e-5)


def test_a_long_generation_decodes_the_same_tokens(model, compiled_runner):
    """A prefill (eager on both sides), then 24 decode steps of three rows, each fed its
    own sampled token: the compiled and the eager runner generate the same tokens."""
    eager = ModelRunner(model, DevicePools(model.cfg, SIZES, CPU))
    compiled = compiled_runner
    compiled.pools.reset()
    prompts = [np.arange(10) + 20 * i for i in range(3)]
    kv = [np.arange(4 + 70 * i, 4 + 70 * i + 40) for i in range(3)]
    fed = [StepRow.of(p, 0, kv[i][:10], i + 1) for i, p in enumerate(prompts)]
    outputs = []
    for runner in (compiled, eager):
        step, out = fed, []
        ops = DeferredOps(clears=[1, 2, 3])
        for n in range(25):
            tokens = runner.execute(step, ops).tokens
            out.append(tokens)
            pos = 10 + n
            step = [StepRow.of([t], pos, kv[i][: pos + 1], i + 1) for i, t in enumerate(tokens)]
            ops = DeferredOps()
        outputs.append(out)
    assert outputs[0] == outputs[1]


def test_mixed_steps_rows_that_do_not_sample_and_steps_past_the_largest_bucket(
    model, compiled_runner
):
    """A step of prefill and decode rows runs its decode rows compiled and its prefill
    rows eagerly, logits back in row order; a one-token row that does not sample gives
    no token; more one-token rows than the largest bucket run a bucket at a time."""
    compiled = compiled_runner
    eager = ModelRunner(model, random_pools(model, 7))
    prefill = StepRow.of(np.arange(6) + 3, 0, np.arange(200, 206), 11)
    decode = decode_rows(3, 4)
    decode[1].sample = False
    many = [*decode_rows(MAX_ROWS, 4), StepRow.of([1], 0, [220], 11)]
    for rows in ([decode[0], prefill, *decode[1:]], many):
        copy_into(compiled.pools, eager.pools)
        with torch.inference_mode():
            ours, theirs = (
                r.execute(rows, DeferredOps(), keep_logits=True) for r in (compiled, eager)
            )
        assert len(ours.tokens) == sum(r.sample for r in rows)
        assert (ours.logits - theirs.logits).abs().max() <= 1e-4
        assert ours.tokens == theirs.tokens


def test_buckets_are_powers_of_two_up_to_the_running_limit():
    assert buckets_for(1) == (1,)
    assert buckets_for(12) == (1, 2, 4, 8, 12)
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)


def test_the_warm_up_compiles_before_the_first_step_and_leaves_the_sink_zeroed(
    compiled_runner,
):
    assert compiled_runner.compiled.compile_seconds > 0
    compiled_runner.pools.reset()
    compiled_runner.warm_up()
    pools = compiled_runner.pools
    for t in (pools.k, pools.v, pools.conv, pools.ssm):
        assert not t.any()


def test_a_bfloat16_model_decodes_the_same_tokens_compiled_and_eager(model):
    """`--dtype bfloat16` with the compiled path (its own compilation): the pools in
    bfloat16, the SSM state in float32, the same greedy tokens as eager."""
    bf16 = builtin_model().to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    runners = []
    for compiled in (True, False):
        pools = DevicePools(bf16.cfg, SIZES, CPU, torch.bfloat16)
        decode = CompiledDecode(bf16, pools, MAX_ROWS) if compiled else None
        runners.append(ModelRunner(bf16, pools, compiled=decode))
    runners[0].warm_up()
    prompts = [np.arange(10) + 20 * i for i in range(3)]
    kv = [np.arange(4 + 70 * i, 4 + 70 * i + 30) for i in range(3)]
    outputs = []
    for runner in runners:
        step, out = [StepRow.of(p, 0, kv[i][:10], i + 1) for i, p in enumerate(prompts)], []
        ops = DeferredOps(clears=[1, 2, 3])
        for n in range(12):
            tokens = runner.execute(step, ops).tokens
            out.append(tokens)
            step = [StepRow.of([t], 10 + n, kv[i][: 11 + n], i + 1) for i, t in enumerate(tokens)]
            ops = DeferredOps()
        outputs.append(out)
    assert runners[0].pools.ssm.dtype == torch.float32
    assert outputs[0] == outputs[1]


def test_a_compiled_path_that_fails_fails_its_step_then_decoding_goes_eager(model, monkeypatch):
    """No crash loop and no repeated failures: a compiled path that cannot be built at
    start-up leaves the executor eager; one that fails in a step fails that step (state
    may be half written: `ops_ran`) and every later step decodes eagerly."""
    from services.executor.runner import StepFailed

    def broken(self, rows):
        raise RuntimeError("inductor: no C++ compiler")

    monkeypatch.setattr(CompiledDecode, "run", broken)
    pools = DevicePools(model.cfg, SIZES, CPU)
    starting = ModelRunner(model, pools, compiled=CompiledDecode(model, pools, MAX_ROWS))
    starting.warm_up()
    assert starting.compiled is None
    running = ModelRunner(model, pools, compiled=CompiledDecode(model, pools, MAX_ROWS))
    eager = ModelRunner(model, random_pools(model, 3))
    copy_into(pools, eager.pools)
    rows = decode_rows(2, 6)
    with pytest.raises(StepFailed) as failed:
        running.execute(rows, DeferredOps())
    assert failed.value.ops_ran and running.compiled is None
    copy_into(pools, eager.pools)
    assert running.execute(rows, DeferredOps()).tokens == eager.execute(rows, DeferredOps()).tokens
