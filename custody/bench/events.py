"""`custody bench events`: ownership events end to end (scheduler ledger -> shipper ->
Redis stream -> session store consumer, applied to the independent ledger), at several
batch sizes (events per stream entry), each against raw pipelined `XADD` of entries of
the same byte size on the same server in the same run, so entries/s divide by entries/s.

The batch sizes include the one the scheduler really ships: its shipper sends one
`events` message per step, so a short run of the e2e workload (16 sessions x 4 turns on
`custody up`'s services) is made first and the median events per `events` message on its
ownership stream is measured, along with the interval between its steps (how long an
event can wait in service for its batch to be shipped).

The producer and the consumer are separate processes, as in production. The producer
makes real transfers (Mamba and row alloc/free through the ledger) as fast as it can,
ships a batch every `batch` events, one `XADD` per batch as the scheduler does; each
entry carries the time its first event was made, and the consumer records when it has
applied it (checkpoint and acknowledgement written), which gives the lag, the wait to
fill the batch included.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import redis

from custody.bench.harness import RESULTS_DIR, plot, progress
from custody.bench.shipped_batches import scheduler_batches
from shared import streams
from shared.redis_server import PrivateRedis

KEYS = streams.SINGLE  # the one replica of the stacks these drive

BATCHES = (1, 16, 256, 4096)
SECONDS = 2.0  # of production per custody run
RAW_SECONDS, RAW_BYTES, PIPELINE_BYTES = 1.0, 128 << 20, 4 << 20
TARGET_EVENTS, TARGET_LAG_MS = 200_000, 50.0
RAW = "custody:raw"


def _producer(url: str, batch: int, seconds: float, ready, out) -> None:
    from services.scheduler.allocators.pools import PoolConfig, Pools
    from services.scheduler.ownership.owners import OwnerKind
    from services.scheduler.runtime.event_shipper import EventShipper

    client = redis.Redis.from_url(url)
    pools = Pools(PoolConfig(kv_pages=1024, mamba_slots=1024, max_running_requests=256))
    shipper = EventShipper(pools.ledger, epoch="bench")
    client.xadd(KEYS.ownership, {"m": shipper.snapshot(), "t": 0.0})
    owner = pools.ledger.new_owner(OwnerKind.REQUEST, "bench")
    held = [0, 0]

    def mamba_alloc() -> None:
        held[0] = pools.mamba.alloc_one(owner)

    def row_alloc() -> None:
        held[1] = pools.req.alloc_one(owner)

    cycle = (
        mamba_alloc,
        lambda: pools.mamba.free_one(held[0], owner),
        row_alloc,
        lambda: pools.req.free_one(held[1], owner),
    )
    sizes, i = [], 0
    ready.wait()
    end = time.time() + seconds
    while time.time() < end:
        first = time.time()  # the batch's oldest event: its lag includes the fill
        for _ in range(batch):
            cycle[i & 3]()
            i += 1
        message, _ = shipper.batch()
        sizes.append(len(message))
        client.xadd(
            KEYS.ownership,
            {"m": message, "t": first},
            maxlen=streams.MAXLEN,
            approximate=True,
        )
    client.xadd(KEYS.ownership, {"m": b"", "t": -1.0})  # end marker
    client.close()
    out.put({"entry_bytes": int(statistics.median(sizes))})


def _consumer(url: str, ready, out) -> None:
    from services.session_store.consumer import OwnershipConsumer

    client = redis.Redis.from_url(url)
    consumer = OwnershipConsumer(client, "bench-store")
    lags: list[float] = []
    ready.set()
    done, first, last, entries = False, None, 0.0, 0
    while not done:
        reply = client.xreadgroup(
            consumer.group, consumer.name, {consumer.stream: ">"}, count=64, block=1000
        )
        batch = []
        for entry_id, fields in reply[0][1] if reply else []:
            done = done or float(fields[b"t"]) < 0
            if float(fields[b"t"]) >= 0:
                batch.append((entry_id, fields))
        if not batch:
            continue
        consumer._handle(batch)  # as the store's poll: apply, checkpoint, acknowledge
        last = time.time()
        for _, fields in batch:
            sent = float(fields[b"t"])
            if sent > 0:  # not the snapshot
                lags.append(last - sent)
                entries += 1
                first = first or sent
    out.put(
        {
            "events": consumer.ledger.events_applied,
            "entries": entries,
            "lags": lags,
            "seconds": last - first if first else 0.0,
            "violations": len(consumer.ledger.violations),
        }
    )


def _raw_xadd(url: str, size: int, seconds: float) -> float:
    """Entries/s of pipelined `XADD` of entries shaped like custody's: `m` of `size`
    bytes and a float `t`, trimmed the same way."""
    client = redis.Redis.from_url(url)
    payload = b"x" * size
    depth = max(1, min(1000, PIPELINE_BYTES // size))
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and n * size < RAW_BYTES:
        pipe = client.pipeline(transaction=False)
        for _ in range(depth):
            pipe.xadd(
                RAW, {"m": payload, "t": time.time()}, maxlen=streams.MAXLEN, approximate=True
            )
        pipe.execute()
        n += depth
    elapsed = time.perf_counter() - start
    client.delete(RAW)
    client.close()
    return n / elapsed


def _one_run(url: str, batch: int, seconds: float, raw_seconds: float) -> dict:
    """Custody at one batch size, then raw XADD of entries of the same byte size."""
    client = redis.Redis.from_url(url)
    client.delete(KEYS.ownership, KEYS.checkpoint)
    ctx = mp.get_context("spawn")
    out, made, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
    consumer = ctx.Process(target=_consumer, args=(url, ready, out))
    consumer.start()
    producer = ctx.Process(target=_producer, args=(url, batch, seconds, ready, made))
    producer.start()
    result = out.get(timeout=120) | made.get(timeout=120)
    producer.join()
    consumer.join()
    client.delete(KEYS.ownership, KEYS.checkpoint)
    client.close()
    result["raw_xadd_entries_per_s"] = _raw_xadd(url, result["entry_bytes"], raw_seconds)
    return result


def _summary(batch: int, runs: list[dict]) -> dict:
    """One batch size: medians over the runs, of rates and of each run's lag percentiles."""
    events = statistics.median(r["events"] / r["seconds"] for r in runs)
    entries = statistics.median(r["entries"] / r["seconds"] for r in runs)
    raw = statistics.median(r["raw_xadd_entries_per_s"] for r in runs)
    p50, p99 = ([float(np.percentile(r["lags"], q)) * 1e3 for r in runs] for q in (50, 99))
    return {
        "events_per_entry": round(
            sum(r["events"] for r in runs) / sum(r["entries"] for r in runs), 2
        ),
        "entry_bytes": int(statistics.median(r["entry_bytes"] for r in runs)),
        "events_per_s": round(events),
        "entries_per_s": round(entries, 1),
        "raw_xadd_entries_per_s": round(raw, 1),
        "entries_ratio": round(entries / raw, 4),
        "lag_p50_ms": round(statistics.median(p50), 2),
        "lag_p99_ms": round(statistics.median(p99), 2),
        "lag_p99_ms_worst_run": round(max(p99), 2),
        "violations": sum(r["violations"] for r in runs),
        "batch": batch,
    }


def sweep(
    url: str,
    batches: tuple[int, ...],
    repeats: int,
    seconds: float = SECONDS,
    raw_seconds: float = RAW_SECONDS,
) -> dict[str, dict]:
    """Per batch size (as a string key), custody against raw XADD; repeats interleaved."""
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    for i in range(repeats):
        for b in batches:
            runs[b].append(_one_run(url, b, seconds, raw_seconds))
        progress("events", i + 1, repeats)
    return {str(b): _summary(b, rs) for b, rs in runs.items()}


def _headline(sched: dict, at: dict) -> dict:
    """The old target, at the scheduler's real batch size."""
    step_p99 = sched["scheduler_step_interval_ms"]["p99"]
    return {
        "batch_events": sched["scheduler_batch_events"],
        "events_per_s": at["events_per_s"],
        "target_events_per_s": TARGET_EVENTS,
        "events_target_met": at["events_per_s"] >= TARGET_EVENTS,
        "lag_p99_ms": at["lag_p99_ms"],
        "target_lag_p99_ms": TARGET_LAG_MS,
        "lag_target_met": at["lag_p99_ms"] < TARGET_LAG_MS,
        "lag_p99_ms_plus_step_p99": round(at["lag_p99_ms"] + step_p99, 2),
    }


def _table(sched: dict, per: dict[str, dict], head: dict) -> str:
    b = sched["scheduler_batch_events"]
    lines = [
        "| events per entry | entry bytes | custody events/s | custody entries/s "
        "| raw XADD entries/s, same bytes | entries ratio | lag p50 / p99, fill included |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in per.items():
        name = f"{key} (scheduler median)" if int(key) == b else key
        lines.append(
            f"| {name} | {r['entry_bytes']:,} | {r['events_per_s']:,} | {r['entries_per_s']:,.0f} "
            f"| {r['raw_xadd_entries_per_s']:,.0f} | {r['entries_ratio']:.3f} "
            f"| {r['lag_p50_ms']} / {r['lag_p99_ms']} ms |"
        )
    step = sched["scheduler_step_interval_ms"]
    p10, p90 = sched["scheduler_batch_events_p10_p90"]
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines += [
        "",
        f"Scheduler's batches in the e2e workload: median {b} events per `events` message "
        f"(p10 {p10:g}, p90 {p90:g}; {sched['scheduler_batches_seen']} messages, median "
        f"{sched['scheduler_batch_bytes']:,} bytes); steps every {step['p50']:g} ms "
        f"(p99 {step['p99']:g} ms).",
        "",
        f"Target at the scheduler's batch of {b}: >= {TARGET_EVENTS:,} events/s applied end "
        f"to end: {head['events_per_s']:,}/s, {verdict(head['events_target_met'])}; p99 lag "
        f"< {TARGET_LAG_MS:g} ms: {head['lag_p99_ms']} ms, {verdict(head['lag_target_met'])} "
        f"(with an event's wait in service for its step to end, up to p99 {step['p99']:g} ms: "
        f"{head['lag_p99_ms_plus_step_p99']} ms).",
    ]
    return "\n".join(lines)


def run(repeats: int = 3) -> dict:
    sched = scheduler_batches()
    batches = tuple(sorted({*BATCHES, max(1, sched["scheduler_batch_events"])}))
    url = os.environ.get("REDIS_URL")
    server = None if url else PrivateRedis(appendonly=False).start()
    try:
        per = sweep(url or server.url, batches, repeats)
    finally:
        if server is not None:
            server.close()
    head = _headline(sched, per[str(max(1, sched["scheduler_batch_events"]))])
    payload = sched | {
        "headline": head,
        "batches": per,
        "violations": sum(r["violations"] for r in per.values()),
        "repeats": repeats,
        "seconds_per_run": SECONDS,
        "load_average_1m": os.getloadavg()[0],
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "events.json").write_text(json.dumps(payload, indent=2) + "\n")
    text = _table(sched, per, head)
    (RESULTS_DIR / "events.md").write_text(text + "\n")
    plot(
        "events",
        "ownership events vs raw XADD of entries of the same size",
        [f"{k} ev/entry" for k in per],
        {
            "custody entries/s": [r["entries_per_s"] for r in per.values()],
            "raw XADD entries/s": [r["raw_xadd_entries_per_s"] for r in per.values()],
            "custody events/s": [r["events_per_s"] for r in per.values()],
        },
        "per second",
        log=True,
    )
    payload["table"] = text
    return payload
