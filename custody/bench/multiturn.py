"""`custody bench multiturn`: a multi-turn serving benchmark in the manner of SGLang's
`bench_multiturn.py` and vLLM's `benchmark_serving_multi_turn.py`, against one `custody up`
stack (private Redis, built-in model, byte ids). `num_clients` conversations of
`num_rounds` rounds arrive as a Poisson process, swept over `request_rates`; at each rate
the same workload runs in two modes, sessions (only the new ids; the server keeps the
history) and stateless (the whole conversation resent; the prefix cache may serve part of
it), the prefix cache flushed before each run so each starts cold
(`multiturn_workload.py` has the knobs, the arrivals and the modes).

Reported per rate and mode, as the clients measured them over server-sent events: TTFT
(mean, p50, p90, p99, per round and over all), time per output token, end-to-end latency,
output tokens/s and requests/s, and per round the prompt tokens the server reused
(`meta_info.cached_tokens`) and the hit rate (cached / prompt tokens); per rate,
`ttft_p50_ratio` is the sessions' TTFT p50 over the stateless one's. With `repeats` > 1
each (rate, mode) runs that many times, the modes alternating, and the requests pool."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp

from custody.bench.harness import RESULTS_DIR, progress
from custody.bench.multiturn_report import markdown, plot_ttft, summarise
from custody.bench.multiturn_workload import MODES, Conversation, Turn, Workload, conversations
from custody.bench.multiturn_workload import drive as drive_rounds
from custody.up import Stack
from shared.config import Settings

Runs = dict[str, dict[str, list[tuple[list[Turn], float]]]]  # rate -> mode -> (turns, seconds)
REFERENCE = (
    "stateless mode: the same conversations, each round resending the whole history (the "
    "prefix cache may serve part of it); both modes start from a flushed cache, checked: "
    "every flush kept 0 pages"
)


def settings_for(workload: Workload) -> Settings:
    """Default pools, grown where the workload needs more: a context for a whole
    conversation, KV for every conversation twice (its own pages and the prefix cache's),
    Mamba slots for the running requests (working and track slots) and a state per open
    session."""
    base = Settings()
    pages = -(-workload.longest // base.page_size)
    running = 2 * base.working_slots * base.max_running_requests
    return Settings.ephemeral(
        context_len=max(base.context_len, workload.longest),
        kv_pages=max(base.kv_pages, 2 * workload.num_clients * pages),
        mamba_slots=max(base.mamba_slots, running + workload.num_clients + 1),
    )


async def _post(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> object:
    async with http.post(f"{url}{path}", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}: {await resp.text()}")
        return await resp.json()


async def flush_when_idle(http: aiohttp.ClientSession, url: str, timeout: float = 120) -> None:
    """Empty the prefix cache; it is refused (400) while requests are queued or running.
    Raises if it kept any page (a session left open): the run would not start cold."""
    deadline = time.monotonic() + timeout
    while True:
        async with http.post(f"{url}/flush_cache", json={}) as resp:
            if resp.status == 200:
                kept = (await resp.json())["kv_pages_kept"]
                if kept:
                    raise RuntimeError(f"/flush_cache kept {kept} pages: a session is open")
                return
            if resp.status != 400 or time.monotonic() > deadline:
                raise RuntimeError(f"/flush_cache answered {resp.status}: {await resp.text()}")
        await asyncio.sleep(0.1)


async def one_run(
    http: aiohttp.ClientSession, url: str, workload: Workload, mode: str, rate: float, tag: str
) -> tuple[list[Conversation], float]:
    """A cold prefix cache, then every conversation at `rate`; sessions (named after
    `tag`) are opened before the clock starts and closed after it stops."""
    await flush_when_idle(http, url)
    sids = None
    if mode == "sessions":
        names = [f"multiturn-{tag}-{k}" for k in range(workload.num_clients)]
        sids = [await _post(http, url, "/open_session", {"session_id": n}) for n in names]
    convs = conversations(workload, sids)
    seconds = await drive_rounds(http, url, convs, workload, rate)
    for sid in sids or []:
        await _post(http, url, "/close_session", {"session_id": sid})
    return convs, seconds


async def warm_up(http: aiohttp.ClientSession, url: str, workload: Workload) -> None:
    """Two rounds of every conversation per mode at the highest rate, not reported: the
    first requests after a start pay one-time costs (the first shapes torch sees)."""
    short = dataclasses.replace(workload, num_rounds=min(2, workload.num_rounds))
    for mode in MODES:
        await one_run(http, url, short, mode, max(workload.request_rates), "warm-up")


async def _sweep(port: int, workload: Workload, repeats: int) -> Runs:
    url = f"http://127.0.0.1:{port}"
    runs: Runs = {f"{r:g}": {m: [] for m in MODES} for r in workload.request_rates}
    total, done = len(runs) * repeats * len(MODES), 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=1 << 20
    ) as http:
        await warm_up(http, url, workload)
        for rate in workload.request_rates:
            for i in range(repeats):
                for mode in MODES:
                    convs, seconds = await one_run(http, url, workload, mode, rate, f"{rate:g}-{i}")
                    turns = [t for c in convs for t in c.turns]
                    runs[f"{rate:g}"][mode].append((turns, seconds))
                    done += 1
                    progress("multiturn", done, total)
    return runs


def sweep(port: int, workload: Workload, repeats: int = 1) -> Runs:
    """Every (rate, repeat, mode) run against the server on `port`: the turns of each and
    its seconds, by rate (as "2", "0.5") and mode."""
    return asyncio.run(_sweep(port, workload, repeats))


def report(workload: Workload, repeats: int, runs: Runs) -> dict:
    """The figures of `runs`, written as bench-results/multiturn.{json,md,png}; the payload
    with its markdown under "table"."""
    rates: dict[str, dict] = {}
    for rate, by_mode in runs.items():
        rates[rate] = {m: summarise(by_mode[m], workload.num_rounds) for m in MODES}
        ratio = rates[rate]["sessions"]["ttft_p50_ms"] / rates[rate]["stateless"]["ttft_p50_ms"]
        rates[rate]["ttft_p50_ratio"] = round(ratio, 3)
    knobs = dataclasses.asdict(workload) | {"request_rates": list(workload.request_rates)}
    payload = {"workload": knobs, "repeats": repeats, "reference": REFERENCE, "rates": rates}
    table = markdown(workload, rates)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "multiturn.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "multiturn.md").write_text(table + "\n")
    plot_ttft(RESULTS_DIR / "multiturn.png", workload, rates)
    payload["table"] = table
    return payload


def run(repeats: int = 1, workload: Workload | None = None) -> dict:
    workload = workload or Workload()
    stack = Stack(settings_for(workload))
    try:
        stack.start_all().wait_healthy()
        runs = sweep(stack.settings.port, workload, repeats)
    finally:
        stack.stop()
    return report(workload, repeats, runs)
