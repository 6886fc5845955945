"""Ownership faults. Each names the pool, the slots, their owners and the last event
that touched each slot, so a fault can be traced to the transfer that caused it."""

from __future__ import annotations


class OwnershipError(RuntimeError):
    """A transfer named slots its giver does not own: a double free, a free by a
    non-owner, or the use of a stale handle."""


class StaleHandle(OwnershipError):
    """A holder used a handle whose slots have since been transferred away."""


class LeakError(OwnershipError):
    """Slots are held by an owner that no longer exists or never claimed them."""


class InvariantViolation(OwnershipError):
    """A pool's ownership does not add up (free list, holders and ledger disagree)."""


class PoolExhausted(RuntimeError):
    """Not enough free slots; nothing was allocated."""

    def __init__(self, pool: str, need: int, free: int) -> None:
        super().__init__(f"pool {pool}: need {need} slots, {free} free; nothing allocated")
        self.pool, self.need, self.free = pool, need, free
