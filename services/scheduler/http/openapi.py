"""GET /openapi.json: an OpenAPI 3.1 document of every route, built from the router and
from the msgspec structs that validate the request bodies (`schemas.py`) and describe the
replies (`replies.py`), so what it states is what is enforced."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib.metadata import version

import msgspec
from aiohttp import web

from services.scheduler.http import replies
from services.scheduler.http.schemas import RequestSchemas

REF = "#/components/schemas/{name}"
SESSION_ROUTES = {"/generate", "/close_session", "/v1/completions", "/v1/chat/completions"}


@dataclass(frozen=True)
class Doc:
    """What one route takes and answers. `body` names a field of RequestSchemas; a
    reply is a struct, or a JSON Schema for a bare value; `events` is the struct of each
    server-sent event of a streamed reply."""

    summary: str
    body: str | None = None
    reply: type | dict | None = None
    events: type | None = None
    media: str = "application/json"
    batch: str | None = None  # the body of the batch form, answered with a list of replies
    typed: bool = False  # with stream: true, named events (the Responses and Messages APIs')


BOOLEAN = {"type": "boolean"}
TYPED_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string"},
        "data": {
            "contentMediaType": "application/json",
            "contentSchema": {"type": "object", "required": ["type"]},
        },
    },
}
FLUSH = "Empty the prefix cache; answers what open sessions kept (400 while requests run)"
INTERNAL_STATE = {
    "type": "object",
    "required": [
        "effective_max_running_requests_per_dp",
        "last_gen_throughput",
        "memory_usage",
        "avg_spec_accept_length",
    ],
    "properties": {
        "effective_max_running_requests_per_dp": {"type": "integer"},
        "last_gen_throughput": {"type": "number"},
        "memory_usage": {
            "type": "object",
            "required": ["token_capacity"],
            "properties": {"token_capacity": {"type": "integer"}},
        },
        "avg_spec_accept_length": {"type": "number"},
    },
}
SERVER_INFO = {
    "type": "object",
    "required": [
        "version",
        "internal_states",
        "context_len",
        "model_path",
        "tokenizer_path",
        "context_length",
    ],
    "properties": {
        "version": {"type": "string"},
        "internal_states": {"type": "array", "items": INTERNAL_STATE},
        "context_len": {"type": "integer"},
        "model_path": {"type": "string"},
        "tokenizer_path": {"type": ["string", "null"]},
        "context_length": {"type": "integer"},
    },
}
ROUTES = {
    ("GET", "/health"): Doc(
        "Readiness (503 until a request would be served at once), and the executor's epoch",
        reply=replies.Health,
    ),
    ("GET", "/health_generate"): Doc(
        "One greedy token generated end to end (503 until ready)", reply=replies.Health
    ),
    ("GET", "/liveness"): Doc("The process is up", reply=replies.Alive),
    ("GET", "/metrics"): Doc("Prometheus metrics", reply={"type": "string"}, media="text/plain"),
    ("GET", "/get_model_info"): Doc("The model and the pools", reply=replies.ModelInfo),
    ("GET", "/model_info"): Doc("The same, by SGLang's newer name", reply=replies.ModelInfo),
    ("GET", "/get_server_info"): Doc(
        "Every setting but the secret ones, the version and internal state (SGLang)",
        reply=SERVER_INFO,
    ),
    ("GET", "/server_info"): Doc("The same as /get_server_info (SGLang)", reply=SERVER_INFO),
    ("GET", "/openapi.json"): Doc("This document", reply={"type": "object"}),
    ("POST", "/open_session"): Doc(
        "Open a session; answers its id", "open_session", {"type": "string"}
    ),
    ("POST", "/fork_session"): Doc(
        "Open a session that starts from another's history; answers its id",
        "fork_session",
        {"type": "string"},
    ),
    ("POST", "/close_session"): Doc("Close a session", "close_session", BOOLEAN),
    ("POST", "/place_session"): Doc(
        "Move a session's state to a tier (operator)", "place_session", replies.Placed
    ),
    ("POST", "/abort_request"): Doc("Abort a request, or all", "abort_request", BOOLEAN),
    ("GET", "/admin/idle_sessions"): Doc(
        "The longest idle sessions, with their idle seconds and timeouts (operator)",
        reply={"type": "object"},
    ),
    ("POST", "/admin/migrate_out"): Doc(
        "Stop a session's turns and place its state on disk, to move it (router)",
        "migrate",
        replies.Placed,
    ),
    ("POST", "/admin/migrate_in"): Doc(
        "Open a session moved from replica `source`, copying its blob (router)",
        "migrate",
        replies.Placed,
    ),
    ("POST", "/admin/migrate_done"): Doc(
        "Close a session that now lives on another replica (router)", "migrate", BOOLEAN
    ),
    ("POST", "/admin/migrate_cancel"): Doc(
        "A move that failed: the session takes turns here again (router)", "migrate", BOOLEAN
    ),
    ("GET", "/flush_cache"): Doc(FLUSH, reply=replies.Flushed),
    ("POST", "/flush_cache"): Doc(FLUSH, reply=replies.Flushed),
    ("POST", "/reset_prefix_cache"): Doc("The same as /flush_cache (vLLM)", reply=replies.Flushed),
    ("POST", "/generate"): Doc(
        "Generate (SGLang); a list of texts or of id lists is a batch",
        "generate",
        replies.GenerateReply,
        replies.GenerateReply,
        batch="generate_batch",
    ),
    ("GET", "/v1/models"): Doc("The served model (OpenAI)", reply=replies.ModelList),
    ("POST", "/tokenize"): Doc(
        "A text or a conversation as the server tokenizes it (vLLM)", "tokenize", replies.Tokens
    ),
    ("POST", "/detokenize"): Doc("Token ids as text (vLLM)", "detokenize", replies.Detokenized),
    ("GET", "/tokenizer_info"): Doc(
        "The tokenizer's special tokens, length and chat template (vLLM)",
        reply=replies.TokenizerInfo,
    ),
    ("POST", "/v1/completions"): Doc(
        "Complete a prompt (OpenAI)", "completions", replies.Completion, replies.Completion
    ),
    ("POST", "/v1/chat/completions"): Doc(
        "Continue a conversation (OpenAI)",
        "chat_completions",
        replies.ChatCompletion,
        replies.ChatCompletionChunk,
    ),
    ("POST", "/v1/responses"): Doc(
        "Create a response, continuing or branching a stored one (OpenAI Responses)",
        "responses",
        {"type": "object", "description": "a Response object (docs/api.md, Responses)"},
        typed=True,
    ),
    ("GET", "/v1/responses/{response_id}"): Doc(
        "A stored response", reply={"type": "object", "description": "a Response object"}
    ),
    ("DELETE", "/v1/responses/{response_id}"): Doc(
        "Delete a stored response (docs/api.md: the responses that continue it stay)",
        reply={"type": "object", "required": ["id", "deleted"]},
    ),
    ("POST", "/v1/responses/compact"): Doc("Refused (400): not served"),
    ("POST", "/v1/responses/{response_id}/cancel"): Doc("Refused (400): not served"),
    ("GET", "/v1/responses/{response_id}/input_items"): Doc(
        "A stored response's input items, a page of them",
        reply={"type": "object", "required": ["object", "data", "has_more"]},
    ),
    ("POST", "/v1/messages"): Doc(
        "Create a message (Anthropic Messages; the session header binds a conversation)",
        "messages",
        {"type": "object", "required": ["id", "type", "role", "content", "stop_reason", "usage"]},
        typed=True,
    ),
    ("POST", "/v1/messages/count_tokens"): Doc(
        "The prompt tokens a message request renders (Anthropic Messages)",
        "messages",
        {"type": "object", "required": ["input_tokens"]},
    ),
}


def openapi_document(router: web.UrlDispatcher, schemas: RequestSchemas) -> dict:
    """The document of every route of `router` (each must have an entry in ROUTES)."""
    types = [*schemas.all(), replies.ErrorReply]
    types += [d.reply for d in ROUTES.values() if isinstance(d.reply, type)]
    types += [d.events for d in ROUTES.values() if d.events is not None]
    refs, components = msgspec.json.schema_components(dict.fromkeys(types), ref_template=REF)
    ref = dict(zip(dict.fromkeys(types), refs, strict=True))
    for component in components.values():
        if "description" in component:
            component["description"] = inspect.cleandoc(component["description"])
    paths: dict[str, dict] = {}
    for route in router.routes():
        if route.method == "HEAD":
            continue
        path = route.resource.canonical
        doc = ROUTES[(route.method, path)]
        paths.setdefault(path, {})[route.method.lower()] = operation(path, doc, ref, schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "custody scheduler",
            "version": version("custody"),
            "description": "SGLang- and OpenAI-compatible API of stateful streaming sessions.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }


def operation(path: str, doc: Doc, ref: dict, schemas: RequestSchemas) -> dict:
    reply = ref[doc.reply] if isinstance(doc.reply, type) else doc.reply
    if doc.batch is not None:
        reply = {"anyOf": [reply, {"type": "array", "items": reply}]}
    content = {doc.media: {"schema": reply}}
    described = "OK"
    if doc.events is not None:
        content["text/event-stream"] = {"schema": event_schema(ref[doc.events], ref)}
        described = (
            "with stream: true, server-sent events `data: <event>`, then `data: [DONE]`; "
            "a fault after the first event ends the stream with `data: <ErrorReply>`"
        )
    if doc.typed:
        content["text/event-stream"] = {"schema": TYPED_EVENT}
        described = (
            "with stream: true, named server-sent events `event: <type>` then `data: <event>`;"
            " a fault after the first ends the stream with an `error` event"
        )
    responses = {"200": {"description": described, "content": content}}
    refusals = {}
    if doc.body is not None:
        refusals["400"] = "bad input: malformed JSON, a wrong type, a value out of range"
        refusals["413"] = "the body is over the size limit"
    if path in SESSION_ROUTES:
        refusals |= {"404": "unknown or closed session", "409": "the session has a turn running"}
    refusals["500"] = "an internal fault, logged under error.request_id"
    refusals["default"] = "any other refusal (401 without a valid key, 405, 429...)"
    failure = {"application/json": {"schema": ref[replies.ErrorReply]}}
    responses |= {code: {"description": why, "content": failure} for code, why in refusals.items()}
    op = {"summary": doc.summary, "responses": responses}
    if doc.body is not None:
        body = ref[getattr(schemas, doc.body)]
        if doc.batch is not None:
            body = {"anyOf": [body, ref[getattr(schemas, doc.batch)]]}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def event_schema(data: dict, ref: dict) -> dict:
    """One server-sent event (before OpenAPI 3.2's itemSchema, a stream's `schema`
    describes each event): its data is `[DONE]`, or JSON holding `data` or an error."""
    payload = {"anyOf": [data, ref[replies.ErrorReply]]}
    json_data = {"contentMediaType": "application/json", "contentSchema": payload}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def add_openapi_route(app: web.Application, schemas: RequestSchemas) -> None:
    """Serve the document of every route added so far (add this one last)."""
    document: dict = {}

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", openapi)
    document.update(openapi_document(app.router, schemas))
