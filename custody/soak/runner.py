"""One soak run: the stack on small pools with two tenant keys and an operator key, the
greedy workers, the hostile client and (with chaos) the tier drill and the monkey, all
under a supervisor loop; then every session closed, the cache flushed, and the verdict.

With chaos the stack runs small state tiers too: device pools the greedy workers' open
sessions outnumber (each keeps `LANES` open), a host tier of about one device's worth of
KV, so it fills and spills, a disk tier of a few blobs (the stack's private state_dir),
and every tier move slowed half-way, so a kill can land inside one."""

from __future__ import annotations

import contextlib
import random
import threading
import time

from custody.soak.chaos import Chaos
from custody.soak.client import Reply, call
from custody.soak.drill import TierDrill
from custody.soak.greedy import Greedy
from custody.soak.hostile import Hostile
from custody.soak.tally import OK, Tally
from custody.soak.tiers import MoveCount
from custody.soak.verdict import diagnosis, failures, held_slots, replay, settle
from custody.up import Backoff, Stack
from shared.config import Settings

WORKERS = 6
LANES = 3  # open sessions per greedy worker, with chaos
TENANT_KEYS = ["soak-tenant-a", "soak-tenant-b"]
ADMIN_KEY = "soak-operator"
POOLS = {"kv_pages": 160, "mamba_slots": 40, "max_running_requests": 12}
# With chaos: 2,048 device KV positions and 40 Mamba slots (8 running requests hold 32)
# for 18 open sessions of up to ~750 positions; the host tier, from bytes in the device
# pools' proportion, holds 55 pages and 17 slots; the disk, 16 whole-context blobs.
TIERED = {
    "kv_pages": 128,
    "mamba_slots": 40,
    "max_running_requests": 8,
    "host_state_bytes": 1_000_000,
    "disk_state_bytes": 16 * 560_000,
    "tier_move_delay_seconds": 0.05,
}


class Soak:
    def __init__(self, duration: float, chaos: bool, keys: bool = True) -> None:
        """`keys=False` runs without authentication (and so without cross-key aborts)."""
        self.settings = Settings.ephemeral(
            context_len=1024,
            chunk_size=64,
            max_step_tokens=256,
            track_interval=64,
            heartbeat_seconds=0.2,
            executor_timeout_seconds=2.0,
            compile=False,  # eager, so the executor the chaos kills is back at once
            api_keys=",".join(TENANT_KEYS) if keys else "",
            admin_api_keys=ADMIN_KEY if keys else "",
            **(TIERED if chaos else POOLS),
        )
        self.duration, self.chaos_on = duration, chaos
        self.tenants: list[str | None] = list(TENANT_KEYS) if keys else [None]
        self.admin: str | None = ADMIN_KEY if keys else None
        self.tally = Tally(chaos)
        self.greedy = Greedy(
            self.settings.port,
            self.settings.context_len,
            self.tally,
            self.tenants[0],
            LANES if chaos else 1,
        )
        self.hostile = Hostile(self.settings.port, self.tally, self.tenants)
        self.stack = Stack(self.settings)
        # faults come back to back here: a restart delay that keeps doubling to 30 s
        # would idle the load, and the backoff itself is not what the soak checks
        self.stack.backoff = {name: Backoff(ceiling=4.0) for name in self.stack.backoff}
        self.chaos = Chaos(self.stack, aim=chaos)
        self.drill = TierDrill(
            self.settings.port, self.tally, self.greedy, self.chaos, self.tenants[0], self.admin
        )
        self.moves = MoveCount(self.settings.executor_metrics_port)

    def flush_when_idle(self, patience: float = 30.0) -> Reply:
        """Flush the prefix cache once nothing runs: while requests still finish (a
        restart's retries, say), the scheduler answers 400 and flushes nothing."""
        deadline = time.monotonic() + patience
        flush = call(self.settings.port, "/flush_cache", {}, self.admin)
        while flush.status == 400 and time.monotonic() < deadline:
            time.sleep(0.2)
            flush = call(self.settings.port, "/flush_cache", {}, self.admin)
        return flush

    def run(self) -> dict:
        self.stack.start_all()
        try:
            self.stack.wait_healthy()
            self.load()
            self.stack.wait_healthy()
            self.chaos.account()
            self.greedy.close_all()
            self.tally.judge("flush_cache", self.flush_when_idle(), OK)
            view = settle(self.settings.store_port, self.admin, self.chaos.supervise)
            if held_slots(view) or not view.get("ready"):
                view["diagnosis"] = diagnosis(self.settings.port, view)
            blobs = self.leftover_blobs()
        finally:
            self.stack.stop()
        return self.result(view, replay(self.greedy.finished), blobs)

    def load(self) -> None:
        """Every client until the deadline, the supervisor restarting what dies."""
        deadline = time.monotonic() + self.duration
        threads = [
            threading.Thread(target=self.greedy.worker, args=(k, deadline)) for k in range(WORKERS)
        ]
        threads.append(threading.Thread(target=self.hostile.worker, args=(deadline,)))
        if self.chaos_on:
            threads.append(threading.Thread(target=self.faults, args=(deadline,)))
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            self.chaos.supervise()
            self.moves.sample()
            time.sleep(0.2)

    def faults(self, deadline: float) -> None:
        """The tier drill first (a kill in each kind of move, for certain), then the
        monkey's random faults until the deadline."""
        self.drill.run()
        self.chaos.loop(deadline, random.Random(99))

    def leftover_blobs(self) -> dict[str, float]:
        """Files left in the state directory, each with when it was last written (seconds
        into the run, as in the fault log): with every session closed, none should be."""
        state_dir = self.stack.settings.blob_dir
        found = {}
        for path in sorted(state_dir.iterdir()) if state_dir else []:
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                found[path.name] = round(path.stat().st_mtime - self.chaos.started, 1)
        return found

    def result(self, view: dict, wrong: int, blobs: dict[str, float]) -> dict:
        held = held_slots(view)
        tally = self.tally
        out = {
            "turns": self.greedy.turns,
            "finished": len(self.greedy.finished),
            "leaked_slots": sum(n for kinds in held.values() for n in kinds.values()),
            "leaked_by_pool": held,
            "ledger_pools": sorted(view.get("counts", {})),
            "leftover_blobs": blobs,
            "ledger_ready": bool(view.get("ready")),
            "ledger_violations": len(view.get("violations", [])),
            "wrong_outputs": wrong,
            "quarantined_requests": tally.quarantined,
            "unexpected_statuses": tally.unexpected,
            "unexpected_examples": tally.examples,
            "hostile_requests": {k: dict(v) for k, v in sorted(tally.hostile.items())},
            "statuses": {k: dict(v) for k, v in sorted(tally.statuses.items())},
            "events": dict(tally.events),
            "service_restarts": self.chaos.report(),
            "tiers": self.chaos_on,
            **self.chaos.tier_report(),
            "tier_drill": self.drill.report(),
            "tier_moves_completed": self.moves.total(),
            "violations": view.get("violations", [])[:5],
        }
        if "diagnosis" in view:
            out["diagnosis"] = view["diagnosis"]
        if not out["ledger_ready"]:
            out["ledger"] = {k: v for k, v in view.items() if k != "diagnosis"}
        out["failed"] = failures(out)
        return out
