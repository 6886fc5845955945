"""The moves of a session's state between the device, the host tier and the disk tier,
each a set of ledger transfers plus one `TierMove` for the executor
(shared/messages/tiers.py), and what completes or undoes them.

A session's state moves as one unit: its KV of positions 0..tokens-1 and its Mamba state
after them, never one without the other. A move's sources are freed at once when the
executor runs that kind of move before anything in the same step writes their tier
(spills read host, hibernates read device); otherwise (loads read disk, restores read
host) a transit owner of the step holds them until the step has run. A destination is
`ready` once the step that writes it has run: no move reads it before. If that step
never runs (refused, or the executor was lost), the destination is given up and the
session re-prefills its history, except a load, whose blob goes back to its session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.allocators import handover
from services.scheduler.allocators.paged_kv import pages_for
from services.scheduler.allocators.tier_slots import DiskState, HostState, host_state
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.lease import Lease, new_lease
from services.scheduler.ownership.owners import Owner, OwnerKind
from shared.messages.tiers import MOVE_ORDER, MoveKind, TierMove

if TYPE_CHECKING:
    from services.scheduler.allocators.pools import Pools
    from services.scheduler.cache.radix_cache import RadixCache
    from services.scheduler.records.session import Session


@dataclass(eq=False)
class Flight:
    """One move planned into a step."""

    move: TierMove
    session: Session
    dest: HostState | DiskState | handover.SessionSlots  # what the move writes
    held: list[Lease] = field(default_factory=list)  # sources in transit
    source: DiskState | None = None  # a load's blob, given back if the load never ran


@dataclass(eq=False)
class TierBatch:
    """The moves and blob deletions a step carries, and its transit owner."""

    flights: list[Flight] = field(default_factory=list)
    discards: list[int] = field(default_factory=list)
    transit: Owner | None = None

    def __bool__(self) -> bool:
        return bool(self.flights or self.discards)

    def claims(self) -> list[Claim]:
        return [
            (lease.owner, lease.pool.name, np.atleast_1d(lease.held))
            for f in self.flights
            for lease in f.held
        ]


class TierMoves:
    """Plans moves into the batch of the step being planned; counts what moved."""

    def __init__(self, pools: Pools, cache: RadixCache, dirty: set[str]) -> None:
        self.pools, self.cache, self.dirty = pools, cache, dirty
        self.batch = TierBatch()
        self.discards: list[int] = []  # blobs freed since the last step was planned
        self.moved: dict[str, int] = dict.fromkeys(MOVE_ORDER, 0)
        self.dropped: dict[str, int] = {"host": 0, "disk": 0}  # states given up for room
        self.failed_loads = 0  # blobs that failed their check: re-prefilled instead

    def take(self) -> TierBatch:
        """The batch for the step just planned; the next step starts a new one."""
        batch, self.batch = self.batch, TierBatch()
        batch.discards, self.discards = self.discards, []
        return batch

    # ---- moves ----
    def hibernate(self, s: Session) -> None:
        """device -> host: the caller checked `host_fits`. The device slots are free at
        once, for this very step to use."""
        slots, tokens, pools = s.slots, s.cached_len, self.pools
        host = host_state(pools, s.owner, tokens, "hibernate")
        pages = pools.rows.row_pages(slots.row.slot, 0, tokens)  # borrowed ones too
        self._plan(
            "hibernate", s, host, slots.working.slot, host.state.held, pages, host.pages.held
        )
        handover.close(pools, slots, retire=False)
        s.slots = None
        if s.cache_node is not None:
            self.cache.unlock(s.cache_node)
            s.cache_node = None
        s.host = host

    def spill(self, s: Session) -> None:
        """host -> disk: the caller checked the disk has a free slot and the host state is
        ready. The host slots are free at once."""
        host, owner = s.host, s.owner
        slot = self.pools.disk.alloc_one(owner, "spill")
        blob = DiskState(owner, new_lease(self.pools.disk, owner, slot), host.tokens)
        self._plan("spill", s, blob, host.state.held, blob.blob.held, host.pages.held, ())
        host.release("spill")
        s.host, s.disk = None, blob

    def load(self, s: Session) -> None:
        """disk -> host, ahead of the turn that needs it: the caller checked `host_fits`
        and that the blob is valid. The blob stays in transit until the step ran."""
        disk = s.disk
        host = host_state(self.pools, s.owner, disk.tokens, "load")
        flight = self._plan("load", s, host, disk.blob.held, host.state.held, (), host.pages.held)
        flight.held.append(disk.blob.move_to(self._transit(), "load"))
        flight.source = disk
        s.disk, s.host = None, host

    def adopt(self, s: Session, replica: str, src_slot: int, tokens: int) -> None:
        """foreign disk -> disk: the blob of `src_slot` that replica `replica` wrote for
        this session (which moved here) is copied into a disk slot of this replica; the
        caller checked one is free. A copy that fails leaves the session to re-prefill."""
        owner = s.owner
        slot = self.pools.disk.alloc_one(owner, "adopt")
        blob = DiskState(owner, new_lease(self.pools.disk, owner, slot), tokens)
        self._plan("adopt", s, blob, src_slot, slot, (), (), replica)
        s.disk, s.cached_len = blob, tokens

    def to_device(self, s: Session) -> None:
        """host -> device: the session holds device slots again, written before the
        forward of this step; the caller made room and checked the host state is ready."""
        host, owner, pools = s.host, s.owner, self.pools
        row = pools.req.alloc_one(owner, "restore")
        pages = pools.kv_pages.alloc(
            pages_for(host.tokens, pools.config.page_size), owner, "restore"
        )
        working = pools.mamba.alloc_one(owner, "restore")
        pools.kv.restore_row(row, pages, host.tokens)
        slots = handover.SessionSlots(
            owner,
            new_lease(pools.req, owner, row),
            new_lease(pools.mamba, owner, working),
            ready=False,
        )
        flight = self._plan("restore", s, slots, host.state.held, working, host.pages.held, pages)
        flight.held += host.hold(self._transit(), "restore")
        s.host, s.slots = None, slots

    def drop_host(self, s: Session, reason: str) -> None:
        s.host.release(reason)
        s.host = None
        self.dirty.add(s.sid)

    def drop_disk(self, s: Session, reason: str) -> None:
        slot = s.disk.blob.slot
        s.disk.blob.release(reason)
        self.discards.append(slot)
        s.disk = None
        self.dirty.add(s.sid)

    # ---- the step ran, or never will ----
    def landed(self, batch: TierBatch, failed: set[int]) -> None:
        """The step carrying `batch` ran; the moves at indices `failed` did not happen."""
        for i, f in enumerate(batch.flights):
            if i in failed:
                self.failed_loads += f.move.kind == "load"
                self._undo(f, blob_good=f.move.kind != "load")
                continue
            self._release_held(f)
            s = f.session
            if any(f.dest is state for state in (s.slots, s.host, s.disk)):
                f.dest.ready = True
                self.dirty.add(s.sid)
        self._retire(batch)

    def abandon(self, batch: TierBatch) -> None:
        """The step carrying `batch` will not run: undo its moves; its deletions wait for
        the next step."""
        for f in batch.flights:
            self._undo(f, blob_good=True)
        self.discards += batch.discards
        self._retire(batch)

    # ---- internals ----
    def _plan(
        self,
        kind: MoveKind,
        s: Session,
        dest: HostState | DiskState | handover.SessionSlots,
        src_slot: int,
        dst_slot: int,
        src_pages: np.ndarray | tuple[()],
        dst_pages: np.ndarray | tuple[()],
        src_replica: str = "",
    ) -> Flight:
        tokens = s.host.tokens if kind == "restore" else dest.tokens
        move = TierMove.of(
            kind,
            s.sid,
            tokens,
            int(src_slot),
            int(dst_slot),
            src_pages,
            dst_pages,
            s.owner.id,
            src_replica,
        )
        flight = Flight(move, s, dest)
        self.batch.flights.append(flight)
        self.moved[kind] += 1
        self.dirty.add(s.sid)
        return flight

    def _transit(self) -> Owner:
        if self.batch.transit is None:
            self.batch.transit = self.pools.ledger.new_owner(OwnerKind.TRANSIT, "step")
        return self.batch.transit

    def _release_held(self, f: Flight) -> None:
        for lease in f.held:
            if lease.pool is self.pools.disk:
                self.discards.append(int(lease.held))
            lease.release("moved")
        f.held = []

    def _undo(self, f: Flight, blob_good: bool) -> None:
        """The move did not happen: its destination holds nothing. A load's blob still
        holds the state: it goes back to its session if that has nothing newer."""
        s = f.session
        if f.dest is s.host and s.host is not None:
            self.drop_host(s, "move_lost")
        elif f.dest is s.disk and s.disk is not None:
            self.drop_disk(s, "move_lost")
        elif f.dest is s.slots and s.slots is not None:  # restored, no turn took it yet
            handover.close(self.pools, s.slots, retire=False)
            s.slots = None
        if f.source is not None and blob_good and not s.closed and s.state_tier is None:
            blob = f.held.pop()
            s.disk = DiskState(s.owner, blob.move_to(s.owner, "load_lost"), f.source.tokens, True)
        self._release_held(f)
        if s.state_tier is None and (s.turn is None or s.turn.slots is None):
            s.cached_len = 0  # nothing holds its state: its next turn re-prefills
        self.dirty.add(s.sid)

    def _retire(self, batch: TierBatch) -> None:
        if batch.transit is not None:
            self.pools.ledger.retire(batch.transit)
            batch.transit = None
