"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (plain or
streamed), with `usage.prompt_tokens_details.cached_tokens`.

A session is named with the extension field `session_id`. An agent loop sends its whole
conversation every time; custody appends to the session only what follows the last
assistant message (the reply it produced itself), so each turn prefills only its new
tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from services.scheduler.http_common import (
    EventStream,
    output_text,
    own_session,
    read_body,
    submitter,
    token_limit,
)
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import InvalidRequest

if TYPE_CHECKING:
    from services.scheduler.schemas import RequestSchemas
    from services.scheduler.schemas_openai import ChatMessage, OpenAIRequest
    from services.scheduler.service import SchedulerService

MODEL_ID = "custody"
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}


def render(messages: list[ChatMessage], generation_prompt: bool = True) -> str:
    """The chat template of the built-in byte-level model."""
    text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
    return text + ("<|assistant|>\n" if generation_prompt else "")


def add_openai_routes(
    app: web.Application, service: SchedulerService, schemas: RequestSchemas
) -> None:

    def usage(req: Request) -> dict:
        return {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def finish(req: Request) -> str:
        return "stop" if req.finish_reason and req.finish_reason.type == "stop" else "length"

    async def respond(
        request: web.Request, body: OpenAIRequest, tokens: list[int], chat: bool
    ) -> web.StreamResponse:
        kind = "chat.completion" if chat else "text_completion"
        claim = service.tenancy.claim(request, None, "chatcmpl-" if chat else "cmpl-")
        rid = claim.shown
        sid = body.session_id
        submit = submitter(service, request, tokens, sid, {})
        field, requested = body.requested_tokens()
        default = DEFAULT_MAX_TOKENS["chat" if chat else "completions"]
        limit = token_limit(service, request, sid, len(tokens), field, requested, default)
        req = Request(claim.server, np.asarray(tokens, dtype=np.int64), body.engine_params(limit))
        created = int(time.time())

        def choice(text: str, reason: str | None) -> dict:
            if chat:
                return {
                    "index": 0,
                    "finish_reason": reason,
                    "message" if reason is not None and not body.stream else "delta": {
                        "role": "assistant",
                        "content": text,
                    },
                }
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        if not body.stream:
            done = await service.run_request(req, submit)
            return web.json_response(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": MODEL_ID,
                    "choices": [choice(output_text(service, done), finish(done))],
                    "usage": usage(done),
                }
            )
        sse = EventStream(request)
        sent = [0]

        async def progress(r: Request) -> None:
            new = r.output[sent[0] :]
            sent[0] = len(r.output)
            chunk = {
                "id": rid,
                "object": f"{kind}.chunk",
                "created": created,
                "model": MODEL_ID,
                "choices": [choice(service.tokenizer.decode(new), finish(r) if r.done else None)],
            }
            await sse.send(chunk)

        done = await service.run_request(req, submit, progress)
        if body.include_usage():
            await sse.send(
                {
                    "id": rid,
                    "object": f"{kind}.chunk",
                    "created": created,
                    "model": MODEL_ID,
                    "choices": [],
                    "usage": usage(done),
                },
            )
        await sse.send("[DONE]")
        return sse.response

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "custody"}],
            }
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, schemas.completions)
        prompt = body.prompt
        tokens = service.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return await respond(request, body, tokens, False)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, schemas.chat_completions)
        messages, sid = body.messages, body.session_id
        if sid is not None and own_session(service, request, sid).history.size:
            last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
            messages = messages[last + 1 :]
            if not messages:
                raise InvalidRequest("nothing new after the last assistant message")
        tokens = service.tokenizer.encode(render(messages))
        return await respond(request, body, tokens, True)

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
