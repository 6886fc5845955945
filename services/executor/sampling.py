"""Next-token choice per row: greedy, or temperature with top-k and top-p, seeded so a
row's draw at a given position is reproducible."""

from __future__ import annotations

import torch

from services.executor.batch import Row


def sample(logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] for the sampling rows; returns (tokens [R], the model's log
    probability of each chosen token [R])."""
    tokens = torch.argmax(logits, dim=-1)
    for j, row in enumerate(rows):
        s = row.sampling
        if s.temperature <= 0.0:
            continue
        scaled = logits[j].float() / s.temperature
        if 0 < s.top_k < scaled.numel():
            cutoff = torch.topk(scaled, s.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_p, 0) - sorted_p > s.top_p
            probs = probs.clone()
            probs[order[outside]] = 0.0
            probs = probs / probs.sum()
        generator = torch.Generator(device=probs.device)
        if s.seed is None:
            generator.seed()
        else:  # the same seed and position give the same draw
            generator.manual_seed(hash((s.seed, row.end)) & (2**63 - 1))
        tokens[j] = torch.multinomial(probs, 1, generator=generator)[0]
    chosen = logits.gather(1, tokens[:, None])[:, 0].float()
    return tokens, chosen - torch.logsumexp(logits.float(), dim=-1)
