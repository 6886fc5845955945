"""`custody up`: a private Redis when none is given, then the three services as separate
processes, supervised: a service that dies is restarted with backoff, and the restart is
logged and counted. Ctrl-C or SIGTERM stops everything and removes what it created.

With `--replicas N` (N > 1) it starts N replicas, each a scheduler and an executor of
its own (`scheduler-<i>`, `executor-<i>`, replica id `<i>`, their API and metrics on free
loopback ports), one session store for all, and the router on `--port`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from shared.config import Settings
from shared.redact import masked_url
from shared.redis_server import PrivateRedis, free_port

log = logging.getLogger("custody.up")
SERVICES = {
    "session-store": "services.session_store.service",
    "executor": "services.executor.service",
    "scheduler": "services.scheduler.main",
}
ROUTER = "services.router.main"


def layout(settings: Settings) -> dict[str, tuple[str, Settings]]:
    """Each child process: its name, its module and its settings."""
    if settings.replicas == 1:
        return {name: (module, settings) for name, module in SERVICES.items()}
    children = {"session-store": (SERVICES["session-store"], settings)}
    for i in range(settings.replicas):
        own = dataclasses.replace(
            settings, replica=str(i), port=free_port(), executor_metrics_port=free_port()
        )
        children[f"executor-{i}"] = (SERVICES["executor"], own)
        children[f"scheduler-{i}"] = (SERVICES["scheduler"], own)
    children["router"] = (ROUTER, settings)
    return children


class Backoff:
    """The delay before restarting one service: doubling with each restart up to a
    ceiling, and back to the first once the service has run `healthy_seconds` without
    exiting; otherwise a crash a day would, within a week, cost every later crash the
    ceiling in downtime."""

    def __init__(
        self, first: float = 0.5, ceiling: float = 30.0, healthy_seconds: float = 60.0
    ) -> None:
        self.first, self.ceiling, self.healthy_seconds = first, ceiling, healthy_seconds
        self.delay = first
        self.started_at = 0.0  # on the supervisor's clock

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float) -> float:
        """The delay before restarting a service found exited at `now`."""
        if now - self.started_at >= self.healthy_seconds:
            self.delay = self.first
        delay, self.delay = self.delay, min(self.delay * 2, self.ceiling)
        return delay


class Stack:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        plan: Callable[[Settings], dict[str, tuple[str, Settings]]] = layout,
        source: Path | None = None,
    ) -> None:
        """`plan` chooses the children: `layout` for `custody up`, one replica's two for a
        compose replica container (custody/replica.py). `source`: another revision's tree
        whose modules the children run (a benchmark's `--baseline`); None: this one's."""
        self.redis: PrivateRedis | None = None
        if not settings.redis_url:
            self.redis = PrivateRedis(appendonly=True).start()
            settings = dataclasses.replace(settings, redis_url=self.redis.url)
        self.state_dir: Path | None = None  # private: removed at exit
        if settings.state_dir is None:
            self.state_dir = Path(tempfile.mkdtemp(prefix="custody-state-"))  # mode 0700
            settings = dataclasses.replace(settings, state_dir=self.state_dir)
        if not settings.cluster_secret:  # its children sign and check registrations
            settings = dataclasses.replace(settings, cluster_secret=secrets.token_hex(32))
        self.settings = settings
        self.layout = plan(settings)
        self.children: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = dict.fromkeys(self.layout, 0)
        self.clock = clock
        self.source = source
        self.backoff = {name: Backoff() for name in self.layout}
        self._due: dict[str, float] = {}

    def start(self, name: str) -> None:
        module, settings = self.layout[name]
        env = {**os.environ, **settings.to_env()}
        if self.source is not None:  # that tree's packages only, none of this one's
            env["PYTHONPATH"] = str(self.source)
        self.children[name] = subprocess.Popen(
            [sys.executable, "-m", module], env=env, cwd=self.source
        )
        self.backoff[name].started(self.clock())

    def start_all(self) -> Stack:
        for name in self.layout:
            self.start(name)
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.children[name].send_signal(sig)
        self.children[name].wait()

    def supervise_once(self) -> None:
        """Restart, after a delay (Backoff), any service that exited."""
        now = self.clock()
        for name, child in list(self.children.items()):
            if child.poll() is None:
                continue
            if name not in self._due:
                self._due[name] = now + self.backoff[name].exited(now)
            if now >= self._due[name]:
                self.restarts[name] += 1
                log.warning(
                    "%s exited (%s); restart #%d", name, child.returncode, self.restarts[name]
                )
                self.start(name)
                del self._due[name]

    def wait_healthy(self, timeout: float = 300) -> None:
        """Until the API answers and every replica has an executor, restarting what died.
        The default allows for the executor's first compilation (about 45 s here, cold)."""
        url = f"http://127.0.0.1:{self.settings.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervise_once()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    health = json.loads(resp.read())
                    if health["executor"] and health.get("ready", 1) >= self.settings.replicas:
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
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def run(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s up %(message)s")
    stack = Stack(settings)
    s = stack.settings
    return supervise(
        stack,
        f"custody API on http://{s.host}:{s.port}  (ledger: http://{s.store_host}:"
        f"{s.store_port}/ledger; redis: {masked_url(s.redis_url)})",
    )


def supervise(stack: Stack, banner: str) -> int:
    """Start every child, print `banner`, restart any child that exits until SIGTERM or
    SIGINT, then stop them all: `custody up`'s loop, and a compose replica container's
    (custody/replica.py), so both restart a dead service the same way."""
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start_all()
        print(banner, flush=True)
        while not stopping:
            stack.supervise_once()
            time.sleep(0.2)
    finally:
        stack.stop()
    return 0
