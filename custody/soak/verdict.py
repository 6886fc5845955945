"""The end of a soak: what the independent ledger holds once everything is closed and
flushed, whether every greedy output is what a fault-free model produces, and which
checks failed."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from custody.soak.client import call
from services.executor.model.batch import ForwardBatch
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.weights import load_model
from shared.messages.forward import StepRow


def held_slots(view: dict) -> dict[str, dict[str, int]]:
    """Every non-free slot of every pool (the device's, and the tiers' host_kv,
    host_mamba and disk), by owner kind (request, session, cache, track, transit): with
    all sessions closed and the cache flushed, each one is a leak."""
    return {
        pool: {kind: n for kind, n in counts.items() if kind != "free" and n}
        for pool, counts in view.get("counts", {}).items()
        if any(n for kind, n in counts.items() if kind != "free")
    }


def settle(
    store_port: int, admin_key: str | None, supervise: Callable[[], None], timeout: float = 30
) -> dict:
    """The store's ledger once it is ready and shows nothing held, or as it is when
    `timeout` runs out (the events of the last frees may still be on their way)."""
    deadline = time.monotonic() + timeout
    view: dict = {}
    while True:
        supervise()
        reply = call(store_port, "/ledger", key=admin_key, timeout=10)
        if reply.status == 200 and reply.is_dict:
            view = reply.body
            if view.get("ready") and not held_slots(view):
                return view
        else:
            view = {"ready": False, "status": reply.outcome, "body": reply.text[:300]}
        if time.monotonic() > deadline:
            return view
        time.sleep(0.5)


def diagnosis(port: int, view: dict) -> dict:
    """When the ledger holds slots at the end: does the scheduler agree (a real leak) or
    is the store behind (a stream it stopped reading)? Its own counts and stream lag."""
    text = call(port, "/metrics", timeout=10).text
    held: dict[str, dict[str, int]] = {}
    lag: dict[str, int] = {}
    for name, labels, value in re.findall(r"^(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if name == "custody_pool_held" and float(value):
            held.setdefault(label["pool"], {})[label["owner_kind"]] = int(float(value))
        elif name == "custody_stream_lag_entries":
            lag[label["stream"]] = int(float(value))
    return {
        "scheduler_held": held,
        "stream_lag": lag,
        "ledger_events_applied": view.get("events_applied"),
        "ledger_epoch": view.get("epoch"),
    }


def replay(finished: list[tuple[list[int], list[int]]], margin: float = 1e-3) -> int:
    """How many outputs a fault-free model disowns (`disowned`)."""
    return sum(disowned(finished, margin))


def disowned(finished: list[tuple[list[int], list[int]]], margin: float = 1e-3) -> list[bool]:
    """For each (prompt, output), whether a fault-free model disowns the output,
    teacher-forced: one forward over prompt + output, and each produced token must be the
    greedy choice there (or tie with it within `margin`: chunking or batching the same
    sequence differently moves logits by about 1e-6, which may flip a near-tie and is not
    a fault; a one-shot comparison would count such a flip, and every token after it)."""
    model = load_model(None, torch.device("cpu"))
    pools = DevicePools(
        model.cfg, PoolSizes(kv_pages=2048, page_size=1, mamba_slots=1), torch.device("cpu")
    )
    verdicts = []
    for prompt, output in finished:
        tokens = torch.tensor(prompt + output[:-1])
        pools.reset()
        batch = ForwardBatch(
            [StepRow.of(tokens, 0, torch.arange(1, len(tokens) + 1), 1)], torch.device("cpu")
        )
        with torch.inference_mode():
            logits = model.lm_head(model(batch, pools)[len(prompt) - 1 :]).float()
        chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
        verdicts.append(bool((chosen < logits.max(dim=1).values - margin).any()))
    return verdicts


TIER_POOLS = ("host_kv", "host_mamba", "disk")
MUST_HIT = ("hibernate", "spill", "restore")  # kinds a chaos soak must kill during


def failures(result: dict) -> list[str]:
    """The checks a soak result fails; empty when it proves what it claims. With tiers,
    also: the ledger covers every tier pool, the disk holds no blob once every session is
    closed, and the executor was killed at least once during each kind in MUST_HIT."""
    failed = [
        key
        for key in ("leaked_slots", "ledger_violations", "wrong_outputs", "unexpected_statuses")
        if result[key]
    ]
    if sum(result["service_restarts"]["unexplained"].values()):
        failed.append("unexplained_restarts")
    if not result["ledger_ready"]:
        failed.append("ledger_not_ready")
    if result["leftover_blobs"]:
        failed.append("leftover_blobs")
    if result["tiers"]:
        if result["ledger_ready"] and set(TIER_POOLS) - set(result["ledger_pools"]):
            failed.append("tier_pools_not_in_ledger")
        kills = result["kills_during_tier_moves"]
        failed += [f"no_kill_during_{kind}" for kind in MUST_HIT if not kills[kind]]
    return failed
