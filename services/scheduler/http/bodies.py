"""Request bodies and their budgets: JSON error bodies, typed bodies, a text prompt's
ids, and the output budget a prompt leaves in the context."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web

from services.scheduler.engine.validation import openai_output_budget, sglang_output_budget
from services.scheduler.http.app_keys import FRONT_DOOR
from services.scheduler.http.schemas import decode_body
from services.scheduler.records.session import Session

T = TypeVar("T")


def error_body(message: str, kind: str, request_id: str | None = None) -> dict:
    detail = {"message": message, "type": kind}
    if request_id is not None:
        detail["request_id"] = request_id
    return {"error": detail}


async def read_body(request: web.Request, schema: type[T]) -> T:
    """The body as its typed, range-checked struct (`schemas.py`), or a 400."""
    return decode_body(await request.read(), schema)


def prompt_tokens(request: web.Request, text: str, session: Session | None) -> list[int]:
    """A raw text prompt's ids, with the special tokens the tokenizer's post-processor
    adds (a BOS) only where the token sequence starts: never for a session turn after
    the first, whose text continues the history."""
    starts = session is None or session.history.size == 0
    return request.app[FRONT_DOOR].tokenizer.encode(text, starts)


def openai_token_limit(
    request: web.Request,
    session: Session | None,
    new_tokens: int,
    field: str,
    requested: int | None,
    default: int,
) -> int:
    """An OpenAI route's max_tokens (see `openai_output_budget`); a session turn's prompt
    is the session's history plus its new input."""
    history = 0 if session is None else session.history.size
    context_len = request.app[FRONT_DOOR].context_len
    return openai_output_budget(history, new_tokens, requested, default, context_len, field)


def sglang_token_limit(
    request: web.Request,
    session: Session | None,
    new_tokens: int,
    requested: int | None,
    default: int,
) -> int:
    """/generate's max_new_tokens (see `sglang_output_budget`)."""
    history = 0 if session is None else session.history.size
    context_len = request.app[FRONT_DOOR].context_len
    return sglang_output_budget(history, new_tokens, requested, default, context_len)


def any_whitespace(request: web.Request) -> bool:
    """Whether constrained JSON may hold any whitespace (the server's setting,
    constraints.py)."""
    return not request.app[FRONT_DOOR].settings.constrained_json_disable_any_whitespace
