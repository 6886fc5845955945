"""`custody bench sessions`: the time to first token of a short turn on a session whose
history is 256, 1k, 4k and 8k tokens long, through the HTTP API of the running services,
against sending the whole history as a plain request (the prefix cache flushed first, so
it is recomputed). Both return one token, so a request's wall time is its TTFT.

Then the over-capacity scenario (`over_capacity.py`, a stack of its own with small device
pools): more 4k sessions than the device holds, whether they resume from saved state, and
what a turn costs when its state is in the host or disk tier; its figures join the JSON."""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request

from custody.bench import over_capacity
from custody.bench.harness import RESULTS_DIR, plot, progress
from custody.up import Stack
from shared.config import Settings

LENGTHS = (256, 1024, 4096, 8192)
NEW = 8


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _timed(port: int, path: str, body: dict) -> float:
    start = time.perf_counter()
    _post(port, path, body)
    return time.perf_counter() - start


def run(repeats: int = 5) -> dict:
    settings = Settings.ephemeral(
        context_len=16384,
        kv_pages=4096,
        max_step_tokens=4096,
        chunk_size=1024,
    )
    stack = Stack(settings).start_all()
    rng = random.Random(0)
    rows = []
    try:
        stack.wait_healthy()
        port = settings.port
        for n, length in enumerate(LENGTHS):
            sid = f"bench-{length}"
            _post(port, "/open_session", {"session_id": sid})
            history = [rng.randrange(256) for _ in range(length)]
            out = _post(
                port,
                "/generate",
                {
                    "input_ids": history,
                    "session_params": {"id": sid},
                    "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
                },
            )
            history += out["output_ids"]
            session_s, recompute_s = [], []
            for _ in range(repeats):
                new = [rng.randrange(256) for _ in range(NEW)]
                params = {"max_new_tokens": 1, "ignore_eos": True}
                _post(port, "/flush_cache", {})
                recompute_s.append(
                    _timed(
                        port, "/generate", {"input_ids": history + new, "sampling_params": params}
                    )
                )
                start = time.perf_counter()
                out = _post(
                    port,
                    "/generate",
                    {"input_ids": new, "session_params": {"id": sid}, "sampling_params": params},
                )
                session_s.append(time.perf_counter() - start)
                history += new + out["output_ids"]
            _post(port, "/close_session", {"session_id": sid})
            rows.append(
                {
                    "history": length,
                    "session_ttft_s": statistics.median(session_s),
                    "recompute_ttft_s": statistics.median(recompute_s),
                }
            )
            progress("sessions", n + 1, len(LENGTHS))
    finally:
        stack.stop()
    over = over_capacity.run(repeats)
    for r in rows:
        r["ratio"] = r["session_ttft_s"] / r["recompute_ttft_s"]
    at_4k = next(r["ratio"] for r in rows if r["history"] == 4096)
    payload = {"ttft_ratio_at_4k": round(at_4k, 4), "rows": rows, "repeats": repeats}
    lines = ["| history | session TTFT | recompute TTFT | ratio |", "|---|---|---|---|"]
    lines += [
        f"| {r['history']} | {r['session_ttft_s'] * 1e3:.1f} ms | "
        f"{r['recompute_ttft_s'] * 1e3:.1f} ms | {r['ratio']:.3f} |"
        for r in rows
    ]
    lines.append(
        f"\nttft_ratio_at_4k = {at_4k:.3f} (target <= 0.1: {'met' if at_4k <= 0.1 else 'NOT met'})"
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
