"""What the soak sees of session state tiers from outside the executor: the executor's
in-flight mark (`Keys.tier_in_flight`, shared/streams.py), which aims the monkey's kills at tier
moves, and the executor's counter of completed moves, summed over its lives.

The mark is a Redis hash, kind -> moves of that kind in the step whose moves are running
(every kind is written, 0 when absent), deleted once they are done. A SIGKILLed executor
cannot delete it, so the mark it leaves behind is exactly what was in flight when it
died: the monkey reads it after the kill to confirm a hit, then deletes it, or the next
life would look busy to the next aimed kill.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from collections.abc import Callable

import redis

from custody.soak.client import call
from shared import streams
from shared.redis_client import connect

KEYS = streams.SINGLE  # the one replica of the stacks these drive

KINDS = ("hibernate", "spill", "load", "restore")
POLL_SECONDS = 0.003  # a move sleeps tier_move_delay_seconds half-way: far longer


class TierWatch:
    def __init__(self, redis_url: str) -> None:
        self.client = connect(redis_url, socket_timeout=2, socket_connect_timeout=2)

    def in_flight(self) -> set[str]:
        """The kinds the mark shows with a move in flight; empty when Redis is down."""
        try:
            mark = self.client.hgetall(KEYS.tier_in_flight)
        except redis.RedisError:
            return set()
        out = set()
        for kind, count in mark.items():
            try:
                if int(count) > 0:
                    out.add(kind.decode())
            except ValueError:
                continue
        return out

    def clear(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.delete(KEYS.tier_in_flight)

    def wait_for(
        self, wanted: Callable[[set[str]], bool], timeout: float, stop: Callable[[], bool]
    ) -> set[str]:
        """Poll the mark until it shows kinds `wanted` accepts (returned), or `timeout`
        passes or `stop()` says no such move can come any more (empty set)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop():
            kinds = self.in_flight()
            if kinds and wanted(kinds):
                return kinds
            time.sleep(POLL_SECONDS)
        return set()


class MoveCount:
    """The executor's `custody_tier_moves_total` by kind, over every life: each sample
    that is lower than the last starts a new life, and the last life's count is banked
    (moves completed after the last sample before a kill are not seen: a lower bound)."""

    PATTERN = re.compile(r'^custody_tier_moves_total\{kind="(\w+)"[^}]*\} (\S+)$', re.M)

    def __init__(self, metrics_port: int, every: float = 1.0) -> None:
        self.port, self.every = metrics_port, every
        self.banked: Counter[str] = Counter()
        self.life: Counter[str] = Counter()
        self._next = 0.0

    def sample(self) -> None:
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every
        reply = call(self.port, "/metrics", timeout=2)
        if reply.status != 200:
            return
        now = Counter({k: int(float(v)) for k, v in self.PATTERN.findall(reply.text)})
        if any(now[k] < self.life[k] for k in self.life):
            self.banked += self.life
        self.life = now

    def total(self) -> dict[str, int]:
        both = self.banked + self.life
        return {kind: both[kind] for kind in KINDS}
