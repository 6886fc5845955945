"""The bodies of the OpenAI-compatible routes as msgspec structs (see `schemas.py`).

Every optional field may be null, as in OpenAI's own schema; a null is the default.
vLLM's sampling extensions (`top_k`, `min_p`, `stop_token_ids`, `ignore_eos`, the
penalties) are honoured. Fields that would change the output and that custody does not
implement (`logit_bias`, `best_of`, chat's `echo`...) are refused unless
neutral; others (`user`, `tool_choice`...) are ignored. `n` (1..16) choices are each their
own request, and so is each prompt of a completions batch.
"""

# No `from __future__ import annotations`: the structs of `openai_schemas` are defined
# inside it, and msgspec must see their annotations as objects.

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from services.scheduler.http.constraints import GuidedChoice, ResponseFormat, Source
from services.scheduler.http.schema_types import (
    OPENAI_UNIMPLEMENTED,
    CacheControl,
    CacheSalt,
    Limits,
    MinP,
    Penalty,
    RepetitionPenalty,
    RetentionPriority,
    Seed,
    Stop,
    StopTokenIds,
    Temperature,
    Text,
    ThinkingBudget,
    TopLogprobs,
    TopP,
    check_seed,
    extension_params,
    neutral_only,
    refuse_unimplemented,
    stop_strings,
)
from services.scheduler.records.sampling import SamplingParams
from shared.http_limits import MAX_BATCH, MAX_CHOICES
from shared.messages.grammar import GrammarSpec


class StreamOptions(Struct):
    include_usage: bool | None = None  # a last chunk with `usage` and no choices
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries its `usage`


class OpenAIRequest(Struct, kw_only=True):
    """What completions and chat completions share; `session_id` (an extension) names a
    custody session. Each route's struct bounds max_tokens and types logprobs."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    session_id: str | None = None
    cache_salt: CacheSalt | None = None
    # SGLang's: the reply's `sglext.cached_tokens_details` (the prompt tokens reused)
    return_cached_tokens_details: bool | None = None
    # not implemented: refused unless neutral (schema_types.NEUTRAL)
    logit_bias: neutral_only("logit_bias") = None
    best_of: neutral_only("best_of") = None
    suffix: neutral_only("suffix") = None
    min_tokens: neutral_only("min_tokens") = None
    # constrained decoding (constraints.py): OpenAI's, then vLLM's
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Source | None = None
    guided_regex: Source | None = None
    guided_choice: GuidedChoice | None = None
    guided_grammar: Source | None = None  # EBNF
    prompt_logprobs: neutral_only("prompt_logprobs") = None  # vLLM's; echo scores a prompt
    cache_control: CacheControl | None = None  # a session's retention hint (http/retention.py)
    retention_priority: RetentionPriority | None = None

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        refuse_unimplemented(self, OPENAI_UNIMPLEMENTED)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options may be given only with stream: true")

    def requested_tokens(self) -> tuple[str, int | None]:
        """The field that limits the output, and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """None: no logprobs; else how many top alternatives per output token."""
        return None

    def echo_logprobs(self) -> bool:
        """The prompt's log probabilities are wanted (completions' echo with logprobs)."""
        return False

    def engine_params(
        self, max_new_tokens: int, history: int = 0, grammar: GrammarSpec | None = None
    ) -> SamplingParams:
        """Each route's struct adds vLLM's extensions (`openai_schemas`); `history`: the
        session history the input follows (an echo's logprobs start after it);
        `grammar`: what the output must match (constraints.py)."""
        wanted = self.wanted_logprobs()
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            logprobs=wanted is not None,
            stop=stop_strings(self.stop),
            top_logprobs=wanted or 0,
            logprob_start=history if self.echo_logprobs() else -1,
            grammar=grammar,
            **extension_params(self),
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class FunctionName(Struct):
    name: Annotated[str, Meta(min_length=1)]


class NamedToolChoice(Struct, kw_only=True):
    """`tool_choice` naming the one function the reply must call."""

    type: Literal["function"] = "function"
    function: FunctionName


class ContentPart(Struct):
    """One part of a message's content; only text parts (the model reads no images)."""

    type: Annotated[str, Meta(extra_json_schema={"const": "text"})]
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported, only 'text'")
        if self.text is None:
            raise ValueError("a text content part needs its text")


TextPart = Annotated[ContentPart, Meta(extra_json_schema={"required": ["type", "text"]})]


class ChatMessage(Struct, omit_defaults=True):
    """A message as the chat template sees it (absent and null fields are left out, as
    transformers leaves them out); docs/chat.md."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, given to the template
    tool_call_id: str | None = None  # a tool message's answer to one of them
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that keep it

    def __post_init__(self) -> None:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")


# What ChatMessage.__post_init__ enforces, stated in its schema.
CONTENT_OR_CALLS = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {
            "required": ["role", "tool_calls"],
            "properties": {"role": {"const": "assistant"}, "tool_calls": {"minItems": 1}},
        },
    ]
}
Message = Annotated[ChatMessage, Meta(extra_json_schema=CONTENT_OR_CALLS)]


# set by custody for every rendering (chat_template.py), so not a request's to change
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = RESERVED_TEMPLATE_VARIABLES & set(kwargs or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")


def prompt_ids(field: str, ids: list, limits: Limits) -> list[int]:
    """A prompt's token ids, checked (a ValueError names `field`)."""
    vocab = limits.vocab_size
    if not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise ValueError(f"{field} must be a non-empty list of token ids in [0, {vocab})")
    limits.check_input(field, ids)
    return ids


def prompt_forms(limits: Limits) -> Any:
    """Completions' `prompt` besides one text: token ids, or a batch of texts or of token
    id lists (OpenAI's four forms). msgspec types one array form per field, so the list
    is checked by `CompletionRequest.prompts`, and its schema says all three."""
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
        "minItems": 1,
        "maxItems": limits.context_len - 1,
    }
    texts = {"type": "array", "items": {"type": "string", "minLength": 1}}
    batch = {"minItems": 1, "maxItems": MAX_BATCH}
    forms = [ids, texts | batch, {"type": "array", "items": ids} | batch]
    return Annotated[list[Any], Meta(extra_json_schema={"anyOf": forms})]


def openai_schemas(limits: Limits) -> tuple[type[OpenAIRequest], type[OpenAIRequest]]:
    """The structs of /v1/completions and /v1/chat/completions, bounded by `limits`."""
    MaxTokens = limits.max_tokens
    TopK = Annotated[int, Meta(ge=-1, le=limits.vocab_size, description="-1 or 0: off")]

    class Extended(OpenAIRequest, kw_only=True):
        """vLLM's sampling extensions, bounded by the vocabulary."""

        top_k: TopK | None = None
        min_p: MinP | None = None
        stop_token_ids: StopTokenIds | None = None
        ignore_eos: bool | None = None
        repetition_penalty: RepetitionPenalty | None = None
        frequency_penalty: Penalty | None = None
        presence_penalty: Penalty | None = None

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.top_k == 0:  # vLLM's other spelling of off
                self.top_k = -1

    class CompletionRequest(Extended, kw_only=True):
        """A prompt as text or token ids, or a batch of them (a list of texts or of id
        lists: each prompt has its own `n` choices, indexed in prompt order)."""

        prompt: Text | prompt_forms(limits)
        # 0 only with echo: the prompt's log probabilities alone (a scoring request)
        max_tokens: limits.max_new_tokens | None = None
        logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
        echo: bool | None = None  # the prompt before the output, its logprobs with them

        def __post_init__(self) -> None:
            super().__post_init__()
            self.prompts()
            if self.max_tokens == 0 and not self.echo:
                raise ValueError("max_tokens 0 asks for nothing unless echo is true")

        def prompts(self) -> list[str | list[int]]:
            """The prompts, each a text or token ids (a ValueError names a malformed
            one)."""
            prompt = self.prompt
            if isinstance(prompt, str):
                return [prompt]
            if all(type(x) is int for x in prompt):
                return [prompt_ids("prompt", prompt, limits)]
            if len(prompt) > MAX_BATCH:
                raise ValueError(f"a batch of prompts holds at most {MAX_BATCH}")
            if all(isinstance(x, str) and x for x in prompt):
                return list(prompt)
            if all(isinstance(x, list) for x in prompt):
                return [prompt_ids(f"prompt[{i}]", ids, limits) for i, ids in enumerate(prompt)]
            raise ValueError(
                "prompt must be a text, a list of token ids, a list of texts or a list of "
                "token id lists"
            )

        def wanted_logprobs(self) -> int | None:
            return self.logprobs

        def echo_logprobs(self) -> bool:
            """The prompt's log probabilities are computed: echo with logprobs."""
            return bool(self.echo) and self.logprobs is not None

    class ChatCompletionRequest(Extended, kw_only=True):
        """A conversation for the chat template; sessions: docs/chat.md."""

        messages: Annotated[list[Message], Meta(min_length=1, max_length=limits.context_len)]
        tools: list[dict[str, Any]] | None = None  # given to the template as they come
        # none, auto, required or one named (http/chat_tools.py)
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        parallel_tool_calls: bool | None = None  # false: at most one call per reply
        # the chat template's other variables (its thinking switch, say)
        chat_template_kwargs: dict[str, Any] | None = None
        thinking_budget: ThinkingBudget | None = None  # http/chat_tools.py `Thinking`
        max_tokens: MaxTokens | None = None
        max_completion_tokens: MaxTokens | None = None
        logprobs: bool | None = None
        top_logprobs: TopLogprobs | None = None
        echo: neutral_only("echo") = None  # vLLM's chat echo: not implemented

        def __post_init__(self) -> None:
            super().__post_init__()
            refuse_unimplemented(self, ("echo",))
            if self.top_logprobs and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            check_template_kwargs(self.chat_template_kwargs)

        def template_variables(self) -> dict[str, Any]:
            """What the chat template sees besides the messages."""
            return {"tools": self.tools} | (self.chat_template_kwargs or {})

        def wanted_logprobs(self) -> int | None:
            return (self.top_logprobs or 0) if self.logprobs else None

        def requested_tokens(self) -> tuple[str, int | None]:
            if self.max_tokens is None and self.max_completion_tokens is not None:
                return "max_completion_tokens", self.max_completion_tokens
            return "max_tokens", self.max_tokens

    return CompletionRequest, ChatCompletionRequest
