"""Track slots and all-or-nothing admission."""

import numpy as np
import pytest

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.allocators.request_slots import admit, release
from services.scheduler.ownership.errors import PoolExhausted, StaleHandle
from services.scheduler.ownership.invariants import check_integrity
from services.scheduler.ownership.owners import OwnerKind


@pytest.fixture
def pools() -> Pools:
    return Pools(
        PoolConfig(kv_pages=32, page_size=4, mamba_slots=12, max_running_requests=4, max_context=64)
    )


def test_admission_rolls_back_a_half_done_reservation(pools, monkeypatch):
    def fail(*_: object) -> None:  # a bug: the track slots fail after every check passed
        raise RuntimeError("closed")

    monkeypatch.setattr(pools.mamba, "alloc", fail)
    with pytest.raises(RuntimeError, match="closed"):
        admit(pools, "r")
    assert pools.req.free_count == 4  # the row taken before the failure went back
    monkeypatch.undo()
    assert check_integrity(pools.ledger, [], idle=True).ok


def test_admission_refuses_before_taking_anything(pools):
    pools.mamba.alloc(11, pools.ledger.new_owner(OwnerKind.CACHE, "hog"))
    before = pools.ledger.events.next_seq
    with pytest.raises(PoolExhausted, match="mamba"):
        admit(pools, "r")
    assert pools.ledger.events.next_seq == before


def test_ping_pong_never_overwrites_the_latest_snapshot(pools):
    req = admit(pools, "r")
    track = req.track
    first = track.begin_snapshot()
    track.record(first, 16)
    second = track.begin_snapshot()
    assert second != first
    track.record(second, 32)
    assert track.begin_snapshot() == first
    assert track.latest_snapshot().slot == second and track.latest_snapshot().seq_len == 32
    with pytest.raises(ValueError):
        track.record(first, 20)  # an older length cannot become the latest


def test_the_prior_snapshot_stays_readable_until_its_entry_is_written(pools):
    """A reply start inside a page: the page-aligned snapshot before it is still the
    cache's to take (`deepest_on_page`), until a later step writes over its entry."""
    track = admit(pools, "r").track
    aligned = track.begin_snapshot()
    track.record(aligned, 28)
    inside = track.begin_snapshot()
    track.record(inside, 30)
    assert track.deepest_on_page(4).slot == aligned and track.deepest_on_page(4).seq_len == 28
    node = pools.ledger.new_owner(OwnerKind.CACHE, "n1")
    given = track.donate(track.deepest_on_page(4), node)
    assert given.slot == aligned and track.deepest_on_page(4) is None
    assert track.latest_snapshot().seq_len == 30  # the session's, at the reply start
    track.record(track.begin_snapshot(), 31)  # the refilled entry is written
    assert track.deepest_on_page(4) is None
    track.record(track.begin_snapshot(), 32)  # written over the reply start's entry
    assert track.deepest_on_page(4).seq_len == 32


def test_a_slot_being_written_is_never_handed_out_again(pools):
    """Pipelined steps: while one step writes a snapshot, the next step gets no slot
    rather than the latest snapshot's (which the cache may take at any moment)."""
    track = admit(pools, "r").track
    track.record(track.begin_snapshot(), 8)
    writing = track.begin_snapshot()
    assert track.begin_snapshot() is None
    track.cancel(writing)
    assert track.begin_snapshot() == writing


def test_donation_moves_the_slot_and_refills_the_track(pools):
    req = admit(pools, "r")
    node = pools.ledger.new_owner(OwnerKind.CACHE, "n1")
    req.track.record(req.track.begin_snapshot(), 8)
    snap = req.track.donate_latest(node)
    assert pools.mamba.owner_of(snap.slot) == node.id
    assert snap.slot not in req.track.slots
    assert req.track.latest_snapshot() is None
    assert all(pools.mamba.owner_of(s) == req.track.owner.id for s in req.track.slots)
    release(pools, req)
    pools.mamba.free_one(snap.slot, node, "evict")
    pools.ledger.retire(node)
    assert check_integrity(pools.ledger, [], idle=True).ok


def test_track_refuses_a_slot_it_lost(pools):
    req = admit(pools, "r")
    thief = pools.ledger.new_owner(OwnerKind.CACHE, "x")
    pools.mamba.transfer(np.array(req.track.slots[:1]), req.track.owner, thief, "bug")
    with pytest.raises(StaleHandle, match="no longer owns"):
        req.track.begin_snapshot()
