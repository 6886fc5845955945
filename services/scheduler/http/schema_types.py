"""The building blocks of the request schemas (`schemas.py`, `schemas_openai.py`): the
ranges every body shares, and the two a deployment sets (vocabulary, context length)."""

# No `from __future__ import annotations`: msgspec must see these annotations as objects.

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from services.scheduler.records.sampling import SEED_MAX
from shared.http_limits import MAX_CACHE_SALT, MAX_RETENTION_PRIORITY
from shared.messages.sampling import MAX_TOP_LOGPROBS

MAX_STOP_TOKEN_IDS = 256
# a stop id may lie past the vocabulary (SGLang's and vLLM's kits send such ids): it can
# never be sampled, so it never matches
StopTokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
StopTokenIds = Annotated[list[StopTokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
ThinkingBudget = Annotated[
    int,
    Meta(
        ge=0,
        le=2**31 - 1,
        description="reasoning tokens before the answer when the prompt opens a reasoning "
        "block; absent: the server's --thinking-budget, at most half the reply's tokens",
    ),
]
MAX_STOPS, MAX_STOP_CHARS = 16, 256

Text = Annotated[str, Meta(min_length=1)]  # an empty text has no token to start from
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOPS)]
Temperature = Annotated[
    float, Meta(ge=0, le=100, description="below 1e-5 the executor samples greedily")
]
TopP = Annotated[float, Meta(gt=0, le=1)]
# vLLM's extensions (msgspec refuses NaN and numbers past a float, so these stay finite)
MinP = Annotated[float, Meta(ge=0, le=1)]
RepetitionPenalty = Annotated[float, Meta(gt=0, description="1: off; > 1 discourages")]
Penalty = Annotated[float, Meta(ge=-2, le=2, description="0: off; > 0 discourages")]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[int, Meta(ge=-1, le=2**31 - 1)]  # SGLang's -1: no input logprobs
# msgspec cannot bound an int past int64: the upper bound is documented here and checked
# by `check_seed`.
Seed = Annotated[int, Meta(ge=0, extra_json_schema={"maximum": SEED_MAX})]
# vLLM's extension: requests with one salt share cached prefixes (whatever their key)
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)]


@dataclass(frozen=True)
class Limits:
    """What a body's ranges depend on: the model's vocabulary and the context length."""

    vocab_size: int
    context_len: int

    @property
    def token(self) -> Any:
        return Annotated[int, Meta(ge=0, lt=self.vocab_size)]

    @property
    def input_ids(self) -> Any:
        """A non-empty list of token ids that leaves room for one output token (the
        bound is documented; `check_input` refuses with a message naming the context)."""
        return Annotated[
            list[self.token],
            Meta(min_length=1, extra_json_schema={"maxItems": self.context_len - 1}),
        ]

    @property
    def max_tokens(self) -> Any:
        return Annotated[int, Meta(ge=1, lt=self.context_len)]

    @property
    def max_new_tokens(self) -> Any:
        """SGLang's budget: 0 is a prefill-only request (its prompt cached, no output)."""
        return Annotated[int, Meta(ge=0, lt=self.context_len)]

    def check_input(self, field: str, ids: object) -> None:
        if isinstance(ids, list) and len(ids) >= self.context_len:
            raise ValueError(
                f"{field} has {len(ids)} tokens: they reach the context length "
                f"{self.context_len}, which must leave room for one output token"
            )


def check_seed(field: str, seed: int | None) -> None:
    if seed is not None and seed > SEED_MAX:
        raise ValueError(f"{field} must lie in [0, 2**64 - 1], got {seed}")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def extension_params(body: Any) -> dict[str, Any]:
    """The sampling extensions both APIs share (top_k, min_p, stop ids, ignore_eos, the
    penalties) as SamplingParams fields; a null is the default."""
    given = {
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "ignore_eos": body.ignore_eos,
    }
    params = {name: value for name, value in given.items() if value is not None}
    return params | {"stop_token_ids": tuple(body.stop_token_ids or ())}


# Fields that change the output, which custody does not implement. Each is accepted at
# its neutral value (clients send defaults: `logit_bias: {}`, `echo: false`); any other
# value is refused naming the field, rather than answered as if it had not been asked.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "min_new_tokens": (None, 0),
    "prompt_logprobs": (None,),
    "stop_regex": (None, "", []),
}


def neutral_only(name: str) -> Any:
    """The type of an unimplemented field: anything, documented as its neutral values
    (so /openapi.json says what is accepted, and a fuzzer's valid cases are valid)."""
    return Annotated[Any, Meta(extra_json_schema={"enum": list(NEUTRAL[name])})]


OPENAI_UNIMPLEMENTED = (
    "logit_bias",
    "best_of",
    "suffix",
    "min_tokens",
    "prompt_logprobs",
)
SGLANG_UNIMPLEMENTED = (
    "logit_bias",
    "min_new_tokens",
    "stop_regex",
)


def refuse_unimplemented(body: Any, names: tuple[str, ...], prefix: str = "") -> None:
    for name in names:
        value = getattr(body, name)
        if not any(value == ok and type(value) is type(ok) for ok in NEUTRAL[name]):
            raise ValueError(
                f"{prefix}{name} is not implemented by custody (got {value!r}); leave it "
                "out or send its neutral value"
            )


# retention hints (http/retention.py): Anthropic's `cache_control`, and a priority
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
RetentionPriority = Annotated[int, Meta(ge=0, le=MAX_RETENTION_PRIORITY)]


class CacheControl(Struct, kw_only=True):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"
