"""The HTTP API (SGLang-compatible subset): sessions, generate, abort, health, model info.

Every refusal is a 4xx with `{"error": {"message", "type"}}` and happens before any slot
moves; a client that disconnects aborts its request, with the abort semantics of
sessions (the session keeps its cache).
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from services.scheduler.engine.request import Request
from services.scheduler.engine.sampling import InvalidRequest, SamplingParams
from services.scheduler.sessions.manager import SessionError

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

MAX_BODY = 8 * 1024 * 1024
SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "no_stop_trim",
}
STATUS = {"not_found": 404, "closed": 404, "busy": 409, "invalid": 400}


def error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


async def body_of(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def sampling_from(raw: object) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise InvalidRequest("sampling_params must be an object")
    unknown = set(raw) - SAMPLING_KEYS
    if unknown:
        raise InvalidRequest(f"unknown sampling_params: {sorted(unknown)}")
    try:
        params = SamplingParams(
            **{k: tuple(v) if k == "stop_token_ids" else v for k, v in raw.items()}
        )
    except TypeError as err:
        raise InvalidRequest(f"bad sampling_params: {err}") from None
    for name, kind in (
        ("max_new_tokens", int),
        ("top_k", int),
        ("temperature", (int, float)),
        ("top_p", (int, float)),
    ):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise InvalidRequest(f"sampling_params.{name} must be a number, got {value!r}")
    return params


def build_app(service: SchedulerService) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
    rids = itertools.count(1)
    engine = service.engine

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executor": service.executor_epoch})

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
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float)
        ):
            raise InvalidRequest("timeout must be a number of seconds")
        session = engine.sessions.open(body.get("session_id"), timeout)
        return web.json_response(session.sid)

    async def close_session(request: web.Request) -> web.Response:
        body = await body_of(request)
        engine.sessions.close(body.get("session_id"))
        service.wake.set()
        return web.json_response(True)

    async def abort_request(request: web.Request) -> web.Response:
        body = await body_of(request)
        rids_to_abort = list(engine.requests) if body.get("abort_all") else [body.get("rid")]
        for rid in rids_to_abort:
            service.finish(engine.abort(str(rid), "aborted by request"))
        service.wake.set()
        return web.json_response(True)

    async def generate(request: web.Request) -> web.Response:
        body = await body_of(request)
        params = sampling_from(body.get("sampling_params"))
        if "input_ids" in body:
            tokens = body["input_ids"]
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise InvalidRequest("input_ids must be a list of integers")
        elif isinstance(body.get("text"), str):
            tokens = service.tokenizer.encode(body["text"])
        else:
            raise InvalidRequest("give text (a string) or input_ids (a list of integers)")
        rid = str(body.get("rid") or f"req-{next(rids)}")
        session = body.get("session_params") or {}
        if not isinstance(session, dict):
            raise InvalidRequest("session_params must be an object")
        req = Request(rid, np.asarray(tokens, dtype=np.int64), params)
        if session.get("id") is not None:
            sid = session["id"]
            done = await service.run_request(
                req, lambda r: engine.submit_turn(sid, np.asarray(tokens), r, session)
            )
        else:
            done = await service.run_request(req, engine.submit)
        return web.json_response(response_of(service, done))

    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/open_session", open_session)
    app.router.add_post("/close_session", close_session)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/generate", generate)
    return app


def response_of(service: SchedulerService, req: Request) -> dict:
    return {
        "text": service.tokenizer.decode(req.output),
        "output_ids": req.output,
        "meta_info": {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "cached_tokens": req.cached_tokens,
        },
    }


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SessionError as err:
        return error(STATUS.get(err.kind, 400), str(err), f"session_{err.kind}")
    except InvalidRequest as err:
        return error(400, str(err))
    except web.HTTPRequestEntityTooLarge as err:
        return error(413, str(err), "request_too_large")
    except web.HTTPException as err:
        return error(err.status, err.reason or "error", "http_error")
