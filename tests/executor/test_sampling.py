"""Sampling: greedy, temperature with top-k, min-p and top-p, vLLM's penalties, seeded
reproducibility, no parameter or logit that makes the distribution NaN or empty, and top
log probabilities from the raw logits."""

import pytest
import torch

from services.executor.sampling import SamplingError, sample, top_logprobs
from shared.messages.forward import StepRow
from shared.messages.sampling import Penalties

g = torch.Generator().manual_seed(0)
LOGITS = torch.randn(1, 50, generator=g)


def draw(sampling: dict, end: int = 10) -> int:
    row = StepRow.of([1], end - 1, torch.arange(1, end + 1), 1, **sampling)
    tokens, logprobs = sample(LOGITS.clone(), [row])
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1).gather(1, tokens[:, None])[:, 0])
    return int(tokens[0])


def test_greedy_and_degenerate_filters_pick_the_argmax():
    best = int(LOGITS.argmax())
    assert draw(dict()) == best
    assert draw(dict(temperature=1.0, top_k=1, seed=3)) == best
    assert draw(dict(temperature=1.0, top_p=1e-6, seed=3)) == best


def test_seeded_draws_repeat_and_differ_across_seeds():
    draws_a = [draw(dict(temperature=2.0, seed=1), end) for end in range(5, 45)]
    assert draws_a == [draw(dict(temperature=2.0, seed=1), end) for end in range(5, 45)]
    draws_b = [draw(dict(temperature=2.0, seed=2), end) for end in range(5, 45)]
    assert draws_a != draws_b
    assert len(set(draws_a)) > 5  # a temperature of 2 spreads over the vocabulary


def test_top_k_never_draws_outside_the_k_best():
    top = set(torch.topk(LOGITS[0], 3).indices.tolist())
    assert {draw(dict(temperature=5.0, top_k=3, seed=s)) for s in range(40)} <= top


def pick(logits: torch.Tensor, sampling: dict, end: int = 10) -> tuple[int, float]:
    """One row's token and logprob, checked to be a valid token with a finite logprob."""
    row = StepRow.of([1], end - 1, torch.arange(1, end + 1), 1, **sampling)
    tokens, logprobs = sample(logits[None, :].clone(), [row])
    assert 0 <= int(tokens[0]) < logits.numel() and torch.isfinite(logprobs).all()
    return int(tokens[0]), float(logprobs[0])


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 1e-5, 1e-300, float("nan"), float("inf")])
def test_no_temperature_breaks_the_distribution(temperature):
    token, _ = pick(LOGITS[0], dict(temperature=temperature, seed=7))
    if not temperature > 1e-5:  # greedy below 1e-5 (and for NaN); 1e-5 is one-hot anyway
        assert token == int(LOGITS.argmax())


@pytest.mark.parametrize("top_p", [1e-9, 0.0, -1.0, float("nan")])
def test_any_top_p_keeps_at_least_the_argmax(top_p):
    token, _ = pick(LOGITS[0], dict(temperature=1.0, top_p=top_p, seed=1))
    if top_p == top_p:  # not NaN: nothing but the argmax survives
        assert token == int(LOGITS.argmax())


def test_top_k_one_and_huge_top_k():
    best = int(LOGITS.argmax())
    assert {pick(LOGITS[0], dict(temperature=3.0, top_k=1, seed=s))[0] for s in range(9)} == {best}
    pick(LOGITS[0], dict(temperature=3.0, top_k=2**62, seed=1))


def test_one_finite_logit_among_minus_infinities_is_always_drawn():
    logits = torch.full((50,), float("-inf"))
    logits[17] = -3.0
    for sampling in (dict(), dict(temperature=1.0, top_k=5, top_p=0.5, seed=2)):
        assert pick(logits, sampling) == (17, 0.0)
    assert pick(logits, dict(temperature=float("inf"), seed=2))[0] == 17


def test_huge_logits_sample_without_overflow():
    logits = LOGITS[0] * 1e30
    best = int(logits.argmax())
    assert pick(logits, dict())[0] == best
    assert pick(logits, dict(temperature=1e-5, seed=1))[0] == best
    assert pick(logits, dict(temperature=1.0, top_p=0.9, seed=1))[0] == best
    pick(torch.tensor([3e38, -3e38, 0.0]), dict(temperature=2.0, seed=4))


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1])
def test_every_64_bit_seed_is_accepted_and_reproducible(seed):
    sampling = dict(temperature=2.0, seed=seed)
    assert pick(LOGITS[0], sampling) == pick(LOGITS[0], sampling)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_broken_logits_raise_a_sampling_error_naming_the_row(bad):
    logits = LOGITS.repeat(2, 1)
    logits[1, 4] = bad
    rows = [StepRow.of([1], 3, torch.arange(1, 5), 1) for _ in range(2)]
    with pytest.raises(SamplingError, match=r"rows \[1\]"):
        sample(logits, rows)
    with pytest.raises(SamplingError, match=r"rows \[0\]"):
        sample(torch.full((1, 50), float("-inf")), rows[:1])


def penalised(logits: list[float], sampling: dict, prompt=(), output=(), **row) -> int:
    """The greedy token under vLLM's penalties, for hand-built logits; the log
    probability reported is still the raw logits' one."""
    pens = sampling.pop("penalties", (1.0, 0.0, 0.0))
    raw = torch.tensor([logits])
    step_row = StepRow.of(
        row.pop("tokens", [0]),
        9,
        torch.arange(1, 11),
        1,
        penalties=Penalties.of(*pens, list(prompt), list(output)),
        **sampling,
        **row,
    )
    tokens, logprobs = sample(raw.clone(), [step_row])
    assert torch.allclose(logprobs, torch.log_softmax(raw, -1)[0, tokens])
    return int(tokens[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    assert penalised([2.0, 1.9, 0.0], {"penalties": (1.0, 0, 0)}, prompt=[0]) == 0
    assert penalised([2.0, 1.9, 0.0], {"penalties": (1.2, 0, 0)}, prompt=[0]) == 1  # 2/1.2
    assert penalised([2.0, 1.9, 0.0], {"penalties": (1.2, 0, 0)}, output=[0]) == 1
    assert penalised([-1.0, -1.1, -5.0], {"penalties": (1.2, 0, 0)}, prompt=[0]) == 1  # -1.2
    assert penalised([2.0, 1.9, 0.0], {"penalties": (1.2, 0, 0)}, prompt=[2]) == 0
    assert penalised([1.0, 1.9, 0.0], {"penalties": (0.5, 0, 0)}, prompt=[0]) == 0  # < 1 favours


def test_frequency_counts_each_occurrence_and_presence_counts_once():
    logits = [1.0, 0.5, 0.0]
    assert penalised(logits, {"penalties": (1.0, 0.2, 0)}, output=[0, 0]) == 0  # 1 - 0.4
    assert penalised(logits, {"penalties": (1.0, 0.2, 0)}, output=[0, 0, 0]) == 1  # 1 - 0.6
    assert penalised(logits, {"penalties": (1.0, 0, 0.6)}, output=[0]) == 1
    assert penalised(logits, {"penalties": (1.0, 0, 0.4)}, output=[0, 0, 0]) == 0  # once
    assert penalised(logits, {"penalties": (1.0, 0.2, 0.6)}, prompt=[0]) == 0  # output only
    assert penalised([0.5, 1.0, 0.0], {"penalties": (1.0, -0.3, 0)}, output=[0, 0]) == 0


def test_a_future_token_counts_as_output():
    """tokens[0] of a future row is the token the step before sampled, which the
    scheduler's output list does not hold yet."""
    logits, pens = [1.0, 0.5, 0.0], {"penalties": (1.0, 0.2, 0)}
    assert penalised(logits, dict(pens), output=[0, 0], tokens=[0], future=True) == 1
    assert penalised(logits, dict(pens), output=[0, 0], tokens=[0], future=False) == 0


def test_penalties_apply_before_temperature_and_filters():
    logits = [3.0, 1.0, -10.0]
    sampling = {"penalties": (1.0, 2.0, 0), "temperature": 1.0, "top_k": 1, "seed": 4}
    assert penalised(logits, sampling, output=[0, 0]) == 1  # 3 - 4 < 1: top-1 is token 1


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {pick(logits, dict(temperature=1.0, min_p=0.35, seed=s))[0] for s in range(60)}
    assert drawn == {0, 1}  # 0.15 < 0.35 * 0.5
    assert {pick(logits, dict(temperature=1.0, min_p=1.0, seed=s))[0] for s in range(9)} == {0}
    assert len({pick(logits, dict(temperature=1.0, min_p=0.0, seed=s))[0] for s in range(60)}) == 4


@pytest.mark.parametrize(
    "pens",
    [
        (1e30, 0, 0),
        (1e-30, 0, 0),
        (1e300, 1e300, -1e300),  # past float32: they must not become inf * 0
        (1e-300, -1e300, 1e300),
        (1.0, 1e30, -1e30),
        (float("nan"),) * 3,
        (-1.0, 0, 0),
    ],
)
def test_no_penalty_breaks_the_distribution(pens):
    """Extreme or invalid penalties keep a finite distribution whose argmax survives."""
    logits = LOGITS[0] * 1e30
    logits[5] = 0.0  # a zero logit times an infinite penalty would be NaN
    for sampling in (dict(), dict(temperature=1.0, top_p=0.5, min_p=0.5, seed=1)):
        row = StepRow.of([3], 9, torch.arange(1, 11), 1, **sampling)
        row.penalties = Penalties.of(*pens, list(range(50)), [3, 3, 7])
        tokens, logprobs = sample(logits[None, :].clone(), [row])
        assert 0 <= int(tokens[0]) < 50 and torch.isfinite(logprobs).all()


def test_top_logprobs_are_the_raw_log_softmax_whatever_the_sampling():
    row = StepRow.of([1], 9, torch.arange(1, 11), 1, temperature=0.3, top_k=2, top_logprobs=4)
    row.penalties = Penalties.of(2.0, 1.0, 1.0, range(50), [1, 2])
    none = StepRow.of([1], 9, torch.arange(1, 11), 1)
    values, ids = torch.topk(torch.log_softmax(LOGITS[0], -1), 4)
    (top_ids, top_lps), empty = top_logprobs(torch.stack([LOGITS[0]] * 2), [row, none])
    assert top_ids == ids.tolist() and torch.allclose(torch.tensor(top_lps), values)
    assert empty == ([], [])
    masked = torch.full((1, 50), float("-inf"))
    masked[0, 3] = 0.0
    assert top_logprobs(masked, [row]) == [([3], [0.0])]  # masked ids are left out
