"""`custody soak --faults distributed`: replicas behind the router under session load,
while faults of every kind in fault_kinds.py are injected one after another, and the
history checker (history.py) watches what the clients were told.

The stack: `--replicas` replicas, each a scheduler and an executor that reach Redis only
through their own proxy (redis_proxy.py), one session store and the router (which reach
Redis directly); eager execution, a short heartbeat and `--replica-dead-seconds`. After
every fault, once the stack is ready again, every held session is probed on the replicas
its placement does not name (a second live copy answers). At the end every session is
closed and the cache flushed; then every ledger must hold nothing (`leaked_slots`), and
no placement, move, placed-set member or blob may be left (`leaked_placements`).

Prints one line per fault (when, which kind, what it hit, how long, and whether each
invariant held over the turns that overlapped it) and, with --json, a summary with
exactly the keys of `SUMMARY_KEYS`."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import urllib.request
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from custody.soak.fault_kinds import KINDS, Target
from custody.soak.history import Turn, judge, wrong_outputs
from custody.soak.redis_proxy import RedisProxy
from custody.soak.session_load import SessionLoad, post
from custody.soak.verdict import disowned
from custody.up import Backoff, Stack, layout
from fronts.migration import MOVE_SECONDS
from services.scheduler.runtime.placed_sweep import GRACE_SECONDS as SWEEP_GRACE_SECONDS
from shared import streams
from shared.config import Settings

SUMMARY_KEYS = (
    "faults",
    "stale_turns",
    "twin_copies",
    "wrong_outputs",
    "leaked_slots",
    "leaked_placements",
    "stuck_sessions",
    "lost_sessions",
    "deaths_outside_faults",
)
WORKERS = 6
# a replica's ownership stream keeps twice this unread: a store paused for a fault's
# window falls further behind under the load, so trimmed_stream meets a real unread trim
STREAM_MAXLEN = 300
# beyond the sweep's grace: its walks (a heartbeat each) and a loaded machine's lag
CLEANUP_MARGIN_SECONDS = 15.0
SETTLE_SECONDS = 1.5  # after a fault, once the stack is ready again, before the next
POOLS = {
    "page_size": 4,
    "kv_pages": 512,
    "mamba_slots": 48,
    "max_running_requests": 12,
    "context_len": 1024,
    "chunk_size": 32,
    "max_step_tokens": 128,
    "track_interval": 8,
}


class Campaign:
    def __init__(self, duration: float, replicas: int, dead_seconds: float) -> None:
        self.duration, self.dead_seconds = duration, dead_seconds
        self.settings = Settings.ephemeral(
            replicas=replicas,
            replica_dead_seconds=dead_seconds,
            heartbeat_seconds=0.2,
            executor_timeout_seconds=2.0,
            compile=False,
            stream_maxlen=STREAM_MAXLEN,
            **POOLS,
        )
        self.proxies: dict[str, RedisProxy] = {}
        self.http_proxies: dict[str, RedisProxy] = {}  # router -> each replica's API
        self.stack = Stack(self.settings, plan=self.plan)
        self.stack.backoff = {name: Backoff(ceiling=2.0) for name in self.stack.backoff}
        self.admin = redis.Redis.from_url(self.stack.settings.redis_url)
        # a session refused 503 longer than this is stuck: 3 dead periods and a move
        stuck = 3 * dead_seconds + MOVE_SECONDS
        self.load = SessionLoad(self.settings.port, WORKERS, self.settings.context_len, stuck)
        self.deaths: list[tuple[float, str]] = []  # (when, replica) a front declared dead
        self._dead_counted: dict[str, float] = {}  # the router's count, as last read
        self._deaths_read = 0.0
        self.rows: list[dict] = []  # one per fault injected
        self.examples: list[str] = []  # what the checker found, a few
        self.turns_acked = 0
        self.left_behind: list[str] = []  # what leaked_placements counts, named
        self.orphans = 0  # sessions opened for a client that never heard so, closed at the end
        self.started = time.monotonic()

    def plan(self, settings: Settings) -> dict[str, tuple[str, Settings]]:
        """`custody up`'s children, each replica's scheduler and executor through their
        replica's proxy; each scheduler advertising an address of its own on the
        loopback (127.0.0.<2 + n>), where its HTTP proxy listens for the router."""
        port = int(settings.redis_url.rsplit(":", 1)[1].split("/")[0])
        children = {}
        for name, (module, own) in layout(settings).items():
            if name.startswith(("scheduler-", "executor-")):
                if own.replica not in self.proxies:
                    self.proxies[own.replica] = RedisProxy(port)
                proxy = self.proxies[own.replica]
                own = dataclasses.replace(own, redis_url=proxy.url)
            if name.startswith("scheduler-"):
                address = f"127.0.0.{2 + len(self.http_proxies)}"
                self.http_proxies[own.replica] = RedisProxy(own.port, own.host, listen=address)
                own = dataclasses.replace(own, advertise_host=address)
            children[name] = (module, own)
        return children

    @property
    def replica_ports(self) -> dict[str, int]:
        return {s.replica: s.port for n, (_, s) in self.stack.layout.items() if n.startswith("sch")}

    def run(self) -> dict:
        self.stack.start_all()
        try:
            self.stack.wait_healthy()
            threads = [
                threading.Thread(target=self.load.worker, args=(k,), daemon=True)
                for k in range(WORKERS)
            ]
            threads.append(threading.Thread(target=self.faults, daemon=True))
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + self.duration
            while time.monotonic() < deadline or threads[-1].is_alive():
                self.stack.supervise_once()
                self.watch_deaths()
                time.sleep(0.1)
                if time.monotonic() >= deadline:
                    self.load.stop.set()
            for thread in threads:
                while thread.is_alive():
                    self.stack.supervise_once()
                    thread.join(0.1)
            self.stack.wait_healthy(120)
            leaked_slots, leaked_placements = self.end()
        finally:
            self.stack.stop()
            for proxy in [*self.proxies.values(), *self.http_proxies.values()]:
                proxy.close()
        return self.summary(leaked_slots, leaked_placements)

    def faults(self) -> None:
        """One fault after another, every kind in turn (shuffled each round), until the
        load stops; none starts in the last 15 s, so the end settles."""
        rng = random.Random(7)
        replicas = sorted(self.replica_ports)
        deadline = self.started + self.duration - 15
        kinds: list[str] = []
        while time.monotonic() < deadline:
            if not kinds:
                kinds = list(KINDS)
                rng.shuffle(kinds)
            kind = kinds.pop()
            target = Target(
                self.stack,
                self.admin,
                self.proxies,
                self.http_proxies,
                rng.choice(replicas),
                self.dead_seconds + 1.5,
            )
            began = time.monotonic()
            try:
                hit = KINDS[kind](target)
            except Exception as err:  # an injection that fails is reported, not fatal
                hit = f"injection failed: {err!r}"
            self.settled()
            self.load.probe(self.admin, self.replica_ports)
            self.rows.append(
                {"at": round(began - self.started, 1), "kind": kind, "hit": hit, "began": began}
                | {"seconds": round(time.monotonic() - began, 1), "ended": time.monotonic()}
            )

    def watch_deaths(self) -> None:
        """Note each replica the router newly declares dead (its
        `custody_router_replicas_declared_dead_total`), once a second."""
        now = time.monotonic()
        if now - self._deaths_read < 1.0:
            return
        self._deaths_read = now
        for replica, count in dead_counts(self.settings.port).items():
            last = self._dead_counted.get(replica, 0.0)
            new = count - last if count >= last else count  # a restarted router counts anew
            self.deaths += [(now, replica)] * int(new)
            self._dead_counted[replica] = count

    def deaths_outside_faults(self) -> list[tuple[float, str]]:
        """Deaths declared outside every fault's window (its start to its end plus a
        dead period and a settle: a death is declared `dead_seconds` after the last
        registration, and read a second late)."""
        margin = self.dead_seconds + SETTLE_SECONDS + 2.0
        return [
            (at, r)
            for at, r in self.deaths
            if not any(row["began"] <= at <= row["ended"] + margin for row in self.rows)
        ]

    def settled(self, timeout: float = 60.0) -> None:
        """Until the router sees every replica ready, then a little longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if get(self.settings.port, "/health").get("ready") == self.settings.replicas:
                break
            time.sleep(0.3)
        time.sleep(SETTLE_SECONDS)

    def end(self) -> tuple[dict[str, int], int]:
        """Close every session the load opened, flush the cache, and read what is left.
        An open whose answer was lost (a router killed or paused mid-open) leaves a live
        session no client knows: the directory names it, and it is closed through the
        router as the client would once it learned the id (`orphans`). A placement whose
        close then finds no session anywhere is left behind, as is everything else. What
        is cleaned up after the answers (a blob is deleted with its replica's next step,
        a placement removed after its close) has as long as a replica's sweep of its placed
        list takes to drop an untrue member (`placed_sweep.GRACE_SECONDS`, from when it first
        met it) and a margin: a shorter wait raced the sweep, and failed now and then on a
        member the sweep was about to drop."""
        opened = {t.sid for t in self.load.turns}
        for sid in opened:
            self.load.close(sid)
        prefix = streams.placement_key("")
        named = {k.decode().removeprefix(prefix) for k in self.placements()}
        for sid in named - opened:
            status, _ = post(self.settings.port, "/close_session", {"session_id": sid})
            self.orphans += status == 200
        post(self.settings.port, "/flush_cache", {})
        deadline = time.monotonic() + SWEEP_GRACE_SECONDS + CLEANUP_MARGIN_SECONDS
        while True:
            views = get(self.settings.store_port, "/ledger/replicas").get("replicas", {})
            leaked = {r: sum(len(s) for s in v["leaked"].values()) for r, v in views.items()}
            left = self._left_behind()
            if not (any(leaked.values()) or left) or time.monotonic() > deadline:
                break
            self.stack.supervise_once()
            time.sleep(0.5)
        self.left_behind = left
        return leaked, len(left)

    def _left_behind(self) -> list[str]:
        """Every placement, move, placed-set member and blob still there."""
        left = [k.decode() for k in self.placements()]
        left += [f"move {m.decode()}" for m in self.admin.zrange(streams.MOVES, 0, -1)]
        for r in self.replica_ports:
            left += [
                f"placed on {r}: {m.decode()}" for m in self.admin.smembers(streams.Keys(r).placed)
            ]
        state_dir = Path(self.stack.settings.state_dir)
        return left + [
            f"blob {p.relative_to(state_dir)}" for p in state_dir.rglob("*") if p.is_file()
        ]

    def placements(self) -> list[bytes]:
        return list(self.admin.scan_iter(match=streams.placement_key("*")))

    def summary(self, leaked_slots: dict[str, int], leaked_placements: int) -> dict:
        """The JSON summary (`SUMMARY_KEYS`), and each fault's row with the invariants
        over the turns that overlapped its window."""
        turns = self.load.turns
        verdict = judge(turns)
        wrong = wrong_outputs(turns, disowned)
        for row in self.rows:

            def inside(found: list[Turn], row: dict = row) -> int:
                return sum(t.ended >= row["began"] and t.started <= row["ended"] for t in found)

            row["stale_turns"] = inside(verdict.stale)
            row["twin_copies"] = inside(verdict.twins)
            row["wrong_outputs"] = inside(wrong)
        faults = dict.fromkeys(KINDS, 0)
        for row in self.rows:
            faults[row["kind"]] += not row["hit"].startswith("injection failed")
        self.examples = verdict.examples
        self.turns_acked = sum(t.kind == "turn" and t.status == 200 for t in turns)
        return {
            "faults": faults,
            "stale_turns": len(verdict.stale),
            "twin_copies": len(verdict.twins),
            "wrong_outputs": len(wrong),
            "leaked_slots": leaked_slots,
            "leaked_placements": leaked_placements,
            "stuck_sessions": len(self.load.stuck),
            "lost_sessions": len(self.load.lost),
            "deaths_outside_faults": len(self.deaths_outside_faults()),
        }


def dead_counts(port: int) -> dict[str, float]:
    """The router's count of deaths declared, by replica; {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "custody_router_replicas_declared_dead_total"
    }


def get(port: int, path: str) -> dict:
    """A GET's JSON body; {} when no answer came."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return {}
