"""`custody bench scaleout --gateway epp`: the scaleout workload driven through the
endpoint picker instead of the router, each request asked of the picker over ext_proc by
a stand-in for Envoy (custody/bench/envoy.py) and then sent to the endpoint it chose.
Two replicas, one run, one stack.

- Affinity: 16 concurrent clients, each a session of 4 turns (non-streamed: the
  stand-in forwards whole answers); a returning turn is a hit when its reply reused the
  history (`cached_tokens` >= history - page_size), and every answer's endpoint must be
  the one the placement directory names.
- Decision time: the picker's own histogram `custody_epp_decision_seconds` (last
  request-body chunk received to the pick sent), read before and after the session runs,
  turns and opens apart, p50/p99 interpolated inside their bucket.
- Prefix hits: the same prefix phases as the router's bench (scaleout.py), sent through
  the picker (prefix-aware) and through a second picker with `--router-policy random`,
  caches flushed before each phase; `rounds` (every prefix once per round) and `iid`."""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time

import numpy as np
import redis

from custody.bench import harness
from custody.bench import scaleout_load as load
from custody.bench.envoy import Envoy
from custody.bench.harness import progress
from custody.bench.scaleout import (
    CLIENTS,
    POOLS,
    PREFIX_CLIENTS,
    PREFIX_LEN,
    PREFIX_OUT,
    ROUNDS,
    SUFFIX,
    TURNS,
    capacity,
)
from custody.up import Stack, layout
from shared.config import Settings
from shared.placement import Placement
from shared.redis_server import free_port
from shared.streams import placement_key

INPUT, OUTPUT = 32, 32
PICKERS = {"epp": "prefix", "epp-random": "random"}
TARGETS = {"affinity_hit_rate": 1.0, "epp_decision_p99_ms": 1.0, "rounds": 2.0}
REFERENCE = (
    "prefix hits: the same prompts through a second picker choosing at random "
    "(--router-policy random), every replica's cache flushed before each phase, checked: "
    "each flush kept 0 pages"
)


def _with_pickers(settings: Settings) -> dict[str, tuple[str, Settings]]:
    children = layout(settings)
    for name, policy in PICKERS.items():
        own = dataclasses.replace(
            settings,
            epp_port=free_port(),
            epp_health_port=free_port(),
            epp_http_port=free_port(),
            router_policy=policy,
        )
        children[name] = ("services.epp.main", own)
    return children


class Gate:
    """One picker behind a stand-in Envoy, one channel per client thread."""

    def __init__(self, stack: Stack, name: str) -> None:
        own = stack.layout[name][1]
        self.address = f"127.0.0.1:{own.epp_port}"
        self.metrics = f"http://127.0.0.1:{own.epp_http_port}"
        self._local = threading.local()

    def send(self, path: str, body: dict) -> tuple[int, object, str | None]:
        envoy = getattr(self._local, "envoy", None)
        if envoy is None:
            envoy = self._local.envoy = Envoy(self.address)
        answer = envoy.send(path, body)
        return answer.status, answer.body, answer.endpoint

    def generate(self, body: dict) -> dict:
        """A plain /generate's reply (load.send_plain's sender)."""
        status, reply, _ = self.send("/generate", body)
        if status != 200:
            raise RuntimeError(f"/generate through the picker: {status} {reply}")
        return reply


def _wait_ready(gate: Gate, replicas: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if load.get(gate.metrics, "/health").get("ready", 0) >= replicas:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the picker at {gate.address} did not see {replicas} replicas")


def _session(
    gate: Gate, sid: str, endpoints: dict[str, str], store: redis.Redis, turns: int
) -> list:
    """One session through the picker: opened, `turns` turns, closed; each turn's
    (index, history, cached tokens, whether its endpoint is the placement's)."""
    rng = np.random.default_rng(abs(hash(sid)) % (1 << 32))
    status, _, _ = gate.send("/open_session", {"session_id": sid})
    assert status == 200, status
    scoped = next(k.decode() for k in store.scan_iter(placement_key("*" + sid)))
    placed = Placement.decode(store.get(scoped)).replica
    history, record = 0, []
    for t in range(turns):
        body = {
            "input_ids": rng.integers(0, 256, INPUT).tolist(),
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True},
        }
        status, reply, chosen = gate.send("/generate", body)
        assert status == 200, reply
        cached = reply["meta_info"]["cached_tokens"]
        record.append((t, history, cached, chosen == endpoints[placed]))
        history += INPUT + len(reply["output_ids"])
    gate.send("/close_session", {"session_id": sid})
    return record


def _sessions(
    stack: Stack,
    gate: Gate,
    endpoints: dict[str, str],
    repeats: int,
    shape: tuple[int, int],
    tag: str = "gw",
) -> dict:
    """`shape`: (clients, turns)."""
    clients, turns = shape
    store = redis.Redis.from_url(stack.settings.redis_url)
    before, ran = load.scrape(gate.metrics), []
    for r in range(repeats):
        jobs = [
            functools.partial(_session, gate, f"{tag}-r{r}-{k}", endpoints, store, turns)
            for k in range(clients)
        ]
        ran += load.concurrently(jobs)
        progress("scaleout --gateway epp: sessions", r + 1, repeats)
    after = load.scrape(gate.metrics)
    store.close()
    returning = [t for t in ran if t[0] > 0]
    page = stack.settings.page_size
    hits = sum(cached >= history - page for _, history, cached, _ in returning)
    name = "custody_epp_decision_seconds"
    kinds = {k: load.bucket_counts(before, after, name, kind=k) for k in ("turn", "open")}

    def figures(buckets: list[tuple[float, float]]) -> dict:
        return {
            "requests": int(sum(n for _, n in buckets)),
            "p50_ms": round(load.quantile(buckets, 0.50) * 1e3, 4),
            "p99_ms": round(load.quantile(buckets, 0.99) * 1e3, 4),
        }

    return {
        "affinity_hit_rate": round(hits / len(returning), 4),
        "affinity_hits": hits,
        "returning_turns": len(returning),
        "endpoint_is_placement": all(t[3] for t in ran),
        "epp_decision_p99_ms": figures(kinds["turn"])["p99_ms"],
        "epp_decision_by_kind": {k: figures(b) for k, b in kinds.items()},
        "sessions": {"clients": clients, "turns": turns, "input": INPUT, "output": OUTPUT},
        "repeats": repeats,
    }


def _epp_first(
    stack: Stack, gate: Gate, endpoints: dict[str, str], repeats: int, shape: tuple[int, int]
) -> dict:
    """The sessions again with the picker and Redis first for the CPU: what the picker
    takes when a core is free as it wakes, as its own pod would have. A diagnostic
    beside the headline, never in its place."""
    pids = [stack.children["epp"].pid, stack.redis.proc.pid]
    with harness.first_for_cpu(pids) as why:
        if why is not None:
            return {"epp_first": why}
        got = _sessions(stack, gate, endpoints, repeats, shape, tag="first")
    return {"epp_first": got["epp_decision_by_kind"]}


def _flush(urls: list[str], gates: list[Gate], timeout: float = 30) -> None:
    """Every replica's prefix cache emptied, and each picker's index of them too. Raises
    if a replica kept a page: a session is still open there, the phase would not start
    cold."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                kept = load.post(url, "/flush_cache", {})["kv_pages_kept"]
                break
            except OSError:  # a request still ending: the flush is refused
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if kept:
            raise RuntimeError(f"the flush kept {kept} pages on {url}: a session is open")
    for gate in gates:
        while any(
            v for (n, _), v in load.scrape(gate.metrics).items() if n == "custody_epp_prefix_blocks"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("a picker's prefix index kept blocks after a flush")
            time.sleep(0.05)


def _prefix(stack: Stack, gates: dict[str, Gate], urls: list[str], rounds: int) -> dict:
    cap = capacity(stack.settings)
    phases: dict[str, dict] = {}
    for order in ("rounds", "iid"):
        prompts = load.prefix_prompts(cap["P"], PREFIX_LEN, SUFFIX, rounds * cap["P"], order)
        for name, gate in gates.items():
            _flush(urls, list(gates.values()))
            replies = load.send_plain(gate.generate, prompts, PREFIX_CLIENTS, PREFIX_OUT)
            phases.setdefault(order, {})[PICKERS[name]] = {
                "hit_tokens": sum(r.cached for r in replies),
                "requests": len(replies),
                "misses": load.misses(prompts, replies, PREFIX_LEN),
            }
            progress("scaleout --gateway epp: prefix phases", len(phases), 2)

    def ratio(p: dict) -> float:
        return round(p["prefix"]["hit_tokens"] / max(1, p["random"]["hit_tokens"]), 3)

    return {
        "prefix_hit_tokens_ratio_vs_random_rounds": ratio(phases["rounds"]),
        "prefix_hit_tokens_ratio_vs_random": ratio(phases["iid"]),
        "prefix_phases": phases,
    }


def run(repeats: int = 7, clients: int = CLIENTS, turns: int = TURNS, rounds: int = ROUNDS) -> dict:
    """The workload through the picker on one 2-replica stack; writes
    bench-results/scaleout_epp.*."""
    start = time.perf_counter()
    stack = Stack(Settings.ephemeral(replicas=2, **POOLS), plan=_with_pickers).start_all()
    try:
        stack.wait_healthy()
        gates = {name: Gate(stack, name) for name in PICKERS}
        for gate in gates.values():
            _wait_ready(gate, 2)
        replicas = load.get(f"http://127.0.0.1:{stack.settings.port}", "/health")["replicas"]
        urls = [r["url"] for _, r in sorted(replicas.items())]
        endpoints = {rid: r["url"].partition("://")[2] for rid, r in replicas.items()}
        shape = (clients, turns)
        payload = _sessions(stack, gates["epp"], endpoints, repeats, shape)
        payload |= _epp_first(stack, gates["epp"], endpoints, min(repeats, 3), shape)
        payload |= _prefix(stack, gates, urls, rounds)
    finally:
        stack.stop()
    payload["reference"] = REFERENCE
    payload["wall_seconds"] = round(time.perf_counter() - start, 1)
    return _write(payload)


def _first(payload: dict) -> str:
    first = payload["epp_first"]
    if isinstance(first, str):
        return first
    return f"{first['turn']['p99_ms']} / {first['open']['p99_ms']}"


def _write(payload: dict) -> dict:
    figures = {
        "affinity_hit_rate": payload["affinity_hit_rate"] >= TARGETS["affinity_hit_rate"],
        "epp_decision_p99_ms": payload["epp_decision_p99_ms"] < TARGETS["epp_decision_p99_ms"],
        "prefix_hit_tokens_ratio_vs_random_rounds": payload[
            "prefix_hit_tokens_ratio_vs_random_rounds"
        ]
        >= TARGETS["rounds"],
    }
    payload["met"] = figures
    opens = payload["epp_decision_by_kind"]["open"]
    text = "\n".join(
        [
            "| figure | value | target | met |",
            "|---|---|---|---|",
            f"| affinity_hit_rate | {payload['affinity_hit_rate']} | 1.0 | "
            f"{figures['affinity_hit_rate']} |",
            f"| epp_decision_p99_ms (turns) | {payload['epp_decision_p99_ms']} | < 1 | "
            f"{figures['epp_decision_p99_ms']} |",
            f"| epp decision p99 ms (opens, apart) | {opens['p99_ms']} | - | - |",
            f"| picker first for the CPU: p99 ms turns / opens | {_first(payload)} | - | - |",
            "| prefix hit tokens vs random, rounds | "
            f"{payload['prefix_hit_tokens_ratio_vs_random_rounds']} | >= 2 | "
            f"{figures['prefix_hit_tokens_ratio_vs_random_rounds']} |",
            "| prefix hit tokens vs random, iid | "
            f"{payload['prefix_hit_tokens_ratio_vs_random']} | - | - |",
        ]
    )
    harness.RESULTS_DIR.mkdir(exist_ok=True)
    (harness.RESULTS_DIR / "scaleout_epp.json").write_text(json.dumps(payload, indent=2) + "\n")
    (harness.RESULTS_DIR / "scaleout_epp.md").write_text(text + "\n")
    return payload | {"table": text}
