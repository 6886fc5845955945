"""Scenarios P1 (last part), P4, P5, P6 and P8 of docs/scenarios.md through the scheduling
core."""

import numpy as np

from tests.engine.scripted import Scripted


def test_p1_a_match_takes_a_fresh_slot_and_a_deferred_copy():
    s = Scripted(chunk=8, track_interval=64)
    s.marks[("a", 6)] = 77  # a prompt ending on a page snapshots a page before its end
    s.submit("a", [1, 2, 3, 4, 5, 6, 7], [9])
    s.run()
    node = s.engine.cache.match(np.arange(1, 8), 7).node
    assert node.end == 6 and s.states[node.mamba] == 77
    b = s.submit("b", [1, 2, 3, 4, 5, 6, 7, 50], [1])
    plan = s.engine.plan_step()
    assert b.cached_tokens == 6
    working = b.slots.state.current.slot
    assert working != node.mamba
    assert plan.ops.copies == [(node.mamba, working)]
    assert s.states[working] != 77  # nothing copied until the step runs
    s.engine.complete_step(plan, s.run_plan(plan))
    assert s.started_with["b"] == 77


def test_p4_donation_lifecycle():
    s = Scripted(chunk=2, track_interval=1)
    s.marks[("r1", 5)] = 42
    s.marks[("r1", 7)] = 99
    r1 = s.submit("r1", [1, 2, 3, 4, 5], [6, 7, 8])
    for _ in range(3):  # chunks [1,2] [3,4] [5]
        s.step()
    node5 = s.engine.cache.match(np.array([1, 2, 3, 4, 5, 6, 7]), 6).node
    assert node5.end == 5 and s.states[node5.mamba] == 42
    assert node5.mamba not in r1.slots.track.slots  # moved, and the track was refilled
    assert s.pools.mamba.owner_of(node5.mamba) == node5.owner.id
    # R2 diverges after [1..5] so that its own prefill does not cache [6,7] first.
    r2 = s.submit("r2", [1, 2, 3, 4, 5, 16, 17], [1])
    plan = s.engine.plan_step()
    assert r2.cached_tokens == 5
    assert (node5.mamba, r2.slots.state.current.slot) in plan.ops.copies
    assert node5 in plan.copy_sources
    s.engine.complete_step(plan, s.run_plan(plan))
    assert s.started_with["r2"] == 42
    s.run()
    assert r1.output == [6, 7, 8]
    m = s.engine.cache.match(np.arange(1, 9), 7)
    assert m.length == 7 and s.states[m.node.mamba] == 99
    assert m.node.parent is node5 and m.node.key.tolist() == [6, 7]
    held = s.engine.check(idle=True)
    assert held.ok and held.counts["mamba"]["request"] == held.counts["mamba"]["track"] == 0


def test_p5_finishing_without_a_snapshot_inserts_nothing():
    s = Scripted(page_size=16, chunk=16, track_interval=16)
    free = s.pools.mamba.free_count
    req = s.submit("short", [1, 2, 3], [4, 5])
    s.step()
    taken = [*req.slots.state.held(), *req.slots.track.slots]
    s.run()
    assert list(s.engine.cache.nodes()) == []
    assert s.pools.mamba.free_count == free
    assert all(s.pools.mamba.owner_of(slot) == 0 for slot in taken)


def test_p6_every_chunk_state_is_reachable():
    s = Scripted(chunk=4, track_interval=64)
    prompt = list(range(1, 17))
    for length in (4, 8, 12, 16):
        s.marks[("long", length)] = length * 10
    s.submit("long", [*prompt, 99], [1])
    donated = set()
    for length in (4, 8, 12, 16):
        s.step()
        m = s.engine.cache.match(np.array([*prompt, 99]), length)
        assert m.length == length and s.states[m.node.mamba] == length * 10
        donated.add(m.node.mamba)
    assert len(donated) == 4
    s.run()


def test_p8_a_copy_source_is_never_evicted_before_its_copy_runs():
    s = Scripted(chunk=8, track_interval=64)
    s.marks[("a", 3)] = 4242  # a prompt ending on a page snapshots a page before its end
    s.submit("a", [1, 2, 3, 4], [9])
    s.run()
    b = s.submit("b", [1, 2, 3, 4, 6], [1])
    plan = s.engine.plan_step()
    assert b.cached_tokens == 3
    ((source, _),) = plan.ops.copies
    s.engine.cache.evict_mamba(100)
    s.engine.cache.evict_kv(10_000)
    assert s.pools.mamba.owner_of(source) != 0 and s.states[source] == 4242
    s.engine.complete_step(plan, s.run_plan(plan))
    assert s.started_with["b"] == 4242
    s.run()
    assert s.engine.cache.evict_mamba(100) >= 1
    assert s.engine.check(idle=True).ok
    assert b.status.value == "finished"
