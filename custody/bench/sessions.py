"""`custody bench sessions`: the time to first token of a short turn on a session whose
history is 256, 1k, 4k and 8k tokens long, through the HTTP API of the running services,
against sending the whole history as a plain request that recomputes it. Both return one
token, so a request's wall time is its TTFT.

A flush cannot make that request recompute: the session borrows its history's pages from
the prefix cache, and a flush keeps them. So each reference request carries a cache salt
no other request used, which no cached entry matches, and its reply must say it reused 0
tokens; each session turn must say it reused its history but the last page. A reply that
says otherwise stops the run: the ratio would compare something else.

Then the over-capacity scenario (`over_capacity.py`, a stack of its own with small device
pools): more 4k sessions than the device holds, whether they resume from saved state, and
what a turn costs when its state is in the host or disk tier; its figures join the JSON."""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request

from custody.bench import branching, over_capacity
from custody.bench.harness import RESULTS_DIR, plot, progress
from custody.up import Stack
from shared.config import Settings

LENGTHS = (256, 1024, 4096, 8192)
NEW = 8
ONE_TOKEN = {"max_new_tokens": 1, "ignore_eos": True}
BRANCHING_REFERENCE = (
    "agents that retry their last step one time in four and fork two sub-agents from turn "
    "3 (custody/bench/branching.py); a request's reusable tokens are the longest prefix of "
    "its prompt equal to an earlier request's tokens of the same agent, page-aligned down, "
    "counted from the workload; without branching, each retry and sub-agent opens an "
    "append-only session and sends its whole history"
)
REFERENCE = (
    "the same history and new tokens as a plain /generate with a fresh cache_salt, so "
    "nothing cached matches; checked: every reference reply reported 0 cached tokens, "
    "every session turn its history but at most the last page"
)


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _timed(port: int, body: dict) -> tuple[float, int, list[int]]:
    """Seconds of one /generate, the prompt tokens its reply says it reused, its output."""
    start = time.perf_counter()
    out = _post(port, "/generate", body)
    return time.perf_counter() - start, out["meta_info"]["cached_tokens"], out["output_ids"]


def _recompute(port: int, tokens: list[int], salt: str) -> float:
    """Seconds of `tokens` as a plain request under `salt`, a salt no request used:
    raises if it reused any cached token, since then it recomputed nothing."""
    body = {"input_ids": tokens, "sampling_params": ONE_TOKEN, "cache_salt": salt}
    seconds, cached, _ = _timed(port, body)
    if cached:
        raise RuntimeError(
            f"the recompute reference reused {cached} cached tokens of {len(tokens)}: "
            "its TTFT is no recompute"
        )
    return seconds


def _turn(
    port: int, sid: str, new: list[int], history: int, page_size: int
) -> tuple[float, list[int]]:
    """Seconds and output of a turn of `new` tokens on `sid`: raises unless it reused
    its `history` but at most the last page, since then it did not resume from state."""
    body = {"input_ids": new, "session_params": {"id": sid}, "sampling_params": ONE_TOKEN}
    seconds, cached, output = _timed(port, body)
    if cached < history - page_size:
        raise RuntimeError(
            f"a turn on {sid} reused {cached} tokens of its {history}-token history: "
            "it did not resume from the session's state"
        )
    return seconds, output


def measure(
    port: int, page_size: int, repeats: int, lengths: tuple[int, ...] = LENGTHS
) -> list[dict]:
    """Per history length, the median TTFT of a session turn and of its recompute, their
    repeats interleaved, on the stack at `port`."""
    rng = random.Random(0)
    rows = []
    for n, length in enumerate(lengths):
        sid = f"bench-{length}"
        _post(port, "/open_session", {"session_id": sid})
        history = [rng.randrange(256) for _ in range(length)]
        body = {"input_ids": history, "session_params": {"id": sid}, "sampling_params": ONE_TOKEN}
        history += _post(port, "/generate", body)["output_ids"]
        session_s, recompute_s = [], []
        for r in range(repeats):
            new = [rng.randrange(256) for _ in range(NEW)]
            recompute_s.append(_recompute(port, history + new, f"recompute-{length}-{r}"))
            seconds, output = _turn(port, sid, new, len(history), page_size)
            session_s.append(seconds)
            history += new + output
        _post(port, "/close_session", {"session_id": sid})
        rows.append(
            {
                "history": length,
                "session_ttft_s": statistics.median(session_s),
                "recompute_ttft_s": statistics.median(recompute_s),
            }
        )
        progress("sessions", n + 1, len(lengths))
    return rows


def run(repeats: int = 5) -> dict:
    settings = Settings.ephemeral(
        context_len=16384,
        kv_pages=4096,
        max_step_tokens=4096,
        chunk_size=1024,
    )
    stack = Stack(settings).start_all()
    try:
        stack.wait_healthy()
        rows = measure(settings.port, settings.page_size, repeats)
        branches = branching.measure(settings.port, settings.page_size)
    finally:
        stack.stop()
    over = over_capacity.run(repeats)
    for r in rows:
        r["ratio"] = r["session_ttft_s"] / r["recompute_ttft_s"]
    at_4k = next(r["ratio"] for r in rows if r["history"] == 4096)
    payload = {
        "ttft_ratio_at_4k": round(at_4k, 4),
        "reference": REFERENCE,
        "rows": rows,
        "repeats": repeats,
        "branch_reuse_share": branches["on"]["branch_reuse_share"],
        "branch_reuse_share_without_branching": branches["off"]["branch_reuse_share"],
        "branching": branches,
        "branching_reference": BRANCHING_REFERENCE,
    }
    lines = ["| history | session TTFT | recompute TTFT | ratio |", "|---|---|---|---|"]
    lines += [
        f"| {r['history']} | {r['session_ttft_s'] * 1e3:.1f} ms | "
        f"{r['recompute_ttft_s'] * 1e3:.1f} ms | {r['ratio']:.3f} |"
        for r in rows
    ]
    lines.append(
        f"\nttft_ratio_at_4k = {at_4k:.3f} (target <= 0.1: {'met' if at_4k <= 0.1 else 'NOT met'})"
    )
    lines.append(f"\nrecompute: {REFERENCE}.")
    on, off = branches["on"], branches["off"]
    lines.append(
        f"\nbranch_reuse_share = {on['branch_reuse_share']:.3f} over {on['branch_requests']} "
        f"retries and sub-agent first turns (target >= 0.9: "
        f"{'met' if on['branch_reuse_share'] >= 0.9 else 'NOT met'}); without branching "
        f"{off['branch_reuse_share']:.3f}; appends {on['append_reuse_share']:.3f} and "
        f"{off['append_reuse_share']:.3f}.\nbranching: {BRANCHING_REFERENCE}."
    )
    lines += ["", over.pop("table")]
    payload.update(over)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "sessions.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "sessions.md").write_text("\n".join(lines) + "\n")
    plot(
        "sessions",
        "time to first token of a short turn",
        [str(r["history"]) for r in rows],
        {
            "session": [r["session_ttft_s"] * 1e3 for r in rows],
            "recompute": [r["recompute_ttft_s"] * 1e3 for r in rows],
        },
        "milliseconds",
    )
    payload["table"] = "\n".join(lines)
    return payload
