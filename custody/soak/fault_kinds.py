"""The faults of the distributed campaign, each a way a distributed system really fails:
a process paused (SIGSTOP: a GC pause, a stall, a VM frozen) past the time after which
it is declared dead; one replica partitioned from Redis, slowed or its connections cut
(through its own proxy, redis_proxy.py); Redis refusing writes (a `maxmemory` OOM
window, a read-only window as after a failover); the session store lagging while a
scheduler restarts; a router killed in the middle of moving sessions; a drain under load.

Each fault is a function of the campaign's `Target` that returns what it hit, and ends
with everything it did undone: no fault outlives its window."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from custody.soak.redis_proxy import RedisProxy
from custody.soak.session_load import post
from custody.up import Stack
from shared import streams
from shared.redis_server import free_port


@dataclass
class Target:
    """What a fault acts on: the stack, its Redis, each replica's proxy, and the replica
    chosen for this fault."""

    stack: Stack
    admin: redis.Redis  # straight to Redis, never through a proxy
    proxies: dict[str, RedisProxy]
    replica: str
    pause_seconds: float  # longer than replica_dead_seconds

    def process(self, name: str) -> subprocess.Popen:
        return self.stack.children[name]

    def wait_restarted(self, name: str, seen: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.stack.restarts[name] == seen and time.monotonic() < deadline:
            time.sleep(0.1)  # the campaign's supervisor restarts it


def pause(proc: subprocess.Popen, seconds: float) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def pause_scheduler(t: Target) -> str:
    pause(t.process(f"scheduler-{t.replica}"), t.pause_seconds)
    return f"scheduler-{t.replica}"


def pause_executor(t: Target) -> str:
    pause(t.process(f"executor-{t.replica}"), t.pause_seconds)
    return f"executor-{t.replica}"


def pause_store(t: Target) -> str:
    pause(t.process("session-store"), t.pause_seconds)
    return "session-store"


def pause_router(t: Target) -> str:
    pause(t.process("router"), t.pause_seconds)
    return "router"


def pause_redis(t: Target) -> str:
    pause(t.stack.redis.proc, t.pause_seconds)
    return "redis"


def partition(t: Target) -> str:
    _proxy_window(t, t.proxies[t.replica].partition)
    return f"replica {t.replica}"


def latency(t: Target) -> str:
    _proxy_window(t, lambda: t.proxies[t.replica].slow(0.2))
    return f"replica {t.replica} +200 ms"


def _proxy_window(t: Target, start: Callable[[], None]) -> None:
    """`start` a fault of the replica's proxy, and heal it after as long as a pause."""
    start()
    try:
        time.sleep(t.pause_seconds)
    finally:
        t.proxies[t.replica].heal()


def cut(t: Target) -> str:
    for _ in range(3):
        t.proxies[t.replica].cut()
        time.sleep(0.5)
    return f"replica {t.replica} x3"


def oom(t: Target) -> str:
    """Redis refuses every write (`OOM command not allowed`) for longer than a
    registration lives."""
    saved = t.admin.config_get("maxmemory*")
    t.admin.config_set("maxmemory-policy", "noeviction")
    t.admin.config_set("maxmemory", 1)
    try:
        time.sleep(t.pause_seconds)
    finally:
        t.admin.config_set("maxmemory", saved["maxmemory"])
        t.admin.config_set("maxmemory-policy", saved["maxmemory-policy"])
    return "redis"


def readonly(t: Target) -> str:
    """Redis turned into a replica of a master that is not there: it keeps its data and
    answers reads, and refuses writes with READONLY, as after a failover."""
    t.admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    try:
        time.sleep(t.pause_seconds)
    finally:
        t.admin.execute_command("REPLICAOF", "NO", "ONE")
    return "redis"


def store_lag(t: Target) -> str:
    """The store paused while a scheduler restarts: the scheduler must not take its
    sessions back from records the store has not caught up on."""
    name = f"scheduler-{t.replica}"
    store = t.process("session-store")
    os.kill(store.pid, signal.SIGSTOP)
    try:
        seen = t.stack.restarts[name]
        t.process(name).kill()
        t.wait_restarted(name, seen)
        time.sleep(2.0)
    finally:
        os.kill(store.pid, signal.SIGCONT)
    return name


def router_kill_mid_migration(t: Target) -> str:
    """A drain through the router, the router SIGKILLed while it moves sessions: the
    restarted router finishes or undoes each move from the directory."""
    port = t.stack.settings.port
    body = {"replica": t.replica}
    draining = threading.Thread(target=post, args=(port, "/admin/drain", body), daemon=True)
    seen = t.stack.restarts["router"]
    draining.start()
    time.sleep(0.3)
    t.process("router").kill()
    t.wait_restarted("router", seen)
    draining.join(5)
    undrain(t)
    return f"router, draining replica {t.replica}"


def drain(t: Target) -> str:
    post(t.stack.settings.port, "/admin/drain", {"replica": t.replica})
    undrain(t)
    return f"replica {t.replica}"


def undrain(t: Target) -> None:
    """What a restart of the drained replica's scheduler does (it takes work again),
    without the restart: the campaign needs both replicas placeable again."""
    t.admin.delete(streams.Keys(t.replica).draining)


KINDS: dict[str, Callable[[Target], str]] = {
    f.__name__: f
    for f in (
        pause_scheduler,
        pause_executor,
        pause_store,
        pause_router,
        pause_redis,
        partition,
        latency,
        cut,
        oom,
        readonly,
        store_lag,
        router_kill_mid_migration,
        drain,
    )
}
