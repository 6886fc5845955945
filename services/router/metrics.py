"""The router's own metrics: routing decisions by kind, the load it sees per replica,
upstream failures, and the time it adds to a request (`overhead`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from services.router.replicas import ReplicaTable

OVERHEAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    def __init__(self, table: ReplicaTable) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "custody_router_requests",
            "requests routed, by why the replica was chosen: affinity (a session's "
            "placement), load (least loaded), request (an abort by rid), fanout (all)",
            ["decision", "replica"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "custody_router_upstream_errors",
            "requests a replica could not be reached for",
            ["replica"],
            registry=self.registry,
        )
        self.overhead = Histogram(
            "custody_router_overhead_seconds",
            "time spent inside the router per request: receive to upstream send, plus "
            "first upstream byte to first byte to the client",
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Replicas(table))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Replicas:
    def __init__(self, table: ReplicaTable) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = GaugeMetricFamily(
            "custody_router_replica_load",
            "running + queued requests a replica registered, plus this router's in flight",
            labels=["replica"],
        )
        ready = GaugeMetricFamily(
            "custody_router_replica_ready",
            "1 if the replica is live with an executor",
            labels=["replica"],
        )
        for replica in self.table.live.values():
            load.add_metric([replica.id], replica.load)
            ready.add_metric([replica.id], float(replica.executor))
        yield load
        yield ready
