"""The compiled decode path on CUDA (services/executor/compiled_decode.py): compiled by
inductor and captured as CUDA graphs (`CudaGraphs`, one per batch bucket and context
bucket), replayed against an eager runner on the same model. After `warm_up` (every
graph captured, none fallen back to eager), decode steps of 1, 3 and 8 rows (3 is padded
to the bucket of 4 with rows of the sink) whose contexts grow past 64 positions into
the 128 bucket: logits within 1e-4 in float32 (TF32 off), the same greedy tokens
wherever eager's top-2 margin is at least 1e-3 (both runners are fed eager's tokens,
so a near tie cannot fork the two runs), and the same state left in the rows' slots and
KV. The built-in model with `max_position_embeddings` 256: three context buckets (64,
128, 256) and four batch buckets (1, 2, 4, 8), twelve graphs.

What this cannot catch: buckets past those captured here (a long context's graph, a
batch past 8), a graph replayed while another stream writes its inputs (the runner
replays on its compute stream), bfloat16 (test_logits.py checks the eager path in
bf16), and the speed the graphs are for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from services.executor.compiled_decode import CompiledDecode
from services.executor.model.batch import DecodeRows
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner, Sampled
from services.executor.weights import builtin_model
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.model_config import builtin_config
from tests.executor.test_compiled_decode import margins

MAX_ROWS = 8
CONFIG = dataclasses.replace(builtin_config(), max_position_embeddings=256)
SPAN = 128  # KV positions of each row's own region
SIZES = PoolSizes(kv_pages=(4 + SPAN * MAX_ROWS) // 4 + 1, page_size=4, mamba_slots=12)
DECODE_STEPS = 20
TOLERANCE = 1e-4
DECIDED = 1e-3  # eager's top-2 margin past which the compiled token must be eager's


def prompt_length(i: int) -> int:
    """Row i's prompt: 48 + i tokens, so every batch's longest context starts under 64
    and ends past it (55 + 20 < 128 at the most): each batch crosses a context bucket."""
    return 48 + i


@pytest.fixture(scope="module")
def exact_fp32() -> Iterator[None]:
    """TF32 off before the graphs are captured (a captured matmul keeps its math mode)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def model(cuda: torch.device, exact_fp32: None) -> Iterator[NemotronH]:
    yield builtin_model(CONFIG, cuda)
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def runners(model: NemotronH, cuda: torch.device) -> tuple[ModelRunner, ModelRunner]:
    """(eager, compiled), each on its own pools; the compiled one warmed up."""
    eager = ModelRunner(model, DevicePools(model.cfg, SIZES, cuda))
    pools = DevicePools(model.cfg, SIZES, cuda)
    compiled = ModelRunner(model, pools, compiled=CompiledDecode(model, pools, MAX_ROWS))
    compiled.warm_up()
    return eager, compiled


def row_kv(i: int) -> np.ndarray:
    return np.arange(4 + SPAN * i, 4 + SPAN * (i + 1))  # past the sink page


def prefill_rows(count: int) -> list[StepRow]:
    g = torch.Generator().manual_seed(count)
    rows = []
    for i in range(count):
        n = prompt_length(i)
        tokens = torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist()
        rows.append(StepRow.of(tokens, 0, row_kv(i)[:n], i + 1))
    return rows


def decode_rows(tokens: list[int], step: int) -> list[StepRow]:
    """Each row's next token at its next position, reading and writing slot i + 1."""
    rows = []
    for i, token in enumerate(tokens):
        start = prompt_length(i) + step
        rows.append(StepRow.of([token], start, row_kv(i)[: start + 1], i + 1))
    return rows


def lockstep(
    eager: ModelRunner, compiled: ModelRunner, count: int
) -> list[tuple[Sampled, Sampled]]:
    """A prefill of `count` rows (eager on both), then DECODE_STEPS decode steps run by
    both, each fed eager's tokens; (eager's, compiled's) answer of every decode step."""
    for runner in (eager, compiled):
        runner.pools.reset()
    ops = DeferredOps(clears=list(range(1, count + 1)))
    tokens = eager.execute(prefill_rows(count), ops).tokens
    assert compiled.execute(prefill_rows(count), ops).tokens == tokens  # both eager here
    steps = []
    for step in range(DECODE_STEPS):
        rows = decode_rows(tokens, step)
        ours = compiled.execute(rows, DeferredOps(), keep_logits=True)
        theirs = eager.execute(rows, DeferredOps(), keep_logits=True)
        steps.append((theirs, ours))
        tokens = theirs.tokens
    return steps


def compare(steps: list[tuple[Sampled, Sampled]], count: int) -> None:
    decided = 0
    for n, (theirs, ours) in enumerate(steps):
        diff = float((ours.logits - theirs.logits).abs().max())
        assert diff <= TOLERANCE, f"{count} rows, decode step {n}: logits differ by {diff:.3g}"
        sure = (margins(theirs.logits) >= DECIDED).tolist()
        for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens, strict=True)):
            assert a == b or not sure[i], f"{count} rows, step {n}, row {i}: token {a} != {b}"
        decided += sum(sure)
    assert decided >= 0.9 * count * len(steps)  # the tokens were compared, nearly all


def same_state(eager: ModelRunner, compiled: ModelRunner, count: int) -> None:
    """The rows' slots and KV regions hold the same state after the run (the sink, which
    the padding rows write, aside)."""
    a, b = eager.pools, compiled.pools
    for x, y in ((a.conv, b.conv), (a.ssm, b.ssm)):
        assert torch.allclose(x[:, 1 : count + 1], y[:, 1 : count + 1], atol=1e-5)
    end = 4 + SPAN * count
    for x, y in ((a.k, b.k), (a.v, b.v)):
        assert torch.allclose(x[:, 4:end], y[:, 4:end], atol=1e-5)


def test_every_graph_is_captured_at_warm_up(runners: tuple[ModelRunner, ModelRunner]):
    _, compiled = runners
    assert compiled.compiled is not None, "the compiled path fell back to eager at warm-up"
    graphs = compiled.compiled.graphs
    assert graphs is not None and graphs.context_buckets() == [64, 128, 256]
    assert sorted(graphs.graphs) == [(b, n) for b in (1, 2, 4, MAX_ROWS) for n in (64, 128, 256)]


@pytest.mark.parametrize("count", [1, 3, 8])
def test_replayed_graphs_decode_as_eager_does_across_a_context_bucket(
    runners: tuple[ModelRunner, ModelRunner], count: int, monkeypatch: pytest.MonkeyPatch
):
    eager, compiled = runners
    assert compiled.compiled is not None and compiled.compiled.graphs is not None
    graphs = compiled.compiled.graphs
    replayed: list[tuple[int, int]] = []  # (batch bucket, context length) of each replay
    replay = graphs.replay

    def counted(rows: DecodeRows) -> torch.Tensor:
        replayed.append((rows.tokens.shape[0], rows.context.shape[1]))
        return replay(rows)

    monkeypatch.setattr(graphs, "replay", counted)
    steps = lockstep(eager, compiled, count)
    torch.cuda.synchronize()
    compare(steps, count)
    same_state(eager, compiled, count)
    bucket = next(b for b in compiled.compiled.buckets if b >= count)
    assert len(replayed) == DECODE_STEPS and {b for b, _ in replayed} == {bucket}
    lengths = [next(n for n in graphs.context_buckets() if n >= c) for _, c in replayed]
    assert set(lengths) == {64, 128}, f"context buckets replayed: {sorted(set(lengths))}"
