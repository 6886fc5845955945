"""One pool of slots, each with exactly one owner: the only code that changes an owner.

Storage is an `array.array` for the scalar path (a Python int per access, no numpy
scalar boxing) with a zero-copy numpy view of the same buffer for the batched path, so a
single Mamba slot and a 256-row decode step both go through the one owner table. The
free list is a stack: O(1) pop and push, and bulk pops and pushes as slices. A pool moved
mostly one slot at a time (`scalar`: Mamba slots, rows) keeps its stack as a list, whose
pop and append cost a third of array's; a KV pool keeps a compact int64 array, which
the batched path fills from bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from services.scheduler.ownership.errors import OwnershipError, PoolExhausted
from services.scheduler.ownership.events import EventLog
from services.scheduler.ownership.owners import FREE, KIND_MASK, SINK_ID, Owner, OwnerKind

OwnerArg = Owner | int | np.ndarray  # an owner, an owner id, or an int64 array of ids per slot


class PoolLedger(Protocol):
    """What a pool needs of the ledger that holds it (ledger.py, which builds the pools):
    a Protocol keeps the two modules out of an import cycle."""

    events: EventLog

    def name(self, owner: OwnerArg) -> str: ...

    def fault(self, pool: SlotPool, slots: Iterable[int], what: str) -> OwnershipError: ...


def _ids(owner: OwnerArg) -> int | np.ndarray:
    return owner.id if isinstance(owner, Owner) else owner


class SlotPool:
    """Slots `1..capacity` of one pool; slot 0 is the padding sink and never moves. A
    pool of capacity 0 (a tier turned off) has nothing to give."""

    def __init__(
        self, ledger: PoolLedger, pool_id: int, name: str, capacity: int, scalar: bool = False
    ) -> None:
        if capacity < 0:
            raise ValueError(f"pool {name}: capacity must be >= 0, got {capacity}")
        self.ledger = ledger
        self.pool_id = pool_id
        self.name = name
        self.capacity = capacity
        self._owner = array("q", [0]) * (capacity + 1)
        self._owner[0] = SINK_ID
        self.owner_view = np.frombuffer(self._owner, dtype=np.int64)
        # Free stack, popped from the end; the lowest slot goes out first. The batched
        # path copies out of it (`_top`) and never keeps a view: it is resized in place.
        self.scalar = scalar
        order = range(capacity, 0, -1)
        self._stack: list[int] | array[int] = list(order) if scalar else array("q", order)
        self._mark = np.zeros(capacity + 1, dtype=np.int64)  # scratch for duplicate checks
        self._emit = ledger.events.flat.extend  # one event: a tuple of 5 (events.py)
        self.free_guard: Callable[[np.ndarray], None] | None = None
        self.alloc_one: Callable[..., int]
        self.transfer_one: Callable[[int, Owner, Owner, str], None]
        self.free_one: Callable[..., None]
        self._bind_scalar_path()

    # ---- counts, all derived from the owner table or the free stack ----
    @property
    def free_count(self) -> int:
        return len(self._stack)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._stack)

    def held_by_kind(self) -> dict[OwnerKind, int]:
        counts = np.bincount(self.owner_view[1:] & KIND_MASK, minlength=len(OwnerKind))
        return {kind: int(counts[kind]) for kind in OwnerKind}

    def owner_of(self, slot: int) -> int:
        return self._owner[slot]

    def owned_by(self, owner: Owner) -> np.ndarray:
        return np.flatnonzero(self.owner_view == owner.id)

    def owns(self, owner: Owner, slots: int | np.ndarray) -> bool:
        if type(slots) is int:  # a lease check on the planning path: no numpy for one slot
            return self._owner[slots] == owner.id
        return bool(np.all(self.owner_view[slots] == owner.id))

    def set_free_guard(self, guard: Callable[[np.ndarray], None]) -> None:
        """`guard(slots)` runs before any free and raises if something still references
        those slots (the paged KV allocator guards pages that rows still use)."""
        self.free_guard = guard
        self._bind_scalar_path()

    # ---- scalar path ----
    def _bind_scalar_path(self) -> None:
        """Build `alloc_one`, `transfer_one` and `free_one` as closures over this pool's
        storage. They run once or more per request (Mamba slots, rows), and attribute
        lookups on `self` were a fifth of their cost, so even the stack's pop and append
        are bound once; the checks are the same. The owner table is reached through a
        memoryview (same buffer), whose item store skips array's format parsing. A pool
        without a free guard gets a `free_one` that does not test for one on every call."""
        owner, emit, pool_id = memoryview(self._owner), self._emit, self.pool_id
        pop, push = self._stack.pop, self._stack.append

        def alloc_one(receiver: Owner, reason: str = "alloc") -> int:
            try:
                slot = pop()
            except IndexError:
                raise PoolExhausted(self.name, 1, 0) from None
            if owner[slot]:
                raise self.ledger.fault(self, [slot], "the free list holds an owned slot")
            rid = owner[slot] = receiver.id
            emit((pool_id, slot, 0, rid, reason))
            return slot

        def transfer_one(slot: int, giver: Owner, receiver: Owner, reason: str) -> None:
            gid = giver.id
            try:
                if owner[slot] != gid or slot <= 0:
                    raise self._not_owner(slot, giver, reason)
            except IndexError:
                raise self._not_owner(slot, giver, reason) from None
            rid = owner[slot] = receiver.id
            emit((pool_id, slot, gid, rid, reason))

        def free_one(slot: int, giver: Owner, reason: str = "free") -> None:
            gid = giver.id
            try:
                if owner[slot] != gid or slot <= 0:
                    raise self._not_owner(slot, giver, reason)
            except IndexError:
                raise self._not_owner(slot, giver, reason) from None
            owner[slot] = 0
            push(slot)
            emit((pool_id, slot, gid, 0, reason))

        self.alloc_one = alloc_one
        self.transfer_one = transfer_one
        self.free_one = free_one if self.free_guard is None else self._guarded(free_one)

    def _guarded(self, free_one: Callable[..., None]) -> Callable[..., None]:
        """`free_one` for a pool with a free guard: the guard runs once the giver is known
        to own the slot and before any change, as in the batched `free`; anything else
        goes straight to `free_one`, whose check refuses it."""
        owner, guard, end = self._owner, self.free_guard, self.capacity + 1

        def guarded_free_one(slot: int, giver: Owner, reason: str = "free") -> None:
            if 0 < slot < end and owner[slot] == giver.id:
                guard(np.array([slot]))
            free_one(slot, giver, reason)

        return guarded_free_one

    # ---- batched path ----
    def alloc(self, n: int, receiver: OwnerArg, reason: str = "alloc") -> np.ndarray:
        """All or nothing: `n` slots from the free list, or PoolExhausted and no change."""
        free = len(self._stack)
        if n > free:
            raise PoolExhausted(self.name, n, free)
        slots = self._top(n)
        # count_nonzero is a C call; any() goes through numpy's Python wrapper
        if np.count_nonzero(self.owner_view[slots]):
            raise self.ledger.fault(self, slots, "the free list holds an owned slot")
        ids = _ids(receiver)
        self.owner_view[slots] = ids  # raises before any change if `ids` does not fit
        del self._stack[free - n :]
        self._emit((self.pool_id, slots, 0, ids, reason))
        return slots

    def take(self, slots: np.ndarray, receiver: Owner, reason: str) -> None:
        """Give these particular free slots to `receiver` (a scheduler rebuilding state
        that outlived it). O(capacity): never on the hot path."""
        self._check_giver(slots, FREE, reason)
        keep = np.array(self._stack, dtype=np.int64)
        del self._stack[:]
        self._push_all(keep[~np.isin(keep, slots)])
        self.owner_view[slots] = receiver.id
        self._emit((self.pool_id, slots.copy(), 0, receiver.id, reason))

    def transfer(self, slots: np.ndarray, giver: OwnerArg, receiver: OwnerArg, reason: str) -> None:
        self._check_giver(slots, giver, reason)
        ids = _ids(receiver)
        self.owner_view[slots] = ids
        self._emit((self.pool_id, slots.copy(), _ids(giver), ids, reason))

    def free(self, slots: np.ndarray, giver: OwnerArg, reason: str = "free") -> None:
        if len(slots) == 0:
            return
        self._check_giver(slots, giver, reason)
        if self.free_guard is not None:
            self.free_guard(slots)
        self.owner_view[slots] = 0
        self._push_all(slots[::-1])
        self._emit((self.pool_id, slots.copy(), _ids(giver), 0, reason))

    def _top(self, n: int) -> np.ndarray:
        """A copy of the top `n` free-stack entries, in the order pops would give them."""
        tail = self._stack[len(self._stack) - n :]
        if self.scalar:
            tail.reverse()
            return np.array(tail, dtype=np.int64)
        return np.frombuffer(tail, np.int64)[::-1].copy()

    def _push_all(self, slots: np.ndarray) -> None:
        """Push `slots` onto the free stack in order (as Python ints onto a list)."""
        if self.scalar:
            self._stack.extend(slots.tolist())
        else:
            self._stack.frombytes(slots.astype(np.int64).tobytes())

    def _check_giver(self, slots: np.ndarray, giver: OwnerArg, reason: str) -> None:
        """Every slot owned by its giver, none listed twice, none the sink."""
        if len(slots) == 0:
            return
        if int(slots.min()) <= 0 or int(slots.max()) > self.capacity:
            raise self._not_owner(slots[(slots <= 0) | (slots > self.capacity)], giver, reason)
        wrong = self.owner_view[slots] != _ids(giver)
        if wrong.any():
            raise self._not_owner(slots[wrong], giver, reason)
        mark = self._mark
        order = np.arange(len(slots))
        mark[slots] = order
        dup = mark[slots] != order
        if dup.any():
            raise self.ledger.fault(
                self, slots[dup], f"{reason} by {self.ledger.name(giver)} lists slots twice"
            )

    def _not_owner(self, slots: int | np.ndarray, giver: OwnerArg, reason: str) -> Exception:
        slots = np.atleast_1d(slots)
        if int(slots.min()) <= 0 or int(slots.max()) > self.capacity:
            what = f"{reason} names a slot outside 1..{self.capacity}"
        else:
            what = f"{reason} by {self.ledger.name(giver)}, who does not own them"
        return self.ledger.fault(self, slots, what)

    # ---- integrity ----
    def free_list_problems(self) -> list[str]:
        """The free stack must hold exactly the slots whose owner is FREE, once each."""
        stacked = np.sort(np.array(self._stack, dtype=np.int64))
        free = np.flatnonzero(self.owner_view == 0)
        if np.array_equal(stacked, free):
            return []
        dup = stacked[1:][stacked[1:] == stacked[:-1]]
        missing = np.setdiff1d(free, stacked)
        owned = np.setdiff1d(stacked, free)
        return [
            f"pool {self.name}: free list disagrees with owners "
            f"(listed twice {dup.tolist()}, free but not listed {missing.tolist()}, "
            f"listed but owned {owned.tolist()})"
        ]
