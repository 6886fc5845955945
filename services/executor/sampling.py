"""Next-token choice per row: greedy, or temperature with top-k and top-p, seeded so a
row's draw at a given position is reproducible.

No sampling parameter can make the distribution empty or non-finite: a temperature
below GREEDY_BELOW is greedy (dividing by it would overflow), logits are shifted by their
maximum before the division, and the filters always keep the most likely token. On CUDA
an invalid distribution would be a device-side assert that kills the process's context.
"""

from __future__ import annotations

import torch

from shared.messages.forward import StepRow

GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy


class SamplingError(ValueError):
    """A row's logits hold NaN or +inf, or nothing but -inf: the model's numbers are
    broken, and no token can be chosen."""


def sample(logits: torch.Tensor, rows: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] for the sampling rows; returns (tokens [R], the model's log
    probability of each chosen token [R])."""
    logits = logits.float()
    _check_finite(logits)
    tokens = torch.argmax(logits, dim=-1)
    for j, row in enumerate(rows):
        if not row.temperature >= GREEDY_BELOW:  # also a NaN temperature
            continue
        probs = _distribution(logits[j], row.temperature, row.top_k, row.top_p)
        generator = torch.Generator(device=probs.device)
        if row.seed is None:
            generator.seed()
        else:  # the same seed and position give the same draw; any int hashes into range
            generator.manual_seed(hash((row.seed, row.end)) & (2**63 - 1))
        tokens[j] = torch.multinomial(probs, 1, generator=generator)[0]
    chosen = logits.gather(1, tokens[:, None])[:, 0]
    return tokens, chosen - torch.logsumexp(logits, dim=-1)


def _check_finite(logits: torch.Tensor) -> None:
    """Refuse rows with NaN or +inf, or without one finite logit (-inf is a masked token)."""
    broken = (torch.isnan(logits) | (logits == float("inf"))).any(-1)
    broken |= ~torch.isfinite(logits).any(-1)
    if bool(broken.any()):
        rows = broken.nonzero()[:, 0].tolist()
        raise SamplingError(f"rows {rows} of the step: logits are NaN, +inf or all -inf")


def _distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Probabilities over the vocabulary, finite, summing to 1, the argmax always > 0."""
    finite = torch.isfinite(logits)
    shifted = (logits - logits.max()) / temperature  # <= 0, so exp cannot overflow
    scaled = shifted.masked_fill(~finite, float("-inf"))  # -inf / inf would be NaN
    if 0 < top_k < scaled.numel():
        cutoff = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if not top_p >= 1.0:  # also a NaN top_p
        sorted_p, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_p, 0) - sorted_p > top_p
        outside[0] = False  # the most likely token, whatever top_p says
        probs = probs.clone()
        probs[order[outside]] = 0.0
        probs = probs / probs.sum()
    return probs
