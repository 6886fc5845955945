"""Session state in the host and disk tiers, on the scheduling core with the data model:
every row's starting state is checked against its sequence and every output against a
one-shot reference, so a move that carried the wrong pages, the wrong slot or KV without
its state shows up as a wrong token, not only as a wrong list."""

import msgspec
import numpy as np

from services.scheduler.ownership.owners import OwnerKind
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver

PAGE = 4


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def tiered(**kw) -> Driver:
    """Device pools for a handful of sessions; a host tier and a disk below them."""
    args = dict(page_size=PAGE, kv_pages=64, mamba_slots=12, rows=4, context=256, step_tokens=128)
    args.update(kw)
    d = Driver(**args)
    d.model.sequence_of = d._sequence  # check every row's starting state
    return d


def two_turns(d: Driver, n: int, first: int = 30, second: int = 5, back: bool = False) -> list:
    """`n` sessions take a first turn each, then a second each, in the same order (the
    cyclic pattern that evicts exactly the session about to return) or, with `back`, in
    reverse order."""
    sids = [d.engine.sessions.open().sid for _ in range(n)]
    histories = {}
    for i, sid in enumerate(sids):
        t = d.run_turn(sid, text(first, i), max_new=6)
        assert t.output == reference(text(first, i), 6, VOCAB)
        histories[sid] = text(first, i) + t.output
    seconds = []
    for i, sid in reversed(list(enumerate(sids))) if back else enumerate(sids):
        new = text(second, 1000 + i)
        t = d.run_turn(sid, new, max_new=6)
        assert t.output == reference(histories[sid] + new, 6, VOCAB), sid
        seconds.append((t, len(histories[sid])))
    return seconds


def test_sessions_beyond_the_device_resume_from_the_host_tier():
    d = tiered(host_pages=512, host_slots=64)
    seconds = two_turns(d, 12)
    moves = d.engine.sessions.moves
    assert moves.moved["hibernate"] > 0 and moves.moved["restore"] > 0
    for t, history in seconds:
        assert t.cached_tokens == history - 1  # the last output token is never computed
    assert d.engine.sessions.states_dropped == 0
    d.assert_idle_clean()


def test_a_full_host_tier_spills_to_disk_and_loads_back():
    d = tiered(host_pages=24, host_slots=3, disk_slots=32)
    seconds = two_turns(d, 12)
    moves = d.engine.sessions.moves
    assert moves.moved["spill"] > 0 and moves.moved["load"] > 0
    assert all(t.cached_tokens == history - 1 for t, history in seconds)
    assert d.engine.sessions.states_dropped == 0 and moves.dropped == {"host": 0, "disk": 0}
    d.assert_idle_clean()


def test_a_full_disk_drops_the_oldest_blob_and_that_session_re_prefills():
    d = tiered(host_pages=24, host_slots=3, disk_slots=2)
    seconds = two_turns(d, 12, back=True)
    moves = d.engine.sessions.moves
    assert moves.dropped["disk"] > 0
    resumed = sum(t.cached_tokens == history - 1 for t, history in seconds)
    assert 0 < resumed < len(seconds)  # the dropped ones recomputed, and were still right
    d.assert_idle_clean()


def test_without_tiers_pressure_drops_state_as_before():
    d = tiered()
    two_turns(d, 12)
    assert d.engine.sessions.states_dropped > 0
    assert sum(d.engine.sessions.moves.moved.values()) == 0
    d.assert_idle_clean()


def place(d: Driver, sid: str, tier: str) -> None:
    d.engine.sessions.tiers.place(d.engine.sessions.sessions[sid], tier)
    d.run()
    assert d.engine.sessions.sessions[sid].state_tier == tier


def one_on_disk_one_on_host(d: Driver, length: int, seed: int) -> tuple[list, dict]:
    """Two sessions after a first turn each: the first placed on disk, the second on the
    host; their ids and histories."""
    sids = [d.engine.sessions.open().sid for _ in range(2)]
    histories = {}
    for i, sid in enumerate(sids):
        t = d.run_turn(sid, text(length, seed + i), max_new=4)
        histories[sid] = text(length, seed + i) + t.output
    place(d, sids[0], "disk")
    place(d, sids[1], "host")
    return sids, histories


def test_placed_on_disk_and_back_the_next_turn_is_exact():
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    sid = d.engine.sessions.open().sid
    first = d.run_turn(sid, text(23, 1), max_new=5)
    history = text(23, 1) + first.output
    for tier in ("host", "disk", "device", "disk"):
        place(d, sid, tier)
        d.assert_idle_clean()
    t = d.run_turn(sid, text(4, 2), max_new=5)
    assert t.cached_tokens == len(history) - 1
    assert t.output == reference(history + text(4, 2), 5, VOCAB)
    d.assert_idle_clean()


def test_a_session_hibernated_while_its_turn_has_rows_in_flight_restores_exactly():
    """Pipelining: the turn ends on step N's result while step N+1, already planned,
    still carries its (dropped) row; the hibernate is planned on top of that."""
    d = tiered(host_pages=64, host_slots=8)
    sid = d.engine.sessions.open().sid
    other = d.generate(text(40, 9), max_new=30)  # keeps steps flowing
    stop = reference(text(10, 3), 3, VOCAB)[2]  # unforeseen: a row is planned past it
    turn = d.turn(sid, text(10, 3), max_new=20, stop_token_ids=(stop,))
    while turn.session.turn is turn:
        d.step()
    assert d.engine.in_flight and any(r.dropped for p in d.engine.in_flight for r in p.rows)
    d.engine.sessions.tiers.place(turn.session, "host")
    d.run()
    assert turn.session.state_tier == "host" and other.output
    t = d.run_turn(sid, text(3, 4), max_new=4)
    history = t.prompt[:-3].tolist()
    assert history[:10] == text(10, 3) and t.cached_tokens >= len(history) - 1
    assert t.output == reference(t.prompt.tolist(), 4, VOCAB)
    d.assert_idle_clean()


def test_a_blob_that_fails_its_check_is_re_prefilled_and_counted():
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    sid = d.engine.sessions.open().sid
    first = d.run_turn(sid, text(20, 5), max_new=5)
    place(d, sid, "disk")
    d.model.corrupt.add(d.engine.sessions.sessions[sid].disk.blob.slot)
    t = d.run_turn(sid, text(3, 6), max_new=5)
    assert d.engine.sessions.moves.failed_loads == 1
    # re-prefilled: at most the first prompt came back, from the prefix cache (the
    # session's first turn shares its prompt there), none of the bad blob's state
    assert t.cached_tokens < len(first.prompt)
    assert t.output == reference(text(20, 5) + first.output + text(3, 6), 5, VOCAB)
    d.assert_idle_clean()
    assert not d.model.blobs  # the bad blob was deleted too


def test_an_executor_loss_keeps_blobs_and_loses_the_host_tier():
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    sids, histories = one_on_disk_one_on_host(d, 18, 20)
    d.engine.device_lost(suspect=False)
    blobs = d.model.blobs
    d.model.__init__(d.pools, VOCAB, d._sequence)  # a new executor: empty device and host
    d.model.blobs = blobs  # ... adopting the disk the old one wrote
    assert d.engine.sessions.sessions[sids[1]].state_tier is None
    assert d.engine.sessions.sessions[sids[0]].state_tier == "disk"
    for sid, cached in ((sids[0], len(histories[sids[0]]) - 1), (sids[1], 0)):
        t = d.run_turn(sid, text(3, 30), max_new=4)
        assert t.cached_tokens == cached
        assert t.output == reference(histories[sid] + text(3, 30), 4, VOCAB)
    d.assert_idle_clean()


def test_a_refused_step_gives_up_what_its_moves_would_have_written():
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    sid = d.engine.sessions.open().sid
    first = d.run_turn(sid, text(12, 7), max_new=4)
    d.engine.sessions.tiers.place(d.engine.sessions.sessions[sid], "host")
    plan = d.engine.plan_step()
    assert [m.kind for m in plan.moves] == ["hibernate"]
    d.engine.step_refused(plan, "refused for the test")
    session = d.engine.sessions.sessions[sid]
    assert session.state_tier is None and session.cached_len == 0
    d.run()
    t = d.run_turn(sid, text(2, 8), max_new=4)
    assert t.output == reference(text(12, 7) + first.output + text(2, 8), 4, VOCAB)
    counts = d.pools.host_kv.held_by_kind()
    assert counts[OwnerKind.TRANSIT] == 0 and counts[OwnerKind.SESSION] == 0
    d.assert_idle_clean()


def test_a_session_restored_by_a_step_is_not_hibernated_by_the_same_step():
    """A restore runs after every hibernate of its step: evicting the session it brings
    back in that step would copy device slots the restore has not written yet."""
    d = tiered(host_pages=512, host_slots=64)
    sid = d.engine.sessions.open().sid
    first = d.run_turn(sid, text(30, 40), max_new=4)
    place(d, sid, "host")
    busy = [d.generate(text(100, 50 + k), max_new=30) for k in range(2)]
    while d.pools.kv_pages.free_count > 9:  # the running requests fill the device
        d.step()
    d.engine.sessions.tiers.place(d.engine.sessions.sessions[sid], "device")
    d.run()  # they keep growing: the device is short in the step that restores
    assert all(r.output == reference(r.prompt.tolist(), 30, VOCAB) for r in busy)
    t = d.run_turn(sid, text(3, 41), max_new=4)
    assert t.output == reference(text(30, 40) + first.output + text(3, 41), 4, VOCAB)
    d.assert_idle_clean()


def test_a_restarted_scheduler_takes_back_valid_blobs_and_deletes_the_rest():
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    sids, histories = one_on_disk_one_on_host(d, 21, 60)
    kept = d.engine.sessions.sessions[sids[0]].disk.blob.slot
    records = d.engine.sessions.records.take_records()
    again = tiered(host_pages=64, host_slots=8, disk_slots=8)  # a new scheduler life
    again.engine.sessions.rebuild(records, state_valid=False)
    assert again.engine.sessions.sessions[sids[0]].state_tier == "disk"
    assert again.engine.sessions.sessions[sids[1]].state_tier is None
    assert sorted(again.engine.sessions.moves.discards) == [s for s in range(1, 9) if s != kept]
    again.model.blobs = d.model.blobs  # the same disk
    for sid, cached in ((sids[0], len(histories[sids[0]]) - 1), (sids[1], 0)):
        t = again.run_turn(sid, text(2, 70), max_new=3)
        assert t.cached_tokens == cached
        assert t.output == reference(histories[sid] + text(2, 70), 3, VOCAB)
    again.assert_idle_clean()


def test_a_rebuild_from_history_only_deletes_every_blob():
    """A restart that waited for the store's proof takes its sessions back from their
    history only (runtime/session_rebuild.py's finish_rebuild): no session holds a blob
    then, and every blob is deleted. Before, the earlier life's stayed on disk for good."""
    d = tiered(host_pages=64, host_slots=8, disk_slots=8)
    one_on_disk_one_on_host(d, 21, 60)
    records = [
        msgspec.structs.replace(r, disk=None) for r in d.engine.sessions.records.take_records()
    ]
    again = tiered(host_pages=64, host_slots=8, disk_slots=8)
    again.engine.sessions.rebuild(records, state_valid=False)
    assert sorted(again.engine.sessions.moves.discards) == list(range(1, 9))
    again.assert_idle_clean()


def test_a_load_for_a_turn_behind_never_spills_the_state_loaded_for_the_turn_ahead():
    """Issue 43, finding 7: room on the host for one state, two sessions on disk, the
    second turn queued once the first one's load has run, before the first is admitted
    (the service plans the step after a load only once the load has run). The load
    behind waits for the turn ahead to take its state to the device; it used to spill
    that state to load its own, the next load of the head spilled it back, and neither
    turn ever ran."""
    d = tiered(host_pages=12, host_slots=1, disk_slots=8)
    sids, histories = [], []
    for i in range(2):
        sid = d.engine.sessions.open().sid
        first = d.run_turn(sid, text(30, 70 + i), max_new=4)
        sids.append(sid)
        histories.append(text(30, 70 + i) + first.output)
        place(d, sid, "disk")
    head = d.turn(sids[0], text(3, 80), max_new=4)
    d.step()  # the head's load is planned
    d.step()  # nothing more to plan: the load runs
    assert head.session.host.ready and not d.engine.in_flight
    behind = d.turn(sids[1], text(3, 81), max_new=4)  # queued before the head is admitted
    d.run(max_steps=200)
    assert head.cached_tokens == len(histories[0]) - 1  # from its blob
    for t, history, seed in ((head, histories[0], 80), (behind, histories[1], 81)):
        assert t.output == reference(history + text(3, seed), 4, VOCAB)
    d.assert_idle_clean()


def pressure(hint: bool) -> tuple[Driver, list[str]]:
    """Twelve sessions, more than the device holds idle, take a turn each in order; the
    first, with `hint`, holds a retention hint (an hour, priority 1)."""
    d = tiered(host_pages=512, host_slots=64)
    sessions = d.engine.sessions
    sids = [sessions.open().sid for _ in range(12)]
    if hint:
        sessions.tiers.retain(sessions.sessions[sids[0]], 3600.0, 1)
    for i, sid in enumerate(sids):
        d.run_turn(sid, text(30, i), max_new=6)
    assert sessions.moves.moved["hibernate"] > 0
    return d, sids


def test_a_retention_hint_keeps_its_session_on_the_device_while_unhinted_ones_move():
    """The least recently used idle session leaves the device first; with a hint it
    stays, and the next unhinted one goes in its place. Once the hint's TTL has passed
    since the session's last use it counts no more: the next pressure moves it first."""
    d, sids = pressure(hint=False)
    tier = {sid: d.engine.sessions.sessions[sid].state_tier for sid in sids}
    assert tier[sids[0]] == "host"  # without the hint, it is the first to go
    d, sids = pressure(hint=True)
    sessions = d.engine.sessions
    hinted = sessions.sessions[sids[0]]
    assert hinted.state_tier == "device"
    assert sessions.sessions[sids[1]].state_tier == "host"
    later = sessions.clock() + 3601.0
    sessions.clock = lambda: later
    assert not sessions.tiers.hinted(hinted, later)
    d.run_turn(sessions.open().sid, text(30, 99), max_new=6)
    assert hinted.state_tier == "host"
    d.assert_idle_clean()
