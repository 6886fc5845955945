"""TEST-ONLY fault injection: one misrouted write, to prove the session store's write
check catches a scheduler bug it could not see in the transfers alone.

With `CUSTODY_FAULT_MISROUTE_WRITE=1` in the scheduler's environment at start, the first
step published with a row has that row's `mamba_out` replaced, on the wire only, by a
free Mamba slot: a slot its request does not own. The plan itself is left alone, so the
scheduler completes the step as usual (only the request's state is wrong). Never set it
outside tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import msgspec
import numpy as np

from services.scheduler.ownership.slot_pool import SlotPool
from shared.messages.forward import Step
from shared.messages.step_rows import RowColumns

log = logging.getLogger("custody.scheduler")
ENV = "CUSTODY_FAULT_MISROUTE_WRITE"


class MisrouteWrite:
    def __init__(self, mamba: SlotPool, armed: bool) -> None:
        self.mamba = mamba
        self.armed = armed

    @classmethod
    def from_env(cls, mamba: SlotPool, environ: Mapping[str, str] = os.environ) -> MisrouteWrite:
        armed = environ.get(ENV) == "1"
        if armed:
            log.warning("%s=1: the first step will misroute a write (a test-only fault)", ENV)
        return cls(mamba, armed)

    def apply(self, step: Step) -> Step:
        """`step`, its first row's state write pointed at a free slot, once; a copy of the
        message: the plan and its rows are left as they are."""
        free = np.flatnonzero(self.mamba.owner_view == 0)
        if not self.armed or not step.rows or not len(free):
            return step
        self.armed = False
        first = msgspec.structs.replace(step.rows[0], mamba_out=int(free[-1]))
        log.warning("test-only fault: %s writes slot %d it does not own", first.rid, free[-1])
        return msgspec.structs.replace(step, columns=RowColumns.of([first, *step.rows[1:]]))
