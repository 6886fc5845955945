"""The session store's independent ledger under speculative decoding: every verify row's
writes checked against its own replay after every step (the speculative states its
speculative owner's, the committed exchange of owners replayed), nothing speculative held
at idle; and a verify row writing a draft's state into a slot its owner does not hold is
named."""

from __future__ import annotations

import numpy as np

from services.scheduler.allocators.spec_slots import SpecSlots
from services.session_store.consumer import OwnershipConsumer
from shared.owners import KIND_MASK, OwnerKind
from tests.engine.driver import Driver
from tests.engine.test_sessions import text
from tests.engine.test_speculation import ForcedDrafts
from tests.session_store.test_write_checker import Publisher, drain


def speculating() -> Driver:
    return Driver(
        page_size=4,
        kv_pages=32,
        mamba_slots=48,
        rows=6,
        context=112,
        chunk=8,
        step_tokens=24,
        drafter=ForcedDrafts(),
    )


def held_kinds(consumer: OwnershipConsumer) -> set[OwnerKind]:
    table = consumer.ledger.tables[consumer.ledger.names.index("mamba")]
    return {OwnerKind(int(o) & KIND_MASK) for o in np.asarray(table[1:]) if o > 0}


def test_the_store_s_ledger_holds_every_verify_step_s_writes(redis_client):
    d = speculating()
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    sids = [d.engine.sessions.open(f"s{i}").sid for i in range(2)]
    seen_speculative = False
    for t in range(2):
        for i, sid in enumerate(sids):
            d.turn(sid, text(6, 10 * t + i), max_new=14)
        for j in range(3):
            d.generate(text(20, 99) + text(3, j), max_new=16)
        while not d.engine.idle:
            pub.step()
            pub.ship()
            drain(consumer)
            assert consumer.ledger.violations == []
            seen_speculative |= OwnerKind.SPECULATIVE in held_kinds(consumer)
    for sid in sids:
        d.engine.sessions.close(sid)
    pub.run()
    drain(consumer)
    assert consumer.ledger.violations == []
    assert seen_speculative and OwnerKind.SPECULATIVE not in held_kinds(consumer)
    assert consumer.checker.checked == pub.published and consumer.checker.unchecked == 0
    assert d.engine.completion.accepted.steps > 10
    d.assert_idle_clean()


def test_a_draft_state_written_outside_its_owner_is_named(redis_client, monkeypatch):
    d = speculating()
    stray = int(np.flatnonzero(d.pools.mamba.owner_view == 0)[-1])  # a free slot
    monkeypatch.setattr(SpecSlots, "for_drafts", lambda self, n: [stray] * min(n, 1))
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    req = d.generate(text(10, 1), max_new=1 + 2)
    for _ in range(6):  # up to its first verify row (one draft, into the stray slot)
        pub.step()
    pub.ship()
    drain(consumer)
    assert any(
        v.kind == "misrouted_write"
        and v.slots == [stray]
        and f"speculative state of {req.rid}" in v.detail
        for v in consumer.ledger.violations
    ), consumer.ledger.violations
