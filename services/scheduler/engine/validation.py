"""Checks on a request's input, made before anything is allocated."""

from __future__ import annotations

import numpy as np

from services.scheduler.engine.sampling import InvalidRequest


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
