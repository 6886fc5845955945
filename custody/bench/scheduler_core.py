"""The scheduler's engine core alone, for `custody bench orchestration`: plan and complete
steps of `batch` decoding rows in process (no HTTP, no Redis, no executor; tokens drawn
at random), pipelined one step deep as the service runs it. Its time per row-step is the
part of the scheduler's CPU that planning and completion take, apart from streaming,
the event loop and the machine's other processes, whose noise the stack's figure
carries. It cannot see what the step loop does around the core (encoding, Redis, events
shipped, tokens streamed)."""

from __future__ import annotations

import time

import numpy as np

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams

PAGE, OUTPUT, VOCAB = 16, 4096, 256


def _engine(batch: int, context: int) -> EngineCore:
    tokens = context + OUTPUT + 64
    pools = Pools(
        PoolConfig(
            kv_pages=batch * (-(-tokens // PAGE) + 1) + 64,
            page_size=PAGE,
            mamba_slots=8 * batch + 64,
            max_running_requests=batch,
            max_context=tokens,
        )
    )
    config = EngineConfig(
        context_len=tokens,
        vocab_size=VOCAB,
        eos_token_ids=frozenset(),
        chunk_size=8192,
        max_step_tokens=16384,
        track_interval=256,
        checkpoint_interval=0,
        junctions=True,
    )
    return EngineCore(pools, config)


def per_row_step_us(batch: int, context: int = 1024, steps: int = 200) -> float:
    """Microseconds of planning and completion per decoding row-step, the best of three
    runs of `steps` steps (the least disturbed by other work)."""
    engine, rng = _engine(batch, context), np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=OUTPUT - 1, ignore_eos=True)
    for i in range(batch):
        engine.submit(Request(f"r{i}", rng.integers(0, VOCAB, context), params))

    def step() -> None:
        engine.plan_step()
        if len(engine.in_flight) > 1:
            oldest = engine.in_flight[0]
            rows = [r.rid for r in oldest.rows if r.sample and not r.dropped]
            tokens = rng.integers(0, VOCAB, len(rows)).tolist()
            engine.complete_step(oldest, dict(zip(rows, tokens, strict=True)))

    while not (engine.in_flight and all(len(p.rows) == batch for p in engine.in_flight)):
        step()  # prefill, until every step is `batch` decoding rows
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - start)
    if not all(len(p.rows) == batch for p in engine.in_flight):
        raise RuntimeError("a request ended or was retracted while the core was timed")
    return round(best / steps / batch * 1e6, 2)
