"""An edge worker process (`--api-workers`): it serves the generation routes (SGLang's
/generate, OpenAI's completions and chat) on the public port beside its siblings
(SO_REUSEPORT), parsing, checking, tokenizing, detokenizing and writing streams here,
while the scheduling core plans, completes and owns the ledger. Every other route, and
every request that names a session, is forwarded whole to the core's own application on
its Unix socket: sessions, limits, aborts and the admin and migration routes are
decided in one place. A worker lives exactly as long as its link to the core."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from pathlib import Path
from typing import cast

import aiohttp
from aiohttp import web

from services.scheduler.edge.remote_door import CORE_GONE, CORE_LOST, InCore, RemoteDoor
from services.scheduler.http import openai_routes, routes
from services.scheduler.http.app import edge_app
from services.scheduler.http.errors import Relayed
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.runtime.front_door import FrontDoor
from shared.config import Settings
from shared.model_config import ModelConfig, builtin_config
from shared.service_main import start
from shared.slow_clients import GuardedRunner
from shared.tokenizer import load_tokenizer

log = logging.getLogger("custody.edge")

LINK_ENV = "CUSTODY_EDGE_LINK"  # the core's edge-link socket
CORE_ENV = "CUSTODY_EDGE_CORE"  # the core's HTTP socket, where forwarded requests go
# (/liveness is the core's: a hung core must fail its probe, whatever its workers do)
SERVED_HERE = frozenset({"/generate", "/v1/models", "/v1/completions", "/v1/chat/completions"})
# what a proxy must not pass on: they describe one connection, not the message
HOP_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade"}
)
CORE = web.AppKey("core", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    """`request` answered by the core's application, streamed back as it comes (an event
    stream chunk by chunk); the client leaving closes the core's request too."""
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    core = request.app[CORE]
    try:
        answer = await core.request(
            request.method, request.rel_url, data=body, headers=headers, allow_redirects=False
        )
    except aiohttp.ClientConnectorError:
        raise Relayed(*CORE_GONE) from None  # not sent: restarting, or gone with this worker
    except aiohttp.ClientConnectionError:
        raise Relayed(*CORE_LOST) from None  # sent, and the core ended before its answer
    async with answer:
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=kept)
        await response.prepare(request)
        async for data in answer.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


@web.middleware
async def in_core(request: web.Request, handler) -> web.StreamResponse:
    """A request the worker finds is the core's (it names a session) goes there whole;
    nothing of it was queued here (RemoteDoor.session raises before anything is)."""
    try:
        return await handler(request)
    except InCore:
        return await forward(request)


def worker_app(door: RemoteDoor, tenancy: Tenancy, core: aiohttp.ClientSession) -> web.Application:
    app = edge_app(cast(FrontDoor, door), tenancy, (in_core,))  # the calls it serves
    app[CORE] = core
    for table in (routes, openai_routes):
        for method, path, handler in table.ROUTES:
            if path in SERVED_HERE:
                app.router.add_route(method, path, handler)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def die_with_parent() -> None:
    """Linux: the kernel ends this worker when the core's process ends, however it ends
    (a killed core must not leave workers holding its port)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def serve(settings: Settings, link: Path, core_http: Path) -> None:
    model = builtin_config() if settings.model is None else ModelConfig.from_dir(settings.model)
    tokenizer = load_tokenizer(settings.model, settings.tokenizer)
    reader, writer = await asyncio.open_unix_connection(link)
    door = RemoteDoor(settings, tokenizer, model, reader, writer)
    connector = aiohttp.UnixConnector(path=str(core_http))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession("http://core", connector=connector, timeout=timeout) as core:
        app = worker_app(door, Tenancy(settings.api_keys, settings.admin_api_keys), core)
        runner = GuardedRunner(app, settings.read_timeout_seconds, settings.keepalive_seconds)
        await runner.setup()
        await web.TCPSite(runner, settings.host, settings.port, reuse_port=True).start()
        where = f"http://{settings.host}:{settings.port}"
        log.info("edge worker %d serving on %s", os.getpid(), where)
        try:
            await door.listen()  # until the core closes the link
        finally:
            await runner.cleanup()
    log.info("the core closed the edge link: this worker ends")


def main() -> None:
    die_with_parent()
    settings = start("edge", [])
    asyncio.run(serve(settings, Path(os.environ[LINK_ENV]), Path(os.environ[CORE_ENV])))


if __name__ == "__main__":
    main()
