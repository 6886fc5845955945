"""`custody bench e2e`: 16 concurrent clients, each running a multi-turn streaming
session against `custody up`'s services (private Redis, built-in model). Reports output
throughput, TTFT and inter-token latency percentiles measured by the clients (server-sent
events), and `overhead_share`: the share of the scheduler loop's busy time in which the
executor was not running a forward (scheduling, the Redis hops, serialisation not hidden
behind a forward), from the services' own metrics. The stack runs its default
configuration (compiled decode, two steps in flight, the session store's write checker
on); the same clients run in the same run, runs alternating, against three more stacks:
one with the eager forward (`--compile false`), one with `pipeline_depth` 0 (one step at
a time), the reference for what pipelining buys, and one with `pipeline_depth` 1."""

from __future__ import annotations

import http.client
import json
import random
import re
import statistics
import threading
import time
import urllib.request

import numpy as np

from custody.bench.harness import RESULTS_DIR, plot, progress
from custody.bench.sessions import _post
from custody.up import Stack
from shared.config import Settings

CLIENTS, TURNS, INPUT, OUTPUT = 16, 4, 32, 32


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


def _stack(overrides: dict) -> Stack:
    return Stack(Settings.ephemeral(**overrides))


def _summary(runs: list[dict]) -> dict:
    itl = np.concatenate([r["itl"] for r in runs]) * 1e3
    return {
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "itl_ms_p50": round(float(np.percentile(itl, 50)), 2),
        "overhead_share": round(statistics.median(r["overhead_share"] for r in runs), 3),
    }


def run(repeats: int = 3) -> dict:
    stacks = {name: _stack(overrides) for name, overrides in CONFIGS.items()}
    by_config: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        for stack in stacks.values():
            stack.start_all().wait_healthy()
        for i in range(repeats):
            for name, stack in stacks.items():
                by_config[name].append(_one_run(stack.settings, i))
            progress("e2e", i + 1, repeats)
    finally:
        for stack in stacks.values():
            stack.stop()
    runs = by_config["default"]
    ttft = np.concatenate([r["ttft"] for r in runs]) * 1e3
    itl = np.concatenate([r["itl"] for r in runs]) * 1e3
    share = statistics.median(r["overhead_share"] for r in runs)
    eager, unpipelined = _summary(by_config["eager"]), _summary(by_config["unpipelined"])
    one_deep = _summary(by_config["one_deep"])
    payload = {
        "clients": CLIENTS,
        "turns": TURNS,
        "input_tokens": INPUT,
        "output_tokens": OUTPUT,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "ttft_ms": {p: round(float(np.percentile(ttft, p)), 1) for p in (50, 90, 99)},
        "itl_ms": {p: round(float(np.percentile(itl, p)), 2) for p in (50, 90, 99)},
        "overhead_share": round(share, 3),
        "eager": eager,
        "unpipelined": unpipelined,
        "one_deep": one_deep,
        "repeats": repeats,
    }
    tps_0 = unpipelined["tokens_per_s"]
    ttft_text = " / ".join(str(v) for v in payload["ttft_ms"].values())
    itl_text = " / ".join(str(v) for v in payload["itl_ms"].values())
    verdict = "met" if share <= 0.15 else "NOT met"
    lines = [
        "| figure | value |",
        "|---|---|",
        f"| output throughput, {CLIENTS} sessions x {TURNS} turns | "
        f"{payload['tokens_per_s']} tokens/s (one step at a time: {tps_0}; "
        f"x{payload['tokens_per_s'] / tps_0:.2f}) |",
        f"| TTFT p50 / p90 / p99 | {ttft_text} ms |",
        f"| inter-token p50 / p90 / p99 | {itl_text} ms "
        f"(eager: p50 {eager['itl_ms_p50']} ms; one step at a time: p50 "
        f"{unpipelined['itl_ms_p50']} ms) |",
        f"| overhead_share (target <= 0.15) | {share:.3f} {verdict} "
        f"(eager: {eager['overhead_share']:.3f}; one step at a time: "
        f"{unpipelined['overhead_share']:.3f}) |",
        f"| output throughput, eager forward | {eager['tokens_per_s']} tokens/s |",
        f"| one step in flight (`--pipeline-depth 1`) | overhead_share "
        f"{one_deep['overhead_share']:.3f}, {one_deep['tokens_per_s']} tokens/s, inter-token "
        f"p50 {one_deep['itl_ms_p50']} ms |",
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "e2e.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "e2e.md").write_text("\n".join(lines) + "\n")
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
    payload["table"] = "\n".join(lines)
    return payload
