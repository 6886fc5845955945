"""Sampling: greedy, temperature with top-k and top-p, and seeded reproducibility."""

import torch

from services.executor.batch import Row, Sampling
from services.executor.sampling import sample

g = torch.Generator().manual_seed(0)
LOGITS = torch.randn(1, 50, generator=g)


def draw(sampling: Sampling, end: int = 10) -> int:
    row = Row(torch.tensor([1]), end - 1, torch.arange(1, end + 1), 1, sampling=sampling)
    tokens, logprobs = sample(LOGITS.clone(), [row])
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1).gather(1, tokens[:, None])[:, 0])
    return int(tokens[0])


def test_greedy_and_degenerate_filters_pick_the_argmax():
    best = int(LOGITS.argmax())
    assert draw(Sampling()) == best
    assert draw(Sampling(temperature=1.0, top_k=1, seed=3)) == best
    assert draw(Sampling(temperature=1.0, top_p=1e-6, seed=3)) == best


def test_seeded_draws_repeat_and_differ_across_seeds():
    draws_a = [draw(Sampling(temperature=2.0, seed=1), end) for end in range(5, 45)]
    assert draws_a == [draw(Sampling(temperature=2.0, seed=1), end) for end in range(5, 45)]
    draws_b = [draw(Sampling(temperature=2.0, seed=2), end) for end in range(5, 45)]
    assert draws_a != draws_b
    assert len(set(draws_a)) > 5  # a temperature of 2 spreads over the vocabulary


def test_top_k_never_draws_outside_the_k_best():
    top = set(torch.topk(LOGITS[0], 3).indices.tolist())
    assert {draw(Sampling(temperature=5.0, top_k=3, seed=s)) for s in range(40)} <= top
