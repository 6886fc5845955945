"""The endpoint picker's own metrics: its picks by why the replica was chosen, the time a
pick takes (the last request-body chunk received to the answer sent: the latency the
picker adds to a request in the gateway), its refusals by status, what the gateway says
served each request, the prefix counters it shares with the router, the replicas it sees
and the faults its background loops survived."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from fronts.choice import PrefixCounters
from fronts.prefix_index import IndexCollector, PrefixIndex
from shared.retry import background_faults

DECISION_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 0.1)


class PickerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.picked = Counter(
            "custody_epp_picks",
            "requests given an endpoint, by why: affinity (a session's placement), prefix, "
            "load, random (router_policy random), request (an abort by rid)",
            ["decision", "replica"],
            registry=self.registry,
        )
        self.refused = Counter(
            "custody_epp_refusals",
            "requests answered by the picker itself (an ImmediateResponse), by status and kind",
            ["status", "kind"],
            registry=self.registry,
        )
        self.decision = Histogram(
            "custody_epp_decision_seconds",
            "last request-body chunk received to the pick sent, by kind: open (a session's "
            "open, placed meanwhile), turn (a session's request), other",
            ["kind"],
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.served = Counter(
            "custody_epp_served",
            "responses whose serving endpoint the gateway reported: the one picked (picked) "
            "or another (other: a fallback, or a gateway not honouring the pick)",
            ["match"],
            registry=self.registry,
        )
        self.prefix = PrefixCounters.of(self.registry, "epp")
        self.faults = background_faults(self.registry)

    def watch(self, index: PrefixIndex) -> None:
        self.registry.register(IndexCollector(index, "epp"))

    def render(self) -> bytes:
        return generate_latest(self.registry)
