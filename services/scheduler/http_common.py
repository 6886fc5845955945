"""What both HTTP route modules use: JSON errors, body parsing, server-sent events, and
resolving the session a request names (with API keys on, only the key that opened a
session may use it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from services.scheduler.engine.request import Request
from services.scheduler.engine.sampling import InvalidRequest
from services.scheduler.limits import check_queue
from services.scheduler.sessions.session import Session
from services.scheduler.tenancy import check_owner

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService


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


def check_number(name: str, value: object, kind: type | tuple) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")


def submitter(
    service: SchedulerService,
    request: web.Request,
    tokens: list[int],
    sid: object,
    session_params: dict,
) -> Callable[[Request], Request]:
    """How to queue a request: plain, or the next turn of a session the caller owns (with
    API keys on, a session is visible only to the key that opened it); refused with a 503
    while the waiting queue is full."""
    engine = service.engine
    check_queue(service)
    if sid is None:
        return engine.submit
    own_session(service, request, sid)
    return lambda r: engine.submit_turn(sid, np.asarray(tokens), r, session_params)


def own_session(service: SchedulerService, request: web.Request, sid: object) -> Session:
    if not isinstance(sid, str):
        raise InvalidRequest("a session id must be a string")
    return check_owner(service.engine.sessions.get(sid), request)


async def open_sse(request: web.Request) -> web.StreamResponse:
    sse = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await sse.prepare(request)
    return sse


async def send_sse(sse: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await sse.write(f"data: {data}\n\n".encode())


def stop_strings(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise InvalidRequest("stop must be a string or a list of strings")


def output_text(service: SchedulerService, req: Request) -> str:
    """The decoded output, cut before a matched stop string unless no_stop_trim."""
    text = service.tokenizer.decode(req.output)
    matched = (req.finish_reason or {}).get("matched")
    if isinstance(matched, str) and not req.params.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    return text
