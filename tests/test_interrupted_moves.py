"""Moves whose router died part-way, as processes on a real Redis: with the router killed,
the test plays a router's steps itself (the same directory calls, the same admin routes)
and stops where a router's death would; a restarted router finds each abandoned move once
its lease has run out and finishes it. Then every session is on one replica only, resumes
from its state there, answers as one-shot, and neither ledger leaks.

- a: in transit, its state placed on disk by the replica it leaves; nothing more.
- b: also opened on the replica it goes to, and then the replica it leaves is restarted
  (its scheduler SIGKILLed): that replica takes the session back moving, and refuses
  its turns until the move is decided.
- c: moved (committed) but never closed where it was, then given a turn where it went
  and moved back: its arrival replaces the stale copy left there (an older epoch).
- d: undone in the directory, but its replica never told: the placement names that
  replica and no target again, so the replica takes the session's turns again.

Then, on one stack with a live router, the settles a router sends that are lost: a copy
an undone move left on its target, and a source never told its move committed. Each
replica settles its copies from the directory by itself, and a later move of the same
session never takes a stale copy for its own."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from custody.up import Stack
from fronts.directory import Directory
from shared import streams
from shared.placement import Move, Placement
from shared.redis_client import connect_async
from shared.registration_auth import signature
from tests.services_harness import call, health, stack_settings, start_stack
from tests.test_migration import check_one_shot, ledgers_clean, play, restart
from tests.test_replicas import OUTPUT, home, turn

LEASE = 2.0  # replica_dead_seconds: a move's lease


def directory(url: str, step: str, move: Move) -> bool:
    """One directory step of `move`, as a router takes it."""

    async def run() -> bool:
        client = await connect_async(url)
        try:
            return bool(await getattr(Directory(client, LEASE), step)(move))
        finally:
            await client.aclose()

    return asyncio.run(run())


def admin(stack: Stack, replica: str, path: str, sid: str, **extra: object) -> object:
    port = stack.layout[f"scheduler-{replica}"][1].port
    return call(port, f"/admin/{path}", {"session_id": sid, **extra})


def release(stack: Stack, replica: str, sid: str) -> None:
    """The old replica closes its copy, as a router asks once the move committed. A 404
    answers too, as the router takes it (fronts/migration.py's `release`): the replica
    released the copy itself, having seen the directory place it elsewhere first
    (services/scheduler/runtime/directory_check.py)."""
    try:
        admin(stack, replica, "migrate_done", sid)
    except urllib.error.HTTPError as err:
        assert err.code == 404, err


def begin(stack: Stack, client: redis.Redis, sid: str) -> Move:
    """Put `sid` in transit to the other replica and take it out of its own."""
    placed = Placement.decode(client.get(streams.placement_key(sid)))
    target = "1" if placed.replica == "0" else "0"
    move = Move(sid, placed.replica, target, placed.epoch, secrets.token_hex(8))
    assert directory(stack.settings.redis_url, "begin", move)
    admin(stack, move.source, "migrate_out", sid)
    return move


def arrive(stack: Stack, move: Move) -> None:
    admin(
        stack,
        move.target,
        "migrate_in",
        move.sid,
        source=move.source,
        epoch=move.epoch + 1,
        move=move.nonce,
    )


def refused(stack: Stack, replica: str, sid: str) -> int:
    """The status a direct turn of `sid` gets from `replica`."""
    with pytest.raises(urllib.error.HTTPError) as err:
        turn(stack.layout[f"scheduler-{replica}"][1].port, sid, [1, 2, 3])
    return err.value.code


def test_a_restarted_router_finishes_the_moves_its_predecessor_abandoned(redis_url, redis_client):
    stack = start_stack(stack_settings(redis_url, replicas=2, replica_dead_seconds=LEASE))
    try:
        port, rng = stack.settings.port, np.random.default_rng(11)
        sids = a, b, c, d = [call(port, "/open_session", {}) for _ in range(4)]
        history = {sid: [] for sid in sids}
        play(port, sids, history, rng, 2, resumed=False)
        stack.kill("router")
        url = stack.settings.redis_url

        move_a = begin(stack, redis_client, a)

        move_c = begin(stack, redis_client, c)
        arrive(stack, move_c)
        assert directory(url, "commit", move_c)  # ... and its router died
        ids = rng.integers(0, 256, 8).tolist()
        reply = turn(stack.layout[f"scheduler-{move_c.target}"][1].port, c, ids)
        history[c] += ids + reply["output_ids"]
        back = Move(c, move_c.target, move_c.source, move_c.epoch + 1)
        assert directory(url, "begin", back)
        admin(stack, back.source, "migrate_out", c)
        arrive(stack, back)
        assert directory(url, "commit", back)
        release(stack, back.source, c)
        directory(url, "done", back)

        move_d = begin(stack, redis_client, d)
        assert directory(url, "abort", move_d)  # ... and its router died
        ids = rng.integers(0, 256, 8).tolist()
        reply = turn(stack.layout[f"scheduler-{move_d.source}"][1].port, d, ids)
        history[d] += ids + reply["output_ids"]

        move_b = begin(stack, redis_client, b)
        arrive(stack, move_b)
        stack.kill(f"scheduler-{move_b.source}")
        restart_scheduler(stack, move_b.source)
        assert refused(stack, move_b.source, b) == 503  # taken back moving

        restart(stack, "router")
        deadline = time.monotonic() + 30
        while redis_client.zcard(streams.MOVES) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert redis_client.zcard(streams.MOVES) == 0
        assert home(redis_client, a) == move_a.target and home(redis_client, b) == move_b.target
        assert Placement.decode(redis_client.get(streams.placement_key(d))) == move_d.before
        assert Placement.decode(redis_client.get(streams.placement_key(c))) == back.after
        for sid in sids:  # one copy only: the other replica has none
            elsewhere = "1" if home(redis_client, sid) == "0" else "0"
            assert refused(stack, elsewhere, sid) == 404, sid
        play(stack.settings.port, sids, history, rng, 2, resumed=True)
        check_one_shot(sids, history)
        ledgers_clean(stack)
    finally:
        stack.stop()


def restart_scheduler(stack: Stack, replica: str) -> None:
    """Start the killed scheduler of `replica` again, and nothing else (the router stays
    dead)."""
    stack.start(f"scheduler-{replica}")
    port = stack.layout[f"scheduler-{replica}"][1].port
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if health(port, timeout=2).get("executor"):
            return
        time.sleep(0.3)
    raise AssertionError(f"scheduler-{replica} did not come back")


@pytest.fixture(scope="module")
def steady(redis_url: str, module_redis_client: redis.Redis) -> Iterator[Stack]:
    """Two replicas and a live router that finds no replica dead while the tests play
    a router's steps (its leases outlast them)."""
    stack = start_stack(stack_settings(redis_url, replicas=2, replica_dead_seconds=30.0))
    yield stack
    stack.stop()


def until_gone(stack: Stack, replica: str, sid: str, seconds: float = 10.0) -> None:
    """Until `replica` holds no copy of `sid` (a direct turn gets 404)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            turn(stack.layout[f"scheduler-{replica}"][1].port, sid, [1, 2, 3])
            code = 200
        except urllib.error.HTTPError as err:
            code = err.code
        if code == 404:
            return
        assert time.monotonic() < deadline, f"replica {replica} still holds {sid}: {code}"
        time.sleep(0.2)


def test_a_turn_sent_where_a_router_last_saw_its_session_follows_a_move_it_did_not_make(
    steady: Stack, module_redis_client: redis.Redis
):
    """The router remembers placements; a move by someone else (here the test, as a
    second router) makes that memory stale, and the old replica's 503 (moving) or 404
    (gone) sends the router to the directory."""
    stack, redis_client = steady, module_redis_client
    port, rng = stack.settings.port, np.random.default_rng(13)
    sids = [call(port, "/open_session", {}) for _ in range(2)]
    history = {sid: [] for sid in sids}
    play(port, sids, history, rng, 1, resumed=False)
    url, moves = stack.settings.redis_url, [begin(stack, redis_client, sid) for sid in sids]
    with pytest.raises(urllib.error.HTTPError) as moving:  # the first, while it moves
        turn(port, sids[0], [1, 2, 3])
    assert moving.value.code == 503
    assert json.loads(moving.value.read())["error"]["type"] == "moving"
    for move in moves:
        arrive(stack, move)
        assert directory(url, "commit", move)
        release(stack, move.source, move.sid)
        directory(url, "done", move)
    play(port, sids, history, rng, 2, resumed=True)  # on the target, from its state
    check_one_shot(sids, history)
    for move in moves:
        assert refused(stack, move.source, move.sid) == 404


def test_a_copy_left_by_an_undone_move_never_answers_for_its_session(
    steady: Stack, module_redis_client: redis.Redis
):
    """A move undone with the target's release lost left a copy there at the move's
    epoch. It goes by itself, and when the session later moves there for real (a drain),
    it resumes from the history it has now, not the copy's: before, the drain took the
    stale copy for its own arrival and the next turn ran on two turns less history."""
    stack, client = steady, module_redis_client
    port, url, rng = stack.settings.port, stack.settings.redis_url, np.random.default_rng(17)
    sid = call(port, "/open_session", {})
    history: dict = {sid: []}
    play(port, [sid], history, rng, 1, resumed=False)
    move = begin(stack, client, sid)
    arrive(stack, move)
    assert directory(url, "abort", move)
    admin(stack, move.source, "migrate_cancel", sid)  # ... and the target's release is lost
    directory(url, "done", move)
    play(port, [sid], history, rng, 2, resumed=True)  # on the source, which kept it
    until_gone(stack, move.target, sid)
    drained = call(port, "/admin/drain", {"replica": move.source})
    try:
        assert drained["failed"] == 0 and home(client, sid) == move.target, drained
        metas = play(port, [sid], history, rng, 1, resumed=True)
        assert metas[0]["prompt_tokens"] == len(history[sid]) - OUTPUT, metas
        check_one_shot([sid], history)
    finally:
        client.delete(streams.Keys(move.source).draining)  # the next test places anywhere
    ledgers_clean(stack)


def test_a_source_never_told_its_session_moved_lets_its_copy_go(
    steady: Stack, module_redis_client: redis.Redis
):
    """A committed move whose release of the source was lost: the source's copy stayed
    `moving` for good (never expiring, holding its blob, counted in its registration)."""
    stack, client = steady, module_redis_client
    port, url, rng = stack.settings.port, stack.settings.redis_url, np.random.default_rng(19)
    sid = call(port, "/open_session", {"timeout": 3})
    history: dict = {sid: []}
    play(port, [sid], history, rng, 1, resumed=False)
    move = begin(stack, client, sid)
    arrive(stack, move)
    assert directory(url, "commit", move)  # ... and the source's release is lost
    directory(url, "done", move)
    play(port, [sid], history, rng, 1, resumed=True)  # on the target
    until_gone(stack, move.source, sid)
    check_one_shot([sid], history)
    ledgers_clean(stack)


def register_black_hole(
    client: redis.Redis, secret: str, hole: socket.socket, stop: threading.Event
) -> str:
    """Register replica "9" at `hole`, a socket that accepts connections and never
    answers (a hung process, a frozen VM, a black-holed path), renewing its registration
    until `stop`; returns its id. (Closing `hole` would reset what waits on it.)"""
    url, epoch = f"http://127.0.0.1:{hole.getsockname()[1]}", "hole"
    entry = {
        "replica": "9",
        "url": url,
        "executor": True,
        "running": 0,
        "queued": 0,
        "sessions": 0,
        "opened": 0,
        "tenants": {},
        "epoch": epoch,
        "sig": signature(secret, "9", url, epoch),
    }
    client.sadd(streams.REPLICAS, "9")

    def renew() -> None:
        while not stop.is_set():
            client.set(streams.Keys("9").alive, json.dumps(entry), px=600)
            time.sleep(0.1)

    threading.Thread(target=renew, daemon=True).start()
    return "9"


def moving_to(client: redis.Redis, target: str) -> bool:
    """Whether any session is in transit to `target` (a drain moves one at a time, in
    its own order: the first to go may be another session this module left open)."""
    for key in client.scan_iter(streams.placement_key("*")):
        raw = client.get(key)
        if raw is not None and Placement.decode(raw).moving_to == target:
            return True
    return False


def test_a_move_to_a_replica_that_never_answers_ends_once_it_stops_registering(
    steady: Stack, module_redis_client: redis.Redis
):
    """A drain whose target accepts the connection and never answers: the call waited
    for TCP to give up (about 15 minutes), holding the move, the front's duties and the
    drain (the preStop hook) with it. It ends once the target stops registering: the move
    is undone, the session answers on the replica it never left."""
    stack, client = steady, module_redis_client
    port, rng = stack.settings.port, np.random.default_rng(23)
    sid = call(port, "/open_session", {})
    history: dict = {sid: []}
    play(port, [sid], history, rng, 1, resumed=False)
    source = home(client, sid)
    other = "1" if source == "0" else "0"
    stop, drained, listening = threading.Event(), {}, socket.create_server(("127.0.0.1", 0))
    client.set(streams.Keys(other).draining, 1)  # the hole is the only target
    try:
        hole = register_black_hole(client, stack.settings.cluster_secret, listening, stop)
        deadline = time.monotonic() + 30
        while True:  # drained again until the router takes the hole for ready (it warms
            drained.clear()  # its connections first, which takes their 2 s timeout)
            drain = threading.Thread(
                target=lambda: drained.update(call(port, "/admin/drain", {"replica": source}))
            )
            drain.start()
            while drain.is_alive() and not moving_to(client, hole):
                assert time.monotonic() < deadline, "the drain hangs before the move began"
                time.sleep(0.05)
            if moving_to(client, hole):
                break
            assert time.monotonic() < deadline, f"the drain never began the move: {drained}"
            time.sleep(0.3)
        time.sleep(1.0)  # the call to the hole waits
        stop.set()  # it stops registering
        drain.join(30)
        assert not drain.is_alive(), "the drain waits on a replica that never answers"
        assert drained["failed"] >= 1 and home(client, sid) == source, drained  # and others'
        play(port, [sid], history, rng, 1, resumed=True)
        check_one_shot([sid], history)
    finally:
        stop.set()
        listening.close()
        client.delete(streams.Keys(other).draining, streams.Keys(source).draining)
        client.srem(streams.REPLICAS, "9")


def test_a_close_that_meets_its_session_in_transit_keeps_the_placement_listed(
    steady: Stack, module_redis_client: redis.Redis
):
    """A close delivered to its replica after a move began (routed just before): the copy
    closes, the close answers 503 `moving` (it cannot stand: the directory has the
    session in transit), and the replica's compare-and-delete finds nothing to delete.
    The move is then undone (its source has no copy left to give): the placement put
    back must still be listed on that replica, for its sweep (placed_sweep.py) to settle.
    Taken away with the close, the listing left a placement nothing would ever look at
    again (the fault campaign's leaked placement key)."""
    stack, client, url = steady, module_redis_client, steady.settings.redis_url
    port = stack.settings.port
    deadline = time.monotonic() + 20
    while True:  # the router may still read the last test's replicas as drained (503)
        try:
            sid = call(port, "/open_session", {})
            break
        except urllib.error.HTTPError as err:
            assert err.code == 503 and time.monotonic() < deadline, err
            time.sleep(0.3)
    key = streams.placement_key(sid)
    placed = Placement.decode(client.get(key))
    target = "1" if placed.replica == "0" else "0"
    move = Move(sid, placed.replica, target, placed.epoch, secrets.token_hex(8))
    assert directory(url, "begin", move)
    source = stack.layout[f"scheduler-{placed.replica}"][1].port
    with pytest.raises(urllib.error.HTTPError) as err:
        call(source, "/close_session", {"session_id": sid})
    assert err.value.code == 503 and b"moving" in err.value.read()
    time.sleep(1.0)  # its heartbeats run the compare-and-delete: in transit, no match
    assert directory(url, "abort", move)
    assert Placement.decode(client.get(key)) == placed
    assert client.sismember(streams.Keys(placed.replica).placed, sid)
    with pytest.raises(urllib.error.HTTPError) as err:  # its client closes it again
        call(port, "/close_session", {"session_id": sid})
    assert err.value.code == 404  # closed: no copy anywhere
    assert refused(stack, placed.replica, sid) == 404 and refused(stack, target, sid) == 404
    client.delete(key)  # what the sweep does after its grace (tests/scheduler: the sweep)
    client.srem(streams.Keys(placed.replica).placed, sid)
