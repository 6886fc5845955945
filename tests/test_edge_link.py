"""The edge link between edge workers and the scheduling core (services/scheduler/edge/),
against a real core: the scheduler runs in this process (its executor and store as the
real services, test_request_path.py), its EdgeLink serves a Unix socket, and each
"worker" is a RemoteDoor on its own connection, as a worker process holds one.

What it shows: a call through the link yields requests equal to the core's own (tokens,
log probabilities, finish, cached tokens); a rid is held for its key across workers
(the second worker's call gets the 409); a worker that closes a call early, or drops
its link, leaves nothing running in the core (the call it had sent fails 502
`core_lost`, a later one 503 `core_gone`); a frame that does not decode closes only that
link (counted by reason); a forward says whether the core got it (503 if not, 502 if it
died under it); the core's gauge of worker calls.
What it cannot show: a worker process's whole HTTP side (test_edge_workers.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from services.scheduler.edge.core_side import EdgeLink
from services.scheduler.edge.remote_door import RemoteDoor
from services.scheduler.edge.worker import worker_app
from services.scheduler.http.errors import Relayed
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.main import Scheduler
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.records.turn import Turn
from shared.model_config import builtin_config
from shared.tokenizer import load_tokenizer
from tests.services_harness import scheduler_here

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
Workers = Callable[[], Awaitable[RemoteDoor]]


def turn(rid: str, tokens: list[int], shown: str = "", max_new: int = 6, cache: str = "") -> Turn:
    params = replace(PARAMS, max_new_tokens=max_new)
    return Turn(rid=rid, shown=shown or rid, tokens=tokens, params=params, cache_namespace=cache)


@asynccontextmanager
async def linked(settings, tmp: Path) -> AsyncIterator[tuple[Scheduler, Workers]]:
    """The core here, its edge link on a socket in `tmp`, and a way to connect workers."""
    async with scheduler_here(settings) as scheduler:
        link = EdgeLink(scheduler.front_door, scheduler.tenancy, scheduler.loop.metrics)
        await link.serve(tmp / "link.sock")
        listening: list[asyncio.Task] = []
        doors: list[RemoteDoor] = []

        async def worker() -> RemoteDoor:
            reader, writer = await asyncio.open_unix_connection(tmp / "link.sock")
            tokenizer = load_tokenizer(settings.model, settings.tokenizer)
            door = RemoteDoor(settings, tokenizer, builtin_config(), reader, writer)
            listening.append(asyncio.create_task(door.listen()))
            doors.append(door)
            return door

        try:
            yield scheduler, worker
        finally:
            for door in doors:  # the workers leave first, so the core's side ends
                door._writer.close()
            await asyncio.gather(*listening, return_exceptions=True)
            link.server.close()


async def until_idle(scheduler: Scheduler) -> None:
    for _ in range(200):
        if not scheduler.front_door.running_ids():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still running: {scheduler.front_door.running_ids()}")


def sample(scheduler: Scheduler, name: str, **labels: str) -> float | None:
    return scheduler.loop.metrics.registry.get_sample_value(name, labels)


def run(settings, tmp: Path, body: Callable[[Scheduler, Workers], Awaitable[None]]) -> None:
    async def go() -> None:
        async with linked(settings, tmp) as (scheduler, worker):
            await body(scheduler, worker)

    asyncio.run(go())


def test_a_call_through_the_link_equals_the_core_s_own(services_only, tmp_path):
    async def body(scheduler: Scheduler, worker: Workers) -> None:
        door = await worker()
        prompt = [5, 9, 13, 2, 7]
        (here,) = await scheduler.front_door.run([turn("core-side", prompt, cache="a")])
        (there,) = await door.run([turn("via-link", prompt, cache="b")])  # cold too
        assert there.output == here.output and len(there.output) == 6
        assert there.logprobs == pytest.approx(here.logprobs)
        assert [list(t[0]) for t in there.top_logprobs] == [list(t[0]) for t in here.top_logprobs]
        assert there.finish_reason == here.finish_reason and there.done
        assert here.cached_tokens == there.cached_tokens == 0
        (warm,) = await door.run([turn("warm", prompt, cache="a")])
        assert warm.cached_tokens == 4 and warm.output == here.output  # the core's cache

    run(services_only.settings, tmp_path, body)


def test_a_rid_is_held_for_its_key_across_workers(services_only, tmp_path):
    async def body(scheduler: Scheduler, worker: Workers) -> None:
        first, second = await worker(), await worker()
        long_one = first.follow([turn("a1", [1, 2, 3], shown="mine", max_new=400)])
        async with aclosing(long_one) as updates:
            await anext(updates)  # queued and running in the core
            in_core = scheduler.engine.requests["a1"]
            assert sample(scheduler, "custody_edge_calls") == 1
            with pytest.raises(Relayed) as refused:
                await second.run([turn("b1", [1, 2, 3], shown="mine")])
            assert refused.value.status == 409 and refused.value.kind == "rid_in_use"
        await until_idle(scheduler)
        assert in_core.finish_reason.type == "abort"  # closing it early aborted it
        (later,) = await second.run([turn("b2", [1, 2, 3], shown="mine")])
        assert later.done  # the rid was released with its call
        assert sample(scheduler, "custody_edge_calls") == 0

    run(services_only.settings, tmp_path, body)


def test_a_dropped_link_or_a_bad_frame_aborts_only_its_own_calls(services_only, tmp_path):
    async def body(scheduler: Scheduler, worker: Workers) -> None:
        dropped, healthy = await worker(), await worker()
        updates = dropped.follow([turn("d1", [4, 4, 4], max_new=200)])
        await anext(updates)
        in_core = scheduler.engine.requests["d1"]
        dropped._writer.close()  # the worker process died
        await until_idle(scheduler)
        assert in_core.finish_reason.type == "abort"
        with pytest.raises(Relayed) as lost:  # it was sent: it may have run
            async for _ in updates:
                pass
        assert lost.value.status == 502 and lost.value.kind == "core_lost"
        with pytest.raises(Relayed) as gone:  # not sent: that worker's core link is gone
            await dropped.run([turn("d2", [4, 4, 4])])
        assert gone.value.status == 503 and gone.value.kind == "core_gone"
        reader, writer = await asyncio.open_unix_connection(tmp_path / "link.sock")
        writer.write(b"\x00\x00\x00\x03abc")  # a length, then bytes that are no message
        assert await reader.read() == b""  # the core closed that link
        assert sample(scheduler, "custody_edge_links_closed_total", reason="bad_frame") == 1
        (fine,) = await healthy.run([turn("h1", [4, 4, 4])])
        assert fine.done and len(fine.output) == 6

    run(services_only.settings, tmp_path, body)


def test_a_forward_says_whether_the_core_got_it(services_only, tmp_path):
    settings = services_only.settings

    async def die_after_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")  # the request reached the core, which dies
        writer.transport.abort()

    async def body(scheduler: Scheduler, worker: Workers) -> None:
        door = await worker()
        dying = await asyncio.start_unix_server(die_after_reading, tmp_path / "dying.sock")
        answers = {}
        for name, path in (("never_got", "absent.sock"), ("died_under", "dying.sock")):
            connector = aiohttp.UnixConnector(path=str(tmp_path / path))
            async with aiohttp.ClientSession("http://core", connector=connector) as core:
                app = worker_app(door, Tenancy(settings.api_keys, settings.admin_api_keys), core)
                async with TestServer(app) as server, aiohttp.ClientSession() as client:
                    url = server.make_url("/close_session")
                    async with client.post(url, json={"session_id": "s"}) as reply:
                        answers[name] = reply.status, (await reply.json())["error"]["type"]
        dying.close()
        assert answers == {"never_got": (503, "core_gone"), "died_under": (502, "core_lost")}

    run(settings, tmp_path, body)
