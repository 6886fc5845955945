"""Random interleavings of session turns (finished, aborted, disconnected, retracted, over-
long, prefill-only; chat turns that keep their reply's start), sessions forking from a
shared system prompt (borrowing the cache's prefix, donating junctions), turns that
branch from an earlier turn of their session (`rid`, `drop_previous_output`, `offset`:
resumed from a kept boundary), sessions forked from another's turn
(`SessionManager.fork`), plain requests sharing prefixes, prompts that need nearly the
whole pool, evictions under pressure (of junction states too), closes, session expiry,
and faults (a refused step with or without its deferred ops run, an executor lost with
its device state, a scheduler restarted from the session records with the same executor
or a new one), over page sizes 1 and 16, one step at a time and pipelined (the next step
planned while one is in flight), with periodic checkpoints or without, with a host tier
below the device or without, on pools small enough that retracts, evictions,
hibernations and dropped session states are routine. Where a request asks for them, stop
tokens end a sixth of the tokens, so requests often end while their next step is already
in flight.

After every step: the busy invariant. At the end: the idle invariant. Throughout: the
data model checks that every row starts from the state of exactly its own prefix, and
every finished output equals a one-shot generation over its history; a run that cannot
become idle (two requests waiting on each other) fails."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.records.request import Request, Status
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from tests.engine.data_model import reference, state_of
from tests.engine.driver import VOCAB, Driver
from tests.engine.test_reply_starts import truncating_turn
from tests.engine.test_speculation import ForcedDrafts

# 4 machines x 250 = 1,000 sequences by default; CUSTODY_ENGINE_EXAMPLES overrides.
EXAMPLES = int(os.environ.get("CUSTODY_ENGINE_EXAMPLES", "250"))
STOPS = tuple(range(0, VOCAB, 6))
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, [21, 22, 23, 24] * 5]
tokens = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24)


class EngineMachine(RuleBasedStateMachine):
    page_size = 1
    depth = 1
    checkpoint_every = 0  # periodic checkpoints, in pages; 0: none
    host_tier = False  # a host tier small enough that hibernations and drops both happen
    speculating = False  # verify rows of drafts spoilt at every position in turn

    def __init__(self) -> None:
        super().__init__()
        self.d = self.new_driver()
        self.histories: dict[str, list[int]] = {}
        # per session, its finished turns a branch may name: (rid, prompt, tokens)
        self.named: dict[str, list[tuple[str, list[int], list[int]]]] = {}
        self.turns: dict[str, tuple[Request, list[int]]] = {}  # rid -> (turn, expected prompt)
        self.reply_starts: dict[str, int] = {}  # rid -> reply start, of the chat turns
        self.plain: dict[str, Request] = {}
        self.opened = 0
        self.now = 0.0  # the sessions' clock, for expiry
        self.records: dict[str, dict] = {}  # what the session store holds, by session id

    def new_driver(self) -> Driver:
        ps = self.page_size
        d = Driver(
            page_size=ps,
            kv_pages=64 if ps == 1 else 8,  # one context: pressure is routine
            mamba_slots=14 + 9 * self.speculating,  # three drafts: three slots a request
            rows=6,
            context=64 if ps == 1 else 128,
            chunk=8 * ps if ps > 1 else 8,
            step_tokens=24 if ps == 1 else 48,
            track_interval=ps * 4,
            checkpoint_interval=ps * self.checkpoint_every,
            depth=self.depth,
            host_pages=(48 if ps == 1 else 6) if self.host_tier else 0,
            host_slots=3 if self.host_tier else 0,
            drafter=ForcedDrafts() if self.speculating else None,
        )
        d.engine.sessions.clock = lambda: self.now
        return d

    # ---- sessions ----
    @precondition(lambda self: len(self.histories) < 4)
    @rule()
    def open_session(self) -> None:
        self._open()

    def _open(self) -> str:
        self.opened += 1  # client-chosen ids keep generated data reproducible
        sid = self.d.engine.sessions.open(f"s{self.opened}", timeout=100).sid
        self.histories[sid], self.named[sid] = [], []
        return sid

    @precondition(lambda self: self.histories)
    @rule(
        data=st.data(),
        new=tokens,
        max_new=st.integers(0, 6),
        overlong=st.booleans(),
        stops=st.booleans(),
    )
    def turn(self, data, new, max_new, overlong, stops):
        sid = data.draw(st.sampled_from(sorted(self.histories)))
        session = self.d.engine.sessions.sessions.get(sid)
        if overlong:
            new = new * (200 // len(new))
        busy = session is not None and session.turn is not None
        too_long = len(self.histories[sid]) + len(new) >= self.d.engine.config.context_len
        before = self.d.pools.ledger.events.next_seq
        try:
            req = self.d.turn(sid, new, max_new=max_new, stop_token_ids=STOPS if stops else ())
        except InvalidRequest as err:
            assert busy or too_long, err
            assert self.d.pools.ledger.events.next_seq == before
            return
        assert not busy and not too_long
        self.turns[req.rid] = (req, self.histories[sid] + new)

    @precondition(lambda self: self.histories)
    @rule(data=st.data(), new=tokens, max_new=st.integers(0, 6))
    def chat_turn(self, data, new, max_new):
        """A chat turn whose template renders its reply otherwise once a message follows
        it (NemotronH's reasoning): its session keeps the state at the reply's start, a
        drawn position of the turn's prompt, and the page boundary before it goes to the
        cache (docs/ownership.md, "Kept boundaries"); its history becomes the canonical
        rendering, which differs from the prompt past the reply start."""
        sid = data.draw(st.sampled_from(sorted(self.histories)))
        history = self.histories[sid]
        prompt = history + new
        start = data.draw(st.integers(len(history) + 1, len(prompt)))
        chat = truncating_turn(prompt, start, base=len(history), seen=len(history))
        session = self.d.engine.sessions.sessions[sid]
        busy = session.turn is not None
        too_long = len(prompt) >= self.d.engine.config.context_len
        params = SamplingParams(max_new_tokens=max_new)
        try:
            req = self.d.engine.submit_turn(
                session, np.asarray(new), self.d.rid(), params, chat=chat
            )
        except InvalidRequest as err:
            assert busy or too_long, err
            return
        assert not busy and not too_long
        self.turns[req.rid] = (req, prompt)
        self.reply_starts[req.rid] = start

    @precondition(lambda self: len(self.histories) < 4)
    @rule(system=st.sampled_from(PREFIXES), own=tokens, max_new=st.integers(0, 6))
    def fork(self, system, own, max_new):
        """A session opens on a shared system prompt, as an agent of a fleet does: its
        first turn borrows whatever of the prompt the cache holds and donates the rest."""
        sid = self._open()
        req = self.d.turn(sid, system + own[:8], max_new=max_new)
        self.turns[req.rid] = (req, system + own[:8])

    def _named(self, data) -> tuple[str, str, list[int], list[int]]:
        sid = data.draw(st.sampled_from(sorted(s for s in self.histories if self.named[s])))
        rid, prompt, tokens = data.draw(st.sampled_from(self.named[sid]))
        return sid, rid, prompt, tokens

    @precondition(lambda self: any(self.named.get(s) for s in self.histories))
    @rule(data=st.data(), new=tokens, max_new=st.integers(0, 6), how=st.integers(0, 2))
    def branch(self, data, new, max_new, how):
        """A turn naming an earlier turn of its session: after its output, after its
        prompt alone, or cut at an offset (negative ones too; 0 cuts nothing)."""
        sid, rid, prompt, toks = self._named(data)
        if how == 0:
            options, base = {"rid": rid}, toks
        elif how == 1:
            options, base = {"rid": rid, "drop_previous_output": True}, prompt
        else:
            cut = data.draw(st.integers(-4, 40))
            options, base = {"rid": rid, "offset": cut}, toks[:cut] if cut else toks
        session = self.d.engine.sessions.sessions[sid]
        busy = session.turn is not None
        too_long = len(base) + len(new) >= self.d.engine.config.context_len
        try:
            req = self.d.turn(sid, new, max_new=max_new, session_params=options)
        except InvalidRequest as err:
            assert busy or too_long, err
            return
        assert not busy and not too_long
        self.turns[req.rid] = (req, base + new)

    @precondition(
        lambda self: len(self.histories) < 4 and any(self.named.get(s) for s in self.histories)
    )
    @rule(data=st.data(), drop=st.booleans())
    def fork_turn(self, data, drop):
        """A session forked from another's turn: its history is that turn's tokens (its
        prompt, with drop), and its first turn resumes from what the cache kept."""
        parent, rid, prompt, toks = self._named(data)
        options = {"rid": rid, "drop_previous_output": drop}
        sessions = self.d.engine.sessions
        child = sessions.fork(
            sessions.sessions[parent], options, lambda: sessions.get(self._open())
        )
        assert child.history.tolist() == (prompt if drop else toks)
        self.histories[child.sid] = prompt if drop else toks

    @precondition(lambda self: self.histories)
    @rule(data=st.data())
    def close_session(self, data):
        sid = data.draw(st.sampled_from(sorted(self.histories)))
        self.d.engine.sessions.close(sid)
        del self.histories[sid]

    # ---- plain requests ----
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=tokens,
        max_new=st.integers(0, 5),
        stops=st.booleans(),
    )
    def plain_request(self, prefix, suffix, max_new, stops):
        req = self.d.generate(
            prefix[:40] + suffix[:8], max_new=max_new, stop_token_ids=STOPS if stops else ()
        )
        self.plain[req.rid] = req

    @rule(seed=st.integers(0, VOCAB - 1))
    def crowd(self, seed):
        """A prompt that needs nearly the whole KV pool: every idle session's state and
        every unlocked cache path must give way (hibernated, dropped, evicted)."""
        context = self.d.engine.config.context_len
        prompt = [(seed + i) % (VOCAB - 1) + 1 for i in range(context - 8)]
        req = self.d.generate(prompt, max_new=2)
        self.plain[req.rid] = req

    # ---- running ----
    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self.settle(self.d.step())

    @rule()
    def run_until_idle(self):
        """Every request to its end, so sessions often sit idle holding their state
        (what forks, pressure and the tiers act on)."""
        for _ in range(1000):
            if self.d.engine.idle:
                return
            self.settle(self.d.step())
        raise AssertionError("the engine did not become idle")

    @precondition(lambda self: self.d.engine.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.d.engine.requests)))
        self.settle(self.d.engine.abort(rid, "client disconnected"))

    @rule(kv=st.integers(0, 8), mamba=st.integers(0, 3))
    def evict(self, kv, mamba):
        self.d.engine.cache.evict_kv(kv)
        self.d.engine.cache.evict_mamba(mamba)

    @precondition(lambda self: len(self.d.engine.in_flight) <= self.depth)
    @rule()
    def plan_ahead(self):
        self.d.plan_ahead()

    # ---- faults ----
    @rule(ops_ran=st.booleans())
    def refuse_step(self, ops_ran):
        """The executor refuses the oldest step in flight (planning one if none is), and
        so every step on top of it, having applied its deferred ops or not."""
        if not self.d.engine.in_flight:
            self.d.plan_ahead()
        if not self.d.engine.in_flight:
            return
        plan = self.d.engine.in_flight[0]
        if ops_ran:  # the executor runs a step's tier moves, then its ops (runner.py)
            self.d.model.move(plan.moves, plan.discards)
            self.d.model.apply_ops(plan)
        self.settle(self.d.engine.step_refused(plan, "refused by the test", ops_ran))

    @rule()
    def lose_executor(self):
        """A new executor with empty pools; the step that was executing is suspect."""
        self.settle(self.d.engine.device_lost())
        self.d.model = type(self.d.model)(self.d.pools, VOCAB, self.d._sequence)

    @rule()
    def expire_sessions(self):
        """Every idle session times out; those with a turn in flight stay."""
        self.now += 1000
        busy = {sid for sid, s in self.d.engine.sessions.sessions.items() if s.turn is not None}
        gone = set(self.d.engine.sessions.expire())
        assert gone == set(self.histories) - busy
        for sid in gone:
            del self.histories[sid]

    @rule(same_executor=st.booleans())
    def restart_scheduler(self, same_executor):
        """A new scheduler life rebuilds its sessions from the store's records, slots
        included when the executor is the same; the requests of the old life are lost
        (their clients saw the connection drop). The request ids go on from where they
        were: a branch names a turn by its id, and an id used again names the later turn
        (docs/api.md), which the machine's list of named turns does not model (a CI run
        found this: a fork named a turn of the old life by an id the new life reused)."""
        model, rids = self.d.model, self.d._rids
        self.d = self.new_driver()
        self.d._rids = rids  # a client's request ids stay its own across the restart
        if same_executor:
            self.d.model = model
            model.sequence_of = self.d._sequence
        self.d.engine.sessions.rebuild(list(self.records.values()), same_executor)
        self.turns.clear()
        self.reply_starts.clear()
        self.plain.clear()
        for sid, history in self.histories.items():
            assert self.d.engine.sessions.sessions[sid].history.tolist() == history

    def expected(self, req: Request, prompt: list[int]) -> list[int]:
        """A one-shot generation, cut where the context ends as the engine cuts it."""
        room = self.d.engine.config.context_len - len(prompt)
        limit = min(req.params.max_new_tokens, room)
        return reference(prompt, limit, VOCAB, req.params.stop_token_ids)

    def settle(self, ended: list[Request]) -> None:
        for req in ended:
            if req.rid in self.turns:
                turn, prompt = self.turns.pop(req.rid)
                assert turn.prompt.tolist() == prompt
                sid = turn.session.sid
                start = self.reply_starts.pop(req.rid, None)
                if req.status is Status.FINISHED:
                    assert req.output == self.expected(req, prompt)
                    if sid in self.histories and start is not None:  # its canonical rendering
                        self.histories[sid] = [*prompt[:start], 7, 7, *req.committed_output()]
                    elif sid in self.histories:
                        self.histories[sid] = prompt + req.committed_output()
                        # a rid names its newest turn (a restarted driver counts rids anew)
                        named = [t for t in self.named[sid] if t[0] != req.rid]
                        self.named[sid] = [*named, (req.rid, prompt, self.histories[sid])]
            else:
                plain = self.plain.pop(req.rid)
                if req.status is Status.FINISHED:
                    assert plain.output == self.expected(plain, plain.prompt.tolist())

    @invariant()
    def persist_records(self):
        """The session store's view: every record the scheduler ships (it ships them
        before any step that reuses the slots they release)."""
        for rec in self.d.engine.sessions.records.take_records():
            self.records[rec.sid] = rec

    @invariant()
    def sessions_hold_their_historys_state(self):
        """With nothing in flight, every idle session's state slot holds exactly the state
        of the history it claims to have computed: never a slot nothing wrote."""
        if self.d.engine.in_flight:
            return
        for s in self.d.engine.sessions.sessions.values():
            if s.turn is None and s.slots is not None:
                held = int(self.d.model.state[s.slots.working.slot])
                assert held == state_of(s.history[: s.cached_len]), f"session {s.sid}"

    @invariant()
    def speculating_rows_run_one_deep(self):
        """A request that speculates never has two sampling rows in flight: where its
        next row starts depends on what its verify row accepts (docs/speculative.md)."""
        if self.speculating:
            for req in self.d.engine.running:
                assert sum(r.sample for r in req.inflight) <= 1, req.rid

    @invariant()
    def busy_invariant(self):
        report = self.d.engine.check()
        assert report.ok, "\n".join(report.problems)

    def teardown(self):
        for rid in list(self.d.engine.requests):
            self.settle(self.d.engine.abort(rid, "teardown"))
        for sid in list(self.histories):
            self.d.engine.sessions.close(sid)
        self.d.run()
        self.d.assert_idle_clean()
        self.d.engine.cache.evict_kv(1 << 30)
        self.d.engine.cache.evict_mamba(1 << 30)
        report = self.d.engine.check(idle=True)
        assert report.ok and all(
            c["free"] == self.d.pools.ledger.pools[p].capacity for p, c in report.counts.items()
        ), report.counts


def _machine(
    page_size: int, depth: int, checkpoint_every: int, host_tier: bool, speculating: bool = False
) -> type:
    machine = type(
        f"EngineMachinePage{page_size}Depth{depth}" + "Speculating" * speculating,
        (EngineMachine,),
        {
            "page_size": page_size,
            "depth": depth,
            "checkpoint_every": checkpoint_every,
            "host_tier": host_tier,
            "speculating": speculating,
        },
    )
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return machine


# Each option is on in two of the first four machines, so every combination of an option
# with pipelining and with both page sizes runs; the fifth runs both with two steps deep.
TestEnginePage1 = _machine(1, 0, checkpoint_every=5, host_tier=False).TestCase
TestEnginePage16 = _machine(16, 0, checkpoint_every=0, host_tier=True).TestCase
TestEnginePage1Pipelined = _machine(1, 1, checkpoint_every=0, host_tier=True).TestCase
TestEnginePage16Pipelined = _machine(16, 1, checkpoint_every=2, host_tier=False).TestCase
# two steps in flight: a request's rows step around three working slots
TestEnginePage1TwoDeep = _machine(1, 2, checkpoint_every=5, host_tier=True).TestCase
# and speculating: every acceptance pattern, its sampling rows one deep
TestEnginePage16Speculating = _machine(
    16, 2, checkpoint_every=2, host_tier=True, speculating=True
).TestCase


class Draws:
    """Hypothesis's `data` for a rule called by hand: the values it draws, in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def test_a_turn_refused_after_its_restore_and_ops_ran_leaves_its_session_whole():
    """A sequence a CI run found: a session hibernated by a crowding prompt, then a turn
    whose step (restoring the session from the host tier) is refused after its ops ran.
    The executor runs a step's tier moves before its ops, so the turn's rollback copy is
    of the restored state; the machine's executor once ran the ops alone."""

    class Draw:
        def draw(self, strategy: object) -> str:
            return "s1"

    machine = _machine(16, 0, checkpoint_every=0, host_tier=True)()
    machine.fork(system=PREFIXES[0], own=[1], max_new=0)
    machine.crowd(seed=0)
    machine.run_until_idle()
    assert machine.d.engine.sessions.sessions["s1"].state_tier == "host"
    machine.turn(Draw(), [1], 0, False, False)
    machine.refuse_step(True)
    machine.sessions_hold_their_historys_state()
    machine.run_until_idle()
    machine.teardown()


def test_a_fork_names_a_turn_of_the_life_before_a_restart():
    """A sequence a CI run found (the machine's own fault): after a scheduler restart the
    machine's new driver numbered request ids from 1 again, so a chat turn of the new life
    reused the id of a turn of the old one, and a fork naming that id got the later turn
    while the machine expected the earlier."""

    machine = _machine(16, 0, checkpoint_every=0, host_tier=True)()
    for _ in range(2):
        machine.fork(system=PREFIXES[0], own=[1], max_new=0)
    machine.run_until_idle()
    machine.persist_records()  # an invariant: hypothesis runs it after every step
    machine.restart_scheduler(same_executor=False)
    machine.chat_turn(Draws("s1", 26), max_new=0, new=[1])
    machine.run_until_idle()
    first = machine.named["s1"][0]
    machine.branch(Draws("s1", first), new=[1], max_new=0, how=0)
    machine.expire_sessions()
    machine.fork_turn(Draws("s1", first), drop=False)
    machine.run_until_idle()
    machine.teardown()


def test_a_restart_while_an_aborted_turn_s_rollback_copy_is_in_flight_keeps_no_unwritten_state():
    """A sequence the machine found (this build's fault): a branch turn's first step,
    copying the state it resumes from into the session's rollback slot, is in flight
    when the turn is aborted, so the session takes that slot back; the scheduler then
    restarts (same executor) before the step runs. The session's record named the slot,
    so the new life took it as the session's state, which nothing had written. Now a
    record names device slots only once no step in flight copies into them."""

    machine = _machine(1, 2, checkpoint_every=5, host_tier=True)()
    for _ in range(3):
        machine.open_session()
    machine.fork(system=PREFIXES[0], own=[1], max_new=0)
    machine.plan_ahead()
    machine.run_until_idle()
    machine.persist_records()
    first = machine.named["s4"][0]
    machine.branch(Draws("s4", first, 0), new=[1], max_new=0, how=2)
    machine.plan_ahead()
    turn = next(iter(machine.d.engine.requests))
    machine.abort(Draws(turn))
    machine.persist_records()
    machine.restart_scheduler(same_executor=True)
    machine.sessions_hold_their_historys_state()
    machine.run_until_idle()
    machine.teardown()


def test_two_requests_that_each_need_the_whole_pool_do_not_take_turns_for_ever():
    """A sequence the speculating machine found (this build's fault, with or without
    speculation): two prompts that each need nearly every KV page; each, pipelining its
    next chunk, retracted the other, which re-admitted took the pages it needed, and so
    on. Now a request planning ahead of its own step waits for it."""
    machine = _machine(16, 2, checkpoint_every=2, host_tier=True, speculating=True)()
    machine.lose_executor()
    machine.crowd(seed=0)
    machine.run_until_idle()
    machine.crowd(seed=141)
    machine.fork(system=PREFIXES[1], own=[218, 227, 193, 57, 5, 192, 110, 1], max_new=6)
    for seed in (137, 0, 0):
        machine.crowd(seed=seed)
    machine.run_until_idle()
    machine.teardown()
