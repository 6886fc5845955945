"""Verifying a row's drafts against the target's logits at each of its positions.

A verify row feeds the token the target chose last and then the draft's guesses
(StepRow.drafts); the logits at position i judge the draft at position i + 1. Greedy
rows accept a draft while it is the target's argmax, and the first disagreement gives
the target's own token. Sampling rows use speculative sampling's rejection rule for a
draft that proposes one token (every draft here does: the n-gram and the MTP head's
argmax): accept draft d with probability p(d) under the target's distribution after
temperature, top-k, min-p and top-p (what a plain row samples from), else draw from p
with d removed and renormalised. Either way every token the row returns is distributed
as the target would sample it one step at a time (docs/speculative.md shows why, and
tests/executor/test_verify.py measures it). If every draft is accepted, the last
position's logits give one more token.

Seeded rows draw from a generator seeded by (seed, position), as plain rows do, but the
draws differ (a uniform, then maybe a residual draw, where a plain row draws once), so
a seeded request may sample differently with speculation on (docs/speculative.md).
"""

from __future__ import annotations

import torch

from services.executor.sampling import GREEDY_BELOW, check_finite, distribution
from shared.messages.forward import StepRow


def accepts(uniform: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Whether each draft is accepted: with probability p(d). One function, so that a
    test can plant a biased rule and watch the distribution test fail."""
    return uniform < p_draft


def speculative_sample(
    probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """N independent verifications of one position: `probs` [N, V] the target's
    distribution, `drafts` [N] the token each draft proposed. Returns (accepted [N],
    token [N]): the draft where accepted, else a draw from the residual."""
    p_draft = probs.gather(1, drafts[:, None])[:, 0]
    uniform = torch.rand(len(drafts), generator=generator, device=probs.device)
    accepted = accepts(uniform, p_draft)
    residual = probs.scatter(1, drafts[:, None], 0.0)
    total = residual.sum(-1, keepdim=True)
    # a draft of probability 1 leaves no residual (and is always accepted)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), probs)
    redraw = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return accepted, torch.where(accepted, drafts, redraw)


def verify_drafts(logits: torch.Tensor, row: StepRow) -> tuple[list[int], list[float]]:
    """`logits` [drafts + 1, V] at the row's last drafts + 1 positions: the tokens the
    row gives (the accepted drafts, then the target's token at the first rejection, or
    one more after them all) and the raw logits' log probability of each."""
    logits = logits.float()
    check_finite(logits)
    drafts = torch.as_tensor(row.tokens[len(row.tokens) - row.drafts :], dtype=torch.long)
    drafts = drafts.to(logits.device)
    tokens: list[int] = []
    greedy = not row.temperature >= GREEDY_BELOW  # also a NaN temperature
    for i in range(row.drafts + 1):
        if greedy:
            token = int(torch.argmax(logits[i]))
            tokens.append(token)
            if i == row.drafts or token != int(drafts[i]):
                break
            continue
        probs = distribution(logits[i], row.temperature, row.top_k, row.top_p, row.min_p)
        generator = torch.Generator(device=probs.device)
        if row.seed is None:
            generator.seed()
        else:  # the draw at a position is the seed's, as a plain row's (sampling.py)
            generator.manual_seed(hash((row.seed, row.start + i + 1, "verify")) & (2**63 - 1))
        if i == row.drafts:
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
            break
        accepted, token = speculative_sample(probs[None], drafts[i : i + 1], generator)
        tokens.append(int(token[0]))
        if not bool(accepted[0]):
            break
    chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    picked = logits[: len(tokens)]
    logprobs = picked.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
    return tokens, logprobs.tolist()
