"""The one step driver: apply the executor's reply to a planned step. The scheduler's
step loop, the in-process runtime (`custody demo`) and the engine tests all complete a
step through here, so a refused step and a run step take the same path everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from shared.wire import unpack_ints

if TYPE_CHECKING:
    from services.scheduler.engine.core import EngineCore


def complete(engine: EngineCore, plan: StepPlan, result: dict) -> list[Request]:
    """`result`: the executor's result message for `plan` (shared/wire.py `result_body`).
    Returns the requests that ended."""
    if result.get("error"):
        return engine.step_refused(plan, result["error"], bool(result.get("ops_ran")))
    tokens = unpack_ints(result["tokens"], "<i4").tolist()
    logprobs = unpack_ints(result["logprobs"], "<f4").tolist()
    return engine.complete_step(
        plan,
        dict(zip(result["rids"], tokens, strict=True)),
        dict(zip(result["rids"], logprobs, strict=True)),
    )
