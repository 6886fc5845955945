"""The orchestration bench's executor: the executor service itself (its stream reads
and answers, step chain, fence, heartbeat and page tables, and every check of a step
that needs no device: services/executor/step_checks.py) with the model replaced by a
fixed step time. A step is decoded, checked and resolved as the executor does it; then
the stand-in sleeps out the rest of `CUSTODY_STANDIN_STEP_MS` and answers each sampling
row with a token drawn uniformly from the vocabulary.

What the scheduler sees is then what a GPU executor of that step time shows it: the
executor's idle share, measured here, is the time it waits for the scheduler. What the
stand-in does not do: tier moves (taken as done: it holds no state to move), grammars
(refused), log probabilities (zeros) and the forward's own host work (building a
batch's tensors, which a GPU executor overlaps with the device)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from services.executor.metrics_http import serve_metrics
from services.executor.page_tables import PageTables
from services.executor.refusal import BatchRefused
from services.executor.runner import Sampled
from services.executor.service import ExecutorService
from services.executor.step_checks import check_rows, check_slots
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.messages.tiers import TierMove
from shared.model_config import builtin_config
from shared.service_main import start

STEP_MS = "CUSTODY_STANDIN_STEP_MS"


class StandInRunner:
    """ModelRunner's interface, as the executor service uses it."""

    compiled = None
    grammars = None

    def __init__(self, settings: Settings, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.vocab = builtin_config().vocab_size
        self.slots = settings.mamba_slots + 1
        kv_rows = (settings.kv_pages + 1) * settings.page_size
        self.tables = PageTables(settings.page_size, kv_rows, settings.max_running_requests)
        self.rng = np.random.default_rng(0)
        self.last_ops_seconds, self.last_ops_bytes = 0.0, 0

    def execute(
        self,
        rows: list[StepRow],
        ops: DeferredOps,
        keep_logits: bool = False,
        moves: Sequence[TierMove] = (),
        discards: Sequence[int] = (),
    ) -> Sampled:
        began = time.perf_counter()
        if any(r.grammar is not None for r in rows):
            raise BatchRefused("the stand-in executor runs no grammars")
        check_slots(rows, ops, self.slots)
        rows, tables = self.tables.resolve(rows)
        if rows:
            check_rows(rows, self.vocab)
        self.tables.commit(tables)
        sampling = sum(1 for r in rows if r.sample)
        tokens = self.rng.integers(0, self.vocab, sampling).tolist()
        rest = self.step_seconds - (time.perf_counter() - began)
        if rest > 0:
            time.sleep(rest)
        return Sampled(tokens, [0.0] * sampling)


class StandInExecutor(ExecutorService):
    def load_runner(self) -> StandInRunner:
        return StandInRunner(self.settings, float(os.environ.get(STEP_MS, "10")) / 1000)


def main(argv: list[str] | None = None) -> None:
    settings = start("executor", argv)
    serve_metrics(settings.host, settings.executor_metrics_port, settings.replica)
    StandInExecutor(settings).serve_forever()


if __name__ == "__main__":
    main()
