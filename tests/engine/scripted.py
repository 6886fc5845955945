"""An executor stand-in that marks state slots with chosen values and samples scripted
tokens, for scenarios phrased in terms of marked data ("mark that slot's data 42")."""

from __future__ import annotations

import numpy as np

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.step import StepPlan
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from tests.engine.data_model import apply_to_arrays, result_of


class Scripted:
    def __init__(
        self,
        page_size: int = 1,
        chunk: int = 2,
        track_interval: int = 1,
        mamba_slots: int = 32,
        kv_pages: int = 256,
    ) -> None:
        self.pools = Pools(
            PoolConfig(
                kv_pages=kv_pages,
                page_size=page_size,
                mamba_slots=mamba_slots,
                max_running_requests=8,
                max_context=256,
            )
        )
        self.engine = EngineCore(
            self.pools,
            EngineConfig(
                context_len=256,
                vocab_size=256,
                chunk_size=chunk,
                max_step_tokens=64,
                track_interval=track_interval,
            ),
        )
        self.states = np.zeros(mamba_slots + 1, dtype=np.int64)
        self.marks: dict[tuple[str, int], int] = {}  # (rid, snapshot length) -> value
        self.script: dict[str, list[int]] = {}  # rid -> tokens to sample, in order
        self.started_with: dict[str, int] = {}  # rid -> its working slot's value at start

    def submit(self, rid: str, prompt: list[int], script: list[int]) -> Request:
        self.script[rid] = list(script)
        req = Request(rid, np.asarray(prompt), SamplingParams(max_new_tokens=len(script)))
        return self.engine.submit(req)

    def run_plan(self, plan: StepPlan) -> dict[str, int]:
        apply_to_arrays(plan.ops, self.states)
        out = {}
        for row in plan.rows:
            self.started_with.setdefault(row.rid, int(self.states[row.mamba_slot]))
            if row.snapshot_slot:
                self.states[row.snapshot_slot] = self.marks.get(
                    (row.rid, row.snapshot_len), 1000 + row.snapshot_len
                )
            self.states[row.mamba_out] = 500 + row.end
            if row.sample:
                out[row.rid] = self.script[row.rid].pop(0)
        return out

    def step(self) -> StepPlan | None:
        plan = self.engine.plan_step()
        if plan is not None:
            self.engine.complete(plan, result_of(plan, self.run_plan(plan)))
            report = self.engine.check()
            assert report.ok, report.problems
        return plan

    def run(self) -> None:
        while not self.engine.idle:
            self.step()
