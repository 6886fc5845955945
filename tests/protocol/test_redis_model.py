"""The model checker's Redis against the real one: each directory script custody runs
(fronts/directory.py's PLACE and SWAP, shared/placement.py's UNPLACE) and its model
(redis_model.py) are given the same key state and arguments, generated, and must agree
on the value after, the answer and the change notice published. So are the leases: the
moves' sorted set under `Directory`'s own begin, renew, done and abandoned (its clock
stopped at a generated moment) and its TAKE_OVER script, and a `KeyLease`'s key under its
own take and its RENEW and RELEASE scripts, a held key live or already past its expiry.
So a changed script or call (a renew without XX, a release without its token check) or a
Redis that expires or scores otherwise fails here.

What it cannot catch: Redis behaviour beyond one operation on one state (the model
checker takes each as atomic, as Redis runs it; begin's three commands and abandoned's
one TAKE_OVER per move are not, and what other routers write between them is the
world's to interleave), a key read at the very millisecond of its expiry (Redis's clock
runs here: expiries are compared to the second), unreadable moves (abandoned drops them;
none is generated), and when a `KeyLease` renews (its loop, not its script)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from unittest import mock

import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from fronts.directory import PLACE, SWAP, TAKE_OVER, Directory
from shared import streams
from shared.key_lease import RELEASE, RENEW, KeyLease
from shared.placement import UNPLACE, Move, Placement
from tests.protocol import redis_model

KEY = streams.placement_key("model-check")
PLACEMENTS = [
    Placement("a", 1),
    Placement("b", 2),
    Placement("a", 1, "b", "1f"),
    Placement("a", 1, "b", "2e"),
    Placement("a", 1, "b"),
]
VALUES = st.sampled_from([p.encode() for p in PLACEMENTS])
SCRIPTS = {
    "place": (PLACE, lambda value, old, new: redis_model.place(KEY, value, new), 1),
    "swap": (SWAP, lambda value, old, new: redis_model.swap(KEY, value, old, new), 2),
    "unplace": (UNPLACE, lambda value, old, new: redis_model.unplace(KEY, value, old), 1),
}
MOVES = [
    Move("model-check", "a", "b", 1, "1f"),
    Move("model-check", "a", "b", 1),
    Move("x", "b", "a", 2),
]
MOVE_OPS = {
    "begin": lambda moves, move, now, lease, placed: (
        redis_model.begin(moves, move, now, lease, placed),
        placed,
    ),
    "renew": lambda moves, move, now, lease, placed: (
        redis_model.renew(moves, move, now, lease),
        None,
    ),
    "done": lambda moves, move, now, lease, placed: (redis_model.done(moves, move), None),
    "take_over": lambda moves, move, now, lease, placed: redis_model.take_over(
        moves, move, now, now + lease
    ),
    "abandoned": lambda moves, move, now, lease, placed: redis_model.abandoned(moves, now, lease),
}
LEASE_KEY = "custody:model-check:lease"
TOKENS = ["mine", "theirs"]
KEY_OPS = {
    "take": lambda key, token, ms: redis_model.take_key(key, token, ms, 0),
    "renew": lambda key, token, ms: redis_model.renew_key(key, token, ms, 0),
    "release": lambda key, token, ms: redis_model.release_key(key, token, 0),
}


def real(client: redis.Redis, name: str, value: str | None, old: str, new: str) -> tuple:
    """The script run on Redis with the key at `value`: (value after, answer, notice)."""
    script, _, argc = SCRIPTS[name]
    client.delete(KEY)
    if value is not None:
        client.set(KEY, value)
    notices = client.pubsub(ignore_subscribe_messages=True)
    notices.subscribe(streams.PLACEMENT_CHANGES)
    notices.get_message(timeout=1.0)  # the subscription's confirmation
    args = [new] if name == "place" else [old, new][:argc]
    answer = client.register_script(script)(keys=[KEY], args=args)
    message = notices.get_message(timeout=0.2)
    notices.close()
    after = client.get(KEY)
    notice = None if message is None else message["data"].decode()
    return (None if after is None else after.decode()), answer, notice


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(SCRIPTS)),
    value=st.none() | VALUES,
    old=VALUES,
    new=VALUES,
)
def test_each_directory_script_does_what_the_checker_assumes(
    redis_url: str, name: str, value: str | None, old: str, new: str
):
    client = redis.Redis.from_url(redis_url)
    try:
        model = SCRIPTS[name][1](value, old, new)
        assert real(client, name, value, old, new) == model, (name, value, old, new)
    finally:
        client.delete(KEY)
        client.close()


async def directory_call(
    redis_url: str, name: str, move: Move, now: float, lease: float
) -> bool | tuple[str, ...] | None:
    """`Directory`'s own `name` (of `move`, but abandoned) with its clock stopped at `now`;
    abandoned's moves as encoded."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        with mock.patch("fronts.directory.time", SimpleNamespace(time=lambda: now)):
            call = getattr(Directory(client, lease), name)
            if name == "abandoned":
                return tuple(taken.encode() for taken in await call())
            return await call(move)
    finally:
        await client.aclose()


def real_moves(
    client: redis.Redis,
    redis_url: str,
    name: str,
    moves: redis_model.Moves,
    move: Move,
    now: float,
    lease: float,
    placed: bool,
) -> tuple:
    """`name` run on Redis with the moves listed as `moves` and, for begin, the session
    placed where `move` starts (`placed`) or not: (moves after, answer)."""
    client.delete(streams.MOVES, streams.placement_key(move.sid))
    if moves:
        client.zadd(streams.MOVES, dict(moves))
    if placed:
        client.set(streams.placement_key(move.sid), move.before.encode())
    if name == "take_over":
        args = [move.encode(), now, now + lease]
        answer = client.register_script(TAKE_OVER)(keys=[streams.MOVES], args=args)
    else:
        answer = asyncio.run(directory_call(redis_url, name, move, now, lease))
    after = client.zrange(streams.MOVES, 0, -1, withscores=True)
    return tuple((member.decode(), score) for member, score in after), answer


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(MOVE_OPS)),
    leases=st.dictionaries(
        st.sampled_from([m.encode() for m in MOVES]),
        st.sampled_from([-30.0, -0.5, 0.0, 0.5, 30.0]),  # its lease's end, from now
    ),
    move=st.sampled_from(MOVES),
    now=st.floats(min_value=1.7e9, max_value=1.8e9),
    lease=st.sampled_from([0.5, 30.0]),
    placed=st.booleans(),
)
def test_each_move_lease_operation_does_what_its_model_says(
    redis_url: str,
    name: str,
    leases: dict[str, float],
    move: Move,
    now: float,
    lease: float,
    placed: bool,
):
    client = redis.Redis.from_url(redis_url)
    try:
        moves = redis_model.listed({member: now + end for member, end in leases.items()})
        model = MOVE_OPS[name](moves, move.encode(), now, lease, placed)
        got = real_moves(client, redis_url, name, moves, move, now, lease, placed)
        assert got == model, (name, moves, move, now, lease, placed)
    finally:
        client.delete(streams.MOVES, streams.placement_key(move.sid))
        client.close()


async def take(redis_url: str, token: str, ms: int) -> tuple[redis_model.Lease, int]:
    """`KeyLease.held`'s take, as `token`'s holder: (the key read while held, taken)."""
    client = aioredis.Redis.from_url(redis_url)
    holder = KeyLease(client, LEASE_KEY, ms / 1000)
    holder.token = token
    try:
        async with holder.held() as taken:  # released on leaving: read it inside
            return read_lease(await client.get(LEASE_KEY), await client.pttl(LEASE_KEY)), taken
    finally:
        await client.aclose()


def read_lease(value: bytes | None, pttl: int) -> redis_model.Lease:
    """The key as the model has it, its expiry from `PTTL` rounded up to the second (the
    milliseconds run since the model's now, when the key was written)."""
    if value is None:
        return redis_model.NO_KEY
    return value.decode(), None if pttl == -1 else math.ceil(pttl / 1000) * 1000


def real_lease(
    client: redis.Redis, redis_url: str, name: str, key: redis_model.Lease, token: str, ms: int
) -> tuple[redis_model.Lease, int]:
    """`name` run on Redis with the key as `key` (its expiry from Redis's now, which is the
    model's 0): (key after, answer)."""
    client.delete(LEASE_KEY)
    held, expiry = key
    if held is not None:
        seconds, micros = client.time()
        pxat = None if expiry is None else seconds * 1000 + micros // 1000 + expiry
        client.set(LEASE_KEY, held, pxat=pxat)  # at once absent if already past it
    if name == "take":
        return asyncio.run(take(redis_url, token, ms))
    script, args = (RENEW, [token, ms]) if name == "renew" else (RELEASE, [token])
    answer = client.register_script(script)(keys=[LEASE_KEY], args=args)
    return read_lease(client.get(LEASE_KEY), client.pttl(LEASE_KEY)), answer


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(KEY_OPS)),
    key=st.just(redis_model.NO_KEY)
    | st.tuples(st.sampled_from(TOKENS), st.none() | st.sampled_from([-1_000, 20_000])),
    token=st.sampled_from(TOKENS),
    ms=st.sampled_from([5_000, 40_000]),
)
def test_each_key_lease_operation_does_what_its_model_says(
    redis_url: str, name: str, key: redis_model.Lease, token: str, ms: int
):
    client = redis.Redis.from_url(redis_url)
    try:
        model = KEY_OPS[name](key, token, ms)
        assert real_lease(client, redis_url, name, key, token, ms) == model, (name, key, token, ms)
    finally:
        client.delete(LEASE_KEY)
        client.close()
