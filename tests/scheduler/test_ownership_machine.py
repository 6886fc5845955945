"""Random sequences of every allocator operation, over page sizes 1, 4 and 16 and pools
small enough that exhaustion is common, with the busy invariant after every step and
the idle invariant once everything is released."""

from __future__ import annotations

import contextlib
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.allocators import handover
from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.allocators.request_slots import RequestSlots, admit, release
from services.scheduler.ownership.errors import PoolExhausted
from services.scheduler.ownership.owners import Owner, OwnerKind
from tests.scheduler.helpers import assert_clean, assert_no_overlap

# 3 machines x 700 = 2,100 sequences by default; CUSTODY_HYPOTHESIS_EXAMPLES overrides.
EXAMPLES = int(os.environ.get("CUSTODY_HYPOTHESIS_EXAMPLES", "700"))


class OwnershipMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.pools = Pools(
            PoolConfig(
                kv_pages=10,
                page_size=ps,
                mamba_slots=10,
                max_running_requests=4,
                max_context=6 * ps + 3,
            )
        )
        self.running: list[RequestSlots] = []
        self.sessions: list[handover.SessionSlots] = []
        self.cache: list[tuple[Owner, int]] = []
        self.serial = 0

    def _name(self) -> str:
        self.serial += 1
        return str(self.serial)

    def _state(self) -> tuple:
        p = self.pools
        return (
            p.rows.pages.copy(),
            p.rows.lens.copy(),
            p.kv_pages.owner_view.copy(),
            p.mamba.owner_view.copy(),
            p.req.owner_view.copy(),
        )

    def _assert_unchanged(self, before: tuple) -> None:
        for a, b in zip(before, self._state(), strict=True):
            assert np.array_equal(a, b), "a failed operation changed state"

    # ---- requests ----
    @rule()
    def admit_request(self):
        with contextlib.suppress(PoolExhausted):
            self.running.append(admit(self.pools, self._name()))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def extend(self, data):
        reqs = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique_by=id))
        rows = np.array([r.row.slot for r in reqs])
        cap = self.pools.rows.max_context
        new = np.array([data.draw(st.integers(int(self.pools.rows.lens[r]), cap)) for r in rows])
        before = self._state()
        try:
            tokens = self.pools.kv.extend(rows, new)
        except PoolExhausted:
            self._assert_unchanged(before)
            return
        assert len(tokens) == int((new - before[1][rows]).sum())

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode(self, data):
        lens = self.pools.rows.lens
        room = [r for r in self.running if lens[r.row.slot] < self.pools.rows.max_context]
        if not room:
            return
        reqs = data.draw(st.lists(st.sampled_from(room), min_size=1, unique_by=id))
        before = self._state()
        try:
            self.pools.kv.decode(np.array([r.row.slot for r in reqs]))
        except PoolExhausted:
            self._assert_unchanged(before)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free_tail(self, data):
        req = data.draw(st.sampled_from(self.running))
        row = req.row.slot
        start = data.draw(st.integers(req.borrowed, int(self.pools.rows.lens[row])))
        self.pools.kv.free_tail(row, start)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        release(self.pools, req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def snapshot_and_donate(self, data):
        req = data.draw(st.sampled_from(self.running))
        length = int(self.pools.rows.lens[req.row.slot])
        if length <= req.track.latest_len and req.track.latest >= 0:
            return
        req.track.record(req.track.begin_snapshot(), length)
        if data.draw(st.booleans()):
            node = self.pools.ledger.new_owner(OwnerKind.CACHE, self._name())
            try:
                snap = req.track.donate_latest(node)
            except PoolExhausted:
                self.pools.ledger.retire(node)
                return
            self.cache.append((node, snap.slot))

    # ---- sessions ----
    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def save_to_session(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        session = self.pools.ledger.new_owner(OwnerKind.SESSION, self._name())
        self.sessions.append(handover.save(self.pools, req, session))

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def restore_session(self, data):
        sess = data.draw(st.sampled_from(self.sessions))
        before = self._state()
        try:
            req = handover.restore(self.pools, sess, self._name())
        except PoolExhausted:
            self._assert_unchanged(before)
            return
        self.sessions.remove(sess)
        self.running.append(req)
        # the session's owner is done once its state moved to the turn
        self.pools.ledger.retire(sess.owner)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close_session(self, data):
        sess = data.draw(st.sampled_from(self.sessions))
        self.sessions.remove(sess)
        handover.close(self.pools, sess)

    # ---- cache ----
    @precondition(lambda self: self.cache)
    @rule(data=st.data())
    def evict(self, data):
        node, slot = data.draw(st.sampled_from(self.cache))
        self.cache.remove((node, slot))
        self.pools.mamba.free_one(slot, node, "evict")
        self.pools.ledger.retire(node)

    # ---- checks ----
    def claims(self) -> list:
        p = self.pools
        claims = [c for r in self.running for c in r.claims(p)]
        claims += [c for s in self.sessions for c in s.claims(p)]
        claims += [(node, "mamba", [slot]) for node, slot in self.cache]
        return claims

    @invariant()
    def busy_invariant(self):
        assert_clean(self.pools, self.claims(), idle=False)
        rows = [r.row.slot for r in self.running] + [s.row.slot for s in self.sessions]
        assert_no_overlap(
            *[self.pools.rows.token_indices(r, 0, int(self.pools.rows.lens[r])) for r in rows]
        )

    def teardown(self):
        for req in self.running:
            release(self.pools, req)
        for sess in self.sessions:
            handover.close(self.pools, sess)
        for node, slot in self.cache:
            self.pools.mamba.free_one(slot, node, "evict")
            self.pools.ledger.retire(node)
        report = assert_clean(self.pools, [], idle=True)
        for name, pool in self.pools.ledger.pools.items():
            assert report.counts[name]["free"] == pool.capacity


def _machine(page_size: int) -> type:
    machine = type(
        f"OwnershipMachinePage{page_size}", (OwnershipMachine,), {"page_size": page_size}
    )
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return machine


TestOwnershipPage1 = _machine(1).TestCase
TestOwnershipPage4 = _machine(4).TestCase
TestOwnershipPage16 = _machine(16).TestCase
