"""One test per lesson of docs/ownership.md on caches and sessions (1-11). Each fails if
the protection it names is removed."""

import numpy as np
import pytest

from services.scheduler.allocators.request_slots import admit
from services.scheduler.ownership.errors import OwnershipError, StaleHandle
from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.records.request import Status
from tests.engine.driver import Driver
from tests.engine.scripted import Scripted
from tests.engine.test_sessions import abort_mid_decode, close_all, text


def test_lesson_01_a_request_keeps_no_usable_reference_after_saving_to_its_session():
    d = Driver()
    sid = d.engine.sessions.open().sid
    req = d.turn(sid, text(6, 1), max_new=3)
    d.step()
    slots = req.slots  # a reference the request could have kept
    d.run()
    assert req.slots is None
    session = d.engine.sessions.get(sid)
    assert session.slots.working.held == slots.state.current.held
    with pytest.raises(StaleHandle, match=f"owned by session:{sid}"):
        _ = slots.state.current.slot
    with pytest.raises(StaleHandle):
        slots.state.current.release()
    next_turn = d.turn(sid, text(2, 2), max_new=2)
    d.step()
    assert (
        next_turn.slots.state.current.slot == slots.state.current.held
    )  # restored, not re-allocated
    d.run()
    close_all(d)


def test_lesson_02_freed_track_slots_leave_no_reference_behind():
    d = Driver()
    req = d.generate(text(8, 1), max_new=3)
    d.step()
    d.step()  # the prefill has completed (and donated its snapshot, refilling the track)
    track = req.slots.track
    kept = list(track.slots)
    d.run()
    assert all(d.pools.mamba.owner_of(s) == 0 for s in kept)
    with pytest.raises(StaleHandle):
        track.begin_snapshot()  # the freed ping-pong slots cannot be written through it
    d.assert_idle_clean()


def test_lesson_03_aborted_first_turn_and_close_free_every_slot():
    d = Driver()
    sid = d.engine.sessions.open().sid
    abort_mid_decode(d, sid, text(10, 1))
    d.assert_idle_clean()
    d.run_turn(sid, text(4, 2), max_new=3)
    d.engine.sessions.close(sid)
    for pool in ("kv", "mamba", "req"):
        counts = d.engine.check(idle=True).counts[pool]
        assert counts["session"] == counts["request"] == counts["track"] == 0, pool


def test_lesson_04_state_copies_and_clears_are_deferred_to_the_step():
    s = Scripted(chunk=8, track_interval=64)
    s.submit("a", [1, 2, 3, 4], [9])
    s.run()
    before = s.states.copy()
    b = s.submit("b", [1, 2, 3, 4, 5], [1])
    plan = s.engine.plan_step()
    assert np.array_equal(s.states, before)  # the scheduler touched no state
    assert plan.ops.copies and plan.copy_sources
    source = plan.ops.copies[0][0]
    assert s.pools.mamba.owner_of(source) != b.slots.owner.id  # donated to the cache...
    assert s.pools.mamba.owner_of(b.slots.state.current.slot) == b.slots.owner.id  # ...fresh slot
    s.engine.complete_step(plan, s.run_plan(plan))


@pytest.mark.parametrize("page_size", [1, 16])
def test_lesson_05_a_resumed_turn_frees_the_tail_it_holds_past_its_history(page_size):
    d = Driver(page_size=page_size)
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(21, 1), max_new=5)
    session = d.engine.sessions.get(sid)
    row = session.slots.row.slot
    # the session's row over-allocated past its history (a retried turn, say)
    d.pools.kv.extend(np.array([row]), np.array([d.pools.rows.lens[row] + 2 * page_size + 3]))
    turn = d.run_turn(sid, text(4, 2), max_new=3)
    assert turn.status is Status.FINISHED
    session = d.engine.sessions.get(sid)
    assert d.pools.rows.lens[session.slots.row.slot] == session.cached_len
    close_all(d)


def test_lesson_06_slots_lent_to_a_turn_are_counted_once():
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(5, 1), max_new=2)
    d.turn(sid, text(5, 2), max_new=4)
    d.step()
    report = d.engine.check(idle=False)
    assert report.ok, report.problems
    session = d.engine.sessions.get(sid)
    assert session.slots is None  # lent: the session does not also claim them
    d.run()
    close_all(d)


def test_lesson_07_every_path_out_of_admission_releases_what_it_took():
    d = Driver(mamba_slots=5)
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(6, 1), max_new=2)  # a cached prefix
    hog = d.pools.ledger.new_owner(OwnerKind.CACHE, "hog")
    d.pools.mamba.alloc(d.pools.mamba.free_count, hog)  # the pool is now too short

    def locks() -> dict[int, tuple[int, int]]:
        return {id(n): (n.kv_lock, n.copy_lock) for n in d.engine.cache.nodes()}

    before = locks()
    waiting = d.generate([*text(6, 1), 7], max_new=2)
    assert d.engine.plan_step() is None and waiting.status is Status.WAITING
    assert locks() == before  # the idle session's lock is its own, not admission's
    # nor was its state given up: the hog's slots are no cache state eviction could free
    assert d.engine.sessions.get(sid).slots is not None
    d.engine.abort(waiting.rid)
    d.pools.mamba.free(d.pools.mamba.owned_by(hog), hog)
    d.pools.ledger.retire(hog)
    d.assert_idle_clean()


def test_lesson_08_a_turn_aborted_before_it_runs_does_not_touch_the_session():
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(30, 1), max_new=4)
    session = d.engine.sessions.get(sid)
    row, length = session.slots.row.slot, int(d.pools.rows.lens[session.slots.row.slot])
    history = session.history.copy()
    early = d.turn(sid, [5], max_new=4)
    d.engine.abort(early.rid)
    assert session.slots.row.slot == row and d.pools.rows.lens[row] == length
    assert np.array_equal(session.history, history)
    assert d.run_turn(sid, [6], max_new=2).cached_tokens == len(history) - 1
    close_all(d)


def test_lesson_09_which_snapshot_is_recorded_comes_from_the_step():
    s = Scripted(chunk=4, track_interval=64)
    req = s.submit("a", list(range(1, 11)), [1])
    plan = s.engine.plan_step()
    (row,) = plan.rows
    req.computed = 9  # the request moved on before the step completed (pipelining)
    s.engine.complete_step(plan, s.run_plan(plan))
    node = s.engine.cache.match(np.arange(1, 11), 9).node
    assert node.end == row.snapshot_len == 4


def test_lesson_10_a_request_shorter_than_a_track_interval_inserts_no_empty_node():
    s = Scripted(page_size=16, chunk=16, track_interval=16)
    s.submit("tiny", [1, 2], [3])
    s.run()
    assert list(s.engine.cache.nodes()) == []
    assert s.engine.cache.match(np.array([1, 2, 3]), 2).length == 0


def test_lesson_11_reserving_a_request_is_all_or_nothing():
    d = Driver(mamba_slots=5)
    hog = d.pools.ledger.new_owner(OwnerKind.CACHE, "hog")
    d.pools.mamba.alloc(2, hog)  # 3 left, 4 needed
    before = d.pools.ledger.events.next_seq
    with pytest.raises(Exception, match="mamba"):
        admit(d.pools, "r")
    assert d.pools.ledger.events.next_seq == before
    assert d.pools.req.free_count == d.pools.req.capacity
    with pytest.raises(OwnershipError):
        d.pools.mamba.free_one(d.pools.mamba.capacity, hog)  # that slot was never taken


def test_the_idle_guard_raises_when_strict_and_counts_otherwise():
    from services.scheduler.ownership.errors import InvariantViolation

    d = Driver()
    leak = d.pools.ledger.new_owner(OwnerKind.REQUEST, "lost")
    d.pools.mamba.alloc_one(leak)  # held by a request nobody tracks
    with pytest.raises(InvariantViolation, match="claimed by no holder"):
        d.engine.audit()
    d.engine.guard.strict = False
    report = d.engine.audit()
    assert not report.ok and d.engine.guard.failures == 2
