"""Every HTTP request body as a typed, range-checked msgspec struct, built for one
deployment's vocabulary and context length.

A body is decoded into its struct before anything else runs, so a value that the engine,
the wire (msgpack) or the executor cannot hold (a seed past 64 bits, a token id outside
the vocabulary, NaN, a lone surrogate) is a 400 naming its field, never a crash in the
scheduler's loop. Fields of the SGLang and OpenAI APIs that custody does not implement, and
unknown fields, are ignored (msgspec's default for structs); a known field of the wrong
type or range is refused. The same structs give /openapi.json its schemas, so the document
states exactly what is enforced. The OpenAI bodies are in `schemas_openai.py`.
"""

# No `from __future__ import annotations`: the structs are defined inside
# `request_schemas`, closed over its limits, and msgspec must see their annotations as
# objects, not as strings naming locals it cannot resolve.

import re
import sys
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from services.scheduler.http import schema_types as st
from services.scheduler.http.constraints import Source, sglang_constraint
from services.scheduler.http.messages_input import MessagesRequest
from services.scheduler.http.responses_input import ResponsesRequest
from services.scheduler.http.schemas_batch import batch_schema
from services.scheduler.http.schemas_openai import openai_schemas
from services.scheduler.http.schemas_tokenizer import tokenizer_schemas
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from shared.http_limits import MAX_CHOICES
from shared.placement import MOVE_NONCE
from shared.session_ids import SESSION_ID
from shared.streams import REPLICA_ID

MAX_SESSION_TIMEOUT = 7 * 24 * 3600
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# What GenerateRequest.__post_init__ enforces, stated in its schema: one input, not both.
ONE_INPUT = {
    "oneOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
    ]
}
ONE_BATCH = {"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}

T = TypeVar("T")


@dataclass(frozen=True)
class RequestSchemas:
    """The body struct of every route that takes one (a struct type, or one annotated with
    a rule its schema states beside the struct's own)."""

    generate: Any
    generate_batch: Any
    open_session: type
    fork_session: type
    close_session: type
    place_session: type
    abort_request: type
    migrate: type
    completions: type
    chat_completions: type
    tokenize: Any
    detokenize: type
    responses: type = ResponsesRequest
    messages: type = MessagesRequest

    def all(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


class SessionParams(Struct):
    """The session a turn continues, and where in its turn tree (records/turn_tree.py):
    `rid` names the turn it follows (absent: the latest), `offset` cuts what it keeps,
    `drop_previous_output` keeps that turn's prompt alone, `replace` forgets the named
    turn's other branches. A session opened with `streaming: true` is append-only, as
    SGLang's streaming sessions are (records/session.py `check_session_params`)."""

    id: str | None = None
    rid: Annotated[str, Meta(max_length=256)] | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class OpenSessionRequest(Struct):
    """A new session, its id chosen by the caller or by custody; `streaming: true` makes
    it append-only (SGLang's streaming session), else its turns may branch."""

    session_id: Annotated[str, Meta(pattern=SESSION_ID.pattern)] | None = None
    timeout: Annotated[float, Meta(gt=0, le=MAX_SESSION_TIMEOUT)] | None = None
    streaming: bool | None = None


class ForkSessionRequest(Struct):
    """A new session that starts from another's history: at its latest turn, or where
    `rid`, `offset` and `drop_previous_output` say, as a turn's `session_params` would
    (records/turn_tree.py); named by the caller (`new_session_id`) or by custody."""

    session_id: str
    rid: Annotated[str, Meta(max_length=256)] | None = None
    offset: int | None = None
    drop_previous_output: bool | None = None
    new_session_id: Annotated[str, Meta(pattern=SESSION_ID.pattern)] | None = None
    timeout: Annotated[float, Meta(gt=0, le=MAX_SESSION_TIMEOUT)] | None = None


class CloseSessionRequest(Struct):
    session_id: str


class PlaceSessionRequest(Struct):
    """An operator moves an idle session's state to a tier (tests, benchmarks, draining
    a device before maintenance)."""

    session_id: str
    tier: Literal["device", "host", "disk"]


class MigrateRequest(Struct):
    """The router moves a session between replicas (operator): `source` names the
    replica it comes from, `epoch` the placement epoch it takes and `move` the attempt's
    nonce (shared/placement.py `Move`), for the replica it goes to."""

    session_id: str
    source: Annotated[str, Meta(pattern=REPLICA_ID.pattern)] | None = None
    epoch: Annotated[int, Meta(ge=1, le=2**62)] | None = None
    move: Annotated[str, Meta(pattern=f"^({MOVE_NONCE.pattern})?$")] = ""


class AbortRequest(Struct):
    """One request by id, or every request."""

    rid: str | None = None
    abort_all: bool = False


def request_schemas(vocab_size: int, context_len: int) -> RequestSchemas:
    """The structs of the SGLang and OpenAI bodies, bounded for this deployment."""
    limits = st.Limits(vocab_size, context_len)
    completions, chat = openai_schemas(limits)
    generate = generate_schema(limits)
    return RequestSchemas(
        Annotated[generate, Meta(extra_json_schema=ONE_INPUT)],
        Annotated[batch_schema(generate, limits), Meta(extra_json_schema=ONE_BATCH)],
        OpenSessionRequest,
        ForkSessionRequest,
        CloseSessionRequest,
        PlaceSessionRequest,
        AbortRequest,
        MigrateRequest,
        completions,
        chat,
        *tokenizer_schemas(limits),
    )


def sampling_schema(limits: st.Limits) -> type:
    """SGLang's sampling parameters, bounded by the vocabulary and context."""
    vocab = limits.vocab_size
    TopK = Annotated[int, Meta(ge=-1, le=vocab, extra_json_schema={"not": {"const": 0}})]

    class GenerateSamplingParams(Struct):
        """SGLang's sampling parameters. An absent or null max_new_tokens is the route's
        default, cut to the room the context leaves; an explicit one that does not fit
        beside the prompt is refused."""

        max_new_tokens: limits.max_new_tokens | None = None
        temperature: st.Temperature = 0.0
        top_p: st.TopP = 1.0
        top_k: TopK = -1
        seed: st.Seed | None = None
        stop: st.Stop | None = None
        stop_token_ids: st.StopTokenIds | None = None
        ignore_eos: bool = False
        no_stop_trim: bool = False
        min_p: st.MinP | None = None
        repetition_penalty: st.RepetitionPenalty | None = None
        frequency_penalty: st.Penalty | None = None
        presence_penalty: st.Penalty | None = None
        # not implemented: refused unless neutral (schema_types.NEUTRAL)
        logit_bias: st.neutral_only("logit_bias") = None
        min_new_tokens: st.neutral_only("min_new_tokens") = None
        n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None  # parallel samples
        # constrained decoding (constraints.py), each as SGLang takes it: a string
        json_schema: Source | None = None
        regex: Source | None = None
        ebnf: Source | None = None
        structural_tag: Source | None = None
        stop_regex: st.neutral_only("stop_regex") = None

        def __post_init__(self) -> None:
            if self.top_k == 0:
                raise ValueError("sampling_params.top_k must be -1 (off) or at least 1, got 0")
            st.check_seed("sampling_params.seed", self.seed)
            st.refuse_unimplemented(self, st.SGLANG_UNIMPLEMENTED, "sampling_params.")

        def engine_params(
            self,
            max_new_tokens: int,
            logprobs: bool = False,
            top_logprobs: int = 0,
            logprob_start: int = -1,
            any_whitespace: bool = True,
        ) -> SamplingParams:
            """`logprob_start`: the input logprobs' first position (-1: none);
            `any_whitespace`: constraints.py."""
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=st.stop_strings(self.stop),
                no_stop_trim=self.no_stop_trim,
                logprobs=logprobs,
                top_logprobs=top_logprobs if logprobs else 0,
                logprob_start=logprob_start if logprobs else -1,
                grammar=sglang_constraint(self, any_whitespace),
                **st.extension_params(self),
            )

    return GenerateSamplingParams


def generate_schema(limits: st.Limits) -> type:
    """SGLang's /generate body, bounded by the vocabulary and context."""
    Sampling = sampling_schema(limits)

    class GenerateRequest(Struct):
        """SGLang's /generate: text or input_ids, not both."""

        text: st.Text | None = None
        input_ids: limits.input_ids | None = None
        sampling_params: Sampling | None = None
        session_params: SessionParams | None = None
        rid: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
        cache_salt: st.CacheSalt | None = None
        stream: bool = False
        return_logprob: bool = False
        # with return_logprob: output_top_logprobs, and input_top_logprobs
        top_logprobs_num: st.TopLogprobs = 0
        # with return_logprob: input logprobs from this position of the input (-1: none)
        logprob_start_len: st.LogprobStart | None = None
        return_text_in_logprobs: bool = False  # each logprob entry's text (else null)

        def __post_init__(self) -> None:
            if (self.text is None) == (self.input_ids is None):
                raise ValueError("give exactly one of text (a string) and input_ids (token ids)")
            limits.check_input("input_ids", self.input_ids)

        def logprob_start(self, item: int = 0) -> int:
            """Where `item`'s input logprobs start (-1: none asked for)."""
            start = self.logprob_start_len
            return -1 if start is None or not self.return_logprob else start

        def sampling(self) -> Sampling:
            return self.sampling_params or Sampling()

        def session_id(self) -> str | None:
            return None if self.session_params is None else self.session_params.id

        def session_options(self) -> dict:
            params = self.session_params
            return {} if params is None else msgspec.structs.asdict(params)

    return GenerateRequest


# Python's recursion limit bounds what msgspec decodes; deeper is a 400, never a 500.
MAX_DEPTH = sys.getrecursionlimit()


def decode_body(raw: bytes, schema: type[T]) -> T:
    """`raw` as a `schema`, or InvalidRequest naming what is wrong. msgspec refuses what
    json.loads lets through: NaN and Infinity, and a lone surrogate escape (a str that
    could not be encoded again)."""
    try:
        return msgspec.json.decode(raw, type=schema)
    except msgspec.ValidationError as err:
        raise InvalidRequest(f"invalid request: {err}") from None
    except RecursionError:  # the decoder's own bound on nesting, at every depth of any field
        message = f"the body nests JSON too deeply (the limit is about {MAX_DEPTH} levels)"
        raise InvalidRequest(message) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as err:
        hint = ""
        if LONE_SURROGATE.search(raw):
            hint = " (a \\ud800-\\udfff escape is valid only as half of a surrogate pair)"
        raise InvalidRequest(f"the body is not valid JSON: {err}{hint}") from None
