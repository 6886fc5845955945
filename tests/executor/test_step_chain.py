"""The executor's step chain: a step planned on top of another runs only right after it,
with its future tokens filled in from that step's samples; a refusal breaks the chain."""

import numpy as np
import pytest

from services.executor.refusal import BatchRefused
from services.executor.step_chain import StepChain
from shared.messages.forward import StepRow


def wire_row(rid: str, tokens: list[int], future: bool = False) -> StepRow:
    n = len(tokens)
    return StepRow.of(tokens, 4, np.arange(16, 20 + n), 1, rid=rid, mamba_out=2, future=future)


def test_future_tokens_are_the_previous_steps_samples():
    chain = StepChain()
    chain.resolve("s", None, [wire_row("a", [5, 6])])
    chain.ran("s", 1, ["a", "b"], [17, 23])
    rows = [wire_row("a", [-1], future=True), wire_row("b", [-1], future=True)]
    chain.resolve("s", 1, rows)
    assert [r.tokens.tolist() for r in rows] == [[17], [23]]


def test_a_step_runs_only_right_after_the_step_it_was_planned_on():
    chain = StepChain()
    chain.ran("s", 1, ["a"], [9])
    with pytest.raises(BatchRefused, match="planned on top of step 2"):
        chain.resolve("s", 2, [wire_row("b", [3])])
    with pytest.raises(BatchRefused, match="planned on top of step 1"):
        chain.resolve("other-scheduler", 1, [wire_row("b", [3])])  # step ids restart
    with pytest.raises(BatchRefused, match="sampled no token for it"):
        chain.resolve("s", 1, [wire_row("c", [-1], future=True)])


def test_a_refusal_breaks_the_chain_until_a_step_builds_on_nothing():
    chain = StepChain()
    chain.ran("s", 1, ["a"], [9])
    chain.broken()  # step 2 was refused
    with pytest.raises(BatchRefused, match="the last step run is nothing"):
        chain.resolve("s", 1, [wire_row("a", [-1], future=True)])  # step 3, on top of 2's base
    chain.resolve("s", None, [wire_row("a", [1, 2, 3])])  # re-planned from scratch
