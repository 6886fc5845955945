"""A Prometheus histogram observed a step at a time.

Every decoding row of a step yields a latency (its inter-token gap), so observing them
one by one costs a lock and a bucket walk per row per step. This histogram takes a
step's values as one array (bucket counts by one sorted search) and is exposed exactly
as prometheus_client's own Histogram is: `_bucket{le=...}` (cumulative), `_count` and
`_sum`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector


class StepHistogram(Collector):
    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: above all
        self.total = 0.0
        registry.register(self)

    def observe_many(self, values: Sequence[float] | np.ndarray) -> None:
        """Count every value of `values` (a value on a bound falls in that bound's
        bucket: `le`)."""
        if len(values) == 0:
            return
        values = np.asarray(values, dtype=np.float64)
        self.counts += np.bincount(
            np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts)
        )
        self.total += float(values.sum())

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = np.cumsum(self.counts)
        buckets = [(_label(b), int(c)) for b, c in zip(self.bounds, cumulative, strict=False)]
        buckets.append(("+Inf", int(cumulative[-1])))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, self.total)
        yield family


def _label(bound: float) -> str:
    """A bound as prometheus_client writes its `le` label (1 -> "1.0")."""
    return repr(float(bound))
