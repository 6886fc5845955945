"""The store's ledger replays a batch in bulk (numpy rounds, ledger_replay.py): it must
find what a replay of one record at a time finds, in the same order, with the tables as
they were before each stop. The reference here is that one-at-a-time replay, written
from the rule (a move checks the slot's owner is its giver, then hands it over)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.session_store.ledger_replay import IndependentLedger
from shared.messages.ownership import Events, PoolTable, Snapshot, Transfers

SIZES = (6, 3)  # two pools' capacities: small, so random moves collide and repeat
OWNERS = (0, 1, 2, 3)


def ledger() -> IndependentLedger:
    led = IndependentLedger()
    pools = [
        PoolTable(id=i, name=f"pool{i}", capacity=n, owners=np.zeros(n + 1, np.int64))
        for i, n in enumerate(SIZES)
    ]
    led.reset(Snapshot(epoch="e", seq=0, pools=pools, owners={}, next_event=0))
    return led


def batch(moves: list[tuple[int, int, int, int]], events: int) -> Events:
    """`moves`: (pool, slot, giver, receiver), spread over `events` events in order."""
    n = len(moves)
    event = np.sort(np.arange(n) * events // max(n, 1)) if n else np.zeros(0, int)
    pool, slot, giver, receiver = (np.array(c, dtype=np.int64) for c in zip(*moves, strict=True))
    records = Transfers(event, pool, slot, giver, receiver)
    return Events.of("e", 1, 0, [f"r{i}" for i in range(events)], records, {})


def one_at_a_time(moves: list[tuple[int, int, int, int]], events: Events, stops: list[int]):
    tables = [[0] * (n + 1) for n in SIZES]
    found, seen, pending = [], [], list(stops)
    for (p, s, g, r), e in zip(moves, events.event.tolist(), strict=True):
        while pending and e >= pending[0]:
            seen.append((pending.pop(0), [list(t) for t in tables]))
        if tables[p][s] != g:
            found.append((p, s, e, "double_free" if r == 0 == tables[p][s] else "not_owner"))
        tables[p][s] = r
    seen += [(stop, [list(t) for t in tables]) for stop in pending]
    return found, seen, tables


move = st.integers(0, 1).flatmap(
    lambda p: st.tuples(
        st.just(p),
        st.integers(1, SIZES[p]),
        st.sampled_from(OWNERS),
        st.sampled_from(OWNERS),
    )
)


@settings(max_examples=150, deadline=None)
@given(st.lists(move, min_size=1, max_size=40), st.integers(1, 12), st.data())
def test_bulk_replay_finds_what_one_at_a_time_finds(moves, events, data):
    events = min(events, len(moves))
    msg = batch(moves, events)
    stops = sorted(set(data.draw(st.lists(st.integers(0, events), max_size=3))))
    want_found, want_seen, want_tables = one_at_a_time(moves, msg, stops)
    led, seen = ledger(), []

    def on_stop(seq: int) -> list:
        seen.append((seq, [t.tolist() for t in led.tables]))
        return []

    found = led.apply(msg, stops, on_stop)
    got = [(led.names.index(v.pool), v.slots[0], v.event, v.kind) for v in found]
    assert got == want_found
    assert seen == want_seen
    assert [t.tolist() for t in led.tables] == want_tables
    assert led.next_event == events
