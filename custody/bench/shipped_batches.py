"""What the scheduler really ships to the ownership stream: its shipper sends one
`events` message per step, so the batch size `custody bench events` must be judged at is
measured here, on a short run of the e2e workload (16 sessions x 4 turns against `custody
up`'s services, as `custody bench e2e` drives them), read back from the stream.
"""

from __future__ import annotations

import numpy as np
import redis

from custody.bench.e2e import _one_run as e2e_run
from custody.up import Stack
from shared import streams
from shared.config import Settings
from shared.messages.cache import CACHE_KIND
from shared.messages.ownership import MESSAGES, Events

KEYS = streams.SINGLE  # the one replica of the stacks these drive

E2E_RUNS = 2


def scheduler_batches(runs: int = E2E_RUNS) -> dict:
    """Events per `events` message during the e2e workload, and the interval between the
    scheduler's steps (how long an event can wait in service for its batch to ship)."""
    stack = Stack(Settings.ephemeral())
    try:
        stack.start_all().wait_healthy()
        for i in range(runs):
            e2e_run(stack.settings, 100 + i)
        client = redis.Redis.from_url(stack.settings.redis_url)
        events, sizes = [], []
        for _, fields in client.xrange(KEYS.ownership):
            if fields.get(b"k") == CACHE_KIND:
                continue  # the prefix cache's, for the routers
            msg = MESSAGES.decode(fields[b"m"])
            if isinstance(msg, Events):
                events.append(msg.num_events)
                sizes.append(len(fields[b"m"]))
        steps = [int(i.split(b"-")[0]) for i, _ in client.xrange(KEYS.forward)]
        client.close()
    finally:
        stack.stop()
    gaps = np.diff(steps)
    gaps = gaps[gaps < 1000]  # not the pause between runs
    return {
        "scheduler_batch_events": round(float(np.median(events))),
        "scheduler_batch_events_p10_p90": [float(x) for x in np.percentile(events, [10, 90])],
        "scheduler_batch_bytes": int(np.median(sizes)),
        "scheduler_batches_seen": len(events),
        "scheduler_step_interval_ms": {
            "p50": float(np.percentile(gaps, 50)),
            "p99": float(np.percentile(gaps, 99)),
        },
    }
