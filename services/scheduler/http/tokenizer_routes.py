"""vLLM's tokenizer routes: `/tokenize`, `/detokenize` and `/tokenizer_info`, with which a
client tokenizes exactly as the server does (lm-eval's remote tokenizer learns the EOS id
by encoding the EOS string, and renders chats with the template `/tokenizer_info` gives)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from services.scheduler.http.app_keys import CHAT, FRONT_DOOR, SCHEMAS
from services.scheduler.http.bodies import read_body
from services.scheduler.records.sampling import InvalidRequest


async def tokenize(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].tokenize)
    door = request.app[FRONT_DOOR]
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = door.tokenizer.encode(body.prompt, special)
    else:
        if body.add_special_tokens:
            raise InvalidRequest(
                "add_special_tokens with messages is not supported: the chat template "
                "writes the special tokens a conversation needs"
            )
        encoder = request.app[CHAT]
        messages = encoder.messages([msgspec.to_builtins(m) for m in body.messages])
        tokens = encoder.tokens(messages, body.add_generation_prompt, {"tools": body.tools})
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": door.context_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await read_body(request, request.app[SCHEMAS].detokenize)
    return web.json_response({"prompt": request.app[FRONT_DOOR].tokenizer.decode(body.tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    """The tokenizer's configuration: its special tokens by name (`eos_token`, present
    even when the checkpoint names none), length and chat template."""
    template = request.app[CHAT].template
    info = {"bos_token": None, "eos_token": None, "pad_token": None} | template.special_tokens
    info |= {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": request.app[FRONT_DOOR].context_len,
        "chat_template": template.source,
    }
    return web.json_response(info)


ROUTES = (
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("GET", "/tokenizer_info", tokenizer_info),
)
