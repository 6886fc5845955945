"""The HTTP API, SGLang-compatible: sessions, generate (plain or streamed as server-sent
events), abort, flush, health, model info and metrics. The OpenAI-compatible routes are in
`api_openai.py`.

Every refusal is a 4xx with `{"error": {"message", "type"}}` and happens before any slot
moves; a client that disconnects aborts its request, with the abort semantics of sessions
(the session keeps its cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.scheduler.api_openai import add_openai_routes
from services.scheduler.http_common import (
    EventStream,
    output_text,
    own_session,
    read_body,
    submitter,
    token_limit,
)
from services.scheduler.http_errors import errors
from services.scheduler.limits import open_session as open_session_within_limits
from services.scheduler.openapi import add_openapi_route
from services.scheduler.records.request import Request
from services.scheduler.schemas import request_schemas
from services.scheduler.tenancy import middleware as tenancy_middleware

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_NEW_TOKENS = 16


def response_of(service: SchedulerService, req: Request, rid: str, logprobs: bool = False) -> dict:
    """The SGLang response; `rid` is the client's (the engine's is internal)."""
    meta = {
        "id": rid,
        "finish_reason": msgspec.to_builtins(req.finish_reason),
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens,
    }
    if logprobs:  # SGLang's shape: [logprob, token id, token text]
        meta["output_token_logprobs"] = [
            [lp, tok, service.tokenizer.decode([tok])]
            for lp, tok in zip(req.logprobs, req.output, strict=False)
        ]
    return {"text": output_text(service, req), "output_ids": list(req.output), "meta_info": meta}


def build_app(service: SchedulerService) -> web.Application:
    app = web.Application(
        client_max_size=MAX_BODY, middlewares=[errors, tenancy_middleware(service.tenancy)]
    )
    engine = service.engine
    schemas = request_schemas(engine.config.vocab_size, engine.config.context_len)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executor": service.executor_epoch})

    async def metrics(_: web.Request) -> web.Response:
        body = await service.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def model_info(_: web.Request) -> web.Response:
        s = service.settings
        return web.json_response(
            {
                "model_path": str(s.model) if s.model else "builtin",
                "context_length": s.context_len,
                "page_size": s.page_size,
                "kv_pages": s.kv_pages,
                "mamba_slots": s.mamba_slots,
                "max_running_requests": s.max_running_requests,
            }
        )

    async def open_session(request: web.Request) -> web.Response:
        body = await read_body(request, schemas.open_session)
        session = open_session_within_limits(service, request, body.session_id, body.timeout)
        return web.json_response(session.sid)

    async def close_session(request: web.Request) -> web.Response:
        sid = (await read_body(request, schemas.close_session)).session_id
        own_session(service, request, sid)
        engine.sessions.close(sid)
        service.wake.set()
        return web.json_response(True)

    async def abort_request(request: web.Request) -> web.Response:
        body = await read_body(request, schemas.abort_request)
        targets = service.tenancy.abort_targets(request, body.rid, body.abort_all, engine.requests)
        for rid in targets:
            service.finish(engine.abort(rid, "aborted by request"))
        service.wake.set()
        return web.json_response(True)

    async def flush_cache(_: web.Request) -> web.Response:
        engine.cache.evict_kv(service.pools.kv_pages.capacity)
        engine.cache.evict_mamba(service.pools.mamba.capacity)
        return web.json_response(True)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, schemas.generate)
        tokens = body.input_ids or service.tokenizer.encode(body.text)
        sampling, sid = body.sampling(), body.session_id()
        rid = service.tenancy.claim(request, body.rid)
        submit = submitter(service, request, tokens, sid, body.session_options())
        limit = token_limit(
            service,
            request,
            sid,
            len(tokens),
            "sampling_params.max_new_tokens",
            sampling.max_new_tokens,
            DEFAULT_MAX_NEW_TOKENS,
        )
        req = Request(rid.server, np.asarray(tokens, dtype=np.int64), sampling.engine_params(limit))
        logprobs = body.return_logprob
        if not body.stream:
            done = await service.run_request(req, submit)
            return web.json_response(response_of(service, done, rid.shown, logprobs))
        sse = EventStream(request)

        async def progress(r: Request) -> None:
            await sse.send(response_of(service, r, rid.shown, logprobs))

        await service.run_request(req, submit, progress)
        await sse.send("[DONE]")
        return sse.response

    for method, path, handler in (
        ("GET", "/health", health),
        ("GET", "/metrics", metrics),
        ("GET", "/get_model_info", model_info),
        ("POST", "/open_session", open_session),
        ("POST", "/close_session", close_session),
        ("POST", "/abort_request", abort_request),
        ("POST", "/flush_cache", flush_cache),
        ("POST", "/generate", generate),
    ):
        app.router.add_route(method, path, handler)
    add_openai_routes(app, service, schemas)
    add_openapi_route(app, schemas)
    return app
