"""The slot pool and the ledger: transfers, counts derived from owners, events."""

import numpy as np
import pytest

from services.scheduler.ownership.errors import OwnershipError, PoolExhausted
from services.scheduler.ownership.ledger import Ledger
from services.scheduler.ownership.owners import FREE, OwnerKind


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


def test_slot_zero_is_never_handed_out(ledger):
    pool = ledger.add_pool("mamba", 4)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    got = sorted([pool.alloc_one(req) for _ in range(4)])
    assert got == [1, 2, 3, 4]
    with pytest.raises(PoolExhausted):
        pool.alloc_one(req)


def test_alloc_is_all_or_nothing(ledger):
    pool = ledger.add_pool("mamba", 4)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    pool.alloc(3, req)
    before = pool.owner_view.copy()
    with pytest.raises(PoolExhausted):
        pool.alloc(2, req)
    assert np.array_equal(pool.owner_view, before)
    assert pool.free_count == 1


def test_counts_are_derived_from_owners(ledger):
    pool = ledger.add_pool("mamba", 6)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    sess = ledger.new_owner(OwnerKind.SESSION, "s")
    slots = pool.alloc(3, req)
    pool.transfer(slots[:2], req, sess, "save")
    counts = pool.held_by_kind()
    assert counts[OwnerKind.REQUEST] == 1
    assert counts[OwnerKind.SESSION] == 2
    assert counts[OwnerKind.FREE] == 3 == pool.free_count


def test_every_transfer_is_an_event_in_order(ledger):
    pool = ledger.add_pool("mamba", 4)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    sess = ledger.new_owner(OwnerKind.SESSION, "s")
    slot = pool.alloc_one(req)
    pool.transfer_one(slot, req, sess, "save")
    pool.free_one(slot, sess)
    events = ledger.events.drain()
    assert [e.seq for e in events] == [0, 1, 2]
    assert [(e.slots, e.giver, e.receiver, e.reason) for e in events] == [
        (slot, FREE.id, req.id, "alloc"),
        (slot, req.id, sess.id, "save"),
        (slot, sess.id, FREE.id, "free"),
    ]
    assert ledger.events.drain() == []


def test_free_list_is_reused_lowest_first(ledger):
    pool = ledger.add_pool("kv", 8)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    slots = pool.alloc(3, req)
    assert slots.tolist() == [1, 2, 3]
    pool.free(slots, req)
    assert pool.alloc(3, req).tolist() == [1, 2, 3]


def test_transfer_to_array_of_receivers(ledger):
    pool = ledger.add_pool("kv", 8)
    a = ledger.new_owner(OwnerKind.REQUEST, "a")
    b = ledger.new_owner(OwnerKind.REQUEST, "b")
    slots = pool.alloc(2, np.array([a.id, b.id]))
    assert pool.owner_of(int(slots[0])) == a.id and pool.owner_of(int(slots[1])) == b.id
    with pytest.raises(OwnershipError):
        pool.free(slots, a)  # b's slot is not a's to free
    assert pool.held_by_kind()[OwnerKind.REQUEST] == 2


def test_sink_and_out_of_range_slots_are_refused(ledger):
    pool = ledger.add_pool("mamba", 4)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    pool.alloc(4, req)
    for bad in (0, -1, 5):
        with pytest.raises(OwnershipError, match="outside"):
            pool.free_one(bad, req)
        with pytest.raises(OwnershipError, match="outside"):
            pool.free(np.array([bad]), req)
    assert pool.free_count == 0


def test_event_log_trims_only_drained_events():
    ledger = Ledger(keep_events=4)
    pool = ledger.add_pool("mamba", 2)
    req = ledger.new_owner(OwnerKind.REQUEST, "r")
    for _ in range(50):
        pool.free_one(pool.alloc_one(req), req)
    assert len(ledger.events.drain()) == 100
    for _ in range(10):
        pool.free_one(pool.alloc_one(req), req)
    events = ledger.events.drain()
    assert [e.seq for e in events] == list(range(100, 120))
    assert len(ledger.events.raw) < 120
