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

from services.scheduler.engine.request import Request
from services.scheduler.engine.sampling import InvalidRequest, SamplingParams
from services.scheduler.http_common import (
    body_of,
    check_number,
    open_sse,
    output_text,
    own_session,
    send_sse,
    stop_strings,
    submitter,
)

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

MODEL_ID = "custody"
ROLES = {"system", "user", "assistant", "tool"}


def render(messages: list[dict], generation_prompt: bool = True) -> str:
    """The chat template of the built-in byte-level model."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if generation_prompt else "")


def check_messages(raw: object) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list")
    for m in raw:
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise InvalidRequest(f"each message needs a role in {sorted(ROLES)} and string content")
    return raw


def params_of(body: dict, default_max: int) -> SamplingParams:
    if body.get("n", 1) != 1:
        raise InvalidRequest("only n=1 is supported")
    values = {
        "max_new_tokens": body.get("max_tokens", body.get("max_completion_tokens", default_max)),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
    }
    for name, value in values.items():
        check_number(name, value, int if name == "max_new_tokens" else (int, float))
    seed = body.get("seed")
    if seed is not None:
        check_number("seed", seed, int)
    return SamplingParams(
        max_new_tokens=values["max_new_tokens"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        seed=seed,
        logprobs=bool(body.get("logprobs")),
        stop=stop_strings(body.get("stop")),
    )


def add_openai_routes(app: web.Application, service: SchedulerService) -> None:

    def usage(req: Request) -> dict:
        return {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def finish(req: Request) -> str:
        return "stop" if (req.finish_reason or {}).get("type") == "stop" else "length"

    async def respond(
        request: web.Request, body: dict, tokens: list[int], chat: bool, params: SamplingParams
    ) -> web.StreamResponse:
        kind = "chat.completion" if chat else "text_completion"
        claim = service.tenancy.claim(request, None, "chatcmpl-" if chat else "cmpl-")
        rid = claim.shown
        sid = body.get("session_id")
        req = Request(claim.server, np.asarray(tokens, dtype=np.int64), params)
        submit = submitter(service, request, tokens, sid, {})
        created = int(time.time())

        def choice(text: str, reason: str | None) -> dict:
            if chat:
                return {
                    "index": 0,
                    "finish_reason": reason,
                    "message" if reason is not None and not body.get("stream") else "delta": {
                        "role": "assistant",
                        "content": text,
                    },
                }
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        if not body.get("stream"):
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
        sse = await open_sse(request)
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
            await send_sse(sse, chunk)

        done = await service.run_request(req, submit, progress)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send_sse(
                sse,
                {
                    "id": rid,
                    "object": f"{kind}.chunk",
                    "created": created,
                    "model": MODEL_ID,
                    "choices": [],
                    "usage": usage(done),
                },
            )
        await send_sse(sse, "[DONE]")
        return sse

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "custody"}],
            }
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens = service.tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = prompt
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        return await respond(request, body, tokens, False, params_of(body, 16))

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await body_of(request)
        messages = check_messages(body.get("messages"))
        sid = body.get("session_id")
        if (
            sid is not None
            and isinstance(sid, str)
            and own_session(service, request, sid).history.size
        ):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            messages = messages[last + 1 :]
            if not messages:
                raise InvalidRequest("nothing new after the last assistant message")
        tokens = service.tokenizer.encode(render(messages))
        return await respond(request, body, tokens, True, params_of(body, 128))

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
