"""`custody bench orchestration`: the scheduler measured against a GPU-like step.

The real scheduler, session store and Redis serve streaming OpenAI completions to
`batch` concurrent clients, each with a prompt of `context` tokens; the executor is
the stand-in (standin_executor.py), which decodes, checks and resolves every step as
the executor does and then sleeps out a fixed step time. With every client decoding,
over a window of steady decode it reads:

- the executor's idle share: the part of the window it spent waiting for a step (1 -
  its busy time / the window); what a GPU of that step time would lose to the
  scheduler;
- the scheduler's CPU per step and per row-step (its process's CPU time over the
  window), and the store's and Redis's;
- step bytes per row (the step messages' bytes over their rows: flat in the context,
  since rows carry KV deltas);
- the clients' inter-token gaps, p50 and p99;
- the scheduler's engine core alone, planning and completing 64 and 256 decoding rows
  in process (scheduler_core.py): the part of its CPU per row-step that is not
  streaming, the loop or the machine's noise;
- the load generator's own CPU and the load average: on two cores the clients, the
  store and Redis share the core the scheduler does not use, and a cell whose
  processes together used more than 90% of the machine is marked saturated: its idle
  share then says as much about the machine as about the scheduler.

What it cannot see: a real forward's host work (the stand-in builds no tensors), tier
moves and grammars (none here), and anything beyond one replica.

`--baseline REV` measures another revision's services beside this one's (baseline.py):
each cell on a stack of the baseline tree's scheduler, store and stand-in executor,
alternating with this revision's, the same clients and windows reading both; the engine
core of each tree too (the baseline's in a subprocess on its tree). `--cells` runs some
of the sweep's cells only.

`--device cuda` (`measure_on_device`) runs the real executor instead, on the GPU, serving
the published 8B shape with `--load-format dummy` weights (custody/bench/published.py)
at a 1K context, 64 and 256 clients, on one stack sized for the larger. Each process is
given cores of its own (`CORES`), so the figures are the processes' and not the
machine's contention. The executor decodes eagerly (`--compile false`: compiling and
capturing an 8B model's buckets would not fit the check's minute), so the step is
longer than a compiled one and the idle share is a lower bound of what a compiled
executor would lose. The state pools must fit beside 16 GB of weights: the SSM state is
kept in bfloat16 (the config's `mamba_ssm_cache_dtype`, as vLLM serves recent releases)
and the pipeline depth is 1 (4 working Mamba slots a request, docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from custody.bench.baseline import alternate, run_in_tree, tree
from custody.bench.harness import RESULTS_DIR, plot
from custody.bench.published import NEMOTRON_H_8B
from custody.bench.scheduler_core import per_row_step_us
from custody.bench.standin_executor import STEP_MS
from custody.up import SERVICES, Stack
from shared.config import Settings
from shared.model_config import ModelConfig, builtin_config

BATCHES, CONTEXTS, STEPS_MS = (8, 64, 256), (1024, 8192, 32768), (2, 5, 10)
OUTPUT = 4096  # tokens a client may get: more than any window needs (clients stop first)
WARMUP_SECONDS, WINDOW_SECONDS = 0.5, 2.0
SATURATED = 0.9  # share of the machine's CPU used by the stack and the clients
TICKS = os.sysconf("SC_CLK_TCK")


# the processes' own cores on the GPU machine (16 cores): the executor's torch threads
# get several, the load generator the rest
CORES = {
    "scheduler": {0},
    "session-store": {1},
    "redis": {2},
    "executor": {3, 4, 5, 6},
    "edge-0": {7},
    "clients": set(range(8, 16)),
}
DEVICE_BATCHES, DEVICE_CONTEXT, DEVICE_OUTPUT = (64, 256), 1024, 512


@dataclass(frozen=True)
class Cell:
    batch: int
    context: int
    step_ms: int  # the stand-in's step time; 0: the real executor

    @property
    def key(self) -> str:
        step = f"{self.step_ms}ms" if self.step_ms else "device"
        return f"b{self.batch}_ctx{self.context // 1024}k_{step}"


SWEEP = [Cell(b, c, ms) for b in BATCHES for c in CONTEXTS for ms in STEPS_MS]
CORE_BATCHES = (64, 256)


def cells_named(keys: Sequence[str]) -> list[Cell]:
    """The sweep's cells of these keys (`--cells`), in the order given; ValueError
    listing the sweep's keys for one that is not among them."""
    by_key = {cell.key: cell for cell in SWEEP}
    unknown = [key for key in keys if key not in by_key]
    if unknown or not keys:
        raise ValueError(
            f"--cells: no cell {', '.join(unknown) or 'given'}; the sweep's cells are "
            + ", ".join(by_key)
        )
    return [by_key[key] for key in dict.fromkeys(keys)]


def settings_for(cell: Cell, stream_interval: int = 1) -> Settings:
    """One replica sized for the cell: every client runs at once, and a prefill step
    takes many prompts' chunks (the stand-in's step time does not grow with them)."""
    tokens = cell.context + OUTPUT + 64
    pages = cell.batch * (-(-tokens // 16) + 1) + 64
    return Settings.ephemeral(
        kv_pages=pages,
        # a running request holds 6 Mamba slots (pipeline depth 2) and pins 1 more (its
        # latest state, cached on a leaf it locks): 7 per client and room to spare
        mamba_slots=8 * cell.batch + 64,
        max_running_requests=cell.batch,
        context_len=tokens,
        chunk_size=8192,
        max_step_tokens=16384,
        host_state_bytes=0,
        stream_interval=stream_interval,
    )


STANDIN = {**SERVICES, "executor": "custody.bench.standin_executor"}


def _standin(settings: Settings) -> dict[str, tuple[str, Settings]]:
    """One replica whose executor is the stand-in."""
    return {name: (module, settings) for name, module in STANDIN.items()}


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = {
        "busy": r"custody_forward_seconds_sum",
        "bytes": r"custody_step_bytes_total",
        "rows": r"custody_step_rows_total",
        "steps": r'custody_executor_steps_total\{[^}]*outcome="ok"[^}]*\}',
    }
    found = {}
    for key, name in wanted.items():
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        found[key] = sum(float(v) for v in values)
    return found


# a process's name in the figures' keys, where it is not its stack name
PROCESS_KEYS = {"session-store": "store"}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


async def _client(
    http: aiohttp.ClientSession, url: str, prompt: list[int], times: list[float], output: int
) -> None:
    body = {"prompt": prompt, "max_tokens": output, "stream": True, "ignore_eos": True}
    async with http.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())


def _pids(stack: Stack) -> dict[str, int]:
    """Each process of the stack by name: its services, Redis, and the scheduler's edge
    workers (its children: edge-0, edge-1, ...)."""
    pids = {name: child.pid for name, child in stack.children.items()}
    if stack.redis is not None and stack.redis.proc is not None:
        pids["redis"] = stack.redis.proc.pid
    if "scheduler" in pids:
        listed = Path(f"/proc/{pids['scheduler']}/task/{pids['scheduler']}/children")
        workers = sorted(int(p) for p in listed.read_text().split()) if listed.exists() else []
        pids |= {f"edge-{i}": pid for i, pid in enumerate(workers)}
    return pids


def _snapshot(stack: Stack) -> dict[str, float]:
    snap = {f"cpu_{name}": _cpu_seconds(pid) for name, pid in _pids(stack).items()}
    snap |= _metrics(stack.settings.executor_metrics_port)
    snap["cpu_clients"] = time.process_time()
    snap["wall"] = time.perf_counter()
    return snap


async def _measure(
    stack: Stack, cell: Cell, window: float, vocab: int, output: int = OUTPUT
) -> dict:
    url = f"http://127.0.0.1:{stack.settings.port}/v1/completions"
    rng = np.random.default_rng(cell.batch * 7919 + cell.context)
    times: list[list[float]] = [[] for _ in range(cell.batch)]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        prompts = [rng.integers(0, vocab, cell.context).tolist() for _ in times]
        tasks = [
            asyncio.create_task(_client(http, url, prompt, t, output))
            for prompt, t in zip(prompts, times, strict=True)
        ]
        try:  # the clients end here, before the session closes their connections
            while not all(times):  # every client decoding
                if any(t.done() for t in tasks):
                    for t in tasks:
                        if t.done():
                            t.result()  # a client that failed says why
                    waiting = sum(not t for t in times)
                    raise RuntimeError(
                        f"a client ended before every client was decoding: {waiting} of "
                        f"{cell.batch} never got a token (a replica too small for the cell?)"
                    )
                await asyncio.sleep(0.05)
            await asyncio.sleep(WARMUP_SECONDS)
            before = _snapshot(stack)
            await asyncio.sleep(window)
            after = _snapshot(stack)
            finished = sum(t.done() for t in tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if finished:
        raise RuntimeError(f"{finished} clients finished inside the window: raise OUTPUT")
    return _figures(cell, before, after, times)


def _figures(cell: Cell, before: dict, after: dict, times: list[list[float]]) -> dict:
    delta = {k: after[k] - before[k] for k in after}
    wall, steps, rows = delta["wall"], max(delta["steps"], 1), max(delta["rows"], 1)
    gaps = np.concatenate(
        [np.diff([x for x in t if before["wall"] <= x <= after["wall"]]) for t in times]
    )
    cpu = {k[4:]: round(v / wall, 3) for k, v in delta.items() if k.startswith("cpu_")}
    used = sum(cpu.values()) / (os.cpu_count() or 1)
    own = {  # custody's processes (and Redis), not the load's clients
        PROCESS_KEYS.get(k[4:], k[4:].replace("-", "_")): v
        for k, v in delta.items()
        if k.startswith("cpu_") and k != "cpu_clients"
    }
    per_step_ms = {name: round(v / steps * 1e3, 3) for name, v in own.items()}
    return {
        "idle_share": round(max(0.0, 1 - delta["busy"] / wall), 4),
        "steps_per_s": round(steps / wall, 1),
        "rows_per_step": round(rows / steps, 1),
        "scheduler_cpu_us_per_step": round(delta["cpu_scheduler"] / steps * 1e6, 1),
        "scheduler_cpu_us_per_row_step": round(delta["cpu_scheduler"] / rows * 1e6, 2),
        "step_bytes_per_row": round(delta["bytes"] / rows, 1),
        "itl_ms_p50": round(float(np.percentile(gaps, 50)) * 1e3, 2) if len(gaps) else None,
        "itl_ms_p99": round(float(np.percentile(gaps, 99)) * 1e3, 2) if len(gaps) else None,
        # each process's CPU time per decoding row and step, and per step: with a core
        # each, the largest per step is what would pace a step
        "cpu_us_per_row_step": {name: round(v / rows * 1e6, 2) for name, v in own.items()},
        "cpu_ms_per_step": per_step_ms,
        "max_process_cpu_ms_per_step": max(per_step_ms.values()),
        "sum_process_cpu_ms_per_step": round(sum(own.values()) / steps * 1e3, 3),
        "cores_used": cpu,  # CPU seconds per second of each process, the clients' too
        "machine_share": round(used, 3),
        "load_average": round(os.getloadavg()[0], 2),
        "saturated": used > SATURATED,
    }


def measure_cell(
    cell: Cell,
    stream_interval: int = 1,
    window: float = WINDOW_SECONDS,
    source: Path | None = None,
) -> dict:
    """One cell on a stack of its own, of `source`'s services (a baseline's tree) or,
    None, this revision's."""
    os.environ[STEP_MS] = str(cell.step_ms)
    stack = Stack(settings_for(cell, stream_interval), plan=_standin, source=source)
    try:
        stack.start_all().wait_healthy()
        return asyncio.run(_measure(stack, cell, window, builtin_config().vocab_size))
    finally:
        stack.stop()


def device_settings(
    model_dir: Path, device: str, batch: int, context: int, output: int = DEVICE_OUTPUT
) -> Settings:
    """One replica of the real executor serving `model_dir`'s config with drawn weights,
    sized for `batch` clients of `context` tokens, each to get `output` (see the module's
    doc)."""
    cfg = ModelConfig.from_dir(model_dir)
    tokens = context + output + 64
    return Settings.ephemeral(
        model=model_dir,
        load_format="dummy",
        device=device,
        compile=False,
        pipeline_depth=1,
        kv_pages=batch * (-(-tokens // 16) + 1) + 64,
        mamba_slots=5 * batch + 16,
        max_running_requests=batch,
        context_len=min(tokens, cfg.max_position_embeddings),
        chunk_size=8192,
        max_step_tokens=16384,
        host_state_bytes=0,
    )


def pin(stack: Stack, cores: dict[str, set[int]]) -> None:
    """Every thread of each process onto its cores (threads made later inherit them);
    cores the machine lacks are dropped, so a smaller machine runs unpinned."""
    have = os.sched_getaffinity(0)
    pids = _pids(stack) | {"clients": os.getpid()}
    for name, pid in pids.items():
        wanted = cores.get(name, set()) & have
        if not wanted:
            continue
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), wanted)


def measure_on_device(
    model_dir: Path,
    device: str = "cuda",
    batches: tuple[int, ...] = DEVICE_BATCHES,
    context: int = DEVICE_CONTEXT,
    window: float = WINDOW_SECONDS,
    done: Callable[[dict[str, dict]], None] = lambda results: None,
    output: int = DEVICE_OUTPUT,
) -> dict[str, dict]:
    """The device cells, one after the other on one stack sized for the largest; `done`
    gets the results so far after each. `output`: the tokens a client may get, more
    than the warm-up and window can take at the device's step time."""
    settings = device_settings(model_dir, device, max(batches), context, output)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    stack = Stack(settings)
    results: dict[str, dict] = {}
    try:
        stack.start_all().wait_healthy(timeout=600)
        pin(stack, CORES)
        for batch in batches:
            cell = Cell(batch, context, 0)
            results[cell.key] = asyncio.run(_measure(stack, cell, window, vocab, output))
            done(results)
            _wait_idle(stack)
    finally:
        stack.stop()
    return results


def run_on_device(repeats: int = 1, device: str = "cuda") -> dict:
    """`custody bench orchestration --device cuda`: the device cells on the published 8B
    shape, written to bench-results/orchestration-<device>.{json,md} after each cell."""
    config = dataclasses.replace(
        NEMOTRON_H_8B,
        mamba_ssm_cache_dtype="bfloat16",
        max_position_embeddings=2 * DEVICE_CONTEXT,
    )
    path = RESULTS_DIR / f"orchestration-{device}"

    def write(results: dict[str, dict]) -> None:
        path.parent.mkdir(exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps({"cells": results}, indent=2) + "\n")
        path.with_suffix(".md").write_text(_table(results) + "\n")

    with tempfile.TemporaryDirectory(prefix="custody-8b-") as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config.to_dict()))
        results = measure_on_device(Path(model_dir), device, done=write)
    return {"cells": results, "table": _table(results)}


def _wait_idle(stack: Stack, timeout: float = 120) -> None:
    """Until the clients' cancelled requests have left the replica."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{stack.settings.port}/server_info", timeout=10
        ) as resp:
            states = json.loads(resp.read())["internal_states"][0]
        if not states["requests"] and not states["queued_requests"]:
            return
        time.sleep(0.2)


def run(repeats: int = 1, cells: list[Cell] | None = None, baseline: str | None = None) -> dict:
    """The sweep's cells (or `cells`), `repeats` runs each, the run of the median idle
    share kept; with `baseline` (a commit id), that revision's services measured too,
    runs alternating with this revision's (baseline.py), each side its own medians."""
    cells = cells or SWEEP
    with contextlib.ExitStack() as scope:
        sources: dict[str, Path | None] = {"this": None}
        if baseline is not None:
            sources["baseline"] = scope.enter_context(tree(baseline, STANDIN.values()))
        cores = {side: _core(source) for side, source in sources.items()}
        runs = alternate(
            repeats,
            cells,
            list(sources),
            lambda _, cell, side: measure_cell(cell, source=sources[side]),
            "orchestration",
        )
    payload = summary(runs["this"], cores["this"])
    if baseline is not None:
        payload["baseline"] = {"revision": baseline, **summary(runs["baseline"], cores["baseline"])}
    payload["table"] = report(payload, repeats)
    _write(payload)
    return payload


def _core(source: Path | None) -> dict[str, float]:
    """The engine core's figures: this revision's in process, a baseline tree's in a
    subprocess on that tree; none where the tree has no scheduler_core.py (the report
    says so)."""
    keys = {b: f"scheduler_core_us_per_row_step_b{b}" for b in CORE_BATCHES}
    if source is None:
        return {key: per_row_step_us(b) for b, key in keys.items()}
    if not (source / "custody" / "bench" / "scheduler_core.py").exists():
        return {}
    code = (
        "import json\nfrom custody.bench.scheduler_core import per_row_step_us\n"
        f"print(json.dumps([per_row_step_us(b) for b in {CORE_BATCHES}]))"
    )
    figures = json.loads(run_in_tree(source, code))
    return dict(zip(keys.values(), figures, strict=True))


def summary(runs: dict[Cell, list[dict]], core: dict[str, float]) -> dict:
    """One side's payload: each cell's run of the median idle share, its figures under
    the keys the results files have always had, and the engine core's."""
    results: dict[str, dict] = {}
    for cell, cell_runs in runs.items():
        ordered = sorted(cell_runs, key=lambda r: r["idle_share"])
        results[cell.key] = ordered[len(ordered) // 2]
    payload: dict = {f"idle_share_{k}": r["idle_share"] for k, r in results.items()}
    for k, r in results.items():
        payload |= {
            f"{name}_cpu_us_per_row_step_{k}": v for name, v in r["cpu_us_per_row_step"].items()
        }
        payload[f"max_process_cpu_ms_per_step_{k}"] = r["max_process_cpu_ms_per_step"]
        payload[f"sum_process_cpu_ms_per_step_{k}"] = r["sum_process_cpu_ms_per_step"]
    small, large = results.get("b64_ctx1k_10ms"), results.get("b64_ctx32k_10ms")
    if small and large:
        payload["step_bytes_ratio_32k_vs_1k"] = round(
            large["step_bytes_per_row"] / small["step_bytes_per_row"], 3
        )
    payload |= core
    payload["cells"] = results
    return payload


def report(payload: dict, repeats: int) -> str:
    """The markdown: a row per cell, and with a baseline its row beneath each; then the
    engine core's line."""
    base = payload.get("baseline")
    if base is None:
        return _table(payload["cells"]) + "\n\n" + _core_line(payload)
    sha = base["revision"][:7]
    note = (
        f"Each cell's second row is baseline {sha}'s services, measured by this revision's "
        f"clients, runs alternating with this revision's; each row the run of the median "
        f"idle share of {repeats}."
    )
    table = _table(payload["cells"], base["cells"], sha)
    core = _core_line(payload) + " " + _core_line(base, sha)
    return f"{note}\n\n{table}\n\n{core}"


def _table(results: dict[str, dict], baseline: dict[str, dict] | None = None, sha: str = "") -> str:
    """One row per cell; with `baseline`, the baseline's row under each, its key marked
    with `sha`."""
    lines = [
        "| cell | idle share | scheduler CPU per step / per row-step "
        "| CPU per row-step, each process | largest / sum per step | bytes per row "
        "| inter-token p50 / p99 | machine used | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        lines.append(_row(key, r))
        if baseline is not None:
            lines.append(_row(f"{key} @ {sha}", baseline[key]))
    return "\n".join(lines)


def _row(key: str, r: dict) -> str:
    mark = " (saturated)" if r["saturated"] else ""
    each = ", ".join(f"{name} {v:.1f}" for name, v in r["cpu_us_per_row_step"].items())
    return (
        f"| {key} | {r['idle_share']:.3f}{mark} | {r['scheduler_cpu_us_per_step']:.0f} us / "
        f"{r['scheduler_cpu_us_per_row_step']:.1f} us | {each} us "
        f"| {r['max_process_cpu_ms_per_step']:.2f} / {r['sum_process_cpu_ms_per_step']:.2f} ms "
        f"| {r['step_bytes_per_row']:.0f} B "
        f"| {r['itl_ms_p50']} / {r['itl_ms_p99']} ms | {r['machine_share']:.2f} "
        f"| {r['load_average']} |"
    )


def _core_line(payload: dict, sha: str = "") -> str:
    """The engine core's figures of this revision (no `sha`) or of baseline `sha`."""
    core = {b: payload.get(f"scheduler_core_us_per_row_step_b{b}") for b in CORE_BATCHES}
    figures = ", ".join(f"b{b} {v} us" for b, v in core.items())
    if not sha:
        return (
            "The scheduler's engine core alone (plan and complete, in process, 1K context; "
            f"scheduler_core.py), per decoding row-step: {figures}."
        )
    if None in core.values():
        return f"Baseline {sha}'s engine core: not measured (no scheduler_core.py at {sha})."
    return f"Baseline {sha}'s own scheduler_core.py, in a subprocess on its tree: {figures}."


def _write(payload: dict) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    saved = {k: v for k, v in payload.items() if k != "table"}
    (RESULTS_DIR / "orchestration.json").write_text(json.dumps(saved, indent=2) + "\n")
    (RESULTS_DIR / "orchestration.md").write_text(payload["table"] + "\n")
    results = payload["cells"]
    series = {"idle share": [r["idle_share"] for r in results.values()]}
    if "baseline" in payload:
        base = payload["baseline"]
        series[f"baseline {base['revision'][:7]}"] = [
            base["cells"][k]["idle_share"] for k in results
        ]
    plot(
        "orchestration",
        "executor idle share with the scheduler against a fixed step time",
        list(results),
        series,
        "share of the window",
    )
    _plot_cpu(payload)


def _plot_cpu(payload: dict) -> None:
    """Each process's CPU per row-step against the batch size, at the 8K context and
    the 10 ms step (the baseline's beside it): bench-results/orchestration-cpu.png."""
    cells = {k: r for k, r in payload["cells"].items() if k.endswith("_ctx8k_10ms")}
    if not cells:
        return
    sides = {"": payload} | (
        {f" @ {payload['baseline']['revision'][:7]}": payload["baseline"]}
        if "baseline" in payload
        else {}
    )
    series = {  # each side's own processes (a baseline before edge workers has none)
        f"{process}{suffix}": [side["cells"][k]["cpu_us_per_row_step"][process] for k in cells]
        for suffix, side in sides.items()
        for process in side["cells"][next(iter(cells))]["cpu_us_per_row_step"]
    }
    plot(
        "orchestration-cpu",
        "CPU per row-step by process, 8K context, 10 ms step",
        [k.split("_", 1)[0] for k in cells],
        series,
        "microseconds per row-step",
    )
