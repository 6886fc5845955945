"""The one step driver: apply the executor's reply to a planned step. The scheduler's
step loop, the in-process runtime (`custody demo`) and the engine tests all complete a
step through here, so a refused step and a run step take the same path everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from shared.messages.forward import StepResult

if TYPE_CHECKING:
    from services.scheduler.engine.core import EngineCore


def complete(engine: EngineCore, plan: StepPlan, result: StepResult) -> list[Request]:
    """`result`: the executor's result for `plan`. Returns the requests that ended."""
    if result.error is not None:
        return engine.step_refused(plan, result.error, result.ops_ran)
    rids = result.rids
    return engine.complete_step(
        plan,
        dict(zip(rids, result.tokens.tolist(), strict=True)),
        dict(zip(rids, result.logprobs.tolist(), strict=True)),
        set(result.failed_moves),
        dict(zip(rids, result.top, strict=True)),
    )
