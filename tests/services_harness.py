"""Starting the three services as processes against the test Redis, and talking to them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from custody.inprocess import InProcess
from custody.soak.campaign import POOLS as CAMPAIGN_POOLS
from custody.up import SERVICES, Stack
from services.scheduler.http.app import build_app
from services.scheduler.main import Scheduler
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.model_config import builtin_config

# the campaign's small pools (custody/soak/campaign.py), run eager:
# tests/executor/test_compiled_decode.py compiles
POOLS = CAMPAIGN_POOLS | {"compile": False}


def call(
    port: int,
    path: str,
    body: dict | None = None,
    timeout: float = 120,
    headers: dict[str, str] | None = None,
) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method="GET" if body is None else "POST",
        headers=headers or {},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a service's /metrics, by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_sum(port: int, name: str) -> float:
    """A metric's samples added up over their labels; an error if it has none."""
    values = [v for (n, _), v in metrics(port).items() if n == name]
    assert values, f"{name} is not exported on :{port}"
    return sum(values)


def health(port: int, timeout: float = 10) -> dict:
    """/health's body, ready (200) or not (503: what it waits for); {} if no answer."""
    try:
        return call(port, "/health", timeout=timeout)
    except urllib.error.HTTPError as err:
        return json.loads(err.read()) if err.code == 503 else {}
    except OSError:
        return {}


def start_stack(settings: Settings) -> Stack:
    """The three services, up and with an executor, or an error."""
    stack = Stack(settings).start_all()
    try:
        stack.wait_healthy()
    except RuntimeError:
        stack.stop()
        raise
    return stack


def stack_settings(redis_url: str, **overrides: object) -> Settings:
    return Settings.ephemeral(
        redis_url=redis_url,
        heartbeat_seconds=0.2,
        executor_timeout_seconds=1.5,
        **(POOLS | overrides),
    )


def agent_settings(redis_url: str, model: Path, **overrides: object) -> Settings:
    """A stack serving `model` as an agent deployment: tool calls in the NemotronH MoE
    form, its reasoning, compact JSON, sessions by `X-Session-ID`, the model called "m",
    and room for an agent's prompt (it lists its tools). It streams every 3 tokens
    (`--stream-interval`): its streamed tool calls and reasoning are checked against
    the one-shot answers, so the interval is seen to keep every stream's shape."""
    agent = {
        "model": model,
        "tool_call_parser": "qwen3_coder",
        "reasoning_parser": "nemotron_v3",
        "constrained_json_disable_any_whitespace": True,
        "session_header": "X-Session-ID",
        "served_model_name": "m",
        "context_len": 4096,
        "kv_pages": 2048,
        "chunk_size": 256,
        "max_step_tokens": 512,
        "stream_interval": 3,
    }
    return stack_settings(redis_url, **(agent | overrides))


def capacities(settings: Settings) -> dict[str, int]:
    """Every pool's capacity, the tiers' included: what is free when nothing is held."""
    tiers = settings.tier_sizes(builtin_config())
    return {
        "kv": settings.kv_pages,
        "mamba": settings.mamba_slots,
        "req": settings.max_running_requests,
        "host_kv": tiers.host_kv_pages,
        "host_mamba": tiers.host_mamba_slots,
        "disk": tiers.disk_slots,
    }


def one_shot(prompt: list[int], n: int) -> list[int]:
    local = InProcess(Settings(**POOLS))
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    req = local.engine.submit(Request("x", np.asarray(prompt), params))
    local.run_until_idle()
    return req.output


def ledger_when_idle(stack: Stack) -> dict:
    """The store's ledger once nothing runs or is held by a session, or after 60 s (the
    store may lag a loaded machine by seconds: it applies every event in order)."""
    deadline = time.monotonic() + 60
    while True:
        view = call(stack.settings.store_port, "/ledger")
        running = ("request", "track", "transit", "session")
        busy = any(c[kind] for c in view["counts"].values() for kind in running)
        if not busy or time.monotonic() > deadline:
            return view
        time.sleep(0.2)


def assert_clean(stack: Stack) -> None:
    """Idle: the scheduler's integrity check (its idle loop runs check_integrity() each
    time it falls idle) never failed; the store's ledger has no violations, no leaks, and
    every slot free once the prefix cache is emptied (a plain request and a session's
    first turn leave their prompt there); the last events may still be on their way to
    the store, so poll for a while."""
    assert call(stack.settings.port, "/flush_cache", {})["flushed"] is True
    capacity = capacities(stack.settings)
    deadline = time.monotonic() + 60  # a store that restarted replays on a loaded machine
    while True:
        view = ledger_when_idle(stack)
        free = {p: c["free"] for p, c in view["counts"].items()}
        if free == capacity or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert view["violations"] == [] and view["leaked"] == {}
    assert free == capacity, (free, capacity, view["counts"])
    assert metric_sum(stack.settings.port, "custody_invariant_check_failures_total") == 0


def kill_executor_during(stack: Stack, port: int, path: str, body: dict) -> dict:
    """POST `body` to `path` streamed, SIGKILL the executor once the first output has
    streamed (so mid-decode however fast the request runs), supervise until the stream
    ends (the executor restarted once) and return its last chunk: SGLang's chunks are
    cumulative, so the last is the whole reply."""
    streamed = threading.Event()
    chunks: list[dict] = []

    def read() -> None:
        data = json.dumps(body | {"stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST")
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                text = line.decode().strip()
                if text.startswith("data:") and text != "data: [DONE]":
                    chunks.append(json.loads(text[len("data:") :]))
                    streamed.set()

    worker = threading.Thread(target=read)
    worker.start()
    assert streamed.wait(timeout=120), "nothing streamed"
    assert worker.is_alive(), chunks[-1]
    stack.kill("executor")  # SIGKILL in the middle of the request's decode
    deadline = time.monotonic() + 120
    while worker.is_alive() and time.monotonic() < deadline:
        stack.supervise_once()
        time.sleep(0.2)
    worker.join(timeout=1)
    assert stack.restarts["executor"] == 1
    return chunks[-1]


def without_scheduler(settings: Settings) -> dict[str, tuple[str, Settings]]:
    """A stack plan of the executor and the store only (the stack's settings: it adds
    its private state_dir), for a test that runs the scheduler in its own process."""
    return {name: (module, settings) for name, module in SERVICES.items() if name != "scheduler"}


READY_SECONDS = 60.0  # a scheduler here starts, or ends, within this; else it says why


@asynccontextmanager
async def scheduler_here(settings: Settings) -> AsyncIterator[Scheduler]:
    """The scheduler in this process, serving on its free port until the block ends. A
    start that never gets ready, or a task that ignores its cancellation, fails naming
    what it waits for (a CI run once hung in here: Registration.run ran on after its cancel,
    which shared/retry.py's honour_cancellation now ends)."""
    scheduler = await Scheduler.connect(settings)
    await scheduler.start()
    runner = web.AppRunner(build_app(scheduler.front_door, scheduler.tenancy))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.port).start()  # free (ephemeral)
    tasks = [
        asyncio.create_task(scheduler.loop.run()),
        asyncio.create_task(
            scheduler.registration.run(scheduler.redis, scheduler.loop.metrics.faults)
        ),
        asyncio.create_task(scheduler.finish_rebuild()),
    ]
    try:
        deadline = time.monotonic() + READY_SECONDS
        while waiting := scheduler.front_door.waiting_for():
            assert time.monotonic() < deadline, f"the scheduler here still waits for {waiting}"
            await asyncio.sleep(0.05)
        yield scheduler
    finally:
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=READY_SECONDS)
        await runner.cleanup()
        await scheduler.redis.aclose()
        stuck = [f"{t.get_coro().__qualname__} at {t.get_stack(limit=3)}" for t in pending]
        assert not stuck, f"tasks that ignored their cancellation: {stuck}"
