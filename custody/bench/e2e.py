"""`custody bench e2e`: 16 concurrent clients, each running a multi-turn streaming
session against `custody up`'s services (private Redis, built-in model). Reports output
throughput, TTFT and inter-token latency percentiles measured by the clients (server-sent
events), and `overhead_share`: the share of the scheduler loop's busy time in which the
executor was not running a forward (scheduling, the Redis hops, serialisation not hidden
behind a forward), from the services' own metrics. The stack runs its default
configuration (compiled decode, two steps in flight, the session store's write checker
on); the same clients run in the same run, runs alternating, against three more stacks:
one with the eager forward (`--compile false`), one with `pipeline_depth` 0 (one step at
a time), the reference for what pipelining buys, and one with `pipeline_depth` 1.

`--baseline REV` adds the same four stacks of another revision's services (baseline.py),
each measured right after this revision's of the same configuration by the same clients;
each side's figures are its own medians."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from custody.bench.baseline import alternate, tree
from custody.bench.harness import RESULTS_DIR, plot
from custody.bench.sessions import _post
from custody.up import SERVICES, Stack
from shared.config import Settings

CLIENTS, TURNS, INPUT, OUTPUT = 16, 4, 32, 32
OVERHEAD_TARGET = 0.10  # issue 47 (it was 0.15)


def _metric_sum(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(rf"^{name}_sum(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _client(port: int, name: str, ttft: list, itl: list, tokens: list) -> None:
    rng = random.Random(name)
    sid = _post(port, "/open_session", {"session_id": name})
    for _ in range(TURNS):
        body = {
            "input_ids": [rng.randrange(256) for _ in range(INPUT)],
            "stream": True,
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True},
        }
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        start = last = time.perf_counter()
        conn.request("POST", "/generate", json.dumps(body))
        resp = conn.getresponse()
        seen = 0
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            count = len(json.loads(line[6:])["output_ids"])
            if seen == 0 and count:
                ttft.append(now - start)
            elif count > seen:
                itl.extend([(now - last) / (count - seen)] * (count - seen))
            seen, last = count, now
        conn.close()
        tokens.append(seen)
    _post(port, "/close_session", {"session_id": sid})


def _one_run(settings: Settings, run: int) -> dict:
    ttft, itl, tokens = [], [], []
    step0 = _metric_sum(settings.port, "custody_step_seconds")
    fwd0 = _metric_sum(settings.executor_metrics_port, "custody_forward_seconds")
    start = time.perf_counter()
    threads = [
        threading.Thread(target=_client, args=(settings.port, f"e2e-{run}-{k}", ttft, itl, tokens))
        for k in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    step = _metric_sum(settings.port, "custody_step_seconds") - step0
    fwd = _metric_sum(settings.executor_metrics_port, "custody_forward_seconds") - fwd0
    return {
        "tokens_per_s": sum(tokens) / wall,
        "ttft": ttft,
        "itl": itl,
        "overhead_share": 1 - fwd / step if step else float("nan"),
    }


CONFIGS = {
    "default": {},
    "eager": {"compile": False},
    "unpipelined": {"pipeline_depth": 0},
    "one_deep": {"pipeline_depth": 1},
}


def _config_summary(runs: list[dict]) -> dict:
    itl = np.concatenate([r["itl"] for r in runs]) * 1e3
    return {
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "itl_ms_p50": round(float(np.percentile(itl, 50)), 2),
        "overhead_share": round(statistics.median(r["overhead_share"] for r in runs), 3),
    }


def run(repeats: int = 3, baseline: str | None = None) -> dict:
    """Every configuration's stack, runs alternating over them; with `baseline` (a commit
    id), that revision's stack of each configuration measured right after this one's."""
    with contextlib.ExitStack() as scope:
        sources: dict[str, Path | None] = {"this": None}
        if baseline is not None:
            sources["baseline"] = scope.enter_context(tree(baseline, SERVICES.values()))
        stacks: dict[tuple[str, str], Stack] = {}
        for name, overrides in CONFIGS.items():
            for side, source in sources.items():
                stacks[name, side] = Stack(Settings.ephemeral(**overrides), source=source)
                scope.callback(stacks[name, side].stop)
        for stack in stacks.values():
            stack.start_all().wait_healthy()
        runs = alternate(
            repeats,
            list(CONFIGS),
            list(sources),
            lambda i, name, side: _one_run(stacks[name, side].settings, i),
            "e2e",
        )
    payload = summary(runs["this"], repeats)
    if baseline is not None:
        payload["baseline"] = {"revision": baseline, **summary(runs["baseline"], repeats)}
    table = report(payload)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "e2e.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "e2e.md").write_text(table + "\n")
    plot(
        "e2e",
        f"{CLIENTS} concurrent sessions",
        ["p50", "p90", "p99"],
        {
            "TTFT": list(payload["ttft_ms"].values()),
            "inter-token": list(payload["itl_ms"].values()),
        },
        "milliseconds",
    )
    payload["table"] = table
    return payload


def summary(by_config: dict[str, list[dict]], repeats: int) -> dict:
    """One side's figures from its runs of each configuration: medians of the runs, and
    percentiles of the default stack's latencies pooled over them."""
    runs = by_config["default"]
    ttft = np.concatenate([r["ttft"] for r in runs]) * 1e3
    itl = np.concatenate([r["itl"] for r in runs]) * 1e3
    return {
        "clients": CLIENTS,
        "turns": TURNS,
        "input_tokens": INPUT,
        "output_tokens": OUTPUT,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "ttft_ms": {p: round(float(np.percentile(ttft, p)), 1) for p in (50, 90, 99)},
        "itl_ms": {p: round(float(np.percentile(itl, p)), 2) for p in (50, 90, 99)},
        "overhead_share": round(statistics.median(r["overhead_share"] for r in runs), 3),
        "eager": _config_summary(by_config["eager"]),
        "unpipelined": _config_summary(by_config["unpipelined"]),
        "one_deep": _config_summary(by_config["one_deep"]),
        "repeats": repeats,
    }


def report(payload: dict) -> str:
    """The markdown table: a value column, or with a baseline its column beside this
    revision's and whether `overhead_share` is below the baseline's."""
    base = payload.get("baseline")
    if base is None:
        return "\n".join(
            ["| figure | value |", "|---|---|"] + [f"| {f} | {v} |" for f, v in _rows(payload)]
        )
    sha = base["revision"][:7]
    lines = [f"| figure | this revision | baseline {sha} |", "|---|---|---|"]
    for (figure, ours), (_, theirs) in zip(_rows(payload), _rows(base), strict=True):
        lines.append(f"| {figure} | {ours} | {theirs} |")
    below = payload["overhead_share"] < base["overhead_share"]
    lines.append(
        f"| overhead_share below the baseline's | {'yes' if below else 'NO'}: "
        f"{payload['overhead_share']:.3f} against {base['overhead_share']:.3f} | |"
    )
    return "\n".join(lines)


def _rows(payload: dict) -> list[tuple[str, str]]:
    """The table's figures of one side, each as (figure, value)."""
    eager, unpipelined = payload["eager"], payload["unpipelined"]
    one_deep, share = payload["one_deep"], payload["overhead_share"]
    tps, tps_0 = payload["tokens_per_s"], unpipelined["tokens_per_s"]
    ttft_text = " / ".join(str(v) for v in payload["ttft_ms"].values())
    itl_text = " / ".join(str(v) for v in payload["itl_ms"].values())
    verdict = "met" if share <= OVERHEAD_TARGET else "NOT met"
    return [
        (
            f"output throughput, {payload['clients']} sessions x {payload['turns']} turns",
            f"{tps} tokens/s (one step at a time: {tps_0}; x{tps / tps_0:.2f})",
        ),
        ("TTFT p50 / p90 / p99", f"{ttft_text} ms"),
        (
            "inter-token p50 / p90 / p99",
            f"{itl_text} ms (eager: p50 {eager['itl_ms_p50']} ms; one step at a time: p50 "
            f"{unpipelined['itl_ms_p50']} ms)",
        ),
        (
            f"overhead_share (target <= {OVERHEAD_TARGET})",
            f"{share:.3f} {verdict} (eager: {eager['overhead_share']:.3f}; one step at a "
            f"time: {unpipelined['overhead_share']:.3f})",
        ),
        ("output throughput, eager forward", f"{eager['tokens_per_s']} tokens/s"),
        (
            "one step in flight (`--pipeline-depth 1`)",
            f"overhead_share {one_deep['overhead_share']:.3f}, {one_deep['tokens_per_s']} "
            f"tokens/s, inter-token p50 {one_deep['itl_ms_p50']} ms",
        ),
    ]
