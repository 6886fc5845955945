"""The placement directory's moves on a real Redis: a move goes into transit only from the
placement its mover read, leaves it once (commit or abort, never both), and an abandoned
move is taken over by one router only once its lease has run out."""

from __future__ import annotations

import asyncio

import pytest

from fronts.directory import Directory
from services.scheduler.runtime import session_rebuild
from services.scheduler.runtime.placed_sweep import PlacedSweep
from shared import streams
from shared.placement import UNPLACE, Move, Placement
from shared.redis_client import connect_async
from tests.engine.driver import Driver


def test_a_placement_reads_back_as_written_and_refuses_what_it_is_not():
    written = (
        Placement("0"),
        Placement("r-1", 7),
        Placement("a", 3, "b"),
        Placement("a", 3, "b", "9f"),
    )
    for placement in written:
        assert Placement.decode(placement.encode().encode()) == placement
    assert Placement.decode(None) is None
    assert Placement.decode(b"0") == Placement("0", 1)  # written before epochs
    assert Placement("a", 3, "b").names("b") and not Placement("a", 3).names("b")
    for bad in ("a x", "a 1 b zz", "a 1 b c d", "", "a 1 ", "a\n 1"):
        with pytest.raises(ValueError):
            Placement.decode(bad)
    move = Move("s", "a", "b", 4)
    assert Move.decode(move.encode().encode()) == move
    assert (move.before, move.in_transit, move.after) == (
        Placement("a", 4),
        Placement("a", 4, "b"),  # a move listed before attempts: none in transit either
        Placement("b", 5),
    )
    # two attempts of one move from one epoch are in transit as two values
    assert Move("s", "a", "b", 4, "1f").in_transit.encode() == "a 4 b 1f"
    assert Move("s", "a", "b", 4, "1f").in_transit != Move("s", "a", "b", 4, "2e").in_transit


def run(redis_url: str, steps) -> object:
    async def go() -> object:
        client = await connect_async(redis_url)
        try:
            return await steps(Directory(client, lease_seconds=0.3))
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_move_commits_or_aborts_once_only_from_where_it_began_and_a_retry_answers_done(
    redis_url, redis_client
):
    async def steps(d: Directory) -> None:
        placed, new = await d.place("s", "a")
        assert new and placed == Placement("a") and not (await d.place("s", "b"))[1]
        stale = Move("s", "a", "b", 2)  # read at another epoch: refused, and not listed
        assert not await d.begin(stale) and not redis_client.zcard(streams.MOVES)
        move = Move("s", "a", "b", 1)
        assert await d.begin(move) and not await d.begin(Move("s", "a", "c", 1))
        assert await d.session("s") == move.in_transit
        assert await d.commit(move) and not await d.abort(move)
        # redis-py sends a command again after a connection error: a commit run twice
        # answers done, and changes nothing
        assert await d.commit(move) and await d.session("s") == Placement("b", 2)
        assert await d.session("s") == Placement("b", 2)
        assert await d.placed_on("b") == ["s"] and await d.placed_on("a") == []
        back = Move("s", "b", "a", 2)
        assert await d.begin(back) and await d.abort(back) and not await d.commit(back)
        assert await d.session("s") == Placement("b", 2)
        await d.done(move)
        await d.done(back)
        await d.renew(back)  # a renewal racing the end of its move lists nothing again
        assert not redis_client.zcard(streams.MOVES)

    run(redis_url, steps)


def test_an_abandoned_move_is_taken_over_once_its_lease_runs_out(redis_url):
    async def steps(d: Directory) -> None:
        await d.place("t", "a")
        move = Move("t", "a", "b", 1)
        assert await d.begin(move)
        assert await d.abandoned() == []  # its router's lease still runs
        await asyncio.sleep(0.4)
        first, second = await asyncio.gather(d.abandoned(), d.abandoned())
        assert sorted([first, second], key=len) == [[], [move]]  # one router takes it
        assert await d.abandoned() == []  # ... and holds it for a lease
        await d.done(move)

    run(redis_url, steps)


def test_an_unreadable_move_or_placement_is_dropped_or_taken_as_none_not_raised(
    redis_url, redis_client
):
    """One bad value in Redis must not stop the router's take-over loop or a scheduler's
    start: a move that does not read is dropped (logged), a placement that does not read
    is taken as none by the rebuild."""
    for bad in ("s a b", "s a b x", "s a b 1 2 3", "s a b 1 nonce"):
        with pytest.raises(ValueError):
            Move.decode(bad)
    redis_client.zadd(streams.MOVES, {"not a move": 0})

    async def steps(d: Directory) -> None:
        await d.place("u", "a")
        move = Move("u", "a", "b", 1)
        assert await d.begin(move)
        await asyncio.sleep(0.4)
        assert await d.abandoned() == [move]
        await d.done(move)

    run(redis_url, steps)
    assert redis_client.zcard(streams.MOVES) == 0
    redis_client.set(streams.placement_key("v"), "a 1 b c d")

    async def rebuilt() -> object:
        client = await connect_async(redis_url)
        try:
            return await session_rebuild._placement(client, "v")
        finally:
            await client.aclose()

    assert asyncio.run(rebuilt()) is None


def test_the_replica_s_placed_list_sheds_what_it_does_not_hold_after_a_grace(
    redis_url, redis_client
):
    """The fault campaign left members whose placement had gone (a close's router killed
    between its two writes) and placements naming a replica that did not hold the
    session. The replica's sweep removes each, only after the grace (an open in flight
    places a moment before it opens), never one in transit or held, and a placement only
    by compare-and-delete."""
    keys, now = streams.Keys("7"), [0.0]
    sessions = Driver().engine.sessions
    held = sessions.open("held").sid
    redis_client.sadd(keys.placed, held, "closed", "orphan", "transit", "elsewhere", "rewritten")
    put = {
        held: Placement("7"),
        "orphan": Placement("7", 2),
        "transit": Placement("7", 2, "8"),
        "elsewhere": Placement("8", 3),
        "rewritten": Placement("7"),
    }
    for sid, placed in put.items():
        redis_client.set(streams.placement_key(sid), placed.encode())

    async def walk(sweep: PlacedSweep) -> None:
        client = await connect_async(redis_url)
        await sweep.step(client)
        while sweep.cursor:
            await sweep.step(client)
        await client.aclose()

    sweep = PlacedSweep(keys, sessions, clock=lambda: now[0], grace=30.0)
    asyncio.run(walk(sweep))
    now[0] = 20.0
    redis_client.set(streams.placement_key("rewritten"), Placement("7", 2).encode())
    asyncio.run(walk(sweep))
    assert len(redis_client.smembers(keys.placed)) == 6  # nothing before the grace
    now[0] = 31.0
    asyncio.run(walk(sweep))
    left = {m.decode() for m in redis_client.smembers(keys.placed)}
    assert left == {held, "transit", "rewritten"}  # rewritten: its grace began again
    assert not redis_client.exists(streams.placement_key("orphan"))
    assert redis_client.get(streams.placement_key("elsewhere")) == b"8 3"  # not ours
    assert sweep.dropped == 3


def test_a_directory_that_hears_every_change_answers_from_memory_and_never_stale(
    redis_url, redis_client
):
    """A picker answers turns from the placements it keeps only while it hears every
    placement write (each publishes its key and new value): a move, a close or a
    replica's own close by another front must reach it, else it would send a turn where
    the session is not. Planted: writes that did not publish would leave the old
    placement here."""

    async def heard(listener: Directory) -> None:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if listener.hearing():
                return
        raise AssertionError("never subscribed")

    async def go() -> None:
        client = await connect_async(redis_url)
        listener, writer = Directory(client, 5.0), Directory(client, 5.0)
        following = asyncio.ensure_future(listener.follow_changes())
        await heard(listener)
        await writer.place("s", "a")
        assert await listener.current("s") == Placement("a")
        reads = redis_client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        assert await listener.current("s") == Placement("a")  # from memory: no read
        assert redis_client.info("commandstats")["cmdstat_get"]["calls"] == reads
        move = Move("s", "a", "b", 1)
        assert await writer.begin(move) and await writer.commit(move)  # another front moves it
        await asyncio.sleep(0.1)  # the notices, heard in order
        assert await listener.current("s") == Placement("b", 2)
        assert redis_client.info("commandstats")["cmdstat_get"]["calls"] == reads + 2  # the CASes
        unplace = client.register_script(UNPLACE)  # the replica's own close
        await unplace(keys=[streams.placement_key("s")], args=[Placement("b", 2).encode()])
        await asyncio.sleep(0.1)
        assert await listener.current("s") is None
        following.cancel()
        await asyncio.sleep(0.05)
        assert not listener.hearing()  # not hearing: every answer is read again
        await writer.place("t", "a")
        assert await listener.current("t") == Placement("a")
        redis_client.set(streams.placement_key("t"), "c 1")  # a write it cannot hear
        assert await listener.current("t") == Placement("c")
        await client.aclose()

    asyncio.run(go())
