"""The bodies of the OpenAI-compatible routes as msgspec structs (see `schemas.py`).

Every optional field may be null, as in OpenAI's own schema. Fields custody does not
implement (`user`, `logit_bias`, `frequency_penalty`, `tools`...) are ignored; `n` other
than 1 is refused, since it would silently change what the client gets.
"""

# No `from __future__ import annotations`: the structs of `openai_schemas` are defined
# inside it, and msgspec must see their annotations as objects.

from typing import Annotated, Literal

from msgspec import Meta, Struct

from services.scheduler.http.schema_types import (
    Limits,
    Seed,
    Stop,
    Temperature,
    Text,
    TopP,
    check_seed,
    stop_strings,
)
from services.scheduler.records.sampling import SamplingParams


class StreamOptions(Struct):
    include_usage: bool | None = None


class OpenAIRequest(Struct, kw_only=True):
    """What completions and chat completions share; `session_id` (an extension) names a
    custody session. Each route's struct bounds max_tokens and types logprobs."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=1)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)

    def requested_tokens(self) -> tuple[str, int | None]:
        """The field that limits the output, and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    def engine_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            logprobs=bool(self.logprobs),
            stop=stop_strings(self.stop),
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


def openai_schemas(limits: Limits) -> tuple[type[OpenAIRequest], type[OpenAIRequest]]:
    """The structs of /v1/completions and /v1/chat/completions, bounded by `limits`."""
    MaxTokens = limits.max_tokens

    class CompletionRequest(OpenAIRequest, kw_only=True):
        """A prompt as text or as token ids."""

        prompt: Text | limits.input_ids
        max_tokens: MaxTokens | None = None
        logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None

        def __post_init__(self) -> None:
            super().__post_init__()
            limits.check_input("prompt", self.prompt)

    class ChatCompletionRequest(OpenAIRequest, kw_only=True):
        """A conversation; with `session_id`, custody appends to the session what follows
        the last assistant message."""

        messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=limits.context_len)]
        max_tokens: MaxTokens | None = None
        max_completion_tokens: MaxTokens | None = None
        logprobs: bool | None = None

        def requested_tokens(self) -> tuple[str, int | None]:
            if self.max_tokens is None and self.max_completion_tokens is not None:
                return "max_completion_tokens", self.max_completion_tokens
            return "max_tokens", self.max_tokens

    return CompletionRequest, ChatCompletionRequest
