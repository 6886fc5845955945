"""`custody bench events`: ownership events end to end (scheduler ledger -> shipper ->
Redis stream -> session store consumer, applied to the independent ledger), against
raw pipelined `XADD` of one small entry per call on the same server in the same run.

The producer and the consumer are separate processes, as in production. The producer
makes real transfers (Mamba and row alloc/free pairs through the ledger) as fast as it
can and ships a batch every 4,096 events; each entry carries its send time, and the
consumer records when it has applied it, which gives the lag.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import numpy as np
import redis

from custody.bench.harness import RESULTS_DIR, plot, progress
from shared import streams
from shared.redis_server import PrivateRedis

BATCH_EVENTS = 4096
SECONDS = 3.0


def _producer(url: str, seconds: float, ready) -> None:
    from services.scheduler.allocators.pools import PoolConfig, Pools
    from services.scheduler.event_shipper import EventShipper
    from services.scheduler.ownership.owners import OwnerKind

    client = redis.Redis.from_url(url)
    pools = Pools(PoolConfig(kv_pages=1024, mamba_slots=1024, max_running_requests=256))
    shipper = EventShipper(pools.ledger, epoch="bench")
    client.xadd(streams.OWNERSHIP, {"m": shipper.snapshot(), "t": time.time()})
    owner = pools.ledger.new_owner(OwnerKind.REQUEST, "bench")
    alloc, free = pools.mamba.alloc_one, pools.mamba.free_one
    row_alloc, row_free = pools.req.alloc_one, pools.req.free_one
    ready.wait()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(BATCH_EVENTS // 4):
            free(alloc(owner), owner)
            row_free(row_alloc(owner), owner)
        message, _ = shipper.batch()
        client.xadd(
            streams.OWNERSHIP,
            {"m": message, "t": time.time()},
            maxlen=streams.MAXLEN,
            approximate=True,
        )
    client.xadd(streams.OWNERSHIP, {"m": b"", "t": -1.0})  # end marker
    client.close()


def _consumer(url: str, out, ready) -> None:
    from services.session_store.consumer import OwnershipConsumer

    client = redis.Redis.from_url(url)
    consumer = OwnershipConsumer(client, "bench-store")
    lags: list[float] = []
    ready.set()
    done = False
    first = last = None
    while not done:
        reply = client.xreadgroup(
            consumer.group, consumer.name, {consumer.stream: ">"}, count=16, block=1000
        )
        for entry_id, fields in reply[0][1] if reply else []:
            sent = float(fields[b"t"])
            if sent < 0:
                done = True
                continue
            consumer._handle([(entry_id, fields)])
            now = time.time()
            lags.append(now - sent)
            first = first or now
            last = now
    out.put(
        {
            "events": consumer.ledger.events_applied,
            "lags": lags,
            "seconds": (last - first) if first and last else 0.0,
            "violations": len(consumer.ledger.violations),
        }
    )


def _raw_xadd(url: str, seconds: float) -> float:
    client = redis.Redis.from_url(url)
    payload = b"x" * 64
    n, end = 0, time.time() + seconds
    while time.time() < end:
        pipe = client.pipeline(transaction=False)
        for _ in range(1000):
            pipe.xadd("custody:raw", {"m": payload}, maxlen=streams.MAXLEN, approximate=True)
        pipe.execute()
        n += 1000
    client.delete("custody:raw")
    client.close()
    return n / seconds


def _one_run(url: str) -> dict:
    client = redis.Redis.from_url(url)
    client.delete(streams.OWNERSHIP, streams.CHECKPOINT)
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    consumer = ctx.Process(target=_consumer, args=(url, out, ready))
    consumer.start()
    producer = ctx.Process(target=_producer, args=(url, SECONDS, ready))
    producer.start()
    result = out.get(timeout=120)
    producer.join()
    consumer.join()
    raw = _raw_xadd(url, 1.0)
    result["raw_xadd_per_s"] = raw
    return result


def run(repeats: int = 3) -> dict:
    url = os.environ.get("REDIS_URL")
    server = None if url else PrivateRedis(appendonly=False).start()
    url = url or server.url
    try:
        runs = []
        for i in range(repeats):
            runs.append(_one_run(url))
            progress("events", i + 1, repeats)
    finally:
        if server is not None:
            server.close()
    rates = [r["events"] / r["seconds"] for r in runs if r["seconds"]]
    lags = np.concatenate([np.asarray(r["lags"]) for r in runs]) * 1e3
    events = float(np.median(rates))
    raw = float(np.median([r["raw_xadd_per_s"] for r in runs]))
    payload = {
        "events_per_s": round(events),
        "raw_xadd_per_s": round(raw),
        "ratio": round(events / raw, 3),
        "p99_lag_ms": round(float(np.percentile(lags, 99)), 2),
        "p50_lag_ms": round(float(np.percentile(lags, 50)), 2),
        "violations": sum(r["violations"] for r in runs),
        "repeats": repeats,
        "events_per_entry": BATCH_EVENTS,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "events.json").write_text(json.dumps(payload, indent=2) + "\n")
    table = "\n".join(
        [
            "| figure | custody | reference | ratio | target |",
            "|---|---|---|---|---|",
            f"| ownership events applied end to end | {events:,.0f} /s | {raw:,.0f} raw XADD /s "
            f"| {events / raw:.1f}x | >= 200,000 /s {'met' if events >= 2e5 else 'NOT met'} |",
            f"| p99 lag, send to applied | {payload['p99_lag_ms']} ms | | | < 50 ms "
            f"{'met' if payload['p99_lag_ms'] < 50 else 'NOT met'} |",
        ]
    )
    (RESULTS_DIR / "events.md").write_text(table + "\n")
    plot(
        "events",
        "ownership events vs raw XADD",
        ["per second"],
        {"ownership events applied": [events], "raw XADD entries": [raw]},
        "per second",
    )
    payload["table"] = table
    return payload
