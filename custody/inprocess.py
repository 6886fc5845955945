"""The scheduler core and the executor in one process, without Redis (`custody demo`,
and tests that need real tensors but not the services).

A step goes the same way as between the services, minus the streams: the scheduler
plans it (rows, KV indices, slots, deferred ops) in the rows' wire form, the executor
validates and runs those very rows, and its result completes the step.
"""

from __future__ import annotations

import torch

from services.executor.compiled_decode import CompiledDecode
from services.executor.grammars import grammars_for
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.tiers import build_tiers
from services.executor.weights import load_model, model_dtype
from services.scheduler.engine.setup import build_engine
from services.scheduler.records.request import Request
from shared.config import Settings
from shared.tokenizer import load_tokenizer


class InProcess:
    def __init__(self, settings: Settings) -> None:
        self.model = load_model(
            settings.model, torch.device("cpu"), settings.dtype, mtp=settings.drafts_by_head
        )
        self.tokenizer = load_tokenizer(settings.model, settings.tokenizer)
        self.engine = build_engine(settings, self.model.cfg, self.tokenizer, strict=True)
        self.pools = self.engine.pools
        device_pools = DevicePools(
            self.model.cfg,
            PoolSizes(settings.kv_pages, settings.page_size, settings.mamba_slots),
            torch.device("cpu"),
            model_dtype(self.model),
            mtp=self.model.mtp is not None,
        )
        tiers = build_tiers(settings, self.model.cfg, device_pools)
        compiled = (
            CompiledDecode(self.model, device_pools, settings.max_running_requests)
            if settings.compile
            else None
        )
        self.grammars = grammars_for(settings, self.model.cfg)
        self.runner = ModelRunner(
            self.model,
            device_pools,
            tiers,
            compiled,
            self.grammars,
            settings.max_running_requests,
        )
        self.runner.warm_up()

    def step(self) -> list[Request]:
        """Plan, run and complete one step; returns the requests that ended."""
        plan = self.engine.plan_step()
        if plan is None:
            return []
        rows = [r.wire for r in plan.rows]
        result = self.runner.execute(rows, plan.ops, moves=plan.moves, discards=plan.discards)
        sampling = [r.rid for r in plan.rows if r.sample]
        return self.engine.complete(plan, result.reply("", plan.step_id, "", sampling))

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.engine.idle:
                return
            self.step()
        raise RuntimeError("the engine did not become idle")
