"""The HTTP application: its middlewares (JSON errors, keys and tenancy), what its
handlers carry (`app_keys.py`), and the route table of the SGLang, OpenAI and tokenizer
routes, with /openapi.json documenting them all. An edge worker's application carries
the same and serves only the generation routes (edge/worker.py)."""

from __future__ import annotations

from aiohttp import web

from services.scheduler.http import (
    messages_routes,
    migration_routes,
    openai_routes,
    responses_routes,
    routes,
    tokenizer_routes,
)
from services.scheduler.http.app_keys import CHAT, FRONT_DOOR, SCHEMAS, TENANCY, TOKENIZER_DIR
from services.scheduler.http.errors import errors
from services.scheduler.http.openapi import add_openapi_route
from services.scheduler.http.schemas import request_schemas
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.http.tenancy import middleware as tenancy_middleware
from services.scheduler.runtime.front_door import FrontDoor
from services.scheduler.text.chat_template import ChatTemplate
from services.scheduler.text.chat_tokens import ChatEncoder
from services.scheduler.text.tokenizer_files import tokenizer_files
from shared.http_limits import MAX_BODY


def build_app(door: FrontDoor, tenancy: Tenancy) -> web.Application:
    """The core's application: every route (behind edge workers, what they forward)."""
    app = edge_app(door, tenancy)
    tokenizer_dir = tokenizer_files(door.settings, door.context_len)
    if tokenizer_dir is not None:
        app[TOKENIZER_DIR] = tokenizer_dir
    tables = (
        routes,
        openai_routes,
        responses_routes,
        messages_routes,
        tokenizer_routes,
        migration_routes,
    )
    for method, path, handler in (route for table in tables for route in table.ROUTES):
        app.router.add_route(method, path, handler)
    add_openapi_route(app, app[SCHEMAS])
    return app


def edge_app(door: FrontDoor, tenancy: Tenancy, inner: tuple = ()) -> web.Application:
    """An application without routes, carrying what every handler reads: the door to
    the core, the body schemas, keys and the chat template (`inner`: middlewares run
    closest to the handler, an edge worker's forwarding)."""
    app = web.Application(
        client_max_size=MAX_BODY, middlewares=[errors, tenancy_middleware(tenancy), *inner]
    )
    schemas = request_schemas(door.vocab_size, door.context_len)
    app[FRONT_DOOR], app[SCHEMAS], app[TENANCY] = door, schemas, tenancy
    app[CHAT] = ChatEncoder(ChatTemplate.load(door.settings.model), door.tokenizer)
    return app
