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


def check_logprob_start(start: int, length: int) -> None:
    """Input logprobs may start anywhere in the prompt of `length` tokens (at its end:
    none); past it is a 400, as in SGLang."""
    if start > length:
        raise InvalidRequest(
            f"logprob_start_len {start} is past the input's {length} tokens (a session "
            "turn's input includes its history): ask for at most that"
        )


def _prompt_fits(history: int, new: int, context_len: int) -> str:
    """How the prompt is named in refusals; a 400 if it leaves no room for an output."""
    prompt = history + new
    said = f"the prompt's {prompt} tokens"
    if history:
        said += f" ({history} of session history + {new} new)"
    if prompt >= context_len:
        raise InvalidRequest(
            f"{said} reach the context length {context_len}, which must leave room for one "
            "output token"
        )
    return said


def openai_output_budget(
    history: int, new: int, requested: int | None, default: int, context_len: int, field: str
) -> int:
    """How many tokens an OpenAI-route request may produce. An explicit limit (`field`)
    that takes the prompt (`history` of its session + `new` input tokens) to the context
    length or beyond is refused naming both numbers, as vLLM and OpenAI do: a silent clamp
    would hand the client less than it asked for. Without one, the route's `default`, cut
    to the room the context leaves."""
    said = _prompt_fits(history, new, context_len)
    prompt = history + new
    if requested is None:
        return min(default, context_len - prompt)
    if prompt + requested >= context_len:
        raise InvalidRequest(
            f"{field} {requested} plus {said} reach the context length {context_len}: "
            f"ask for fewer than {context_len - prompt}"
        )
    return requested


def sglang_output_budget(
    history: int, new: int, requested: int | None, default: int, context_len: int
) -> int:
    """How many tokens a /generate request may produce, as SGLang decides: its tokenizer
    manager checks an explicit `max_new_tokens` against the request's own input only
    (400 when input + budget pass the context length), and its scheduler then clamps the
    budget to the room the whole prompt leaves; for a session turn that prompt includes
    the history, so a long session's turn gets fewer tokens (finish_reason length), not
    a 400. Without a budget, `default`, clamped alike."""
    if new >= context_len:
        raise InvalidRequest(
            f"The input ({new} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if requested is not None and requested + new > context_len:
        raise InvalidRequest(
            "Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {requested + new} tokens: "
            f"{new} tokens from the input messages and {requested} tokens for the "
            "completion (sampling_params.max_new_tokens). Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        )
    _prompt_fits(history, new, context_len)
    wanted = default if requested is None else requested
    return min(wanted, context_len - history - new)
