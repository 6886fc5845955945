"""Next-token choice per row: vLLM's penalties, then greedy, or temperature with top-k,
min-p and top-p, seeded so a row's draw at a given position is reproducible; and the log
probabilities of the raw logits (whatever the sampling parameters, vLLM's default), of
the sampled token and, for a row that scores its input, of each next input token.

No sampling parameter can make the distribution empty or non-finite: a temperature
below GREEDY_BELOW is greedy (dividing by it would overflow), logits are shifted by their
maximum before the division, a penalty leaves a finite logit finite (clamped) and a
masked one masked, a non-finite penalty is no penalty, and the filters always keep the
most likely token. On CUDA an invalid distribution would be a device-side assert that
kills the process's context.

Penalties (repetition over the prompt and output ids, frequency and presence over the
output ids) count tokens that no one keeps between steps: each penalised row carries
them (shared/messages/sampling.py), so nothing is rebuilt after a retract or an executor
restart. Only a future token (StepRow.future: tokens[0], this step's input, which the
step before sampled) is unknown to the scheduler; it is counted here as an output token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from shared.messages.forward import StepRow
from shared.messages.sampling import Penalties, RowScores, Top

GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy


class SamplingError(ValueError):
    """A row's logits hold NaN or +inf, or nothing but -inf: the model's numbers are
    broken, and no token can be chosen."""


def sample(
    logits: torch.Tensor, rows: list[StepRow], allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] for the sampling rows; returns (tokens [R], the model's log
    probability of each chosen token [R]). `allowed` [R, V]: the tokens a grammar lets
    each row choose (services/executor/grammars.py); the log probabilities stay the raw
    logits' (vLLM's default)."""
    logits = logits.float()
    check_finite(logits)
    processed = logits
    if any(row.penalties is not None for row in rows):
        processed = torch.stack([penalise(logits[j], row) for j, row in enumerate(rows)])
    if allowed is not None:
        processed = processed.masked_fill(~allowed.to(processed.device), float("-inf"))
    tokens = torch.argmax(processed, dim=-1)
    for j, row in enumerate(rows):
        if not row.temperature >= GREEDY_BELOW:  # also a NaN temperature
            continue
        probs = distribution(processed[j], row.temperature, row.top_k, row.top_p, row.min_p)
        generator = torch.Generator(device=probs.device)
        if row.seed is None:
            generator.seed()
        else:  # the same seed and position give the same draw; any int hashes into range
            generator.manual_seed(hash((row.seed, row.end)) & (2**63 - 1))
        tokens[j] = torch.multinomial(probs, 1, generator=generator)[0]
    chosen = logits.gather(1, tokens[:, None])[:, 0]
    return tokens, chosen - torch.logsumexp(logits, dim=-1)


def top_logprobs(logits: torch.Tensor, rows: list[StepRow]) -> list[Top]:
    """Per row the `row.top_logprobs` most likely ids under the raw logits' log-softmax,
    most likely first, with their log probabilities (masked ids, -inf, are left out)."""
    return _top(torch.log_softmax(logits.float(), -1), [row.top_logprobs for row in rows])


def _top(logprobs: torch.Tensor, wanted: list[int]) -> list[Top]:
    """Per row of `logprobs` [R, V] its `wanted[r]` most likely ids and their values."""
    ks = [max(0, min(k, logprobs.shape[-1])) for k in wanted]
    if not any(ks):
        return [((), ())] * len(ks)
    values, ids = torch.topk(logprobs, max(ks), dim=-1)
    values, ids = values.cpu(), ids.cpu()
    top: list[Top] = []
    for j, k in enumerate(ks):
        keep = torch.isfinite(values[j, :k])
        top.append((ids[j, :k][keep].tolist(), values[j, :k][keep].tolist()))
    return top


SCORED_PER_PASS = 256  # positions whose logits exist at once: a vocabulary of 131k is 128 MiB


def score_inputs(
    lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, row: StepRow
) -> RowScores:
    """A row's input log probabilities: `hidden` [len(row.tokens), H] are its positions'
    last hidden states; each scored position's logits (the same raw log-softmax as the
    output's) give the log probability of the token after it, and its top alternatives
    when the row asks for them. Logits are made a slice of positions at a time."""
    first = row.scored_from - row.start
    targets = torch.tensor(row.scored, dtype=torch.long, device=hidden.device)
    chosen: list[torch.Tensor] = []
    top: list[Top] = []
    for i in range(0, len(targets), SCORED_PER_PASS):
        at = hidden[first + i : first + min(i + SCORED_PER_PASS, len(targets))]
        logprobs = torch.log_softmax(lm_head(at).float(), -1)
        chosen.append(logprobs.gather(1, targets[i : i + len(at), None])[:, 0])
        if row.top_logprobs:
            top += _top(logprobs, [row.top_logprobs] * len(at))
    return RowScores.of(row.rid, torch.cat(chosen).cpu().tolist(), top)


def penalise(logits: torch.Tensor, row: StepRow) -> torch.Tensor:
    """One row's logits [V] after vLLM's penalties: repetition divides the positive
    logits of every id seen in the prompt or output and multiplies the negative ones;
    frequency subtracts its value per occurrence in the output, presence once per id
    present there. A new tensor; the raw logits stay for the log probabilities."""
    pen = row.penalties
    if pen is None:
        return logits
    output = torch.tensor(_output_ids(row, pen), dtype=torch.long, device=logits.device)
    out, info = logits.clone(), torch.finfo(logits.dtype)
    fit = lambda x, low: min(max(x, low), info.max)  # noqa: E731 (no inf * 0 = NaN below)
    rep = pen.repetition
    if math.isfinite(rep) and rep > 0 and rep != 1.0:
        rep = fit(rep, info.tiny)
        prompt = torch.tensor(pen.prompt_ids, dtype=torch.long, device=logits.device)
        seen = torch.unique(torch.cat([prompt, output]))
        picked = out[seen]
        out[seen] = torch.where(picked > 0, picked / rep, picked * rep)
    freq, pres = pen.frequency, pen.presence
    if len(output) and math.isfinite(freq) and math.isfinite(pres) and (freq or pres):
        freq, pres = fit(freq, -info.max), fit(pres, -info.max)
        counts = torch.bincount(output, minlength=logits.numel())
        out = torch.where(counts > 0, out - freq * counts.to(out.dtype) - pres, out)
    return torch.where(torch.isfinite(logits), out.clamp(-info.max, info.max), logits)


def _output_ids(row: StepRow, pen: Penalties) -> np.ndarray:
    """The output ids so far: the scheduler's, plus a future token it has yet to see."""
    ids = pen.output_ids
    return np.append(ids, row.tokens[:1]) if row.future else ids


def check_finite(logits: torch.Tensor) -> None:
    """Refuse rows with NaN or +inf, or without one finite logit (-inf is a masked token)."""
    broken = (torch.isnan(logits) | (logits == float("inf"))).any(-1)
    broken |= ~torch.isfinite(logits).any(-1)
    if bool(broken.any()):
        rows = broken.nonzero()[:, 0].tolist()
        raise SamplingError(f"rows {rows} of the step: logits are NaN, +inf or all -inf")


def distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Probabilities over the vocabulary, finite, summing to 1, the argmax always > 0."""
    finite = torch.isfinite(logits)
    shifted = (logits - logits.max()) / temperature  # <= 0, so exp cannot overflow
    scaled = shifted.masked_fill(~finite, float("-inf"))  # -inf / inf would be NaN
    if min_p > 0:  # p < min_p * p_max, as logits: the argmax's is 0, so it always stays
        scaled = scaled.masked_fill(scaled < math.log(min(min_p, 1.0)), float("-inf"))
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
