"""The scheduler core and the executor in one process, without Redis.

This is how a request goes end to end until the services talk over streams: the
scheduler plans a step (rows, KV indices, slots, deferred ops), the executor validates
and runs it on the model, and the sampled tokens complete the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.executor.batch import Row, Sampling
from services.executor.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import load_model
from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.engine.core import EngineConfig, EngineCore
from services.scheduler.engine.request import Request
from services.scheduler.engine.step import RowPlan
from shared.tokenizer import load_tokenizer


@dataclass(frozen=True)
class LocalConfig:
    model_dir: Path | None = None
    page_size: int = 16
    kv_pages: int = 1024
    mamba_slots: int = 64
    max_running_requests: int = 16
    context_len: int = 8192
    chunk_size: int = 512
    max_step_tokens: int = 1024
    track_interval: int = 64


class InProcess:
    def __init__(self, config: LocalConfig = LocalConfig()) -> None:
        self.model = load_model(config.model_dir, torch.device("cpu"))
        cfg = self.model.cfg
        self.tokenizer = load_tokenizer(config.model_dir, cfg.eos_token_id)
        self.pools = Pools(
            PoolConfig(
                config.kv_pages,
                config.page_size,
                config.mamba_slots,
                config.max_running_requests,
                config.context_len,
            )
        )
        self.engine = EngineCore(
            self.pools,
            EngineConfig(
                context_len=config.context_len,
                vocab_size=cfg.vocab_size,
                eos_token_id=cfg.eos_token_id,
                chunk_size=config.chunk_size,
                max_step_tokens=config.max_step_tokens,
                track_interval=config.track_interval,
            ),
        )
        device_pools = DevicePools(
            cfg,
            PoolSizes(config.kv_pages, config.page_size, config.mamba_slots),
            torch.device("cpu"),
        )
        self.runner = ModelRunner(self.model, device_pools)

    def step(self) -> list[Request]:
        """Plan, run and complete one step; returns the requests that ended."""
        plan = self.engine.plan_step()
        if plan is None:
            return []
        result = self.runner.execute([_row(r) for r in plan.rows], plan.ops)
        sampling = [r.rid for r in plan.rows if r.sample]
        return self.engine.complete_step(
            plan,
            dict(zip(sampling, result.tokens, strict=True)),
            dict(zip(sampling, result.logprobs, strict=True)),
        )

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.engine.idle:
                return
            self.step()
        raise RuntimeError("the engine did not become idle")


def _row(plan: RowPlan) -> Row:
    p = plan.params
    return Row(
        torch.from_numpy(np.ascontiguousarray(plan.tokens)),
        plan.start,
        torch.from_numpy(np.ascontiguousarray(plan.kv_indices)),
        plan.mamba_slot,
        plan.snapshot_slot,
        plan.snapshot_len,
        plan.sample,
        Sampling(p.temperature, p.top_p, p.top_k, p.seed),
    )
