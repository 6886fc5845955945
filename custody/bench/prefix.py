"""`custody bench prefix`: how much of a shared prefix later requests reuse, with junction
checkpoints on and off (docs/ownership.md, "Shared prefixes"), through the HTTP API.

Two `custody up` stacks run side by side (built-in model, private Redis each), one with
`--junction-checkpoints` on and one with it off (states only at chunk ends), and every
series of `prefix_workloads.py` runs on both, the modes alternating which goes first,
the prefix cache flushed before each run. Requests go one at a time, each answered before
the next, with one greedy output token, so a request's wall time is its TTFT; the reply's
`meta_info.cached_tokens` is what it reused. Around each run the scheduler's prefix
counters (/metrics) give the state-gap tokens and the checkpoints taken. After a run, one
more request of the series (the check) is sent warm, then after a flush cold, with a few
greedy tokens: a reused state must give the tokens a cold prefill gives.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from custody.bench.harness import progress
from custody.bench.prefix_report import report
from custody.bench.prefix_workloads import WORKLOADS, Series
from custody.up import Stack
from shared.config import Settings

MODES = {"on": True, "off": False}  # --junction-checkpoints
CHECK_TOKENS = 8  # greedy tokens the warm and cold check requests compare
# the scheduler's prefix counters (services/scheduler/runtime/metrics.py): (sample, kind)
COUNTERS = {
    "kv_matched_tokens": ("custody_prefix_tokens_total", "kv_matched"),
    "state_matched_tokens": ("custody_prefix_tokens_total", "state_matched"),
    "state_gap_tokens": ("custody_prefix_state_gap_tokens_total", ""),
    "junction_checkpoints": ("custody_prefix_checkpoints_total", "junction"),
    "interval_checkpoints": ("custody_prefix_checkpoints_total", "interval"),
}
# Results by series name, then mode: one dict per repeat (run_series).
Runs = dict[str, dict[str, list[dict]]]


def _post(port: int, path: str, body: dict) -> object:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _flush(port: int, timeout: float = 120) -> None:
    """Empty the prefix cache; refused (400) while a request is queued or running. Raises
    if it kept any page (a session left open): the next run, or the cold check, would
    find a cached prefix."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kept = _post(port, "/flush_cache", {})["kv_pages_kept"]
            if kept:
                raise RuntimeError(f"/flush_cache kept {kept} pages: a session is open")
            return
        except urllib.error.HTTPError as err:
            if err.code != 400 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    samples = {
        (s.name, s.labels.get("kind", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return {key: samples[sample] for key, sample in COUNTERS.items()}


def _generate(port: int, tokens: list[int], sid: str | None, n: int) -> tuple[float, dict]:
    """Seconds and reply of one greedy request of `n` tokens (a turn on `sid` if given)."""
    body: dict = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    if sid is not None:
        body["session_params"] = {"id": sid}
    start = time.perf_counter()
    reply = _post(port, "/generate", body)
    return time.perf_counter() - start, reply


class _Sessions:
    """The sessions a run opened on one stack, each a fresh id, all closed at `close`."""

    def __init__(self, port: int, tag: str) -> None:
        self.port, self.tag, self.open = port, tag, []
        self.opened = itertools.count()

    def new(self) -> str:
        sid = f"{self.tag}-{next(self.opened)}"
        _post(self.port, "/open_session", {"session_id": sid})
        self.open.append(sid)
        return sid

    def close(self) -> None:
        for sid in self.open:
            _post(self.port, "/close_session", {"session_id": sid})
        self.open = []


def run_series(port: int, series: Series, tag: str, seed: int) -> dict:
    """One run of `series` on the stack at `port`, from a flushed cache; the cache is
    flushed again when it ends. Per request its cached tokens and seconds, the prefix
    counters' deltas over the requests, and the check's tokens warm and cold."""
    prompts, check = series.prompts(seed)
    sessions = _Sessions(port, tag)
    _flush(port)
    before = _counters(port)
    seconds, cached = [], []
    for prompt in prompts:
        sid = sessions.new() if series.sessions else None
        took, reply = _generate(port, prompt, sid, 1)
        seconds.append(took)
        cached.append(reply["meta_info"]["cached_tokens"])
    after = _counters(port)
    answers = []
    for _ in ("warm", "cold"):
        sid = sessions.new() if series.sessions else None
        answers.append(_generate(port, check, sid, CHECK_TOKENS)[1])
        sessions.close()  # a session's lock would keep the prefix through the flush
        _flush(port)
    warm, cold = answers
    return {
        "cached_tokens": cached,
        "seconds": seconds,
        **{key: after[key] - before[key] for key in COUNTERS},
        "check_cached_tokens": [a["meta_info"]["cached_tokens"] for a in answers],
        "outputs_equal_cold": warm["output_ids"] == cold["output_ids"],
    }


def drive(ports: dict[str, int], workloads: tuple[Series, ...], repeats: int) -> Runs:
    """Every series `repeats` times on each mode's stack, the modes alternating which
    goes first (by series and repeat), so machine noise falls on both alike."""
    runs: Runs = {s.name: {mode: [] for mode in ports} for s in workloads}
    total, done = len(workloads) * repeats * len(ports), 0
    for i, series in enumerate(workloads):
        for r in range(repeats):
            order = list(ports) if (i + r) % 2 == 0 else list(reversed(ports))
            for mode in order:
                tag = f"{series.name}-{mode}-{r}"
                runs[series.name][mode].append(run_series(ports[mode], series, tag, seed=i))
                done += 1
                progress("prefix", done, total)
    return runs


def settings_for(junctions: bool, **overrides: object) -> Settings:
    """Default pools, decode eager (these requests are all prefill: compiling the decode
    step would only slow the start)."""
    return Settings.ephemeral(**({"compile": False} | overrides), junction_checkpoints=junctions)


def run(repeats: int = 1, workloads: tuple[Series, ...] = WORKLOADS, **overrides: object) -> dict:
    """Both stacks (`overrides`: settings of both), every series on each; the figures,
    also written as bench-results/prefix.{json,md,png}, with the markdown under "table"."""
    with contextlib.ExitStack() as running:
        stacks = {}
        for mode, junctions in MODES.items():
            stacks[mode] = Stack(settings_for(junctions, **overrides))
            running.callback(stacks[mode].stop)
            stacks[mode].start_all()
        for stack in stacks.values():
            stack.wait_healthy()
        started = time.monotonic()
        runs = drive({m: s.settings.port for m, s in stacks.items()}, workloads, repeats)
        wall = time.monotonic() - started
    return report(workloads, repeats, stacks["on"].settings, runs, wall)
