"""The executor's deferred clears and copies run on the runner's compute stream, in order
with the forwards (services/executor/runner.py): after the forward that writes a copy's
source, before the forward that reads its destination.

A session's turn: a prefill chunk that samples nothing (so the host never waits for it)
writes slot 1; the next step copies slot 1 to slot 2 and clears slot 3, and its rows
read slot 2 (the turn continues from the copy) and slot 3 (a fresh sequence; slot 3
held another sequence's state before). Run twice on the same model from identically
rebuilt pools, once as it is and once with the device held back at the point that
matters, its logits and tokens must not change:

- `ops`: the kernels the runner calls (`clear_slots`, `copy_slots`, wrapped) first hold
  the current CUDA stream for ~50 ms (`torch.cuda._sleep`): ops queued anywhere but on
  the forward's stream, or with no wait between them, land after the forward read the
  slots;
- `source`: the compute stream is held ~50 ms before the prefill chunk that writes slot
  1: a copy queued anywhere but after that forward reads slot 1 before it is written.

Each delay comes with a negative control, the same ops queued on a side stream out of
the runner's order: for `ops`, the side stream held the same way and the forward not
waiting for it; for `source`, the compute stream held before the chunk and the ops not
waiting for it. The result must differ from the undelayed one, or the delay is too short
to be seen and the ordering test is blind (the control fails saying so).

What this cannot catch: a race that only a longer hold would open (the other side's
work taking over ~50 ms), races between the tier copier's stream and the compute stream
(tiers/copier.py), and the compiled decode path's streams (CUDA graphs replay on the
stream that calls them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import services.executor.runner as runner_module
from kernels.slot_ops import clear_slots, copy_slots
from services.executor.model.nemotron_h import NemotronH
from services.executor.runner import ModelRunner, Sampled
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from tests.executor.oracle import build_reference, ours, pools_for, row, scattered_kv

CYCLES = 100_000_000  # ~50 ms at the H200's ~2 GHz clock
PAGE = 4
g = torch.Generator().manual_seed(23)
A = torch.randint(0, 96, (30,), generator=g).tolist()  # the session's turn: slot 1, then 2
B = torch.randint(0, 96, (20,), generator=g).tolist()  # slot 3's old sequence
C = torch.randint(0, 96, (12,), generator=g).tolist()  # slot 3's new sequence, after a clear
KV_A, KV_B, KV_C = scattered_kv([len(A), len(B), len(C)], PAGE, seed=4)
SAME = 1e-5  # the delayed run's logits against the undelayed: the same arithmetic
UNSEEN = 1e-2  # the negative control's, at the least: a forward that read stale state


class Delays:
    """The slot kernels as the runner calls them, which while `on` first hold the current
    stream for CYCLES; `held` counts the calls that did."""

    def __init__(self) -> None:
        self.on = False
        self.held = 0

    def wrap(self, kernel: Callable[..., None]) -> Callable[..., None]:
        def held_back(*args: object) -> None:
            if self.on:
                torch.cuda._sleep(CYCLES)
                self.held += 1
            kernel(*args)

        return held_back


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> Delays:
    d = Delays()
    monkeypatch.setattr(runner_module, "clear_slots", d.wrap(clear_slots))
    monkeypatch.setattr(runner_module, "copy_slots", d.wrap(copy_slots))
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, cuda: torch.device) -> Iterator[NemotronH]:
    directory: Path = tmp_path_factory.mktemp("nemotron_h")
    build_reference(directory)
    yield ours(directory, cuda)
    torch.cuda.empty_cache()


def prepared(model: NemotronH, device: torch.device) -> ModelRunner:
    """A runner on fresh pools whose slot 3 holds B's state, everything done."""
    runner = ModelRunner(model, pools_for(model, PAGE, device=device))
    runner.execute([row(B, 0, KV_B, 3)], DeferredOps(clears=[3]))
    torch.cuda.synchronize()
    return runner


def prefill(runner: ModelRunner) -> None:
    """All of A but its last token into a cleared slot 1, sampling nothing: no host sync."""
    runner.execute([row(A[:-1], 0, KV_A, 1, sample=False)], DeferredOps(clears=[1]))


def turn_ops() -> DeferredOps:
    ops = DeferredOps()
    ops.copy(1, 2)
    ops.clear(3)
    return ops


def turn_rows() -> list[StepRow]:
    """A's last token from slot 2 (the copy of slot 1), C from slot 3 (cleared)."""
    return [row(A[-1:], len(A) - 1, KV_A, 2), row(C, 0, KV_C, 3)]


def turn(runner: ModelRunner, hold_source: bool = False) -> Sampled:
    """The prefill chunk, then the step with the ops; `hold_source`: the compute stream
    is held CYCLES before the chunk, so its write of slot 1 lands late."""
    if hold_source:
        with torch.cuda.stream(runner.stream):
            torch.cuda._sleep(CYCLES)
    prefill(runner)
    return runner.execute(turn_rows(), turn_ops(), keep_logits=True)


def unordered(runner: ModelRunner, hold: str, device: torch.device) -> Sampled:
    """The turn with the ops queued on a side stream, out of the runner's order: `ops`,
    the side stream held before them and the forward not waiting for them; `source`, the
    compute stream held before the chunk and the ops not waiting for it."""
    ops = turn_ops()
    index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    clears, src, dst = index(ops.clears), index([1]), index([2])  # before any hold
    side = torch.cuda.Stream(device)
    if hold == "ops":
        prefill(runner)
        torch.cuda.synchronize()
    else:
        with torch.cuda.stream(runner.stream):
            torch.cuda._sleep(CYCLES)
        prefill(runner)
    with torch.cuda.stream(side):
        if hold == "ops":
            torch.cuda._sleep(CYCLES)
        clear_slots(runner.pools.state_tensors, clears)
        copy_slots(runner.pools.state_tensors, src, dst)
    if hold == "source":
        runner.stream.wait_stream(side)  # the forward after the ops: only the source races
    try:
        return runner.execute(turn_rows(), DeferredOps(), keep_logits=True)
    finally:
        torch.cuda.synchronize()


def max_diff(a: Sampled, b: Sampled) -> float:
    return float((a.logits - b.logits).abs().max())


@pytest.mark.parametrize("hold", ["ops", "source"])
def test_deferred_ops_are_ordered_with_the_forwards_on_the_compute_stream(
    model: NemotronH, cuda: torch.device, delays: Delays, hold: str
):
    expected = turn(prepared(model, cuda))
    runner = prepared(model, cuda)
    delays.on = hold == "ops"
    got = turn(runner, hold_source=hold == "source")
    delays.on = False
    torch.cuda.synchronize()
    if hold == "ops":
        assert delays.held == 3, delays.held  # the chunk's clear, the turn's clear and copy
    assert got.tokens == expected.tokens
    assert max_diff(got, expected) <= SAME, (
        f"held {hold}: logits moved by {max_diff(got, expected)}"
    )


@pytest.mark.parametrize("hold", ["ops", "source"])
def test_the_delay_is_seen_by_a_forward_out_of_order(
    model: NemotronH, cuda: torch.device, hold: str
):
    """The negative control: without the runner's ordering, the same hold changes the
    result; if not, the ordering test above would pass whatever the order."""
    expected = turn(prepared(model, cuda))
    got = unordered(prepared(model, cuda), hold, cuda)
    diff = max_diff(got, expected)
    if diff <= UNSEEN:
        pytest.fail(
            f"held {hold}: ops out of the runner's order moved the logits by only {diff:.3g}: "
            f"a {CYCLES}-cycle delay is not seen, and the ordering test is blind"
        )
