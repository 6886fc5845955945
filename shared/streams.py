"""Stream names and the Redis stream operations every service uses the same way."""

from __future__ import annotations

import redis

OWNERSHIP = "custody:ownership"
STORE_GROUP = "session-store"
FORWARD = "custody:forward"
EXECUTOR_GROUP = "executor"
RESULTS = "custody:results"
EXECUTOR_ALIVE = "custody:executor-alive"  # the live executor's epoch, expiring
SCHEDULER_EPOCH = "custody:scheduler-epoch"  # the live scheduler's epoch (fencing)
SESSIONS = "custody:sessions"  # set of persisted session ids
# The executor's tier moves in flight (hash kind -> count), set while a step's moves run:
# after a kill, a fault drill reads what was moving.
TIER_IN_FLIGHT = "custody:executor:tier_in_flight"


def session_key(sid: str) -> str:
    return f"custody:session:{sid}"


CHECKPOINT = "custody:ledger"
SNAPSHOT_WANTED = "custody:snapshot-wanted"
# Approximate bound of a stream: far above the worst lag of its consumer, so nothing
# unread is ever trimmed (trimming with ~ keeps whole radix-tree nodes, cheaply).
MAXLEN = 100_000


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (reading the stream from its start) if it is missing."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise
