"""The path of a generation through the scheduler's process, from the route's handler to
the core and back: the edge decodes and checks a request once into a turn, hands it to
the core, and pulls the core's updates into the one function that builds its reply, so no
module of the edge is entered again from the core or from a module it called.

What is recorded: every Python call made on behalf of one request (the frames below its
route handler, resumed coroutines counted once), reduced to calls from one of our modules
to another; a cycle in that graph through an edge module (`services/scheduler/http/`) is
a module re-entered after the request left it (a callback from the core, or two edge
modules handing the request back and forth). The scheduler runs in the test's process
(its executor and store as the real services), so the tracer sees its frames.

What it cannot catch: re-entry through another task (the step loop waking a waiter is
the core's own business, and not on the request's path), or cycles among the core's
modules (engine internals), which the import rule of test_structure.py bounds instead.
The planted test shows a callback into the edge is seen."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import CodeType, FrameType

import pytest
from aiohttp import ClientSession

from services.scheduler.http import openai_routes, routes
from tests.services_harness import scheduler_here

ROOT = Path(__file__).resolve().parents[1]
OURS = ("services", "shared", "protocol")
EDGE = "services.scheduler.http."


def module_of(code: CodeType) -> str | None:
    """Our module a code object belongs to (dotted), or None for a library's."""
    try:
        parts = Path(code.co_filename).resolve().relative_to(ROOT).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts) if parts and parts[0] in OURS else None


class CallGraph:
    """Calls between our modules made below one of `roots` (handler code objects)."""

    def __init__(self, roots: set[CodeType]) -> None:
        self.roots = roots
        self.edges: dict[tuple[str, str], str] = {}  # (caller, callee) -> callee's name
        self._seen: set[FrameType] = set()

    def hook(self, frame: FrameType, event: str, _arg: object) -> None:
        if event != "call" or frame in self._seen:
            return
        self._seen.add(frame)  # held, so no later frame reuses it unseen
        callee = module_of(frame.f_code)
        if callee is None:
            return
        caller, below = None, frame.f_back
        while below is not None and below.f_code not in self.roots:
            if caller is None:
                caller = module_of(below.f_code)
            below = below.f_back
        if frame.f_code in self.roots:
            return
        if below is None:
            return  # not on a request's path
        caller = caller or module_of(below.f_code)
        if caller is not None and caller != callee:
            self.edges.setdefault((caller, callee), frame.f_code.co_qualname)

    def reentries(self) -> list[list[str]]:
        """The cycles through an edge module: each a list of modules, first repeated."""
        graph: dict[str, set[str]] = {}
        for a, b in self.edges:
            graph.setdefault(a, set()).add(b)
        found = []
        for start in sorted(m for m in graph if m.startswith(EDGE)):
            path = shortest_path_back(graph, start)
            if path is not None:
                found.append(path)
        return found

    def describe(self, cycle: list[str]) -> str:
        steps = [f"{a} -> {b} ({self.edges[(a, b)]})" for a, b in itertools.pairwise(cycle)]
        return "\n  ".join(steps)


def shortest_path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest path of calls from `start` back to `start`, or None."""
    paths, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for node in frontier:
            for after in sorted(graph.get(node, ())):
                if after == start:
                    return [*paths[node], start]
                if after not in paths:
                    paths[after] = [*paths[node], after]
                    nxt.append(after)
        frontier = nxt
    return None


@asynccontextmanager
async def traced(roots: set[CodeType]) -> AsyncIterator[CallGraph]:
    graph = CallGraph(roots)
    previous = sys.getprofile()
    sys.setprofile(graph.hook)
    try:
        yield graph
    finally:
        sys.setprofile(previous)


HANDLERS = {
    routes.generate.__code__,
    openai_routes.completions.__code__,
    openai_routes.chat.__code__,
}


async def post(http: ClientSession, url: str, body: dict) -> list[bytes]:
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw[:300]
        return raw.split(b"\n\n")


def run_traced(settings, requests: Callable[[ClientSession, str], object]) -> CallGraph:
    async def go() -> CallGraph:
        url = f"http://127.0.0.1:{settings.port}"
        async with scheduler_here(settings), ClientSession() as http:
            await requests(http, url)  # once untraced: lazy imports and caches warm up
            async with traced(HANDLERS) as graph:
                await requests(http, url)
            return graph

    return asyncio.run(go())


async def generate_three_ways(http: ClientSession, url: str) -> None:
    sampling = {"max_new_tokens": 4, "temperature": 0}
    await post(http, f"{url}/generate", {"text": "plain", "sampling_params": sampling})
    await post(
        http, f"{url}/generate", {"text": "streamed", "sampling_params": sampling, "stream": True}
    )
    async with http.post(f"{url}/open_session", json={"capacity_of_str_len": 1000}) as resp:
        sid = await resp.json()
    for k in range(2):
        body = {"text": f"turn {k}", "sampling_params": sampling, "session_params": {"id": sid}}
        await post(http, f"{url}/generate", body)
        await post(http, f"{url}/generate", body | {"stream": True})
    async with http.post(f"{url}/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200


async def openai_streams(http: ClientSession, url: str) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "stream": True, "logprobs": 1}
    await post(http, f"{url}/v1/completions", body)
    messages = [{"role": "user", "content": "hi"}]
    chunks = await post(
        http, f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": 4, "stream": True}
    )
    assert json.loads(chunks[0].removeprefix(b"data: "))["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("requests", [generate_three_ways, openai_streams])
def test_a_generation_never_re_enters_a_module_it_left(services_only, requests):
    graph = run_traced(services_only.settings, requests)
    assert any(a.startswith(EDGE) and not b.startswith(EDGE) for a, b in graph.edges), (
        "the tracer saw no call from the edge into the core"
    )
    cycles = graph.reentries()
    assert not cycles, "modules re-entered:\n  " + "\n\n  ".join(map(graph.describe, cycles))


PLANTED = """
def handler(core_run):
    return core_run(callback)

def callback():
    return None

def helper():
    return None
"""

CORE = """
def run(progress):
    return progress()

def plain(_):
    return None
"""


def planted(source: str, module: str) -> dict:
    """`source`'s functions as if written in our `module` (their code names its file)."""
    names: dict = {}
    exec(compile(source, str(ROOT / (module.replace(".", "/") + ".py")), "exec"), names)
    return names


def test_the_tracer_sees_a_planted_callback_into_the_edge():
    edge, core = (
        planted(PLANTED, EDGE + "routes"),
        planted(CORE, "services.scheduler.runtime.intake"),
    )

    async def drive(run: Callable) -> CallGraph:
        async with traced({edge["handler"].__code__}) as graph:
            edge["handler"](run)
        return graph

    called_back = asyncio.run(drive(core["run"]))
    assert called_back.reentries() == [
        [EDGE + "routes", "services.scheduler.runtime.intake", EDGE + "routes"]
    ]
    assert asyncio.run(drive(core["plain"])).reentries() == []
