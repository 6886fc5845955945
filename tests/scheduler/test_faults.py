"""Each fault of the lessons in docs/ownership.md, in its generic form, is caught the moment it
happens, and the error names the slots, their owners and the event that moved them."""

import numpy as np
import pytest

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.allocators.request_slots import admit, release
from services.scheduler.ownership.errors import LeakError, OwnershipError, StaleHandle
from services.scheduler.ownership.invariants import check_integrity
from services.scheduler.ownership.lease import new_lease
from services.scheduler.ownership.owners import OwnerKind


@pytest.fixture
def pools() -> Pools:
    return Pools(
        PoolConfig(kv_pages=32, page_size=4, mamba_slots=12, max_running_requests=4, max_context=64)
    )


def test_double_free_names_slot_and_last_event(pools):
    req = pools.ledger.new_owner(OwnerKind.REQUEST, "r7")
    slot = pools.mamba.alloc_one(req)
    pools.mamba.free_one(slot, req)
    with pytest.raises(OwnershipError) as err:
        pools.mamba.free_one(slot, req)
    text = str(err.value)
    assert f"mamba[{slot}] owned by free" in text
    assert "request:r7" in text and "free: request:r7 -> free" in text


def test_batched_double_free_in_one_call(pools):
    req = pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    slots = pools.mamba.alloc(2, req)
    with pytest.raises(OwnershipError, match="twice"):
        pools.mamba.free(np.array([slots[0], slots[0]]), req)
    assert pools.mamba.held_by_kind()[OwnerKind.REQUEST] == 2  # nothing moved


def test_free_by_non_owner_names_both_owners(pools):
    a = pools.ledger.new_owner(OwnerKind.REQUEST, "a")
    s = pools.ledger.new_owner(OwnerKind.SESSION, "s1")
    slot = pools.mamba.alloc_one(a)
    with pytest.raises(OwnershipError) as err:
        pools.mamba.free_one(slot, s)
    text = str(err.value)
    assert "session:s1, who does not own them" in text
    assert f"mamba[{slot}] owned by request:a" in text
    assert pools.mamba.owner_of(slot) == a.id


def test_stale_handle_after_transfer(pools):
    req = admit(pools, "r1")
    session = pools.ledger.new_owner(OwnerKind.SESSION, "s1")
    kept = req.state.current
    moved = kept.move_to(session, "save")
    with pytest.raises(StaleHandle) as err:
        _ = kept.slot  # the request kept a reference it handed on (lesson 1)
    text = str(err.value)
    assert "request:r1" in text and f"mamba[{moved.slot}] owned by session:s1" in text
    assert "save: request:r1 -> session:s1" in text
    with pytest.raises(StaleHandle):
        kept.release()  # lesson 2: freeing through the stale handle
    assert moved.is_valid()


def test_stale_handle_after_abba(pools):
    """Owner ids are never reused, so a slot coming back to a *new* request does not
    revive the old request's handle."""
    old = pools.ledger.new_owner(OwnerKind.REQUEST, "old")
    lease = new_lease(pools.mamba, old, pools.mamba.alloc_one(old))
    lease.release()
    new = pools.ledger.new_owner(OwnerKind.REQUEST, "new")
    slot = pools.mamba.alloc_one(new)
    assert slot == lease.held
    with pytest.raises(StaleHandle, match="request:new"):
        lease.check()


def test_slot_dropped_without_transfer_is_caught_at_release(pools):
    req = admit(pools, "r1")
    dropped = req.track.slots[0]
    req.track.slots[0] = req.track.slots[1]  # forget a slot instead of handing it on
    with pytest.raises(OwnershipError) as err:
        release(pools, req)
    assert "track:r1" in str(err.value)
    assert pools.mamba.owner_of(dropped) == req.track.owner.id


def test_owner_retired_while_holding_is_a_leak(pools):
    req = pools.ledger.new_owner(OwnerKind.REQUEST, "r9")
    slot = pools.mamba.alloc_one(req)
    with pytest.raises(LeakError) as err:
        pools.ledger.retire(req)
    assert f"mamba[{slot}] owned by request:r9" in str(err.value)


def test_unclaimed_slot_is_reported_with_owner_and_event(pools):
    req = pools.ledger.new_owner(OwnerKind.REQUEST, "r3")
    slot = pools.mamba.alloc_one(req)
    report = check_integrity(pools.ledger, [], idle=True)
    text = "\n".join(report.problems)
    assert f"slots [{slot}] are held but claimed by no holder" in text
    assert "alloc: free -> request:r3" in text
    assert "idle, yet slots" in text


def test_slot_claimed_twice_is_counted_twice(pools):
    """Lesson 6: a session and its running turn both claiming the lent slot."""
    req = pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    sess = pools.ledger.new_owner(OwnerKind.SESSION, "s")
    slot = pools.mamba.alloc_one(req)
    claims = [(req, "mamba", [slot]), (sess, "mamba", [slot])]
    text = "\n".join(check_integrity(pools.ledger, claims, idle=False).problems)
    assert f"slots [{slot}] counted twice" in text


def test_partial_page_tail_freed_without_alignment(pools):
    req = admit(pools, "r1")
    row = req.row.slot
    pools.kv.extend(np.array([row]), np.array([10]))  # pages for positions 0-3, 4-7, 8-11
    start = 6  # a tail from position 6: the page of positions 4-7 still holds 4 and 5
    wrong = pools.rows.row_pages(row, (start // 4) * 4, 10)  # rounds down: a bug
    with pytest.raises(OwnershipError) as err:
        pools.kv_pages.free(wrong, req.owner)
    assert "free of pages a row still uses" in str(err.value)
    assert f"kv[{int(wrong[0])}] owned by request:r1" in str(err.value)
    pools.kv.free_tail(row, start)  # the aligned path keeps the partial page
    assert pools.rows.lens[row] == start
    assert pools.kv_pages.held_by_kind()[OwnerKind.REQUEST] == 2
    release(pools, req)
    assert check_integrity(pools.ledger, [], idle=True).ok


def test_admission_rolls_back_when_a_pool_is_short(pools):
    held = [admit(pools, f"r{i}") for i in range(3)]  # 12 mamba slots: 3 requests x 4
    before = pools.ledger.events.next_seq
    with pytest.raises(Exception, match="need"):
        admit(pools, "r5")
    assert pools.ledger.events.next_seq == before  # nothing taken, nothing to roll back
    for req in held:
        release(pools, req)
    assert check_integrity(pools.ledger, [], idle=True).ok
