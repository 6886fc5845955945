"""The chaos monkey, and the account that tells its kills from real crashes.

Every restart the supervisor makes (`Stack.restarts`) must be explained by a kill the
monkey made before it: a kill is recorded before its signal is sent, and each restart
consumes one recorded kill of that service. A restart with none left to consume is
unexplained: the service died on its own (a crash, an exception, a hostile input), which
fails the soak even when the restart hid it from every client.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

from custody.up import SERVICES, Stack

VICTIMS = [*SERVICES, "redis"]


class Chaos:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter({name: 0 for name in VICTIMS})
        self.unexplained: Counter[str] = Counter({name: 0 for name in SERVICES})
        self._pending: Counter[str] = Counter()  # kills whose restart is not seen yet
        self._seen = dict(stack.restarts)

    def loop(self, deadline: float, rng: random.Random) -> None:
        """A fault every 6-12 s, none in the last 10 s of load, so the end settles."""
        while time.monotonic() < deadline - 10:
            time.sleep(rng.uniform(6, 12))
            self.inject(rng.choice(VICTIMS))

    def inject(self, victim: str) -> None:
        if victim == "redis":
            with self.lock:
                self.injected[victim] += 1
            self.stack.redis.stop()
            time.sleep(0.5)
            self.stack.redis.start()
            return
        child = self.stack.children[victim]
        if child.poll() is not None:
            return  # already down: a kill now would explain a restart it did not cause
        with self.lock:
            self.injected[victim] += 1
            self._pending[victim] += 1
        self.stack.kill(victim, signal.SIGKILL)

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
