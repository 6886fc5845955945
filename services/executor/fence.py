"""Fencing: the executor runs steps only from the live scheduler.

A scheduler writes its epoch to its replica's scheduler-epoch key when it starts, before
it publishes anything, so a scheduler that was replaced (paused, partitioned, restarted) cannot
have its late steps run against slots its successor now owns. The key's value is cached
and read again when a step comes from another epoch (once per scheduler life, and once
per step of a fenced scheduler) and once a heartbeat. Without the key (an older
scheduler) every step is admitted, and the key read again each time until it appears.
"""

from __future__ import annotations

import redis


class SchedulerFence:
    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key
        self.live: str | None = None  # the key's value when last read

    def admits(self, epoch: str) -> bool:
        if epoch != self.live:
            self.refresh()
        return self.live is None or epoch == self.live

    def refresh(self) -> None:
        """Read the key again; also once a heartbeat, so a scheduler replaced while its
        predecessor keeps sending is fenced within a heartbeat even before the new one
        has published a step."""
        value = self.client.get(self.key)
        self.live = None if value is None else value.decode()
