"""The chaos monkey, and the account that tells its kills from real crashes.

Every restart the supervisor makes (`Stack.restarts`) must be explained by a kill the
monkey made before it: a kill is recorded before its signal is sent, and each restart
consumes one recorded kill of that service. A restart with none left to consume is
unexplained: the service died on its own (a crash, an exception, a hostile input), which
fails the soak even when the restart hid it from every client.

With tiers on (`aim`), a share of the executor kills is aimed at tier moves: the monkey
polls the executor's in-flight mark and kills while it shows a move. Every executor kill,
aimed or not, is then counted by the mark the dead executor left behind
(`kills_during_tier_moves`, per kind): the mark read before the kill only aims it, since
the move may end between that read and the signal.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

from custody.soak.tiers import KINDS, TierWatch
from custody.up import SERVICES, Stack

VICTIMS = [*SERVICES, "redis"]
AIMED_SHARE = 0.7  # of the random executor kills, with tiers on
AIM_SECONDS = 8.0  # an aimed kill waits this long for a move, then kills anyway


class Chaos:
    def __init__(self, stack: Stack, aim: bool = False) -> None:
        """`aim`: tiers are on, so aim executor kills at tier moves."""
        self.stack, self.aim = stack, aim
        self.watch = TierWatch(stack.settings.redis_url)
        self.tier_kills: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self.aimed = Counter({"hit": 0, "missed": 0})  # aimed kills: a move hit or not
        self.started = time.time()  # wall clock, to set the fault log beside file times
        self.log: list[tuple[float, str, list[str]]] = []  # (seconds in, victim, kinds hit)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter({name: 0 for name in VICTIMS})
        self.unexplained: Counter[str] = Counter({name: 0 for name in SERVICES})
        self._pending: Counter[str] = Counter()  # kills whose restart is not seen yet
        self._seen = dict(stack.restarts)

    def loop(self, deadline: float, rng: random.Random) -> None:
        """A fault every 6-12 s, none in the last 10 s of load, so the end settles."""
        while time.monotonic() < deadline - 10:
            time.sleep(rng.uniform(6, 12))
            victim = rng.choice(VICTIMS)
            if victim == "executor" and self.aim and rng.random() < AIMED_SHARE:
                seconds = min(AIM_SECONDS, max(0.0, deadline - 10 - time.monotonic()))
                hit = self.kill_in_move(lambda kinds: True, seconds, lambda: False)
                self.aimed["hit" if hit else "missed"] += 1
            else:
                self.inject(victim)

    def kill_in_move(
        self, wanted: Callable[[set[str]], bool], timeout: float, stop: Callable[[], bool]
    ) -> set[str]:
        """Kill the executor once the mark shows kinds `wanted` accepts, or when `timeout`
        passes (unless `stop()`: then no kill); the kinds the kill hit."""
        seen = self.watch.wait_for(wanted, timeout, stop)
        if not seen and stop():
            return set()
        return self.inject("executor")

    def inject(self, victim: str) -> set[str]:
        """One fault; for the executor, the tier move kinds its kill hit."""
        if victim == "redis":
            with self.lock:
                self.injected[victim] += 1
            self.stack.redis.stop()
            time.sleep(0.5)
            self.stack.redis.start()
            self.watch.clear()  # a mark the executor could not delete while Redis was down
            self.note(victim, set())
            return set()
        child = self.stack.children[victim]
        if child.poll() is not None:
            return set()  # already down: a kill now would explain a restart it did not cause
        with self.lock:
            self.injected[victim] += 1
            self._pending[victim] += 1
        self.stack.kill(victim, signal.SIGKILL)
        hit = self.watch.in_flight() if victim == "executor" else set()  # its last mark
        if victim == "executor":
            self.watch.clear()
        with self.lock:
            self.tier_kills.update(hit)
        self.note(victim, hit)
        return hit

    def note(self, victim: str, hit: set[str]) -> None:
        with self.lock:
            self.log.append((round(time.time() - self.started, 1), victim, sorted(hit)))

    def supervise(self) -> None:
        """One supervisor round, then the account of any restart it made."""
        self.stack.supervise_once()
        self.account()

    def account(self) -> None:
        with self.lock:
            for name, count in self.stack.restarts.items():
                for _ in range(count - self._seen.get(name, 0)):
                    if self._pending[name]:
                        self._pending[name] -= 1
                    else:
                        self.unexplained[name] += 1
                self._seen[name] = count

    def report(self) -> dict:
        self.account()
        return {"injected": dict(self.injected), "unexplained": dict(self.unexplained)}

    def tier_report(self) -> dict:
        with self.lock:
            return {
                "kills_during_tier_moves": {kind: self.tier_kills[kind] for kind in KINDS},
                "aimed_kills": dict(self.aimed),
                "fault_log": list(self.log),
            }
