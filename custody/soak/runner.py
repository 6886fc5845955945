"""One soak run: the stack on small pools with two tenant keys and an operator key, the
greedy workers, the hostile client and (with chaos) the monkey, all under a supervisor
loop; then every session closed, the cache flushed, and the verdict."""

from __future__ import annotations

import random
import threading
import time

from custody.soak.chaos import Chaos
from custody.soak.client import call
from custody.soak.greedy import Greedy
from custody.soak.hostile import Hostile
from custody.soak.tally import OK, Tally
from custody.soak.verdict import diagnosis, failures, held_slots, replay, settle
from custody.up import Stack
from shared.config import Settings
from shared.redis_server import free_port

WORKERS = 6
TENANT_KEYS = ["soak-tenant-a", "soak-tenant-b"]
ADMIN_KEY = "soak-operator"


class Soak:
    def __init__(self, duration: float, chaos: bool, keys: bool = True) -> None:
        """`keys=False` runs without authentication (and so without cross-key aborts)."""
        self.settings = Settings(
            port=free_port(),
            store_port=free_port(),
            executor_metrics_port=free_port(),
            kv_pages=160,
            mamba_slots=40,
            max_running_requests=12,
            context_len=1024,
            chunk_size=64,
            max_step_tokens=256,
            track_interval=64,
            heartbeat_seconds=0.2,
            executor_timeout_seconds=2.0,
            api_keys=",".join(TENANT_KEYS) if keys else "",
            admin_api_keys=ADMIN_KEY if keys else "",
        )
        self.duration, self.chaos_on = duration, chaos
        self.tenants: list[str | None] = list(TENANT_KEYS) if keys else [None]
        self.admin: str | None = ADMIN_KEY if keys else None
        self.tally = Tally(chaos)
        self.greedy = Greedy(
            self.settings.port, self.settings.context_len, self.tally, self.tenants[0]
        )
        self.hostile = Hostile(self.settings.port, self.tally, self.tenants)
        self.stack = Stack(self.settings)
        self.chaos = Chaos(self.stack)

    def run(self) -> dict:
        self.stack.start_all()
        try:
            self.stack.wait_healthy()
            self.load()
            self.stack.wait_healthy()
            self.chaos.account()
            self.greedy.close_all()
            flush = call(self.settings.port, "/flush_cache", {}, self.admin)
            self.tally.judge("flush_cache", flush, OK)
            view = settle(self.settings.store_port, self.admin, self.chaos.supervise)
            if held_slots(view) or not view.get("ready"):
                view["diagnosis"] = diagnosis(self.settings.port, view)
        finally:
            self.stack.stop()
        return self.result(view, replay(self.greedy.finished))

    def load(self) -> None:
        """Every client until the deadline, the supervisor restarting what dies."""
        deadline = time.monotonic() + self.duration
        threads = [
            threading.Thread(target=self.greedy.worker, args=(k, deadline)) for k in range(WORKERS)
        ]
        threads.append(threading.Thread(target=self.hostile.worker, args=(deadline,)))
        if self.chaos_on:
            rng = random.Random(99)
            threads.append(threading.Thread(target=self.chaos.loop, args=(deadline, rng)))
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            self.chaos.supervise()
            time.sleep(0.2)

    def result(self, view: dict, wrong: int) -> dict:
        held = held_slots(view)
        tally = self.tally
        out = {
            "turns": self.greedy.turns,
            "finished": len(self.greedy.finished),
            "leaked_slots": sum(n for kinds in held.values() for n in kinds.values()),
            "leaked_by_pool": held,
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
            "violations": view.get("violations", [])[:5],
        }
        if "diagnosis" in view:
            out["diagnosis"] = view["diagnosis"]
        if not out["ledger_ready"]:
            out["ledger"] = {k: v for k, v in view.items() if k != "diagnosis"}
        out["failed"] = failures(out)
        return out
