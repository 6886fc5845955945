"""`custody bench scaleout`: two replicas behind the router, in one run on one stack.

- Affinity: 16 concurrent clients, each a session of 4 streamed turns through the
  router; a returning turn lands on the replica holding its state when its reply reused
  the history (`cached_tokens` >= history - page_size: any other replica does not have
  the session). Cross-check: the router's `affinity` count per replica equals what the
  placement keys (`custody:placement:<sid>`, read after each open) predict.
- Router overhead: the router's own histogram `custody_router_overhead_seconds`, read
  before and after those runs, p50/p99 interpolated inside their bucket; for context,
  the clients' times through the router against the same clients sent straight to the
  replicas (their URLs from the router's /health), runs alternating.
- Prefix hits: P shared prefixes of L tokens, P x L twice one replica's prefix cache (so
  more than one holds and no more than two do), plain requests each a prefix and a
  unique suffix shorter than a page (so a cached prefix ends where its Mamba state is),
  sent through the router (prefix-aware, the default) and through a second router
  process on the same Redis and replicas with `--router-policy random`; caches flushed
  before each phase. Also straight to one replica (no router) for context. Two orders:
  `iid` (each request's prefix drawn uniformly; the headline) and `rounds` (every prefix
  once per round, rounds shuffled). Each phase says where its misses stand (a prefix's
  first request, one sent while its prefix's first was still running, one after its
  prefix had been cached), how many the load bound diverted, and what the router's index
  promised. The ceiling is the ratio a router missing only first requests would get
  against the same random run.

The stack runs eager (`compile=False`): compiling costs ~45 s cold per executor, and
neither the router's overhead nor where state lands depends on the forward's speed."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time
import urllib.error
from collections import Counter
from collections.abc import Callable

import numpy as np
import redis

from custody.bench import harness
from custody.bench import scaleout_load as load
from custody.bench.harness import progress
from custody.bench.scaleout_report import write
from custody.up import Stack
from shared.config import Settings
from shared.placement import Placement
from shared.redis_server import free_port
from shared.streams import placement_key

CLIENTS, TURNS, INPUT, OUTPUT = 16, 4, 32, 32
PREFIX_LEN, SUFFIX, PREFIX_OUT, PREFIX_CLIENTS = 256, 8, 4, 4
ROUNDS = 8  # requests per prefix in each prefix phase
POOLS = {
    "page_size": 16,
    "kv_pages": 257,  # 256 usable (page 0 pads): 4,096 tokens, 16 prefixes of 256
    "mamba_slots": 64,
    "track_interval": 64,
    "context_len": 4096,
    "compile": False,
}
PHASES = (
    ("iid", "prefix"),
    ("iid", "random"),
    ("iid", "one_replica"),
    ("rounds", "prefix"),
    ("rounds", "random"),
)
REFERENCE = (
    "prefix hits: the same prompts through a second router choosing at random "
    "(--router-policy random), every replica's cache flushed before each phase, checked: "
    "each flush kept 0 pages on every replica (and straight to one replica, for context); "
    "router overhead: the same clients sent straight to the replicas"
)


def capacity(settings: Settings) -> dict[str, int]:
    """One replica's prefix cache: KV pages (page 0 pads) and Mamba states (slot 0 is
    reserved); a cached prefix of PREFIX_LEN holds PREFIX_LEN / page_size pages and one
    state. P is the most prefixes two replicas hold."""
    tokens = (settings.kv_pages - 1) * settings.page_size
    prefixes = min(tokens // PREFIX_LEN, settings.mamba_slots - 1)
    return {"tokens": tokens, "prefixes": prefixes, "P": 2 * prefixes}


def _random_router(settings: Settings, port: int) -> subprocess.Popen:
    """A second router on the same Redis and replicas, choosing at random."""
    env = {**os.environ, **dataclasses.replace(settings, router_policy="random").to_env()}
    module = [sys.executable, "-m", "services.router.main"]
    return subprocess.Popen([*module, "--router-policy", "random", "--port", str(port)], env=env)


def _wait_ready(url: str, replicas: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if load.get(url, "/health").get("ready", 0) >= replicas:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the router on {url} did not see {replicas} replicas")


def _flush(router: str, timeout: float = 30) -> None:
    """Every replica's prefix cache emptied (retried while requests end), and the
    router's index of them emptied too, so the next phase starts cold. Raises if any
    replica kept a page (the router adds up what each kept): a session is still open."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kept = load.post(router, "/flush_cache", {})["kv_pages_kept"]
            break
        except urllib.error.HTTPError:  # a request still ending: the flush is refused
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if kept:
        raise RuntimeError(f"the flush kept {kept} pages on the replicas: a session is open")
    while any(
        v for (n, _), v in load.scrape(router).items() if n == "custody_router_prefix_blocks"
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the router's prefix index kept blocks after a flush")
        time.sleep(0.05)


def _times(turns: list[load.Turn]) -> dict[str, float]:
    ttft = np.array([t.ttft for t in turns]) * 1e3
    wall = np.array([t.wall for t in turns]) * 1e3
    return {
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 2),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 2),
        "turn_ms_p50": round(float(np.percentile(wall, 50)), 2),
        "turn_ms_p99": round(float(np.percentile(wall, 99)), 2),
    }


def _sessions(
    settings: Settings, urls: list[str], repeats: int, clients: int, turns: int, tag: str = "so"
) -> dict:
    """Affinity and overhead through the router, alternating with the same clients sent
    straight to the replicas (client k to replica k mod n); `tag` starts their session
    ids (a second pass on the same stack must not reopen the first's)."""
    router, homes = f"http://127.0.0.1:{settings.port}", {}
    store = redis.Redis.from_url(settings.redis_url)

    def placed(sid: str) -> None:
        homes[sid] = Placement.decode(store.get(placement_key(sid))).replica

    def jobs(tag: str, url_of: list[str], opened: Callable[[str], None]) -> list:
        shape = (INPUT, OUTPUT)
        return [
            functools.partial(load.session, url_of[k], f"{tag}-{k}", turns, shape, opened)
            for k in range(clients)
        ]

    before, routed, direct = load.scrape(router), [], []
    for r in range(repeats):
        routed += load.concurrently(jobs(f"{tag}-r{r}", [router] * clients, placed))
        direct += load.concurrently(jobs(f"{tag}-d{r}", urls * clients, lambda sid: None))
        progress("scaleout: sessions", r + 1, repeats)
    after = load.scrape(router)
    store.close()
    returning = [t for t in routed if t.index > 0]
    hits = sum(t.cached >= t.history - settings.page_size for t in returning)
    expected = {rid: n * (turns + 2) for rid, n in Counter(homes.values()).items()}
    counted = load.by_label(
        before, after, "custody_router_requests_total", "replica", decision="affinity"
    )
    name = "custody_router_overhead_seconds"
    buckets = load.bucket_counts(before, after, name)
    kinds = {k: load.bucket_counts(before, after, name, kind=k) for k in ("open", "turn")}
    return {
        "affinity_hit_rate": round(hits / len(returning), 4),
        "affinity_hits": hits,
        "returning_turns": len(returning),
        "affinity_by_replica": {"expected": expected, "counted": counted},
        "affinity_counts_match_placement": expected == {k: int(v) for k, v in counted.items()},
        "router_overhead_p50_ms": round(load.quantile(buckets, 0.50) * 1e3, 4),
        "router_overhead_p99_ms": round(load.quantile(buckets, 0.99) * 1e3, 4),
        "router_overhead_requests": int(sum(n for _, n in buckets)),
        "router_overhead_buckets": [[b if b < np.inf else "+Inf", int(n)] for b, n in buckets],
        "router_overhead_by_kind": {
            k: {
                "requests": int(sum(n for _, n in b)),
                "p50_ms": round(load.quantile(b, 0.50) * 1e3, 4),
                "p99_ms": round(load.quantile(b, 0.99) * 1e3, 4),
            }
            for k, b in kinds.items()
        },
        "client_through_router": _times(routed),
        "client_direct_to_replica": _times(direct),
        "sessions": {"clients": clients, "turns": turns, "input": INPUT, "output": OUTPUT},
        "repeats": repeats,
    }


def _phase(router: str, url: str, prompts: list[list[int]]) -> dict:
    """One prefix phase from a flushed cache: the reused tokens and the decisions of the
    router that routed it (none when `url` is a replica)."""
    _flush(router)
    before = load.scrape(url)
    start = time.perf_counter()
    generate = functools.partial(load.post, url, "/generate")
    replies = load.send_plain(generate, prompts, PREFIX_CLIENTS, PREFIX_OUT)
    seconds = time.perf_counter() - start
    after = load.scrape(url)

    def counted(name: str, label: str) -> dict[str, int]:
        return {k: int(v) for k, v in load.by_label(before, after, name, label).items() if v}

    cached = [r.cached for r in replies]
    return {
        "hit_tokens": sum(cached),
        "hit_requests": sum(c >= PREFIX_LEN for c in cached),
        "requests": len(cached),
        "seconds": round(seconds, 2),
        "decisions": counted("custody_router_requests_total", "decision"),
        "misses": load.misses(prompts, replies, PREFIX_LEN),
        "routed_by_replica": counted("custody_router_requests_total", "replica"),
        "index_matched_tokens": sum(
            counted("custody_router_prefix_tokens_total", "replica").values()
        ),
        "diverted_by_bound": sum(
            counted("custody_router_prefix_diverted_total", "replica").values()
        ),
    }


def _prefix(settings: Settings, random_url: str, urls: list[str], rounds: int) -> dict:
    """Every phase of PHASES on the same stack, the same prompts for each order."""
    router, cap = f"http://127.0.0.1:{settings.port}", capacity(settings)
    sys.stderr.write(
        f"scaleout: prefix cache per replica {cap['tokens']} tokens = {cap['prefixes']} "
        f"prefixes of {PREFIX_LEN}; P = {cap['P']} (P x L = {cap['P'] * PREFIX_LEN})\n"
    )
    targets = {"prefix": router, "random": random_url, "one_replica": urls[0]}
    phases: dict[str, dict] = {}
    reusable: dict[str, int] = {}  # prompt tokens a router that never misses reuses
    for i, (order, name) in enumerate(PHASES):
        prompts = load.prefix_prompts(cap["P"], PREFIX_LEN, SUFFIX, rounds * cap["P"], order)
        firsts = len({tuple(p[:PREFIX_LEN]) for p in prompts})
        reusable[order] = (len(prompts) - firsts) * PREFIX_LEN
        phases.setdefault(order, {})[name] = _phase(router, targets[name], prompts)
        progress("scaleout: prefix phases", i + 1, len(PHASES))
    ratios = {
        order: round(p["prefix"]["hit_tokens"] / max(1, p["random"]["hit_tokens"]), 3)
        for order, p in phases.items()
    }
    ceilings = {
        order: round(reusable[order] / max(1, p["random"]["hit_tokens"]), 3)
        for order, p in phases.items()
    }
    return {
        "prefix_hit_tokens_ratio_vs_random": ratios["iid"],
        "prefix_hit_tokens_ratio_vs_random_rounds": ratios["rounds"],
        "prefix_hit_tokens_ratio_ceiling": ceilings,
        "prefix_hit_tokens_max": reusable,
        "prefix_hit_tokens": {
            o: {n: v["hit_tokens"] for n, v in p.items()} for o, p in phases.items()
        },
        "prefix_phases": phases,
        "prefix_sizes": {
            "P": cap["P"],
            "L": PREFIX_LEN,
            "suffix": SUFFIX,
            "max_new_tokens": PREFIX_OUT,
            "clients": PREFIX_CLIENTS,
            "requests_per_phase": rounds * cap["P"],
            "cache_capacity_tokens_per_replica": cap["tokens"],
            "cache_capacity_prefixes_per_replica": cap["prefixes"],
        },
    }


def _router_first(stack: Stack, urls: list[str], repeats: int, clients: int, turns: int) -> dict:
    """The router's overhead once more, the router and Redis ahead of every other process
    for the CPU (nice -10): on two cores shared by two replicas, the store, Redis, the
    router and the clients, a router woken by a request may wait for a core, which its
    own pod would give it at once. A diagnostic beside the headline, never in its place."""
    with harness.first_for_cpu([stack.children["router"].pid, stack.redis.proc.pid]) as why:
        if why is not None:
            return {"router_first": why}
        got = _sessions(stack.settings, urls, repeats, clients, turns, tag="first")
    keys = ("router_overhead_p50_ms", "router_overhead_p99_ms", "router_overhead_by_kind")
    return {"router_first": {k: got[k] for k in keys}}


def run(repeats: int = 7, clients: int = CLIENTS, turns: int = TURNS, rounds: int = ROUNDS) -> dict:
    """The whole benchmark on one 2-replica stack; writes bench-results/scaleout.*."""
    start = time.perf_counter()
    stack = Stack(Settings.ephemeral(replicas=2, **POOLS)).start_all()
    random_port = free_port()
    baseline = _random_router(stack.settings, random_port)
    try:
        stack.wait_healthy()
        router, random_url = (
            f"http://127.0.0.1:{stack.settings.port}",
            f"http://127.0.0.1:{random_port}",
        )
        _wait_ready(random_url, 2)
        urls = [r["url"] for _, r in sorted(load.get(router, "/health")["replicas"].items())]
        payload = _sessions(stack.settings, urls, repeats, clients, turns)
        payload |= _router_first(stack, urls, min(repeats, 3), clients, turns)
        payload |= _prefix(stack.settings, random_url, urls, rounds)
    finally:
        baseline.terminate()
        baseline.wait()
        stack.stop()
    payload["pools"] = {k: v for k, v in POOLS.items() if k != "compile"}
    payload["compile"] = False
    payload["reference"] = REFERENCE
    payload["wall_seconds"] = round(time.perf_counter() - start, 1)
    return write(payload)
