"""The faults of the distributed campaign, each a way a distributed system really fails:
a process paused (SIGSTOP: a GC pause, a stall, a VM frozen) past the time after which
it is declared dead; one replica partitioned from Redis, slowed or its connections cut
(through its own proxy, redis_proxy.py); Redis refusing writes (a `maxmemory` OOM
window, a read-only window as after a failover); the session store lagging while a
scheduler restarts; a router killed in the middle of moving sessions; a drain under load;
a move whose target hangs; replies from replicas to the router lost; a scheduler's new
life paused at its first read of its records; the ownership stream trimmed past what a
paused store read, and the scheduler that wrote it killed.

Each fault is a function of the campaign's `Target` that returns what it hit, and ends
with everything it did undone: no fault outlives its window."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
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
    http_proxies: dict[str, RedisProxy]  # between the router and each replica's API
    replica: str
    pause_seconds: float  # longer than replica_dead_seconds

    @property
    def others(self) -> list[str]:
        return [r for r in sorted(self.proxies) if r != self.replica]

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


def hang_target(t: Target) -> str:
    """A drain of the other replicas moves sessions to this one, whose scheduler stops
    (SIGSTOP) once the moves have begun: each move must end (undone) once it stops
    registering, not wait for TCP to give up."""
    drains = [
        threading.Thread(target=post, args=(t.stack.settings.port, "/admin/drain", {"replica": r}))
        for r in t.others
    ]
    for thread in drains:
        thread.start()
    time.sleep(0.3)
    pause(t.process(f"scheduler-{t.replica}"), t.pause_seconds)
    for thread in drains:
        thread.join(60)
    for other in t.others:
        t.admin.delete(streams.Keys(other).draining)
    return f"scheduler-{t.replica}, moves to it under way"


def lost_reply(t: Target) -> str:
    """A drain of this replica while every answer of the others to the router is lost
    (the requests run): its moves' arrivals, and the releases of what an undone move
    left, are answered into the void."""
    for other in t.others:
        t.http_proxies[other].lose_replies()
    try:
        draining = threading.Thread(
            target=post, args=(t.stack.settings.port, "/admin/drain", {"replica": t.replica})
        )
        draining.start()
        time.sleep(t.pause_seconds)
    finally:
        for other in t.others:
            t.http_proxies[other].heal()
    draining.join(60)
    undrain(t)
    return f"replies of {', '.join(t.others)}, draining replica {t.replica}"


RECORD_READ = b"$6\r\nrecord\r\n"  # HGET <session key> record, as redis-py sends it


def restart_race(t: Target) -> str:
    """The scheduler killed; its new life, restarted by the supervisor, paused at its
    first read of its session records (after it read where they are placed) for longer
    than it takes the router to re-home them."""
    name, paused = f"scheduler-{t.replica}", threading.Event()

    def pause_new_life() -> None:
        os.kill(t.process(name).pid, signal.SIGSTOP)
        paused.set()

    seen = t.stack.restarts[name]
    t.process(name).kill()
    t.proxies[t.replica].trap((RECORD_READ,), pause_new_life)
    try:
        t.wait_restarted(name, seen)
        paused.wait(30)  # a life with no records never reads one
    finally:
        t.proxies[t.replica].disarm()
        if paused.is_set():
            time.sleep(t.pause_seconds)
            os.kill(t.process(name).pid, signal.SIGCONT)
    return name if paused.is_set() else f"{name} (it read no record)"


def trimmed_stream(t: Target) -> str:
    """The store paused until the scheduler has trimmed ownership entries it never read,
    then the scheduler killed: no life left can fill the gap, and the store must decide
    (its sessions end `session_lost`) rather than all wait for one another."""
    name, store = f"scheduler-{t.replica}", t.process("session-store")
    metrics = f"http://127.0.0.1:{t.stack.layout[name][1].port}/metrics"
    before = _trimmed_unread(metrics)  # this life's count so far (another fault's)
    os.kill(store.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _trimmed_unread(metrics) <= before:
            time.sleep(0.5)
        seen = t.stack.restarts[name]
        t.process(name).kill()
        t.wait_restarted(name, seen)
    finally:
        os.kill(store.pid, signal.SIGCONT)
    return name


def _trimmed_unread(metrics_url: str) -> float:
    """The scheduler's `custody_ownership_trimmed_unread_total`; 0 when it does not answer."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    counted = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("custody_ownership_trimmed_unread_total")
    ]
    return sum(counted)


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
        hang_target,
        lost_reply,
        restart_race,
        trimmed_stream,
    )
}
