"""The over-capacity part of `custody bench sessions`: more long sessions than the device
pools hold, through the HTTP API of the running services.

Two questions. Do sessions that outnumber the device still resume from saved state? N
sessions (at least 4x what the device holds) each take a first turn and then a second,
in the same cyclic order, which is the worst case for LRU: every second turn finds its
state evicted from the device, so only the host and disk tiers can save it. And what does
a turn cost when its state was moved to the host or the disk tier, against recomputing
the history and against a stateless client whose whole history is still in the prefix
cache? Every turn returns one token, so a request's wall time is its TTFT; the two sides
of each ratio alternate within one run.

A flush keeps what a session on the device borrows, so the recompute is a plain request
under a cache salt no request used, and its reply must say it reused 0 tokens. A turn
from the host or disk tier is timed after a flush that must say it kept nothing: the
session left the device, so no page of its history may stay cached.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from collections.abc import Callable

from custody.bench.harness import progress
from custody.up import Stack
from shared.config import Settings
from shared.model_config import builtin_config

HISTORY = 4096  # tokens of each session's first prompt
FACTOR = 4  # sessions per session the device pools hold
NEW = 8  # new tokens of every timed turn
# Small device pools (16,384 tokens: four 4k sessions), so N stays small on a CPU.
KV_PAGES, PAGE_SIZE, CONTEXT_LEN = 1024, 16, 8192
TARGETS = {  # key: (comparison, target)
    "resumed_share": (">=", 0.99),
    "ttft_ratio_host_at_4k": ("<=", 0.1),
    "ttft_ratio_disk_at_4k": ("<=", 0.25),
}
DISK_NOTE = (
    "a spill fsyncs the blob and drops its cached pages (posix_fadvise DONTNEED) in the "
    "executor, so the timed load reads the blob from disk"
)
ONE_TOKEN = {"max_new_tokens": 1, "ignore_eos": True}
RECOMPUTE = "recompute, a fresh cache_salt (checked: 0 cached tokens)"


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _turn(port: int, sid: str, tokens: list[int]) -> dict:
    body = {"input_ids": tokens, "session_params": {"id": sid}, "sampling_params": ONE_TOKEN}
    return _post(port, "/generate", body)


def _plain(port: int, tokens: list[int], salt: str | None = None) -> dict:
    body = {"input_ids": tokens, "sampling_params": ONE_TOKEN}
    return _post(port, "/generate", body if salt is None else body | {"cache_salt": salt})


def _flush_all(port: int, tier: str) -> None:
    """Empty the prefix cache before a turn from `tier`: raises if the flush kept any
    page, since then the turn could find its history cached."""
    kept = _post(port, "/flush_cache", {})["kv_pages_kept"]
    if kept:
        raise RuntimeError(f"the flush before a {tier}-tier turn kept {kept} pages cached")


def _recompute(port: int, tokens: list[int], salt: str) -> float:
    """Seconds of `tokens` as a plain request under `salt`, a salt no request used:
    raises if it reused any cached token, since then it recomputed nothing."""
    seconds, out = _timed(lambda: _plain(port, tokens, salt))
    cached = out["meta_info"]["cached_tokens"]
    if cached:
        raise RuntimeError(f"the recompute reused {cached} cached tokens of {len(tokens)}")
    return seconds


def _timed(call: Callable[[], dict]) -> tuple[float, dict]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _resumed_share(
    port: int, sids: list[str], history: int, page_size: int, rng: random.Random
) -> tuple[float, list[list[int]]]:
    """First turns of every session, then second turns in the same order; the share of
    second turns that started from saved state (at most one page recomputed)."""
    histories = []
    for i, sid in enumerate(sids):
        prompt = _tokens(rng, history)
        histories.append(prompt + _turn(port, sid, prompt)["output_ids"])
        progress("sessions: first turns", i + 1, len(sids))
    resumed = 0
    for i, sid in enumerate(sids):
        new = _tokens(rng, NEW)
        out = _turn(port, sid, new)
        resumed += out["meta_info"]["cached_tokens"] >= len(histories[i]) - page_size
        histories[i] += new + out["output_ids"]
        progress("sessions: second turns", i + 1, len(sids))
    return resumed / len(sids), histories


def _compare(
    port: int,
    sid: str,
    history: list[int],
    tier: str,
    repeats: int,
    page_size: int,
    rng: random.Random,
) -> dict:
    """Medians of a turn on `sid` with its state placed in `tier` before each, against a
    plain request of its history and the same new tokens: recomputed (a fresh cache salt)
    for the host and disk tiers, from a warm prefix cache for the device. The fewest tokens
    a timed reference reused is `reference_cached_tokens` (0 for a recompute, checked).
    The two sides alternate which goes first. Extends `history` in place."""
    session_s, plain_s, warm_cached, resumed, placed = [], [], [], 0, 0

    def session_side(new: list[int]) -> dict:
        nonlocal resumed, placed
        placed += _post(port, "/place_session", {"session_id": sid, "tier": tier})["tier"] == tier
        if tier != "device":
            _flush_all(port, tier)
        seconds, out = _timed(lambda: _turn(port, sid, new))
        session_s.append(seconds)
        resumed += out["meta_info"]["cached_tokens"] >= len(history) - page_size
        return out

    def plain_side(new: list[int]) -> None:
        if tier != "device":
            plain_s.append(_recompute(port, history + new, f"recompute-{tier}-{len(plain_s)}"))
            return
        _plain(port, history + new)  # a stateless client's history, cached
        seconds, out = _timed(lambda: _plain(port, history + new))
        plain_s.append(seconds)
        warm_cached.append(out["meta_info"]["cached_tokens"])

    for r in range(repeats):
        new = _tokens(rng, NEW)
        if r % 2:
            plain_side(new)
            out = session_side(new)
        else:
            out = session_side(new)
            plain_side(new)
        history += new + out["output_ids"]
        progress(f"sessions: {tier} tier", r + 1, repeats)
    return {
        "session_ttft_s": statistics.median(session_s),
        "reference_ttft_s": statistics.median(plain_s),
        "reference_cached_tokens": min(warm_cached, default=0),
        "turns_placed": placed,
        "turns_resumed": resumed,
    }


def run(
    repeats: int = 5,
    history: int = HISTORY,
    factor: int = FACTOR,
    kv_pages: int = KV_PAGES,
    page_size: int = PAGE_SIZE,
    context_len: int = CONTEXT_LEN,
) -> dict:
    """The scenario on a stack of its own (small device pools, a private state dir);
    figures with their targets, and a markdown table under "table"."""
    settings = Settings.ephemeral(
        page_size=page_size,
        kv_pages=kv_pages,
        context_len=context_len,
        max_step_tokens=4096,
        chunk_size=1024,
    )
    capacity = kv_pages * page_size // history
    n = factor * capacity
    rng = random.Random(1)
    stack = Stack(settings).start_all()
    try:
        stack.wait_healthy()
        port = settings.port
        sids = [f"over-{i}" for i in range(n)]
        for sid in sids:
            _post(port, "/open_session", {"session_id": sid})
        share, histories = _resumed_share(port, sids, history, page_size, rng)
        for sid in sids[1:]:  # the tier timings run on an otherwise idle device
            _post(port, "/close_session", {"session_id": sid})
        sides = {
            tier: _compare(port, sids[0], histories[0], tier, repeats, page_size, rng)
            for tier in ("host", "disk", "device")
        }
        _post(port, "/close_session", {"session_id": sids[0]})
    finally:
        stack.stop()
    tiers = stack.settings.tier_sizes(builtin_config())  # with the private state dir
    pools = {
        "page_size": page_size,
        "kv_pages": kv_pages,
        "kv_tokens": kv_pages * page_size,
        "mamba_slots": settings.mamba_slots,
        "host_kv_pages": tiers.host_kv_pages,
        "host_mamba_slots": tiers.host_mamba_slots,
        "disk_slots": tiers.disk_slots,
    }
    return _payload(share, sides, n, capacity, history, pools, repeats)


def _ratio(side: dict) -> float:
    return round(side["session_ttft_s"] / side["reference_ttft_s"], 4)


def _payload(
    share: float,
    sides: dict,
    n: int,
    capacity: int,
    history: int,
    pools: dict,
    repeats: int,
) -> dict:
    figures = {
        "resumed_share": round(share, 4),
        "ttft_ratio_host_at_4k": _ratio(sides["host"]),
        "ttft_ratio_disk_at_4k": _ratio(sides["disk"]),
        "ttft_ratio_vs_prefix_cache_at_4k": _ratio(sides["device"]),
    }
    payload: dict = {}
    for key, value in figures.items():
        payload[key] = value
        if key in TARGETS:
            op, target = TARGETS[key]
            payload[f"{key}_target"] = f"{op} {target}"
            payload[f"{key}_met"] = value >= target if op == ">=" else value <= target
    payload["over_capacity"] = {
        "sessions": n,
        "device_capacity_sessions": capacity,
        "history": history,
        "new_tokens": NEW,
        "repeats": repeats,
        "pools": pools,
        "host": sides["host"] | {"reference": RECOMPUTE},
        "disk": sides["disk"] | {"reference": RECOMPUTE},
        "device": sides["device"] | {"reference": "plain request, prefix cache warm"},
        "disk_note": DISK_NOTE,
    }
    payload["table"] = _table(payload)
    return payload


def _table(payload: dict) -> str:
    oc = payload["over_capacity"]
    lines = [
        f"{oc['sessions']} sessions of {oc['history']} tokens, the device holds "
        f"{oc['device_capacity_sessions']}: resumed_share = {payload['resumed_share']:.3f} "
        f"(target {payload['resumed_share_target']}: "
        f"{'met' if payload['resumed_share_met'] else 'NOT met'})",
        "",
        "| state before the turn | session TTFT | reference | reference TTFT | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for tier, key in (
        ("host", "ttft_ratio_host_at_4k"),
        ("disk", "ttft_ratio_disk_at_4k"),
        ("device", "ttft_ratio_vs_prefix_cache_at_4k"),
    ):
        side = oc[tier]
        verdict = "none"
        if key in TARGETS:
            verdict = f"{payload[key + '_target']} {'met' if payload[key + '_met'] else 'NOT met'}"
        lines.append(
            f"| {tier} | {side['session_ttft_s'] * 1e3:.1f} ms | {side['reference']} | "
            f"{side['reference_ttft_s'] * 1e3:.1f} ms | {payload[key]:.3f} | {verdict} |"
        )
    return "\n".join(lines)
