"""Redis clients for one Redis or a Redis Cluster, told apart by asking the server.

A plain client on a cluster node answers MOVED for every key another node serves, so
every service connects through `connect` (or `connect_async`): one probe connection asks
`INFO cluster` and is closed, then the cluster client or the plain client is returned.
Checked against a real cluster (tests/test_redis_cluster.py, redis-py 8.1), what custody
must do on a cluster:

- Keep every multi-key command, transaction and pipeline on one replica's names
  (`streams.Keys`, hash tag `{r<id>}`, one slot). `pipeline(transaction=True)` over
  two slots raises `CrossSlotTransactionError`; on one slot it is MULTI/EXEC on that
  slot's node. A `transaction=False` pipeline on one slot is one round trip to one node.
- Queue a blocking XREADGROUP or XREAD only on a `pipeline(transaction=False)`: inside
  MULTI, Redis (any Redis) never blocks and the read returns nothing at once.
- On redis.asyncio, use `transaction=False` pipelines only. Its transactional cluster
  pipeline resolves each queued command's slot on a new thread with its own event loop
  (`asyncio.run`): a thread per command, and a connection opened there (the client's
  first initialisation, a `COMMAND GETKEYS`) is bound to a dead loop and fails later
  ("attached to a different loop"). `connect_async` initialises the client first.
- Use only database 0 (a cluster has no other; the URL's `/0` is accepted).
- Type a pipeline as `redis.client.Pipeline | redis.cluster.ClusterPipeline`: the
  cluster pipeline is not a subclass.
- Cross-replica names (`streams.REPLICAS`, `placement_key`, `request_key`) are single
  keys of various slots: single-key commands, one at a time, work on any of them.

redis-py (sync and asyncio) finds the slot of an XREAD or XREADGROUP (whose keys follow
`STREAMS`) by asking the server `COMMAND GETKEYS`, twice per call: three round trips per
read, on the executor's hot path. The cluster clients here read those names off the
arguments instead (measured: an XREADGROUP 0.9 ms, then as fast as on one Redis).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio as aioredis
from redis._parsers.commands import AsyncCommandsParser, CommandsParser
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

_STREAM_READS = {"XREAD", "XREADGROUP"}
_OPTION_ARGS = {"GROUP": 2, "COUNT": 1, "BLOCK": 1, "NOACK": 0, "CLAIM": 1}
_OPTION_ARGS |= {"MAXCOUNT": 1, "MAXSIZE": 1}


def _word(arg: object) -> str:
    return (arg.decode() if isinstance(arg, bytes) else str(arg)).upper()


def stream_keys(args: tuple) -> list | None:
    """The streams an XREAD or XREADGROUP reads, from its arguments (the command name
    first); None for any other command or an option not known here (the server is asked)."""
    if _word(args[0]) not in _STREAM_READS:
        return None
    i = 1
    while i < len(args) and _word(args[i]) != "STREAMS":
        if _word(args[i]) not in _OPTION_ARGS:
            return None
        i += 1 + _OPTION_ARGS[_word(args[i])]
    names = args[i + 1 :]
    return list(names[: len(names) // 2]) or None


class _Keys(CommandsParser):
    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        keys = stream_keys(args)
        return keys if keys is not None else super().get_keys(redis_conn, *args)


class _AsyncKeys(AsyncCommandsParser):
    async def get_keys(self, *args: Any) -> Any:
        keys = stream_keys(args)
        return keys if keys is not None else await super().get_keys(*args)


def connect(url: str, **options: Any) -> redis.Redis | RedisCluster:
    """A client for the Redis at `url`: the cluster client when it is a cluster node.
    `options` go to `from_url` (timeouts, say) of the probe and of the client."""
    probe = redis.Redis.from_url(url, **options)
    try:
        cluster = probe.info("cluster").get("cluster_enabled") == 1
    finally:
        probe.close()
    if not cluster:
        return redis.Redis.from_url(url, **options)
    client = RedisCluster.from_url(url, **options)
    client.commands_parser = _Keys(client)
    return client


async def connect_async(url: str, **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """`connect` for redis.asyncio. A cluster client comes back initialised (its slot
    map read), so no later first use happens where it cannot (see above)."""
    probe = aioredis.Redis.from_url(url, **options)
    try:
        cluster = (await probe.info("cluster")).get("cluster_enabled") == 1
    finally:
        await probe.aclose()
    if not cluster:
        return aioredis.Redis.from_url(url, **options)
    client = AsyncRedisCluster.from_url(url, **options)
    client.commands_parser = _AsyncKeys()
    await client.initialize()
    return client


async def warm_async(client: aioredis.Redis | AsyncRedisCluster, connections: int) -> None:
    """Open `connections` connections of `client`'s pool now (concurrent pings each take
    one): a burst of requests then finds them open, instead of paying a connect and its
    handshake's round trips on the request's own path."""
    await asyncio.gather(*(client.ping() for _ in range(connections)))
