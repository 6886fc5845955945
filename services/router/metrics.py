"""The router's own metrics: routing decisions by kind, the load it sees per replica,
upstream failures, the time it adds to a request (`overhead`), the prompt tokens it sent
where they were cached, the size of its index of each replica's prefix cache, and the
faults its background loops survived (shared/retry.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fronts.choice import PrefixCounters
from fronts.prefix_index import IndexCollector, PrefixIndex
from fronts.replicas import ReplicaTable
from shared.retry import background_faults

OVERHEAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    def __init__(self, table: ReplicaTable) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "custody_router_requests",
            "requests routed, by why the replica was chosen: affinity (a session's "
            "placement), prefix (the longest cached prefix), load (least loaded), request "
            "(an abort by rid), fanout (all), random (router_policy random)",
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
            "first upstream byte to first byte to the client; by kind: open (a session's "
            "open, its placement written first), turn (a session's request), other",
            ["kind"],
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.prefix = PrefixCounters.of(self.registry, "router")
        self.faults = background_faults(self.registry)  # its background loops'
        self.registry.register(_Replicas(table))

    def watch(self, index: PrefixIndex, deaths: Mapping[str, int]) -> None:
        """`deaths`: the replicas this router found dead, by id (kept current by it)."""
        self.registry.register(IndexCollector(index, "router"))
        self.registry.register(_Deaths(deaths))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Replicas:
    def __init__(self, table: ReplicaTable) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
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
        yield CounterMetricFamily(
            "custody_router_unverified_registrations",
            "registrations read and refused: not signed with the cluster secret",
            value=self.table.unverified,
        )


class _Deaths:
    """The replicas this router found dead (fronts/migration.py `Mover._dead`)."""

    def __init__(self, deaths: Mapping[str, int]) -> None:
        self.deaths = deaths

    def collect(self) -> Iterator[CounterMetricFamily]:
        dead = CounterMetricFamily(
            "custody_router_replicas_declared_dead",
            "times a replica was found dead (its registration missing for "
            "replica_dead_seconds), by replica",
            labels=["replica"],
        )
        for replica, times in sorted(self.deaths.items()):
            dead.add_metric([replica], times)
        yield dead
