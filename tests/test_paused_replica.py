"""One live copy of every session, even when a replica is paused (SIGSTOP: equally a GC
pause, a stall, a partition from Redis) for longer than `replica_dead_seconds`, so a
router re-homes its sessions (docs/scaleout.md, "The lease").

Woken, the replica's lease has lapsed (protocol/lives.py): it
refuses its sessions until it has checked each against the placement directory, and then
releases what moved (answered elsewhere now) and what was closed elsewhere meanwhile. A
turn it was running when paused is neither acknowledged nor recorded: the session's next
turn, on the replica it moved to, runs on the history without it. Without the lease, the
old copy answered 200 beside the new one (two live copies), kept serving after a close
through the router, and counted twice against the key's limits."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import urllib.error
from collections.abc import Iterator

import pytest
import redis

from custody.soak.redis_proxy import RedisProxy
from custody.up import Stack, layout
from shared import streams
from shared.config import Settings
from shared.placement import Placement
from tests.services_harness import call, health, stack_settings
from tests.test_migration import ledgers_clean
from tests.test_replicas import OUTPUT, one_shots, turn

DEAD_SECONDS = 3.0


def placement(client: redis.Redis, sid: str) -> Placement | None:
    return Placement.decode(client.get(streams.placement_key(sid)))


def status_of(port: int, sid: str, ids: list[int], max_new: int = OUTPUT) -> tuple[int, dict]:
    """(status, body); 0 when nothing answered."""
    body = {
        "input_ids": ids,
        "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0},
    }
    try:
        return 200, call(port, "/generate", body, timeout=60)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError as err:  # not listening (yet)
        return 0, {"error": repr(err)}


def registered_sessions(client: redis.Redis, replica: str) -> int:
    raw = client.get(streams.Keys(replica).alive)
    return -1 if raw is None else json.loads(raw)["sessions"]


@pytest.fixture(scope="module")
def redis_client(module_redis_client: redis.Redis) -> redis.Redis:
    """The module's stack is shared: the database is flushed once, never between tests."""
    return module_redis_client


@pytest.fixture(scope="module")
def proxy(redis_url: str) -> Iterator[RedisProxy]:
    """Replica 0's scheduler reaches Redis through it (a fault hook: `RedisProxy.trap`)."""
    proxy = RedisProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def two(redis_url: str, redis_client: redis.Redis, proxy: RedisProxy) -> Iterator[Stack]:
    def plan(settings: Settings) -> dict[str, tuple[str, Settings]]:
        children = layout(settings)
        module, own = children["scheduler-0"]
        children["scheduler-0"] = (module, dataclasses.replace(own, redis_url=proxy.url))
        return children

    settings = stack_settings(redis_url, replicas=2, replica_dead_seconds=DEAD_SECONDS)
    stack = Stack(settings, plan=plan).start_all()
    try:
        stack.wait_healthy()
    except RuntimeError:
        stack.stop()
        raise
    yield stack
    stack.stop()


def test_a_session_closed_by_its_idle_timeout_leaves_no_placement(
    two: Stack, redis_client: redis.Redis
):
    """No router hears of an idle timeout: the replica takes the placement away itself
    (compare-and-delete), as it does for every routed session it closes."""
    sid = call(two.settings.port, "/open_session", {"timeout": 1})
    home = placement(redis_client, sid).replica
    assert redis_client.sismember(streams.Keys(home).placed, sid)
    deadline = time.monotonic() + 10
    while redis_client.exists(streams.placement_key(sid)):
        assert time.monotonic() < deadline, "the placement outlived its session"
        time.sleep(0.2)
    assert not redis_client.sismember(streams.Keys(home).placed, sid)


def test_a_paused_replica_serves_nothing_that_moved_and_keeps_no_closed_copy(
    two: Stack, redis_client: redis.Redis
):
    stack = two
    scheduler = stack.children["scheduler-0"]
    try:
        port = stack.settings.port
        direct = stack.layout["scheduler-0"][1].port
        sids = [call(port, "/open_session", {}) for _ in range(8)]
        ours = [s for s in sids if placement(redis_client, s).replica == "0"][:3]
        assert len(ours) == 3, "the router placed too few sessions on replica 0"
        moved, closed, busy = ours
        history = {sid: [] for sid in ours}
        for sid in ours:
            first = [3, 4, 5, 6, 7, 8]
            history[sid] += first + turn(port, sid, first)["output_ids"]

        # a long turn of `busy` runs when the pause comes: it must never be acknowledged
        cut: dict = {}
        long_turn = threading.Thread(
            target=lambda: cut.update(answer=status_of(direct, busy, [9, 9, 9], 400))
        )
        long_turn.start()
        time.sleep(0.5)
        os.kill(scheduler.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while any(placement(redis_client, s).replica != "1" for s in ours):
            assert time.monotonic() < deadline, [placement(redis_client, s) for s in ours]
            time.sleep(0.2)
        second = [11, 12, 13, 14]
        answer = turn(port, moved, second)  # served by replica 1 now
        assert answer["meta_info"]["prompt_tokens"] == len(history[moved]) + len(second)
        history[moved] += second + answer["output_ids"]
        assert call(port, "/close_session", {"session_id": closed}) is True

        os.kill(scheduler.pid, signal.SIGCONT)
        long_turn.join(60)
        status, body = cut["answer"]
        assert status == 503, (status, body)  # the turn is not acknowledged
        for sid in ours:  # the old copy never answers again
            status, body = status_of(direct, sid, [1, 2])
            assert status in (503, 404), (sid, status, body)
        deadline = time.monotonic() + 20
        while any(status_of(direct, sid, [1, 2])[0] != 404 for sid in ours):
            assert time.monotonic() < deadline, "replica 0 kept a copy"
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        while registered_sessions(redis_client, "0") != len(
            [
                s
                for s in sids
                if placement(redis_client, s) and placement(redis_client, s).replica == "0"
            ]
        ):
            assert time.monotonic() < deadline, "a released copy is still counted"
            time.sleep(0.2)

        third = [21, 22, 23]
        answer = turn(port, busy, third)  # the cut turn is not in its history
        assert answer["meta_info"]["prompt_tokens"] == len(history[busy]) + len(third), answer
        assert answer["output_ids"] == one_shots([history[busy] + third])[0]
        for sid in sids:
            if sid != closed:
                call(port, "/close_session", {"session_id": sid})
        ledgers_clean(stack)
        assert scheduler.poll() is None and stack.restarts["scheduler-0"] == 0
    finally:
        if scheduler.poll() is None:
            os.kill(scheduler.pid, signal.SIGCONT)


def test_a_dead_replica_s_sessions_move_only_once_the_store_has_its_last_records(
    two: Stack, redis_client: redis.Redis
):
    """Replica 0 dies (scheduler and executor SIGKILLed, not restarted) while the store
    is paused, its last turn acknowledged but not applied: the router's move of the
    session waits for the store's proof (shared/records_proof.py) instead of opening it
    on replica 1 from the older record; once the store goes on, the next turn runs on the
    whole acknowledged history."""
    port = two.settings.port
    sids: list[str] = []
    deadline = time.monotonic() + 30  # replica 0 may still be coming back from the last test
    while not sids or placement(redis_client, sids[-1]).replica != "0":
        assert time.monotonic() < deadline, "no session was placed on replica 0"
        sids.append(call(port, "/open_session", {}))
        time.sleep(0.1)
    sid = sids[-1]
    history: list[int] = []
    for ids in ([5, 6, 7], [8, 9, 10]):
        history += ids + turn(port, sid, ids)["output_ids"]
    store = two.children["session-store"]
    os.kill(store.pid, signal.SIGSTOP)
    try:
        last = [11, 12, 13]
        history += last + turn(port, sid, last)["output_ids"]  # acknowledged, not applied
        for name in ("scheduler-0", "executor-0"):
            two.children[name].kill()
            two.children[name].wait()
        time.sleep(DEAD_SECONDS + 6)  # dead, and a move would have been tried meanwhile
        assert placement(redis_client, sid).replica == "0"  # waited for the proof
    finally:
        os.kill(store.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while placement(redis_client, sid).replica != "1":
        assert time.monotonic() < deadline, placement(redis_client, sid)
        time.sleep(0.3)
    after = [21, 22]
    answer = turn(port, sid, after)
    assert answer["meta_info"]["prompt_tokens"] == len(history) + len(after), answer
    assert answer["output_ids"] == one_shots([history + after])[0]
    for other in sids:
        call(port, "/close_session", {"session_id": other})
    deadline = time.monotonic() + 60
    while two.restarts["scheduler-0"] == 0 or two.restarts["executor-0"] == 0:
        assert time.monotonic() < deadline
        two.supervise_once()
        time.sleep(0.2)
    # Back, replica 0 finds the store's record of `sid` (it died before it could record
    # the move) and no placement (closed on replica 1): closed elsewhere, so not taken
    # back, never a second copy of a closed session.
    direct = two.layout["scheduler-0"][1].port
    deadline = time.monotonic() + 60
    while (status := status_of(direct, sid, [1, 2])[0]) in (0, 503):
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    assert status == 404, status


def test_a_new_life_paused_before_it_registers_takes_back_nothing_that_moved_meanwhile(
    two: Stack, redis_client: redis.Redis, proxy: RedisProxy
):
    """Replica 0's scheduler is killed and started again; its new life is paused at its
    first read of its session records (after it read where they are placed), long
    enough for the router to re-home them. Woken, it must serve none of them: before,
    it read the directory before it registered and was never fenced (its first write
    could not find a lease lapsed), so both replicas answered 200 for the same sessions."""
    port, direct = two.settings.port, two.layout["scheduler-0"][1].port
    sids: list[str] = []
    deadline = time.monotonic() + 60  # replica 0 may still be coming back from the last test
    while health(direct, timeout=2).get("status") != "ok":
        assert time.monotonic() < deadline, "replica 0 is not back"
        two.supervise_once()
        time.sleep(0.3)
    while len([s for s in sids if placement(redis_client, s).replica == "0"]) < 2:
        assert time.monotonic() < deadline, "too few sessions were placed on replica 0"
        sids.append(call(port, "/open_session", {}))
    ours = [s for s in sids if placement(redis_client, s).replica == "0"]
    history = {sid: [] for sid in ours}
    for sid in ours:
        history[sid] += [5, 6, 7] + turn(port, sid, [5, 6, 7])["output_ids"]
    router, paused = two.children["router"], threading.Event()

    def pause_new_life() -> None:
        os.kill(two.children["scheduler-0"].pid, signal.SIGSTOP)
        paused.set()

    os.kill(router.pid, signal.SIGSTOP)  # it re-homes only once the new life has read
    try:
        two.kill("scheduler-0")
        proxy.trap((b"$6\r\nrecord\r\n",), pause_new_life)  # HGET <session key> record
        two.start("scheduler-0")
        assert paused.wait(60), "the new life never read its session records"
    finally:
        os.kill(router.pid, signal.SIGCONT)
    scheduler = two.children["scheduler-0"]
    try:
        deadline = time.monotonic() + 60
        while any(placement(redis_client, s).replica != "1" for s in ours):
            assert time.monotonic() < deadline, [placement(redis_client, s) for s in ours]
            time.sleep(0.2)
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while health(direct, timeout=2).get("status") != "ok":
        assert time.monotonic() < deadline, "the new life did not come up"
        time.sleep(0.3)
    deadline = time.monotonic() + 20
    while any((status := status_of(direct, s, [1, 2])[0]) != 404 for s in ours):
        assert status != 200, "the new life served a session that lives on replica 1"
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    for sid in ours:  # one copy, on replica 1, with the whole history
        answer = turn(port, sid, [8, 9])
        assert answer["meta_info"]["prompt_tokens"] == len(history[sid]) + 2, answer
    for sid in sids:
        call(port, "/close_session", {"session_id": sid})
    ledgers_clean(two)


def test_a_close_whose_record_was_held_while_its_session_moved_is_not_acknowledged(
    two: Stack, redis_client: redis.Redis, proxy: RedisProxy
):
    """Replica 0 closes a session, and the write carrying the close's record is held (its
    scheduler paused as it sends it) until the router, finding the replica dead, has
    re-homed the session from the store's record, which has no close. Woken, replica 0
    must not answer the close 200: the session lives on replica 1, and the router that
    closed it took that placement away (a live copy placed nowhere, which the fault
    campaign found as a leaked listing). It answers 503 `moving`, and the close made again
    (by the router, or its client) closes the copy on replica 1: nothing is left."""
    port = two.settings.port
    sids = sessions_until_one_on_replica_0(two, redis_client)
    sid = sids[-1]
    history = [5, 6, 7] + turn(port, sid, [5, 6, 7])["output_ids"]
    scheduler, moved = two.children["scheduler-0"], threading.Event()
    before = placement(redis_client, sid)

    def hold_until_moved() -> None:
        os.kill(scheduler.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        # until the move has committed: a move under way (moving_to set) is not re-homed
        while placement(redis_client, sid).replica == before.replica and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        moved.set()

    # the outbox's write of the close's record: an XADD to the ownership stream naming it
    proxy.trap((b"XADD", streams.Keys("0").ownership.encode(), sid.encode()), hold_until_moved)
    closing: dict = {}
    closer = threading.Thread(
        target=lambda: closing.update(answer=status_of_close(port, sid)), daemon=True
    )
    closer.start()
    try:
        assert moved.wait(90), "the close's record was never written"
        assert placement(redis_client, sid) == Placement("1", before.epoch + 1), "not re-homed"
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    closer.join(90)
    status, body = closing["answer"]
    if status == 503:  # refused `moving`: the copy on replica 1 lives, with its history
        assert placement(redis_client, sid).replica == "1", body
        answer = turn(port, sid, [8, 9])
        assert answer["meta_info"]["prompt_tokens"] == len(history) + 2, answer
        status, body = status_of_close(port, sid)
    assert status == 200, (status, body)  # (the router may have closed it again itself)
    deadline = time.monotonic() + 20
    while placement(redis_client, sid) is not None or any(
        redis_client.sismember(streams.Keys(r).placed, sid) for r in ("0", "1")
    ):
        assert time.monotonic() < deadline, "the closed session is still placed or listed"
        time.sleep(0.2)
    for replica in ("0", "1"):  # and no copy of it anywhere
        assert status_of(two.layout[f"scheduler-{replica}"][1].port, sid, [1])[0] == 404
    for other in sids[:-1]:
        call(port, "/close_session", {"session_id": other})
    ledgers_clean(two)


def status_of_close(port: int, sid: str) -> tuple[int, dict]:
    try:
        return 200, {"closed": call(port, "/close_session", {"session_id": sid}, timeout=90)}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_drain_never_carries_a_session_from_the_records_of_a_source_that_still_serves(
    two: Stack, redis_client: redis.Redis, proxy: RedisProxy
):
    """Replica 0 is cut off from Redis for about a second, a turn of its session running:
    its registration expires, its lease (longer) holds. A drain then must not take it
    for absent and carry the session from the store's record: cut off, the replica has
    not written the turn's record yet, and once back, still under its lease, it answers
    the turn, which the copy on replica 1 would not have (the fault campaign's stale
    turn, 200, after a drain whose source stopped registering). The move fails (503
    from the source it could not ask), the session stays, whole, on replica 0."""
    port = two.settings.port
    sids = sessions_until_one_on_replica_0(two, redis_client)
    sid = sids[-1]
    history = [5, 6, 7] + turn(port, sid, [5, 6, 7])["output_ids"]
    running: dict = {}
    long_turn = threading.Thread(
        target=lambda: running.update(answer=status_of(port, sid, [8, 9], 64)), daemon=True
    )
    long_turn.start()
    time.sleep(0.2)
    proxy.partition()
    try:
        deadline = time.monotonic() + 5
        while redis_client.exists(streams.Keys("0").alive):
            assert time.monotonic() < deadline, "replica 0's registration never expired"
            time.sleep(0.05)
        time.sleep(0.3)  # the router has read it missing
        drained = call(port, "/admin/drain", {"replica": "0"})
    finally:
        proxy.heal()
        redis_client.delete(streams.Keys("0").draining)
    long_turn.join(60)
    status, answer = running["answer"]
    assert status == 200, (status, answer)  # answered under its lease, once back
    history += [8, 9] + answer["output_ids"]
    deadline = time.monotonic() + 10
    while (got := status_of(port, sid, [10, 11]))[0] == 503:  # until the router reads it
        assert time.monotonic() < deadline, got  # registered again
        time.sleep(0.2)
    assert got[0] == 200 and got[1]["meta_info"]["prompt_tokens"] == len(history) + 2, got
    assert drained["history"] == drained["state"] == 0, drained  # nothing was carried
    assert placement(redis_client, sid).replica == "0"
    for other in sids:
        call(port, "/close_session", {"session_id": other})
    ledgers_clean(two)


def sessions_until_one_on_replica_0(two: Stack, redis_client: redis.Redis) -> list[str]:
    """Sessions opened through the router until one is placed on replica 0 (the last),
    once replica 0 is back from whatever the test before did to it."""
    port, direct = two.settings.port, two.layout["scheduler-0"][1].port
    deadline = time.monotonic() + 60
    while health(direct, timeout=2).get("status") != "ok":
        assert time.monotonic() < deadline, "replica 0 is not back"
        two.supervise_once()
        time.sleep(0.3)
    sids: list[str] = []
    while not sids or placement(redis_client, sids[-1]).replica != "0":
        assert time.monotonic() < deadline, "no session was placed on replica 0"
        sids.append(call(port, "/open_session", {}))
    return sids
