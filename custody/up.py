"""`custody up`: a private Redis when none is given, then the three services as separate
processes, supervised: a service that dies is restarted with backoff, and the restart is
logged and counted. Ctrl-C or SIGTERM stops everything and removes what it created."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

from shared.config import Settings
from shared.redis_server import PrivateRedis

log = logging.getLogger("custody.up")
SERVICES = {
    "session-store": "services.session_store.service",
    "executor": "services.executor.service",
    "scheduler": "services.scheduler.service",
}


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.redis: PrivateRedis | None = None
        if not settings.redis_url:
            self.redis = PrivateRedis(appendonly=True).start()
            settings = dataclasses.replace(settings, redis_url=self.redis.url)
        self.settings = settings
        self.children: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = dict.fromkeys(SERVICES, 0)
        self._backoff: dict[str, float] = dict.fromkeys(SERVICES, 0.5)
        self._due: dict[str, float] = {}

    def start(self, name: str) -> None:
        env = {**os.environ, **self.settings.to_env()}
        self.children[name] = subprocess.Popen([sys.executable, "-m", SERVICES[name]], env=env)

    def start_all(self) -> Stack:
        for name in SERVICES:
            self.start(name)
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.children[name].send_signal(sig)
        self.children[name].wait()

    def supervise_once(self) -> None:
        """Restart, after a growing delay, any service that exited."""
        now = time.monotonic()
        for name, child in list(self.children.items()):
            if child.poll() is None:
                continue
            due = self._due.setdefault(name, now + self._backoff[name])
            if now >= due:
                self.restarts[name] += 1
                log.warning(
                    "%s exited (%s); restart #%d", name, child.returncode, self.restarts[name]
                )
                self.start(name)
                self._backoff[name] = min(self._backoff[name] * 2, 30.0)
                del self._due[name]

    def wait_healthy(self, timeout: float = 120) -> None:
        """Until the scheduler answers and has an executor, restarting what died."""
        url = f"http://127.0.0.1:{self.settings.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervise_once()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if json.loads(resp.read())["executor"]:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError("the services did not come up")

    def stop(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        for child in self.children.values():
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
        if self.redis is not None:
            self.redis.close()


def run(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s up %(message)s")
    stack = Stack(settings)
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start_all()
        s = stack.settings
        print(
            f"custody API on http://{s.host}:{s.port}  (ledger: http://{s.host}:{s.store_port}"
            f"/ledger; redis: {s.redis_url})",
            flush=True,
        )
        while not stopping:
            stack.supervise_once()
            time.sleep(0.2)
    finally:
        stack.stop()
    return 0
