"""Speculative decoding as the scheduler commits it, against the data model (whose state
is a hash of every token fed, so a wrong slot committed changes every later token).

A test-only drafter proposes the data model's own greedy continuation, spoilt at a
position that cycles through every acceptance pattern (0 to n drafts accepted, a
rejection at each position). Greedy outputs must equal a one-shot generation for plain
requests, shared prefixes, sessions, stops inside accepted drafts, aborts and retracts;
the engine's integrity check runs after every step (the driver's), and nothing is held
once idle. Then each bug of the peers' that this design rules out is planted, and the
check that must see it is shown to fail.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from services.scheduler.allocators import request_slots
from services.scheduler.allocators.pools import PoolConfig
from services.scheduler.allocators.spec_slots import SpecSlots
from services.scheduler.engine import admission
from services.scheduler.engine.completion import Completion
from services.scheduler.engine.drafts import PromptNgram, RepeatLast
from services.scheduler.ownership.errors import PoolExhausted
from services.scheduler.records.request import Request
from services.scheduler.records.row_plan import RowPlan
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver
from tests.engine.test_sessions import text


class ForcedDrafts:
    """The true continuation, spoilt at draft position k (none spoilt when k == n), k
    cycling over 0..n so that every pattern of acceptance occurs."""

    by_head = False

    def __init__(self, stops: tuple[int, ...] = ()) -> None:
        self.calls = 0
        self.patterns: Counter[tuple[int, int]] = Counter()  # (drafts, spoilt at)
        self.stops = stops

    def propose(self, req: Request, n: int) -> list[int]:
        truth = reference(list(req.sequence), n, VOCAB)
        k = self.calls % (n + 1)
        self.calls += 1
        self.patterns[(n, k)] += 1
        return [(t + 1) % VOCAB if i == k else t for i, t in enumerate(truth)]


def speculating(depth: int = 1, drafts: int = 3, **kw) -> tuple[Driver, ForcedDrafts]:
    forced = ForcedDrafts()
    return Driver(page_size=4, depth=depth, drafter=forced, drafts=drafts, **kw), forced


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_every_acceptance_pattern_gives_the_one_shot_output(depth):
    d, forced = speculating(depth)
    reqs = [d.generate(text(9 + i, i), max_new=30) for i in range(4)]
    d.run()
    for req in reqs:
        assert req.output == reference(list(req.prompt), 30, VOCAB)
    assert {k for (n, k) in forced.patterns if n == 3} == {0, 1, 2, 3}
    accepted = d.engine.completion.accepted
    assert accepted.steps > 0 and 1.0 < accepted.mean_length < 4.0
    d.assert_idle_clean()


def test_sessions_and_shared_prefixes_resume_the_committed_state():
    d, _ = speculating()
    sid = d.engine.sessions.open("s").sid
    history: list[int] = []
    for t in range(4):
        new = text(5, 40 + t)
        req = d.run_turn(sid, new, max_new=9)
        history += list(new)
        assert req.output == reference(history, 9, VOCAB)
        history += req.output
    shared = text(20, 7)
    first = d.generate(shared, max_new=12)
    d.run()
    again = d.generate(list(shared) + first.output + text(3, 8), max_new=12)
    d.run()
    assert again.cached_tokens > 0
    assert again.output == reference(list(again.prompt), 12, VOCAB)
    d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_a_stop_token_inside_accepted_drafts_ends_there_and_keeps_no_later_state():
    """The one-shot output with stop tokens, its stop inside a verify row's accepted
    drafts; the session's next turn starts from the state of exactly what it kept."""
    plain = reference(list(text(8, 3)), 40, VOCAB)
    stop = plain[7]
    d, _ = speculating(eos=stop)
    sid = d.engine.sessions.open("s").sid
    req = d.run_turn(sid, text(8, 3), max_new=40)
    assert req.output == reference(list(text(8, 3)), 40, VOCAB, stops={stop})
    nxt = d.run_turn(sid, text(4, 5), max_new=10)
    history = list(text(8, 3)) + req.committed_output() + list(text(4, 5))
    assert nxt.output == reference(history, 10, VOCAB, stops={stop})
    d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_max_new_tokens_and_the_context_bound_the_drafts():
    d, _ = speculating(context=64)
    short = d.generate(text(9, 1), max_new=5)
    long = d.generate(text(50, 2), max_new=40)
    d.run()
    assert short.output == reference(list(text(9, 1)), 5, VOCAB)
    assert len(long.output) == 64 - 50
    d.assert_idle_clean()


@pytest.mark.parametrize("depth", [0, 1])
def test_aborts_and_retracts_mid_verify_lose_nothing(depth):
    """Under memory pressure, one request aborted and another retracted while a verify
    row of theirs is in flight: the others' outputs are one-shot's, the retracted one's
    too once it re-prefills."""
    d, _ = speculating(
        depth=depth, kv_pages=30, mamba_slots=30, rows=4, step_tokens=24, context=120, chunk=8
    )
    reqs = [d.generate(text(12, i), max_new=25) for i in range(6)]
    verifying = lambda r: any(w.drafts for w in r.inflight)  # noqa: E731
    aborted = retracted = None
    for _ in range(400):
        if len(d.engine.in_flight) <= depth:
            d.plan_ahead()  # a step left in flight, as the service awaits its result
        if aborted is None and (hit := next(filter(verifying, d.engine.running), None)):
            aborted = hit.rid
            d.engine.abort(hit.rid)
        elif retracted is None and (hit := next(filter(verifying, d.engine.running), None)):
            retracted = hit.rid
            d.engine.retract(hit)
        d.step()
        if d.engine.idle:
            break
    assert aborted and retracted
    for req in reqs:
        if req.rid != aborted:
            assert req.output == reference(list(req.prompt), 25, VOCAB), req.rid
    d.assert_idle_clean()


def test_greedy_drafters_change_nothing_but_the_step_count():
    """The n-gram and repeat-last drafts: the same outputs as no speculation."""
    prompts = [list(text(6, i)) * 3 for i in range(3)]
    outputs = {}
    for name, drafter in (("off", None), ("ngram", PromptNgram()), ("last", RepeatLast())):
        d = Driver(page_size=4, drafter=drafter)
        reqs = [d.generate(p, max_new=20) for p in prompts]
        d.run()
        outputs[name] = [r.output for r in reqs]
        d.assert_idle_clean()
    assert outputs["ngram"] == outputs["off"] == outputs["last"]


def test_a_planted_commit_of_the_unverified_state_is_caught(monkeypatch):
    """vLLM #57128 and #43559's kind: the state after every draft kept whatever was
    accepted. The data model's check of each row's starting state fails at once."""

    def commit_all(self, state, written, kept, drafts):
        state.commit(written)

    monkeypatch.setattr(SpecSlots, "commit", commit_all)
    d, _ = speculating()
    d.generate(text(9, 1), max_new=30)
    with pytest.raises(AssertionError, match="starts from a wrong state"):
        d.run()


def cached_tokens_of_a_multi_turn_workload(drafter) -> list[int]:
    """An agent loop without sessions (each request's prompt is the last one's prompt,
    output and new input: the prefix cache serves it from decode snapshots) beside a
    session's turns; each request's cached tokens, in order."""
    d = Driver(page_size=4, track_interval=8, drafter=drafter)
    cached = []
    prompt = list(text(10, 1))
    sid = d.engine.sessions.open("s").sid
    for t in range(4):
        req = d.generate(prompt, max_new=21)
        turn = d.turn(sid, text(5, 20 + t), max_new=13)
        d.run()
        cached += [req.cached_tokens, turn.cached_tokens]
        prompt += req.output + list(text(4, 30 + t))
    d.engine.sessions.close(sid)
    d.assert_idle_clean()
    return cached


def test_prefix_reuse_is_the_same_with_speculation_on(monkeypatch):
    """SGLang #32459's figure: cached tokens over a multi-turn workload, on and off; and
    a planted version (verify rows never keep their snapshots) that loses reuse."""
    off = cached_tokens_of_a_multi_turn_workload(None)
    assert sum(off) > 0
    assert cached_tokens_of_a_multi_turn_workload(ForcedDrafts()) == off

    real = Completion._verified

    def losing_snapshots(self, req, row, tokens, logprobs):  # the planted bug
        if row.wire.snapshot_slot:
            req.slots.track.cancel(row.wire.snapshot_slot)
            wire = msgspec.structs.replace(row.wire, snapshot_slot=0, snapshot_len=0)
            row = RowPlan(wire, row.prefill, row.step)
        real(self, req, row, tokens, logprobs)

    monkeypatch.setattr(Completion, "_verified", losing_snapshots)
    assert cached_tokens_of_a_multi_turn_workload(ForcedDrafts()) != off


def test_sessions_moved_between_tiers_with_speculation_resume_exactly():
    """Twelve sessions over a device that holds four: each hibernates to the host tier
    or spills to disk and comes back; every row's starting state is checked."""
    d = Driver(
        page_size=4,
        kv_pages=64,
        mamba_slots=24,
        rows=4,
        context=256,
        step_tokens=128,
        host_pages=24,
        host_slots=3,
        disk_slots=32,
        drafter=ForcedDrafts(),
    )
    d.model.sequence_of = d._sequence
    sids = [d.engine.sessions.open().sid for _ in range(12)]
    histories = {}
    for rounds in range(2):
        for i, sid in enumerate(sids):
            new = text(12 if not rounds else 4, 100 * rounds + i)
            req = d.run_turn(sid, new, max_new=9)
            history = histories.get(sid, []) + list(new)
            assert req.output == reference(history, 9, VOCAB), sid
            histories[sid] = history + req.output
    moved = d.engine.sessions.moves.moved
    assert moved["hibernate"] > 0 and moved["restore"] > 0 and moved["spill"] > 0
    for sid in sids:
        d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_an_executor_lost_while_a_verify_step_runs_changes_nothing_but_time():
    """The executor dies while a verify row runs: the request's committed state is the
    one before that step, the request is planned again, and the same output follows."""
    d, _ = speculating(depth=1)
    sid = d.engine.sessions.open("s").sid
    req = d.turn(sid, text(10, 1), max_new=20)
    while not any(r.drafts for r in req.inflight):
        d.step()
    assert d.engine.device_lost(suspect=False) == []
    d.model = type(d.model)(d.pools, VOCAB, d._sequence)
    d.run()
    assert req.output == reference(list(text(10, 1)), 20, VOCAB)
    d.engine.sessions.close(sid)
    d.assert_idle_clean()


@pytest.mark.parametrize("ops_ran", [False, True])
def test_a_refused_verify_step_aborts_its_turn_and_the_session_keeps_its_state(ops_ran):
    d, _ = speculating(depth=1)
    sid = d.engine.sessions.open("s").sid
    first = d.run_turn(sid, text(10, 1), max_new=8)
    history = list(text(10, 1)) + first.output
    req = d.turn(sid, text(5, 2), max_new=20)
    while not any(r.drafts for r in req.inflight):
        d.step()
    ended = d.engine.step_refused(d.engine.in_flight[0], "a planted refusal", ops_ran)
    assert req in ended and req.finish_reason.type == "abort"
    d.run()
    after = d.run_turn(sid, text(4, 3), max_new=10)
    assert after.output == reference(history + list(text(4, 3)), 10, VOCAB)
    d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_a_planted_piecewise_slot_allocation_is_caught(monkeypatch):
    """SGLang #34676's kind: a request's Mamba slots taken piecewise. Unplanted, the
    pressure below runs clean (admission checks room for every slot a speculating
    request needs, and a failed take gives back what it took). Planted, the room check
    forgets the speculative slots and a failed take keeps what it took: the take fails
    half-way, and the integrity check names the slots nobody claims."""
    d, _ = speculating(depth=1, mamba_slots=18, rows=4)
    reqs = [d.generate(text(9, i), max_new=10) for i in range(4)]
    d.run()
    assert all(r.output == reference(list(r.prompt), 10, VOCAB) for r in reqs)

    without_spec = property(lambda self: self.working_slots + self.track_slots)
    monkeypatch.setattr(PoolConfig, "request_mamba_slots", without_spec)
    real_admit, real_give_back = request_slots.admit, request_slots._give_back

    def keeping_what_it_took(pools, rid):
        monkeypatch.setattr(request_slots, "_give_back", lambda *args: None)
        try:
            return real_admit(pools, rid)
        finally:
            monkeypatch.setattr(request_slots, "_give_back", real_give_back)

    monkeypatch.setattr(admission, "admit", keeping_what_it_took)
    d, _ = speculating(depth=1, mamba_slots=18, rows=4)
    for i in range(4):
        d.generate(text(9, i), max_new=10)
    with pytest.raises(PoolExhausted):
        d.run()
    report = d.engine.check()
    assert not report.ok and any("claimed by no holder" in p for p in report.problems)
