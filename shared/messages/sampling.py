"""What sampling adds to the forward wire (forward.py): a row's penalties with the token
ids they count, a result's top log probabilities, packed, and the input log
probabilities of the rows that scored their positions (`RowScores`).

Penalties need the tokens a request has seen, and nothing keeps them between steps: each
sampling row that is penalised carries them (the distinct prompt ids for the repetition
penalty, the output ids the scheduler knows), so a re-prefill after a retract or a new
executor life needs no rebuilt state. The one output token the scheduler cannot know is
a future token (forward.StepRow.future): the executor adds it (services/executor/
sampling.py). The cost: 4 bytes per distinct prompt id and per output token, on every
sampling step of a penalised request.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from shared.messages.envelope import F4, I4, Arrays, WireError, array, empty

MAX_TOP_LOGPROBS = 20  # the most top log probabilities a row may ask for (OpenAI's limit)
Top = tuple[Sequence[int], Sequence[float]]  # one position's top ids and their logprobs


class Penalties(Arrays, kw_only=True):
    """vLLM's penalties of one sampling row, and the ids they count: `prompt_ids` the
    distinct prompt ids (empty unless `repetition` != 1), `output_ids` the output so far."""

    repetition: float = 1.0  # > 1 divides positive logits of seen ids, multiplies negative
    frequency: float = 0.0  # subtracted once per occurrence in the output
    presence: float = 0.0  # subtracted once if present in the output
    prompt_ids: I4 = msgspec.field(name="prompt", default_factory=empty(I4))
    output_ids: I4 = msgspec.field(name="output", default_factory=empty(I4))

    @classmethod
    def of(
        cls,
        repetition: float,
        frequency: float,
        presence: float,
        prompt: Sequence[int] | np.ndarray,
        output: Sequence[int],
    ) -> Penalties:
        """`prompt`: the whole prompt; only its distinct ids travel, and only when the
        repetition penalty uses them."""
        seen = np.unique(np.asarray(prompt)) if repetition != 1.0 else ()
        return cls(
            repetition=repetition,
            frequency=frequency,
            presence=presence,
            prompt_ids=array(seen, I4),
            output_ids=array(output, I4),
        )


def pack_top(top: Sequence[Top]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sampling row its top ids and logprobs (any count, 0 included) as three packed
    arrays: the counts, then every row's ids and logprobs end to end."""
    counts = [len(ids) for ids, _ in top]
    counts = counts if any(counts) else []  # nobody asked: no counts at all
    ids = [i for row_ids, _ in top for i in row_ids]
    logprobs = [lp for _, row_lps in top for lp in row_lps]
    return array(counts, I4), array(ids, I4), array(logprobs, F4)


def unpack_top(n: np.ndarray, flat_ids: np.ndarray, flat_lps: np.ndarray, rows: int) -> list[Top]:
    """The inverse of `pack_top` for `rows` sampling rows (no counts at all: nobody asked);
    a WireError when the lengths disagree."""
    if not len(n):
        if len(flat_ids) or len(flat_lps):
            raise WireError(f"{len(flat_ids)} top ids without counts")
        return [((), ())] * rows
    if len(n) != rows or int(n.min()) < 0:
        raise WireError(f"top counts {n.tolist()} for {rows} rows")
    if not int(n.sum()) == len(flat_ids) == len(flat_lps):
        raise WireError(
            f"{len(flat_ids)} top ids and {len(flat_lps)} logprobs for counts summing to "
            f"{int(n.sum())}"
        )
    ends = np.cumsum(n)
    return [
        (flat_ids[end - k : end], flat_lps[end - k : end])
        for k, end in zip(n.tolist(), ends.tolist(), strict=True)
    ]


class RowScores(Arrays, kw_only=True):
    """The input log probabilities of one row that scored positions (StepRow.scored):
    per scored position the raw logits' log-softmax at the token after it, and the
    row's `top_logprobs` most likely ids there (packed as `pack_top` packs them, one
    entry per position)."""

    rid: str
    logprobs: F4
    top_counts: I4 = msgspec.field(default_factory=empty(I4))
    top_ids: I4 = msgspec.field(default_factory=empty(I4))
    top_logprobs: F4 = msgspec.field(default_factory=empty(F4))

    def __post_init__(self) -> None:
        """Cut or disagreeing arrays are refused as they are decoded."""
        unpack_top(self.top_counts, self.top_ids, self.top_logprobs, len(self.logprobs))

    @classmethod
    def of(cls, rid: str, logprobs: Sequence[float], top: Sequence[Top] = ()) -> RowScores:
        counts, ids, lps = pack_top(top)
        return cls(
            rid=rid, logprobs=array(logprobs, F4), top_counts=counts, top_ids=ids, top_logprobs=lps
        )

    @property
    def top(self) -> list[Top]:
        """Per scored position its top ids and their log probabilities (empty where
        none were asked for)."""
        return unpack_top(self.top_counts, self.top_ids, self.top_logprobs, len(self.logprobs))
