"""Checks on a request's input, made before anything is allocated."""

from __future__ import annotations

import numpy as np

from services.scheduler.records.sampling import InvalidRequest


def check_tokens(tokens: object, vocab_size: int) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidRequest("input_ids must be a flat list of integers")
    if arr.size == 0:
        raise InvalidRequest("the input is empty")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise InvalidRequest(f"token ids must lie in [0, {vocab_size})")
    return arr.astype(np.int64)


def check_prompt_length(length: int, context_len: int) -> None:
    if length >= context_len:
        raise InvalidRequest(
            f"the input has {length} tokens; the context length is {context_len} and must "
            "leave room for one output token"
        )


def output_budget(
    history: int, new: int, requested: int | None, default: int, context_len: int, field: str
) -> int:
    """How many tokens a request may produce. An explicit limit (`field`) that takes the
    prompt (`history` of its session + `new` input tokens) to the context length or
    beyond is refused naming both numbers, as SGLang and vLLM do: a silent clamp would
    hand the client less than it asked for. Without one, the route's `default`, cut to the
    room the context leaves."""
    prompt = history + new
    said = f"the prompt's {prompt} tokens"
    if history:
        said += f" ({history} of session history + {new} new)"
    if prompt >= context_len:
        raise InvalidRequest(
            f"{said} reach the context length {context_len}, which must leave room for one "
            "output token"
        )
    if requested is None:
        return min(default, context_len - prompt)
    if prompt + requested >= context_len:
        raise InvalidRequest(
            f"{field} {requested} plus {said} reach the context length {context_len}: "
            f"ask for fewer than {context_len - prompt}"
        )
    return requested
