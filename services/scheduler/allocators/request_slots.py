"""Everything one running request holds, reserved in one step or not at all.

A request needs a row, its ring of working Mamba slots (one more than the pipeline's
depth, see working_slots.py), as many track slots (track_buffer.py) and, when the
engine speculates, a slot per draft (spec_slots.py). Admission
checks every pool first and only then takes; if taking still fails half-way (a bug),
what was taken is given back before the error propagates (lesson 11). Release gives
everything back and retires both owners, which fails loudly if anything was dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.allocators.pools import Pools
from services.scheduler.allocators.spec_slots import SpecSlots
from services.scheduler.allocators.track_buffer import TrackSlots
from services.scheduler.allocators.working_slots import WorkingSlots
from services.scheduler.ownership.errors import PoolExhausted
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.lease import Lease, new_lease
from services.scheduler.ownership.owners import Owner, OwnerKind


@dataclass(slots=True)
class RequestSlots:
    owner: Owner  # request:<rid>
    row: Lease
    state: WorkingSlots
    track: TrackSlots
    spec: SpecSlots
    borrowed: int = 0  # positions [0, borrowed) use KV pages owned by someone else

    def claims(self, pools: Pools) -> list[Claim]:
        own = row_state_claims(pools, self.owner, self.row, self.state.held(), self.borrowed)
        track, spec = self.track, self.spec
        return [*own, (track.owner, "mamba", track.claims()), (spec.owner, "mamba", spec.held())]


def row_state_claims(
    pools: Pools, owner: Owner, row: Lease, working: list[int], borrowed: int
) -> list[Claim]:
    """What the holder of a row's state claims: the row, its working Mamba slots and the
    KV pages of positions [borrowed, length) (the ones before are borrowed)."""
    slot = row.slot
    length = int(pools.rows.lens[slot])
    return [
        (owner, "req", [slot]),
        (owner, "mamba", working),
        (owner, "kv", pools.rows.row_pages(slot, borrowed, length)),
    ]


def admit(pools: Pools, rid: str) -> RequestSlots:
    """Row + working slots + track slots + speculative slots for request `rid`, all or
    nothing."""
    need = pools.config.request_mamba_slots
    if not pools.req.can_alloc(1):
        raise PoolExhausted("req", 1, pools.req.free_count)
    if not pools.mamba.can_alloc(need):
        raise PoolExhausted("mamba", need, pools.mamba.free_count)
    ledger = pools.ledger
    owner = ledger.new_owner(OwnerKind.REQUEST, rid)
    track_owner = ledger.new_owner(OwnerKind.TRACK, rid)
    spec_owner = ledger.new_owner(OwnerKind.SPECULATIVE, rid)
    taken: list[Lease] = []
    try:
        row = new_lease(pools.req, owner, pools.req.alloc_one(owner, "admit"))
        taken.append(row)
        working: list[Lease] = []
        for _ in range(pools.config.working_slots):
            working.append(new_lease(pools.mamba, owner, pools.mamba.alloc_one(owner, "admit")))
            taken.append(working[-1])
        track_slots = pools.mamba.alloc(pools.config.track_slots, track_owner, "admit")
        taken.append(new_lease(pools.mamba, track_owner, track_slots))
        spec = take_spec_slots(pools, spec_owner)
        taken += spec.leases
    except BaseException:
        _give_back(pools, taken, (owner, track_owner, spec_owner))
        raise
    pools.rows.lens[row.held] = 0
    pools.rows.changed(row.slot, 0)
    track = TrackSlots(pools.mamba, track_owner, track_slots.tolist())
    return RequestSlots(owner, row, WorkingSlots(tuple(working)), track, spec)


def take_spec_slots(pools: Pools, owner: Owner) -> SpecSlots:
    """The speculative slots of a request being admitted (none when the engine does not
    speculate); the caller has checked there is room."""
    leases = [
        new_lease(pools.mamba, owner, pools.mamba.alloc_one(owner, "admit"))
        for _ in range(pools.config.spec_slots)
    ]
    return SpecSlots(owner, leases)


def release(pools: Pools, req: RequestSlots) -> None:
    """Free the request's own KV, its row, its working, track and speculative slots."""
    row = req.row.slot
    pools.kv.free_tail(row, req.borrowed, "finish")
    pools.kv.forget(row)
    track = new_lease(pools.mamba, req.track.owner, req.track.checked_slots())
    leases = [track, *req.spec.leases, *req.state.leases, req.row]
    _give_back(pools, leases, (req.owner, req.track.owner, req.spec.owner))


def _give_back(pools: Pools, leases: list[Lease], owners: tuple[Owner, ...]) -> None:
    for lease in leases:
        lease.release("release")
    for owner in owners:
        pools.ledger.retire(owner)
