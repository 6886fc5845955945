"""The generation throughput of the last decode steps: what SGLang reports as
`last_gen_throughput` in /server_info, read by its benchmarks (bench_one_batch_server)
after a run. Tokens sampled per step over the time the last `STEPS` steps spanned, so it
holds the figure of the last busy stretch once the server is idle again, as SGLang's
does."""

from __future__ import annotations

import time
from collections import deque

STEPS = 64  # the steps the figure spans


class RecentThroughput:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=STEPS)  # (completed at, tokens)

    def add(self, tokens: int) -> None:
        """A step completed with `tokens` sampled (one per sampling row)."""
        if tokens:
            self._steps.append((time.monotonic(), tokens))

    @property
    def tokens_per_second(self) -> float:
        """Tokens of all but the first recorded step over the time since it (0.0 before
        two steps)."""
        if len(self._steps) < 2:
            return 0.0
        span = self._steps[-1][0] - self._steps[0][0]
        tokens = sum(n for _, n in list(self._steps)[1:])
        return tokens / span if span > 0 else 0.0
