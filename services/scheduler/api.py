"""The HTTP API, SGLang-compatible: sessions, generate (plain or streamed as server-sent
events), abort, flush, health, model info and metrics. The OpenAI-compatible routes are in
`api_openai.py`.

Every refusal is a 4xx with `{"error": {"message", "type"}}` and happens before any slot
moves; a client that disconnects aborts its request, with the abort semantics of sessions
(the session keeps its cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.scheduler.api_openai import add_openai_routes
from services.scheduler.engine.request import Request
from services.scheduler.engine.sampling import InvalidRequest, SamplingParams
from services.scheduler.http_common import (
    body_of,
    check_number,
    error,
    open_sse,
    output_text,
    own_session,
    send_sse,
    stop_strings,
    submitter,
)
from services.scheduler.limits import open_session as open_session_within_limits
from services.scheduler.sessions.manager import SessionError
from services.scheduler.tenancy import middleware as tenancy_middleware

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

MAX_BODY = 8 * 1024 * 1024
SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "no_stop_trim",
}
STATUS = {"not_found": 404, "closed": 404, "busy": 409, "invalid": 400}


def sampling_from(raw: object) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise InvalidRequest("sampling_params must be an object")
    unknown = set(raw) - SAMPLING_KEYS
    if unknown:
        raise InvalidRequest(f"unknown sampling_params: {sorted(unknown)}")
    stop = raw.get("stop_token_ids", ())
    if not isinstance(stop, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop
    ):
        raise InvalidRequest("sampling_params.stop_token_ids must be a list of integers")
    for key in ("ignore_eos", "no_stop_trim"):
        if not isinstance(raw.get(key, False), bool):
            raise InvalidRequest(f"sampling_params.{key} must be true or false")
    seed = raw.get("seed")
    if seed is not None:
        check_number("sampling_params.seed", seed, int)
    values = dict(raw)
    values["stop"] = stop_strings(raw.get("stop"))
    values["stop_token_ids"] = tuple(stop)
    params = SamplingParams(**values)
    for name, kind in (
        ("max_new_tokens", int),
        ("top_k", int),
        ("temperature", (int, float)),
        ("top_p", (int, float)),
    ):
        check_number(f"sampling_params.{name}", getattr(params, name), kind)
    return params


def token_input(service: SchedulerService, body: dict) -> list[int]:
    if "input_ids" in body:
        tokens = body["input_ids"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise InvalidRequest("input_ids must be a list of integers")
        return tokens
    if isinstance(body.get("text"), str):
        return service.tokenizer.encode(body["text"])
    raise InvalidRequest("give text (a string) or input_ids (a list of integers)")


def response_of(service: SchedulerService, req: Request, rid: str, logprobs: bool = False) -> dict:
    """The SGLang response; `rid` is the client's (the engine's is internal)."""
    meta = {
        "id": rid,
        "finish_reason": req.finish_reason,
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

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executor": service.executor_epoch})

    async def metrics(_: web.Request) -> web.Response:
        await service.refresh_stream_lag()
        return web.Response(
            body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

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
        body = await body_of(request)
        timeout = body.get("timeout")
        if timeout is not None:
            check_number("timeout", timeout, (int, float))
        session = open_session_within_limits(service, request, body.get("session_id"), timeout)
        return web.json_response(session.sid)

    async def close_session(request: web.Request) -> web.Response:
        sid = (await body_of(request)).get("session_id")
        own_session(service, request, sid)
        engine.sessions.close(sid)
        service.wake.set()
        return web.json_response(True)

    async def abort_request(request: web.Request) -> web.Response:
        body = await body_of(request)
        targets = service.tenancy.abort_targets(
            request, body.get("rid"), body.get("abort_all") is True, engine.requests
        )
        for rid in targets:
            service.finish(engine.abort(rid, "aborted by request"))
        service.wake.set()
        return web.json_response(True)

    async def flush_cache(_: web.Request) -> web.Response:
        engine.cache.evict_kv(service.pools.kv_pages.capacity)
        engine.cache.evict_mamba(service.pools.mamba.capacity)
        return web.json_response(True)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await body_of(request)
        params = sampling_from(body.get("sampling_params"))
        tokens = token_input(service, body)
        session = body.get("session_params") or {}
        if not isinstance(session, dict):
            raise InvalidRequest("session_params must be an object")
        rid = service.tenancy.claim(request, body.get("rid"))
        req = Request(rid.server, np.asarray(tokens, dtype=np.int64), params)
        submit = submitter(service, request, tokens, session.get("id"), session)
        logprobs = body.get("return_logprob") is True
        if not body.get("stream"):
            done = await service.run_request(req, submit)
            return web.json_response(response_of(service, done, rid.shown, logprobs))
        sse = await open_sse(request)

        async def progress(r: Request) -> None:
            await send_sse(sse, response_of(service, r, rid.shown, logprobs))

        await service.run_request(req, submit, progress)
        await send_sse(sse, "[DONE]")
        return sse

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
    add_openai_routes(app, service)
    return app


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SessionError as err:
        return error(STATUS.get(err.kind, 400), str(err), f"session_{err.kind}")
    except InvalidRequest as err:
        return error(400, str(err))
    except web.HTTPRequestEntityTooLarge as err:
        return error(413, err.text or "request body too large", "request_too_large")
    except web.HTTPException as err:
        return error(err.status, err.reason or "error", "http_error")
