"""Sampling parameters of one request, validated before anything is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.messages.grammar import GrammarSpec
from shared.messages.sampling import MAX_TOP_LOGPROBS

SEED_MAX = 2**64 - 1  # what msgpack (uint64) carries to the executor
NO_PENALTIES = (1.0, 0.0, 0.0)  # repetition, frequency, presence


class InvalidRequest(ValueError):
    """Bad input: rejected with a clear message before any slot moves."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output
    ignore_eos: bool = False
    no_stop_trim: bool = False
    logprobs: bool = False  # the reply carries the output's log probabilities
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int = 0  # the top log probabilities kept per output (and input) token
    # with logprobs: the input's log probabilities from this position of the prompt
    # (SGLang's logprob_start_len, OpenAI's echo); -1: none (Request.score_inputs)
    logprob_start: int = -1
    grammar: GrammarSpec | None = None  # what the output must match (constrained decoding)

    @property
    def penalised(self) -> bool:
        """Rows carry the ids the penalties count only when a penalty is on."""
        penalties = (self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        return penalties != NO_PENALTIES

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise InvalidRequest(
                f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must lie in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k != -1 and not 1 <= self.top_k <= vocab_size:
            raise InvalidRequest(
                f"top_k must be -1 or lie in [1, {vocab_size}], got {self.top_k!r}"
            )
        self._validate_extensions()
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise InvalidRequest(f"seed must lie in [0, 2**64), got {self.seed!r}")
        if len(self.stop_token_ids) > 256:
            raise InvalidRequest("stop_token_ids may hold at most 256 ids")
        if len(self.stop) > 16 or any(
            not isinstance(x, str) or not 0 < len(x) <= 256 for x in self.stop
        ):
            raise InvalidRequest("stop must be at most 16 non-empty strings of <= 256 characters")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise InvalidRequest(
                f"stop_token_ids {bad} are negative (an id past the "
                "vocabulary is accepted and never matches)"
            )

    def _validate_extensions(self) -> None:
        """vLLM's ranges for min_p and the penalties (NaN and infinities refused)."""
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must lie in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must lie in [-2, 2], got {getattr(self, name)!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )

    def stops_at(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        if token in self.stop_token_ids:
            return True
        return token in eos_token_ids and not self.ignore_eos
