"""Pipelined scheduling (step N+1 planned while step N is in flight), case by case. The
random interleavings are in test_engine_machine.py; these pin the named situations."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.records.request import Status
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver
from tests.engine.test_sessions import close_all, text


def first_new_token(tokens: list[int], at: int) -> int:
    """A position from `at` on whose token did not occur before it, and that token."""
    for i in range(at, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no fresh token in the reference")


def test_a_decode_row_feeds_the_token_the_step_in_flight_samples():
    d = Driver()
    req = d.generate(text(10, 1), max_new=5)
    d.step()  # prefill planned
    d.step()  # first decode planned while the prefill is in flight; the prefill completes
    row = d.engine.in_flight[0].rows[0]
    assert row.future and row.tokens.tolist() == [-1] and row.start == 10
    assert row.mamba_slot != row.mamba_out  # it reads the prefill's result, writes the other
    d.run()
    assert req.output == reference(text(10, 1), 5, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_stop_token_sampled_while_the_next_steps_run_leaves_the_session_state_intact(
    depth: int,
):
    """The turn samples its stop token in step N; the `depth` steps after it, already
    planned, feed that token and the ones after. Their rows are dropped, the session keeps
    the state step N committed (none of them wrote it), and the next turn continues
    exactly as a one-shot generation over the trimmed history."""
    d = Driver(depth=depth)
    sid = d.engine.sessions.open().sid
    prompt = text(12, 1)
    ref = reference(prompt, 12, VOCAB)
    at = first_new_token(ref, 3)
    turn = d.turn(sid, prompt, max_new=12, stop_token_ids=(ref[at],))
    dropped = []
    while turn.status is not Status.FINISHED:
        d.step()
        dropped += [r for p in d.engine.in_flight for r in p.rows if r.dropped]
    assert turn.output == ref[: at + 1]
    assert [r.start for r in dropped] == [len(prompt) + at + k for k in range(depth)]
    assert all(r.future for r in dropped)
    session = d.engine.sessions.get(sid)
    history = prompt + ref[:at]
    assert session.history.tolist() == history and session.cached_len == len(history)
    assert session.slots.working.held not in [r.mamba_out for r in dropped]  # speculative
    d.run()
    nxt = d.run_turn(sid, text(4, 2), max_new=6)
    assert nxt.cached_tokens == len(history)
    assert nxt.output == reference(history + text(4, 2), 6, VOCAB)
    close_all(d)


def test_a_request_at_its_token_limit_is_not_planned_past_it():
    d = Driver()
    req = d.generate(text(6, 1), max_new=2)
    d.step()  # prefill (samples token 1)
    d.step()  # decode of token 1 (samples token 2, the last)
    d.step()  # nothing more may be planned for it
    rows = [r for p in d.engine.in_flight for r in p.rows]
    assert all(r.rid != req.rid for r in rows) or req.done
    d.run()
    assert req.output == reference(text(6, 1), 2, VOCAB)
    d.assert_idle_clean()


def test_a_refused_step_ends_its_requests_and_requeues_those_planned_after_it():
    d = Driver()
    a = d.generate(text(9, 1), max_new=4)
    first = d.engine.plan_step()  # a's prefill
    b = d.generate(text(7, 2), max_new=4)
    second = d.engine.plan_step()  # on top of it: a's first decode (future), b's prefill
    assert second.after == first.step_id
    assert {r.rid for r in second.rows} == {a.rid, b.rid}
    ended = d.engine.step_refused(first, "Mamba slots [0] must lie in 1..64")
    assert not d.engine.in_flight and all(r.dropped for r in second.rows)
    assert ended == [a] and a.status is Status.ABORTED
    assert "executor refused the step" in a.finish_reason.message
    assert b.status is Status.WAITING and b.computed == 0  # re-queued: it re-prefills
    d.run()
    assert b.output == reference(text(7, 2), 4, VOCAB)
    d.assert_idle_clean()


def test_outputs_do_not_depend_on_the_pipeline_depth():
    outputs = []
    for depth in (0, 1, 2):
        d = Driver(page_size=4, depth=depth, chunk=8, track_interval=8)
        sid = d.engine.sessions.open().sid
        reqs = [d.generate(np.arange(1, 30) % 50 + i, max_new=7) for i in range(3)]
        turns = [d.run_turn(sid, text(15, i), max_new=5) for i in range(1, 4)]
        d.run()
        outputs.append([r.output for r in reqs + turns])
        close_all(d)
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_request_short_of_room_waits_for_its_step_in_flight_instead_of_retracting():
    """Two requests share a prefix on a pool of one context, so that the cache's pages
    are all locked by the two of them. The one short of room for its next chunk while its
    last step is in flight used to retract itself, dropping that step, and be admitted
    again from the cache where it stood, every step, for ever (the other was retracted
    and admitted again alike). It now waits for its step, and both finish."""
    d = Driver(kv_pages=64, mamba_slots=14, rows=6, context=64, chunk=8, step_tokens=24)
    shared = text(20, 1)
    prompts = [shared + text(34, 2), shared + text(16, 3)]
    reqs = [d.generate(prompt, max_new=3) for prompt in prompts]
    d.run(max_steps=100)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output == reference(prompt, 3, VOCAB)
    d.assert_idle_clean()


def test_a_request_whose_step_is_in_flight_is_never_retracted_for_another():
    """Three requests, two sharing a prefix, need more pages than a pool of one context
    holds. Each time one had its last prefill step in flight (the step that ends it),
    the request behind it took its pages: its step was thrown away and it was admitted
    again from the cache, and the three did this to each other in turn for ever. A
    request with a step in flight is now never a victim, and all three finish."""
    d = Driver(kv_pages=64, mamba_slots=14, rows=6, context=64, chunk=8, step_tokens=24)
    a, b = text(24, 4), text(20, 5)
    prompts = [[*a, 1, 1], [*b, 1, 1, 1, 1], [*a, 1]]
    reqs = [d.generate(prompt, max_new=n) for prompt, n in zip(prompts, [1, 3, 1], strict=True)]
    d.run(max_steps=100)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output == reference(prompt, req.params.max_new_tokens, VOCAB)
    d.assert_idle_clean()


def test_rows_in_flight_that_do_not_run_on_from_computed_fail_the_engine_check():
    """`Request.planned` is the last row in flight's end; the check proves the rows run on
    from `computed`, so a path that moved `computed` under them is named, not believed."""
    d = Driver()
    req = d.generate(text(10, 1), max_new=5)
    d.step()
    d.step()  # a decode row in flight behind the prefill's
    assert d.engine.check().ok and req.planned == req.inflight[-1].end
    req.computed += 1
    problems = d.engine.check().problems
    assert any(f"request {req.rid}: a row in flight starts at" in p for p in problems), problems


def test_two_steps_deep_a_request_steps_around_three_working_slots():
    """At depth 2 a decode row is planned while two steps of its request are in flight:
    each reads what the one before writes and writes a slot neither of the two in flight
    writes, so whichever of them turns out to be the last leaves its state intact."""
    d = Driver(depth=2)
    req = d.generate(text(10, 1), max_new=8)
    d.plan_ahead()  # the prefill
    d.plan_ahead()  # a decode fed the prefill's token
    d.plan_ahead()  # a decode fed that decode's token
    rows = [p.rows[0] for p in d.engine.in_flight]
    assert [r.future for r in rows] == [False, True, True]
    assert [r.start for r in rows] == [0, 10, 11]
    writes = [r.mamba_out for r in rows]
    assert len(set(writes)) == 3 and set(writes) == set(req.slots.state.held())
    assert [r.mamba_slot for r in rows[1:]] == writes[:2]
    d.run()
    assert req.output == reference(text(10, 1), 8, VOCAB)
    d.assert_idle_clean()


def test_two_steps_deep_a_penalised_request_is_planned_with_one_token_in_flight_at_most():
    """The executor counts penalties over the output the scheduler knows and the one
    future token it fills in: a row planned while two tokens are in flight would miss one.
    So a penalised request is planned with one token in flight at most; a plain one with
    two."""
    d = Driver(depth=2)
    req = d.generate(text(10, 1), max_new=6, repetition_penalty=1.3)
    plain = d.generate(text(10, 2), max_new=6)
    most = {req.rid: 0, plain.rid: 0}
    plan_step = d.engine.plan_step

    def planned_counting():
        before = {r.rid: r.pending_tokens for r in (req, plain) if not r.done}
        plan = plan_step()
        for row in plan.rows if plan is not None else []:
            most[row.rid] = max(most[row.rid], before[row.rid])
        return plan

    d.engine.plan_step = planned_counting
    d.run()
    assert most == {req.rid: 1, plain.rid: 2}
    assert plain.output == reference(text(10, 2), 6, VOCAB)
    d.assert_idle_clean()


def test_two_steps_deep_a_request_missing_from_the_last_step_waits_for_its_token():
    """A future token is filled in from the step just before only: a request whose last
    row is in an older step in flight is not planned until that step completes."""
    d = Driver(depth=2)
    a = d.generate(text(10, 1), max_new=6)
    d.plan_ahead()  # a's prefill
    b = d.generate(text(10, 2), max_new=6)
    d.engine.queue.running.remove(a)  # a sits out the next step, as under a full budget
    d.plan_ahead()  # b's prefill only
    d.engine.queue.running.insert(0, a)
    third = d.engine.plan_step()
    assert {r.rid for r in third.rows} == {b.rid}  # b's decode; a waits for its token
    d.run()
    assert a.output == reference(text(10, 1), 6, VOCAB)
    assert b.output == reference(text(10, 2), 6, VOCAB)
    d.assert_idle_clean()
