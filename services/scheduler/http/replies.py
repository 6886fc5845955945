"""The shapes of the HTTP replies as msgspec structs: /openapi.json documents them, and the
schemathesis test holds every live reply to them, so the document cannot drift from what
the handlers send."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from services.scheduler.records.finish import FinishReason


class ErrorDetail(Struct):
    message: str
    type: str
    request_id: str | None = None  # on a 500: the id the scheduler's log names it by


class ErrorReply(Struct):
    """Every refusal and failure: 4xx for bad input, JSON 500 for a fault."""

    error: ErrorDetail


class MetaInfo(Struct):
    id: str
    finish_reason: FinishReason | None  # null while a streamed request runs
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # with return_logprob: [logprob, token id, token text (null unless
    # return_text_in_logprobs)] per output token, and per
    # output token its top_logprobs_num alternatives (when asked) in the same shape; the
    # input's from logprob_start_len (empty without it), the first position's logprob
    # and alternatives null
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None


class GenerateReply(Struct):
    """One /generate reply, or one event of a streamed one (the output so far); a batch
    answers a list of them, and each event of its stream names its item (`index`)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


class Health(Struct, omit_defaults=True):
    status: str  # "ok"; "starting" (503) while it waits
    executor: str | None  # the executor's epoch; null until one is up
    waiting_for: list[str] = []  # on a 503: "executor", "lease"


class Alive(Struct):
    status: str


class Placed(Struct):
    """Where a session's state is after an operator placed it (null: nowhere, its next
    turn re-prefills), and how many positions of its history that state holds."""

    session_id: str
    tier: str | None
    cached_tokens: int


class Flushed(Struct):
    """A flush's answer (200; SGLang's clients read only the status): what the prefix cache
    kept. Entries an open session borrows stay, so a request on those tokens still hits;
    a caller that needs them recomputed sends a fresh `cache_salt` instead."""

    flushed: bool
    kv_pages_kept: int
    mamba_slots_kept: int
    kept_because: str


class ModelInfo(Struct):
    model_path: str
    tokenizer_path: str | None  # tokenizer files any `--tokenizer DIR` client can load
    context_length: int
    page_size: int
    kv_pages: int
    mamba_slots: int
    max_running_requests: int


class Model(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str  # the checkpoint it serves (vLLM's field)
    max_model_len: int


class Tokens(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None  # vLLM's field; custody does not return token strings


class Detokenized(Struct):
    prompt: str


class TokenizerInfo(Struct):
    """The special tokens by name (as tokenizer_config.json names them; more than these
    three where the checkpoint has more), the length and the chat template."""

    tokenizer_class: str
    model_max_length: int
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None


class ModelList(Struct):
    object: str
    data: list[Model]


class PromptTokensDetails(Struct):
    cached_tokens: int


class CachedTokensDetails(Struct):
    device: int  # every reused prompt token (custody has no host prefix cache)
    host: int


class SglExt(Struct):
    """SGLang's extension of an OpenAI reply, with `return_cached_tokens_details`."""

    cached_tokens_details: CachedTokensDetails


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    """Per output token (of this chunk, in a stream): its text, its log probability,
    the `logprobs` most likely tokens and the sampled one with theirs, and the offset of
    its text in the output."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: CompletionLogprobs | None  # null unless the request set logprobs
    matched_stop: int | str | None = None  # SGLang's: the stop token id or string


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]  # the request's top_logprobs most likely tokens


class ChatLogprobs(Struct):
    """Per output token (of this chunk, in a stream)."""

    content: list[TokenLogprob]


class Completion(Struct):
    """A /v1/completions reply, or one event of a streamed one (`text_completion.chunk`,
    the last carrying `usage` when stream_options.include_usage)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    sglext: SglExt | None = None


class CalledFunction(Struct):
    name: str
    arguments: str  # a JSON object's text


class ToolCallReply(Struct):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Struct):
    """`content` null when the model only called tools; `tool_calls` and
    `reasoning_content` with the server's parsers (docs/api.md)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallReply] | None = None
    reasoning_content: str | None = None


class ToolCallDelta(Struct):
    """A streamed call: first its `index`, `id`, `type` and name, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class AssistantDelta(Struct):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


ChatFinish = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(Struct):
    index: int
    finish_reason: ChatFinish | None
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None  # with logprobs: true
    matched_stop: int | str | None = None  # SGLang's: the stop token id or string


class ChatCompletion(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sglext: SglExt | None = None


class ChatDeltaChoice(Struct):
    index: int
    finish_reason: ChatFinish | None
    delta: AssistantDelta
    logprobs: ChatLogprobs | None = None  # with logprobs: true
    matched_stop: int | str | None = None  # SGLang's, on the finishing chunk


class ChatCompletionChunk(Struct):
    """One event of a streamed /v1/chat/completions reply."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatDeltaChoice]
    usage: Usage | None = None
    sglext: SglExt | None = None
