"""The one place a handler's failure becomes an HTTP answer. A refusal is a 4xx with
`{"error": {"message", "type"}}`; anything unexpected is a JSON 500 whose `request_id` the
log names too, never aiohttp's text/plain page; and a streamed reply whose 200 headers
already went out ends with an error event, never with a second response written into its
chunked body."""

from __future__ import annotations

import contextlib
import logging
import secrets

from aiohttp import web
from redis.exceptions import RedisError

from services.scheduler.http.bodies import error_body
from services.scheduler.http.events import EVENT_STREAM
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import SessionError
from services.scheduler.text.chat_template import ChatRefused
from shared.tenancy import Refused
from shared.tokenizer import TokenizerMissing

log = logging.getLogger("custody.scheduler.http")

SESSION_STATUS = {
    "not_found": 404,
    "closed": 404,
    "busy": 409,
    "conflict": 409,  # a chat's messages differ from the session's (docs/chat.md)
    "invalid": 400,
    "limit": 429,
    "moving": 503,  # leaving for another replica: the router sends the retry there
    "rebuilding": 503,  # its records are not proven current yet (session_rebuild.py)
    "fenced": 503,  # this replica's lease on its sessions lapsed (protocol/lives.py)
    "outcome_unknown": 504,  # moved while the turn's record was on its way (intake.py)
    "lost": 410,  # its history cannot be proven current after a fault (session_rebuild.py)
}
RETRY_AFTER_SECONDS = 1  # on every 503: what is refused now is served soon
ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's API: its errors in Anthropic's shape
# Anthropic's error type of each status; another 4xx is an invalid request, another 5xx
# an API error
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class Relayed(Exception):
    """A failure the core answered for a call an edge worker sent it (edge/), as the
    worker raises it, so its errors middleware answers exactly as the core's would."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def classify(err: Exception) -> tuple[int, str, str]:
    """Status, message and type of the answer to `err`."""
    if isinstance(err, Relayed | Refused):
        return err.status, str(err), err.kind
    if isinstance(err, SessionError):
        return SESSION_STATUS.get(err.kind, 400), str(err), f"session_{err.kind}"
    if isinstance(err, InvalidRequest | TokenizerMissing | ChatRefused):
        return 400, str(err), "invalid_request_error"
    if isinstance(err, web.HTTPRequestEntityTooLarge):
        return 413, err.text or "request body too large", "request_too_large"
    if isinstance(err, web.HTTPException):
        return err.status, err.reason or "error", "http_error"
    if isinstance(err, RedisError):  # refused (read-only, out of memory) or unreachable
        return 503, "Redis cannot be reached or refuses writes now; retry", "dependency_unavailable"
    return 500, "internal error; the scheduler's log has it under request_id", "internal_error"


def shaped(path: str, status: int, message: str, kind: str, request_id: str | None) -> dict:
    """The error body of `path`'s API: `{"error": {"message", "type"}}` (OpenAI's and
    SGLang's), or on Anthropic's routes `{"type": "error", "error": {"type", "message"}}`
    with Anthropic's type for the status."""
    if not path.startswith(ANTHROPIC_PATHS):
        return error_body(message, kind, request_id)
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    detail = {"type": ANTHROPIC_TYPES.get(status, fallback), "message": message}
    return {
        "type": "error",
        "error": detail | ({} if request_id is None else {"request_id": request_id}),
    }


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as err:
        stream = request.get(EVENT_STREAM)
        streaming = stream is not None and stream.response.prepared
        if streaming and isinstance(err, ConnectionError):
            log.info("%s %s: the client went away mid-stream", request.method, request.path)
            return stream.response  # its request was aborted; there is no one to answer
        status, message, kind = classify(err)
        request_id = None
        # a session's 503 is a refusal; a relayed 500 the core logged; Redis's a fault
        # its own loops log (shared/retry.py), counted there
        if isinstance(err, RedisError):
            log.warning("%s %s: Redis: %s", request.method, request.path, err)
        elif status >= 500 and not isinstance(err, SessionError | Relayed | Refused):
            request_id = secrets.token_hex(8)
            log.exception("%s %s failed (request_id %s)", request.method, request.path, request_id)
        body = shaped(request.path, status, message, kind, request_id)
        if streaming:
            with contextlib.suppress(ConnectionError):
                await stream.fail(body)
            return stream.response
        headers = dict(err.headers) if isinstance(err, Refused) else {}
        if status == 503:
            headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
        if isinstance(err, web.HTTPMethodNotAllowed):
            headers["Allow"] = ",".join(sorted(err.allowed_methods))
        return web.json_response(body, status=status, headers=headers)
