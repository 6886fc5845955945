"""custody's Redis operations through redis-py's cluster clients, on a real three-node
cluster: what shared/redis_client.py's docstring says custody must do, checked. Replica
"0" and replica "1" hash to slots that different nodes serve, so a command that reached
the wrong node would fail with MOVED and a pipeline or transaction that spanned them
would be refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import CrossSlotTransactionError

from shared import streams
from shared.redis_client import connect, connect_async, stream_keys
from shared.redis_server import PrivateCluster

K0, K1 = streams.Keys("0"), streams.Keys("1")
CROSS = [streams.REPLICAS, streams.placement_key("chat"), streams.request_key("rid-1")]


def names(keys: streams.Keys) -> list[str]:
    fixed = ["ownership", "forward", "results", "executor_alive", "scheduler_epoch", "alive"]
    fixed += ["sessions", "checkpoint", "snapshot_wanted", "tier_in_flight"]
    return [getattr(keys, name) for name in fixed] + [keys.session("chat")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateCluster]:
    server = PrivateCluster().start()
    yield server
    server.close()
    assert not server.dir.exists()


@pytest.fixture
def client(cluster: PrivateCluster) -> Iterator[RedisCluster]:
    rc = connect(cluster.url)
    for keys in (K0, K1):
        streams.ensure_group(rc, keys.forward, streams.EXECUTOR_GROUP)
        streams.ensure_group(rc, keys.ownership, streams.STORE_GROUP)
    yield rc
    rc.flushdb()  # every primary's
    rc.close()


def getkeys_calls(cluster: PrivateCluster) -> int:
    total = 0
    for url in cluster.urls:
        with redis.Redis.from_url(url) as node:
            total += node.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0)
    return total


def test_connect_tells_a_cluster_from_a_plain_redis(cluster: PrivateCluster, redis_url: str):
    assert len(set(cluster.urls)) == 3 and cluster.url == cluster.urls[0]
    for url, kind in ((cluster.url, RedisCluster), (redis_url, redis.Redis)):
        with connect(url) as client:
            assert type(client) is kind and client.ping()

    async def both() -> list[object]:
        clients = [await connect_async(cluster.url), await connect_async(redis_url)]
        for c in clients:
            assert await c.ping()
            await c.aclose()
        return clients

    cluster_client, plain = asyncio.run(both())
    assert type(cluster_client) is AsyncRedisCluster and type(plain) is aioredis.Redis


def test_a_replica_is_one_slot_and_two_replicas_two_nodes(client: RedisCluster):
    slots = [{client.cluster_keyslot(name) for name in names(keys)} for keys in (K0, K1)]
    assert len(slots[0]) == len(slots[1]) == 1 and slots[0] != slots[1]
    assert client.get_node_from_key(K0.forward) != client.get_node_from_key(K1.forward)
    assert len({client.cluster_keyslot(name) for name in CROSS}) == len(CROSS)


def test_session_store_transaction_on_one_replica(client: RedisCluster):
    for keys in (K0, K1):
        entry = client.xadd(keys.ownership, {"m": b"event"})
        client.xreadgroup(streams.STORE_GROUP, "store", {keys.ownership: ">"})
        client.hset(keys.session("gone"), "record", b"old")
        pipe = client.pipeline(transaction=True)
        pipe.hset(keys.session("chat"), "record", b"rec")
        pipe.sadd(keys.sessions, "chat")
        pipe.delete(keys.session("gone"))
        pipe.srem(keys.sessions, "gone")
        pipe.hset(keys.checkpoint, mapping={"seq": 7})
        pipe.xack(keys.ownership, streams.STORE_GROUP, entry)
        assert pipe.execute() == [1, 1, 1, 0, 1, 1]
        assert client.smembers(keys.sessions) == {b"chat"}
        assert client.xpending(keys.ownership, streams.STORE_GROUP)["pending"] == 0
    pipe = client.pipeline(transaction=True)
    pipe.sadd(K0.sessions, "x")
    pipe.sadd(K1.sessions, "x")
    with pytest.raises(CrossSlotTransactionError):
        pipe.execute()


def test_executor_pipeline_answers_and_blocks_on_the_next_read(
    client: RedisCluster, cluster: PrivateCluster
):
    before = getkeys_calls(cluster)
    for keys in (K0, K1):
        step = client.xadd(keys.forward, {"m": b"step"})
        [[_, [(read, _)]]] = client.xreadgroup(
            streams.EXECUTOR_GROUP, "exec", {keys.forward: ">"}, count=8, block=100
        )
        nxt = client.xadd(keys.forward, {"m": b"next"})
        pipe = client.pipeline(transaction=False)
        pipe.xadd(keys.results, {"m": b"result"}, maxlen=streams.MAXLEN, approximate=True)
        pipe.xack(keys.forward, streams.EXECUTOR_GROUP, step)
        pipe.xreadgroup(streams.EXECUTOR_GROUP, "exec", {keys.forward: ">"}, count=8, block=500)
        _, acked, [[stream, [(got, _)]]] = pipe.execute()
        assert (read, acked, stream, got) == (step, 1, keys.forward.encode(), nxt)
        pipe.xreadgroup(streams.EXECUTOR_GROUP, "exec", {keys.forward: ">"}, count=8, block=300)
        start = time.monotonic()
        assert pipe.execute() == [[]] and time.monotonic() - start >= 0.25  # it blocked
    pipe = client.pipeline(transaction=True)  # inside MULTI a read never blocks
    pipe.xreadgroup(streams.EXECUTOR_GROUP, "exec", {K0.forward: ">"}, count=8, block=2000)
    start = time.monotonic()
    assert pipe.execute() == [None] and time.monotonic() - start < 1
    assert getkeys_calls(cluster) == before  # the stream names were read off the arguments


def test_stream_reads_and_group_admin(client: RedisCluster):
    for keys in (K0, K1):
        first = client.xadd(keys.results, {"m": b"r1"})
        last = client.xadd(keys.results, {"m": b"r2"})
        assert client.xrevrange(keys.results, count=1)[0][0] == last
        [[_, entries]] = client.xread({keys.results: first}, count=8, block=200)
        assert [entry_id for entry_id, _ in entries] == [last]
        start = time.monotonic()
        assert client.xread({keys.results: last}, count=8, block=300) == []
        assert time.monotonic() - start >= 0.25
        client.xadd(keys.ownership, {"m": b"event"})
        client.xreadgroup(streams.STORE_GROUP, "dead", {keys.ownership: ">"})
        [group] = client.xinfo_groups(keys.ownership)
        assert (group["name"], group["pending"]) == (streams.STORE_GROUP.encode(), 1)
        assert client.xinfo_stream(keys.ownership)["length"] == 1
        _, claimed, _ = client.xautoclaim(
            keys.ownership, streams.STORE_GROUP, "live", 0, "0-0", count=256
        )
        assert [fields for _, fields in claimed] == [{b"m": b"event"}]


def test_single_keys_of_any_slot(client: RedisCluster):
    for keys in (K0, K1):
        assert client.set(keys.executor_alive, "e1", nx=True, px=5000)
        assert client.set(keys.executor_alive, "e2", nx=True, px=5000) is None
        assert 0 < client.pttl(keys.executor_alive) <= 5000
    client.sadd(streams.REPLICAS, "0", "1")
    client.set(streams.placement_key("chat"), "1")
    assert client.smembers(streams.REPLICAS) == {b"0", b"1"}
    got = [client.get(name) for name in (K0.executor_alive, K1.executor_alive, *CROSS[1:])]
    assert got == [b"e1", b"e1", b"1", None]


def test_async_scheduler_operations(client: RedisCluster, cluster: PrivateCluster):
    before = getkeys_calls(cluster)

    async def scenario(keys: streams.Keys) -> None:
        ac = await connect_async(cluster.url)
        pipe = ac.pipeline(transaction=True)  # as a first use: initialised
        pipe.sadd(keys.sessions, "chat")
        pipe.hset(keys.checkpoint, mapping={"seq": 1})
        assert await pipe.execute() == [1, 1]
        assert await ac.smembers(keys.sessions) == {b"chat"}
        pipe = ac.pipeline(transaction=False)  # the outbox's flush
        pipe.xadd(keys.ownership, {"m": b"event"}, maxlen=streams.MAXLEN, approximate=True)
        pipe.xadd(keys.forward, {"m": b"step"}, maxlen=streams.MAXLEN, approximate=True)
        _, step = await pipe.execute()
        assert (await ac.xrevrange(keys.forward, count=1))[0][0] == step
        [[_, [(got, _)]]] = await ac.xread({keys.forward: "0-0"}, count=8, block=200)
        assert got == step and await ac.xread({keys.forward: step}, block=200) == []
        assert (await ac.xinfo_groups(keys.ownership))[0]["lag"] == 1
        assert (await ac.xinfo_stream(keys.ownership))["length"] == 1
        assert await ac.set(keys.scheduler_epoch, "1", nx=True, px=5000)
        assert await ac.get(keys.scheduler_epoch) == b"1"
        assert await ac.exists(keys.snapshot_wanted) == 0
        await ac.aclose()

    asyncio.run(scenario(K0))
    asyncio.run(scenario(K1))
    assert getkeys_calls(cluster) == before


def test_stream_keys_reads_names_off_the_arguments():
    args = ("XREADGROUP", b"GROUP", "STREAMS", "COUNT", b"COUNT", "8", b"BLOCK", "5")
    assert stream_keys((*args, b"NOACK", b"STREAMS", "a", "b", ">", ">")) == ["a", "b"]
    assert stream_keys(("XREAD", b"STREAMS", "STREAMS", "0-0")) == ["STREAMS"]
    assert stream_keys(("XREAD", b"FUTURE", "1", b"STREAMS", "a", "0-0")) is None
    assert stream_keys(("GET", "a")) is None
