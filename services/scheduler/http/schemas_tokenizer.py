"""The bodies of vLLM's tokenizer routes (`/tokenize`, `/detokenize`), which clients such
as lm-eval's remote tokenizer call to tokenize exactly as the server does."""

# No `from __future__ import annotations`: the structs close over `limits` (schemas.py).

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from services.scheduler.http import schema_types as st
from services.scheduler.http.schemas_openai import Message

DETOKENIZE_FACTOR = 16  # a /detokenize list may be this many contexts long
# What TokenizeRequest.__post_init__ enforces, stated in its schema: exactly one of the
# two given, not null (a null one is absent to the server; "required" alone would count
# it present, and the schema would refuse a body the server rightly accepts).
PROMPT_OR_MESSAGES = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


def tokenizer_schemas(limits: st.Limits) -> tuple[Any, type]:
    """The structs of /tokenize and /detokenize, bounded by `limits`."""

    class TokenizeRequest(Struct, kw_only=True):
        """A text (`prompt`) or a conversation (`messages`, rendered by the chat template
        as /v1/chat/completions renders it). `add_special_tokens` defaults as vLLM's
        do: true for a text, false for a conversation (its template writes its own)."""

        prompt: str | None = None
        messages: Annotated[list[Message], Meta(min_length=1)] | None = None
        tools: list[dict[str, Any]] | None = None
        add_generation_prompt: bool = True
        add_special_tokens: bool | None = None
        return_token_strs: Literal[False] = False  # token strings: not implemented

        def __post_init__(self) -> None:
            if (self.prompt is None) == (self.messages is None):
                raise ValueError("give exactly one of prompt (a string) and messages")

    class DetokenizeRequest(Struct):
        tokens: Annotated[
            list[limits.token], Meta(max_length=DETOKENIZE_FACTOR * limits.context_len)
        ]

    return Annotated[TokenizeRequest, Meta(extra_json_schema=PROMPT_OR_MESSAGES)], DetokenizeRequest
