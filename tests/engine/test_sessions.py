"""Scenarios S1-S11 of docs/scenarios.md on the scheduling core."""

import msgspec
import numpy as np
import pytest

from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.records.request import Status
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import SessionError
from shared.messages.envelope import I4, array
from shared.messages.ownership import SessionRecord
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver

rng = np.random.default_rng(0)


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def close_all(d: Driver) -> None:
    for sid in list(d.engine.sessions.sessions):
        d.engine.sessions.close(sid)
    d.run()
    d.assert_idle_clean()


def test_s1_inheritance():
    d = Driver()
    sid = d.engine.sessions.open().sid
    history: list[int] = []
    previous = None
    for k in range(3):
        new = text(5 + k, k)
        turn = d.run_turn(sid, new, max_new=12)
        assert turn.status is Status.FINISHED and len(turn.output) == 12
        expected = 0 if previous is None else len(previous.prompt) + len(previous.output) - 1
        assert turn.cached_tokens == expected
        assert turn.output == reference(history + new, 12, VOCAB)
        history += new + turn.output
        previous = turn
    close_all(d)


def test_s1_stop_token_keeps_every_computed_position():
    d = Driver(eos=None)
    sid = d.engine.sessions.open().sid
    first = d.run_turn(sid, text(6, 1), max_new=12)
    stop = first.output[4]
    d2 = Driver()
    sid2 = d2.engine.sessions.open().sid
    t1 = d2.run_turn(sid2, text(6, 1), max_new=12, stop_token_ids=(stop,))
    assert t1.finish_reason.type == "stop" and t1.output[-1] == stop
    t2 = d2.run_turn(sid2, text(3, 2), max_new=4)
    assert t2.cached_tokens == len(t1.prompt) + len(t1.output) - 1  # the stop token is trimmed
    assert t2.prompt.tolist() == t1.prompt.tolist() + t1.output[:-1] + text(3, 2)
    close_all(d)
    close_all(d2)


def test_s2_a_turn_rejected_before_it_runs_changes_nothing():
    d = Driver(context=256)
    sid = d.engine.sessions.open().sid
    t1 = d.run_turn(sid, text(8, 1))
    before = d.pools.ledger.events.next_seq
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        d.turn(sid, text(4, 2), max_new=-1)
    with pytest.raises(InvalidRequest, match="context length 256"):
        d.turn(sid, text(300, 3))
    assert d.pools.ledger.events.next_seq == before
    t2 = d.run_turn(sid, text(4, 4))
    assert t2.prompt.tolist()[: len(t1.prompt) + 12] == t1.prompt.tolist() + t1.output
    assert t2.cached_tokens > 0
    close_all(d)


def abort_mid_decode(d: Driver, sid: str, tokens, after_steps: int = 3):
    req = d.turn(sid, tokens, max_new=50)
    for _ in range(after_steps):
        d.step()
    assert req.status is Status.RUNNING and 0 < len(req.output) < 50
    d.engine.abort(req.rid, "client disconnected")
    assert req.status is Status.ABORTED
    return req


def test_s3_first_turn_aborted_leaves_an_empty_session():
    d = Driver()
    sid = d.engine.sessions.open().sid
    abort_mid_decode(d, sid, text(10, 1))
    session = d.engine.sessions.get(sid)
    assert session.slots is None and len(session.history) == 0
    t = d.run_turn(sid, text(5, 2))
    assert t.prompt.tolist() == text(5, 2) and t.cached_tokens == 0
    close_all(d)


@pytest.mark.parametrize("page_size", [1, 16])
def test_s4_nth_turn_aborted_keeps_the_cache(page_size):
    d = Driver(page_size=page_size)
    sid = d.engine.sessions.open().sid
    t1 = d.run_turn(sid, text(20, 1))
    abort_mid_decode(d, sid, text(7, 2))
    t3 = d.run_turn(sid, text(9, 3))
    history = t1.prompt.tolist() + t1.output
    assert t3.prompt.tolist() == history + text(9, 3)
    assert t3.cached_tokens >= len(history) - 1
    fresh = Driver(page_size=page_size)
    fsid = fresh.engine.sessions.open().sid
    fresh.run_turn(fsid, text(20, 1))
    assert fresh.run_turn(fsid, text(9, 3)).output == t3.output
    close_all(d)
    close_all(fresh)


@pytest.mark.parametrize("page_size", [1, 16])
def test_s5_overshoot_is_trimmed(page_size):
    d = Driver(page_size=page_size)
    sid = d.engine.sessions.open().sid
    req = d.turn(sid, text(30, 1), max_new=8)
    while True:
        plan = d.engine.plan_step()
        sampled = d.model.run(plan)
        if len(req.output) == 7:  # the last step: over-allocate past the finish, as a retry would
            row = req.slots.row.slot
            d.pools.kv.extend(np.array([row]), np.array([d.pools.rows.lens[row] + 6]))
        if d.engine.complete_step(plan, sampled):
            break
    session = d.engine.sessions.get(sid)
    row = session.slots.row.slot
    assert session.cached_len == len(req.prompt) + len(req.output) - 1
    assert d.pools.rows.lens[row] == session.cached_len
    held = d.pools.kv_pages.held_by_kind()[OwnerKind.SESSION]  # its own pages ...
    borrowed = session.slots.borrowed // page_size  # ... after the prompt it shares
    assert held + borrowed == -(-session.cached_len // page_size)
    close_all(d)


@pytest.mark.parametrize("logprobs", [False, True])
def test_s6_concurrency(logprobs):
    d = Driver(rows=8, mamba_slots=40)
    for round_ in range(10):
        sids = [d.engine.sessions.open().sid for _ in range(6)]
        histories = {sid: [] for sid in sids}
        for k in range(5):
            turns = {
                sid: d.turn(sid, text(3 + k, round_ * 100 + k), max_new=4, logprobs=logprobs)
                for sid in sids
            }
            d.run()
            for sid, t in turns.items():
                assert t.status is Status.FINISHED
                assert t.output == reference(
                    histories[sid] + text(3 + k, round_ * 100 + k), 4, VOCAB
                )
                histories[sid] += text(3 + k, round_ * 100 + k) + t.output
        for sid in sids:
            d.engine.sessions.close(sid)
        d.run()
        d.assert_idle_clean()


def test_s7_abort_heavy_chunked_prefill():
    d = Driver(
        page_size=16, context=512, chunk=32, step_tokens=96, kv_pages=200, rows=12, mamba_slots=48
    )
    sids = [d.engine.sessions.open().sid for _ in range(4)]
    for i, sid in enumerate(sids):
        d.turn(sid, text(40, i), max_new=4)
    d.run()
    plain_prefix = text(50, 99)
    for r in range(8):
        turns = [d.turn(sid, text(20, r * 10 + i), max_new=6) for i, sid in enumerate(sids)]
        plains = [d.generate(plain_prefix + text(5, 1000 + r * 2 + j), max_new=3) for j in range(2)]
        for _ in range(2):
            d.step()
        for t in turns[r % 2 :: 2]:
            d.engine.abort(t.rid, "abort")
        d.run()
        assert all(p.status is Status.FINISHED for p in plains)
        for i, sid in enumerate(sids):
            with pytest.raises(InvalidRequest, match="context length 512"):
                d.turn(sid, text(600, 7))
            recovery = d.run_turn(sid, text(3, 500 + r * 10 + i), max_new=2)
            assert recovery.status is Status.FINISHED and recovery.cached_tokens > 0
            if len(d.engine.sessions.get(sid).history) > 380:
                d.engine.sessions.close(sid)
                sids[i] = d.engine.sessions.open().sid
                d.run_turn(sids[i], text(40, 77 + r), max_new=4)
    close_all(d)


def test_s8_close_during_a_turn():
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(10, 1))
    req = d.turn(sid, text(5, 2), max_new=10)
    d.step()
    d.step()
    d.engine.sessions.close(sid)
    assert req.status is Status.RUNNING and req.slots is not None  # nothing freed under it
    with pytest.raises(SessionError, match="closed"):
        d.turn(sid, text(3, 3))
    d.run()
    assert req.status is Status.FINISHED and len(req.output) == 10
    with pytest.raises(SessionError, match="closed"):
        d.turn(sid, text(3, 3))
    d.assert_idle_clean()
    assert d.pools.mamba.free_count == d.pools.mamba.capacity - sum(
        1 for n in d.engine.cache.nodes() if n.mamba
    )


def test_s9_history_cannot_be_rewritten():
    d = Driver()
    sid = d.engine.sessions.open(streaming=True).sid
    d.run_turn(sid, text(10, 1))
    session = d.engine.sessions.get(sid)
    before = session.history.copy()
    for bad in ({"offset": 3}, {"replace": True}, {"drop_previous_output": True}):
        with pytest.raises(SessionError, match="streaming session"):
            d.turn(sid, text(3, 2), session_params=bad)
    assert np.array_equal(session.history, before)
    close_all(d)


def test_s10_lent_slots_are_counted_once():
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(10, 1))
    d.turn(sid, text(5, 2), max_new=6)
    d.step()  # the session's slots are now the turn's
    report = d.engine.check()
    assert report.ok, report.problems
    assert report.counts["mamba"]["session"] == 1  # the rollback copy, not the lent state
    assert report.counts["req"]["request"] == 1 and report.counts["req"]["session"] == 0
    d.run()
    close_all(d)


def test_s11_equivalence_over_random_turns():
    r = np.random.default_rng(5)
    d = Driver(page_size=4, chunk=8, step_tokens=24)
    sid = d.engine.sessions.open().sid
    history: list[int] = []
    for _k in range(8):
        new = r.integers(1, VOCAB, size=int(r.integers(1, 30))).tolist()
        n = int(r.integers(1, 15))
        t = d.run_turn(sid, new, max_new=n)
        assert t.output == reference(history + new, n, VOCAB)
        history += new + t.output
    close_all(d)


def test_a_second_concurrent_turn_is_refused_and_changes_nothing():
    d = Driver()
    sid = d.engine.sessions.open().sid
    first = d.turn(sid, text(5, 1), max_new=5)
    d.step()
    before = d.pools.ledger.events.next_seq
    with pytest.raises(SessionError, match="already has a turn in flight") as err:
        d.turn(sid, text(3, 2))
    assert err.value.kind == "busy"
    assert d.pools.ledger.events.next_seq == before and len(d.engine.waiting) == 0
    d.run()
    assert first.status is Status.FINISHED
    close_all(d)


def test_idle_sessions_expire_after_their_timeout():
    d = Driver()
    now = [0.0]
    d.engine.sessions.clock = lambda: now[0]
    keep = d.engine.sessions.open("keep").sid
    brief = d.engine.sessions.open("brief", timeout=10).sid
    d.run_turn(brief, text(5, 1), max_new=3)
    now[0] = 11.0
    d.step()  # planning runs the expiry
    assert d.engine.sessions.expire() == [] and brief not in d.engine.sessions.sessions
    with pytest.raises(SessionError, match="closed"):
        d.turn(brief, text(2, 2))
    assert keep in d.engine.sessions.sessions
    close_all(d)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_lost_device_is_rebuilt_from_history(page_size):
    """Executor restart: the step in flight is abandoned, sessions lose their state but
    not their history, plain requests continue; every output still equals one-shot."""
    d = Driver(page_size=page_size)
    sid = d.engine.sessions.open().sid
    t1 = d.run_turn(sid, text(20, 1), max_new=6)
    t2 = d.turn(sid, text(5, 2), max_new=8)
    plain = d.generate(text(40, 3), max_new=8)
    for _ in range(3):
        d.step()
    plan = d.engine.plan_step()  # in flight when the executor dies
    d.engine.device_lost()
    d.model = type(d.model)(d.pools, VOCAB, d._sequence)  # a new executor: empty pools
    assert d.engine.check(idle=False).ok
    assert plan is not None and not d.engine.in_flight
    d.run()
    history = t1.prompt.tolist() + t1.output
    assert t2.status is Status.FINISHED and t2.output == reference(history + text(5, 2), 8, VOCAB)
    assert plain.output == reference(text(40, 3), 8, VOCAB)
    t3 = d.run_turn(sid, text(3, 4), max_new=4)
    assert t3.cached_tokens > 0
    close_all(d)


def test_records_claiming_one_slot_twice_are_taken_back_from_history_only():
    """A store that kept a record it should have replaced (two records naming one row)
    must not keep a restarted scheduler from starting (it crash-looped on the ownership
    error): both sessions come back with their history only, counted, and their next
    turns re-prefill to the right tokens; a third session keeps its device state."""
    d = Driver()
    sids = [d.engine.sessions.open().sid for _ in range(3)]
    histories = {}
    for i, sid in enumerate(sids):
        prompt = text(6, 50 + i)
        histories[sid] = prompt + d.run_turn(sid, prompt, max_new=4).output
    records = {r.sid: r for r in d.engine.sessions.records.all_records()}
    a, b, kept = sids
    assert records[a].row is not None and records[b].row != records[a].row
    records[b] = msgspec.structs.replace(records[b], row=records[a].row)
    again = Driver()
    again.model = d.model  # the same executor: device contents survive
    again.model.sequence_of = again._sequence
    again.engine.sessions.rebuild(list(records.values()), state_valid=True)
    sessions = again.engine.sessions
    assert sessions.conflicting_records == 2
    assert sessions.sessions[a].slots is None and sessions.sessions[b].slots is None
    assert sessions.sessions[kept].slots is not None
    assert not again.engine.check().problems
    for sid in sids:
        new = text(3, 90)
        turn = again.run_turn(sid, new, max_new=4)
        assert turn.output == reference(histories[sid] + new, 4, VOCAB)
        assert turn.cached_tokens == (0 if sid != kept else len(histories[sid]) - 1)
    close_all(again)


def test_an_id_closed_here_does_not_block_a_later_session_of_that_id_arriving():
    """Closed here once, "x" lived on elsewhere (or was opened anew there); when the
    directory moves it here, it arrives (the closed-id memory refused it before)."""
    d = Driver()
    sessions = d.engine.sessions
    sessions.open("x")
    sessions.close("x")
    with pytest.raises(SessionError):
        sessions.open("x")  # a client's open of a closed id: still refused
    record = SessionRecord(sid="x", history=array(np.arange(1, 6), I4))
    session = sessions.arrive(record, source="7", epoch=2)
    assert session.history.tolist() == [1, 2, 3, 4, 5] and session.epoch == 2
    turn = d.run_turn("x", text(3, 4), max_new=3)
    assert turn.output == reference([1, 2, 3, 4, 5, *text(3, 4)], 3, VOCAB)
    close_all(d)


def test_only_the_attempt_that_brought_a_copy_finds_it_again_on_arrival():
    """A move retried (the same attempt) finds its copy; a later attempt of the same move
    (same source, same epoch: the first was aborted and its settle lost) replaces the
    stale copy by the current record, as does an attempt without a nonce."""
    d = Driver()
    sessions = d.engine.sessions
    old = SessionRecord(sid="x", history=array(np.arange(1, 6), I4))
    first = sessions.arrive(old, source="7", epoch=2, move="aa")
    assert sessions.arrive(old, source="7", epoch=2, move="aa") is first  # a retry
    current = SessionRecord(sid="x", history=array(np.arange(1, 10), I4))
    second = sessions.arrive(current, source="7", epoch=2, move="bb")
    assert second is not first and second.history.tolist() == list(range(1, 10))
    assert sessions.arrive(current, source="7", epoch=2) is not second  # no nonce: copied
    close_all(d)


def test_a_request_that_needs_a_waiting_turn_s_room_takes_it_instead_of_waiting_for_ever():
    """The head of the queue needs pages held only by a session whose turn waits behind
    it. The session's state is not in use until its turn is admitted, so pressure moves
    it off the device (here: drops it) as an idle session's; the turn then re-prefills
    from the cache. Before this rule the two waited for each other for ever."""
    d = Driver(page_size=1, kv_pages=64, mamba_slots=14, rows=6, context=64, chunk=8)
    sid = d.engine.sessions.open("s").sid
    first = list(range(1, 31))
    out = d.run_turn(sid, first, max_new=3).output
    shared = list(range(100, 130))
    d.generate(shared, max_new=1)
    d.run()
    assert d.pools.kv_pages.free_count < 6  # the session and the cached prompt fill the pool
    head = d.generate(shared + [7] * 6, max_new=1)
    turn = d.turn(sid, [9, 9, 9, 9], max_new=2)
    d.run(max_steps=200)
    assert head.output == reference(shared + [7] * 6, 1, VOCAB)
    assert turn.output == reference(first + out + [9, 9, 9, 9], 2, VOCAB)
    assert d.engine.sessions.states_dropped == 1
    d.engine.sessions.close(sid)
    d.assert_idle_clean()
