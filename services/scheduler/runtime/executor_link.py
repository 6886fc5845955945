"""The scheduler's view of the executor: which executor life (epoch) is up, reading the
result of a step from the results stream, and noticing that the executor is gone (its
alive key expired or names a new epoch), which means its device state is gone too. A
result entry that is not of the wire format is logged and counted (`malformed`, in the
live metrics); if what can still be read of it says it answers the step in flight, that
step's outcome is unknown, and the executor's device state is treated as lost (the
requests of the step are suspects, engine/faults.py), else the entry is passed over."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from services.scheduler.engine.step import StepPlan
from shared import streams
from shared.messages.envelope import WireError
from shared.messages.forward import ResultHead, StepResult, decode_result, decode_result_head
from shared.redis_client import connect_async

log = logging.getLogger("custody.scheduler")


class ExecutorLost(Exception):
    """The executor that was to run a step is gone; `alive` is the epoch up now, if any."""

    def __init__(self, alive: str | None) -> None:
        super().__init__(f"executor lost; alive now: {alive}")
        self.alive = alive


class ExecutorLink:
    def __init__(self, scheduler_epoch: str, timeout_seconds: float, keys: streams.Keys) -> None:
        self.keys = keys
        self.scheduler_epoch = scheduler_epoch
        self.timeout_seconds = timeout_seconds
        self.epoch: str | None = None  # the executor life steps are published for
        self.losses = 0
        self.malformed = 0  # result entries refused as not of the wire format
        self.results: aioredis.Redis | None = None  # its own connection: it blocks
        self._results_from = "0-0"

    async def start(self, redis_url: str, redis: aioredis.Redis) -> None:
        """Read results from an explicit id, never "$": a result that lands between
        publishing a step and starting to read must not be missed."""
        self.results = await connect_async(redis_url)
        last = await redis.xrevrange(self.keys.results, count=1)
        self._results_from = last[0][0] if last else "0-0"

    async def alive_epoch(self, redis: aioredis.Redis) -> str | None:
        alive = await redis.get(self.keys.executor_alive)
        return alive.decode() if alive else None

    async def await_result(self, redis: aioredis.Redis, plan: StepPlan) -> StepResult:
        """The step's result; raises `ExecutorLost` once the executor that was to run it
        is gone."""
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            reply = await self.results.xread(
                {self.keys.results: self._results_from}, count=8, block=200
            )
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._results_from = entry_id
                    result = self._result_of(fields, plan.step_id)
                    if result is not None:
                        return result
            if reply and time.monotonic() < deadline:
                continue  # results are flowing: ask after the executor only when they stop
            alive = await self.alive_epoch(redis)
            if alive == self.epoch:
                deadline = time.monotonic() + self.timeout_seconds
            elif time.monotonic() > deadline or alive is not None:
                log.error("executor %s lost during step %s", self.epoch, plan.step_id)
                raise ExecutorLost(alive)

    def _result_of(self, fields: dict, step_id: int) -> StepResult | None:
        raw = fields.get(b"m", b"")
        try:
            result = decode_result(raw)
        except WireError as err:
            self.malformed += 1
            if self._answers(_head_of(raw), step_id):
                log.error(
                    "the result of step %s is malformed (%s); device state lost", step_id, err
                )
                raise ExecutorLost(self.epoch) from None
            log.error("a malformed result was passed over: %s", err)
            return None
        return result if self._answers(result, step_id) else None

    def _answers(self, head: ResultHead | StepResult | None, step_id: int) -> bool:
        """Whether `head` answers `step_id` of this scheduler life, from the executor life
        the step was published for."""
        return (
            head is not None
            and head.seq == step_id
            and head.scheduler_epoch == self.scheduler_epoch
            and head.epoch == self.epoch
        )


def _head_of(raw: bytes) -> ResultHead | None:
    """What can still be read of a malformed result, if anything."""
    try:
        return decode_result_head(raw)
    except WireError:
        return None
