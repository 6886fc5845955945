"""The core's edge workers (`--api-workers`): started beside it, each with the core's
settings and the paths of its two sockets, and started again if one exits; ended with
the core (and by the kernel if the core is killed: worker.py `die_with_parent`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from prometheus_client import Counter

from services.scheduler.edge.worker import CORE_ENV, LINK_ENV
from shared.config import Settings

log = logging.getLogger("custody.scheduler.edge")

RESTART_DELAY_SECONDS = 0.5  # a worker that exits at once is not restarted in a loop


class EdgeWorkers:
    def __init__(
        self, settings: Settings, count: int, link: Path, core_http: Path, exits: Counter
    ) -> None:
        self.count = count
        self.exits = exits  # custody_edge_worker_exits_total
        sockets = {LINK_ENV: str(link), CORE_ENV: str(core_http)}
        self.env = {**os.environ, **settings.to_env(), **sockets}
        self.processes: list[asyncio.subprocess.Process] = []
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(i)) for i in range(self.count)]

    async def _keep(self, index: int) -> None:
        while True:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.scheduler.edge.worker", env=self.env
            )
            self.processes.append(proc)
            code = await proc.wait()
            self.processes.remove(proc)
            self.exits.inc()
            log.warning("edge worker %d (pid %d) exited with %s: restarting", index, proc.pid, code)
            await asyncio.sleep(RESTART_DELAY_SECONDS)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for proc in self.processes:
            if proc.returncode is None:
                proc.terminate()
        await asyncio.gather(*(proc.wait() for proc in self.processes), return_exceptions=True)
