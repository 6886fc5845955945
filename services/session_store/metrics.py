"""The store's Prometheus metrics: what each replica's ledger found, labelled with that
replica.

The store holds several replicas' ledgers, so it cannot label its exposition with one
replica as the scheduler and the executor do (shared/metrics_labels.py): each sample names
its own replica, `replica` last among its labels as there. The values are read from the
ledgers at scrape time, so a replica discovered later appears at its first scrape and no
gauge can drift from its ledger. The faults the store's background loops survived
(`custody_background_faults_total`, shared/retry.py) are labelled the same way: by loop,
and by the replica the loop serves (discovery: the store's own).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.session_store.ledger_replay import KINDS
from services.session_store.replicas import ReplicaConsumers
from shared.metrics_labels import LABEL


class LedgerMetrics(Collector):
    def __init__(self, replicas: ReplicaConsumers) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        violations = GaugeMetricFamily(
            "custody_ledger_violations", "ownership violations found", labels=["kind", LABEL]
        )
        leaked = GaugeMetricFamily(
            "custody_ledger_leaked_slots",
            "slots held by running work at idle",
            labels=["pool", LABEL],
        )
        applied = GaugeMetricFamily(
            "custody_ledger_events_applied", "ownership events replayed", labels=[LABEL]
        )
        refused = GaugeMetricFamily(
            "custody_ownership_messages_refused",
            "ownership stream entries refused as malformed (acknowledged, snapshot asked)",
            labels=[LABEL],
        )
        fenced = GaugeMetricFamily(
            "custody_session_records_fenced",
            "session records refused: written under a placement epoch the directory left",
            labels=[LABEL],
        )
        lost = CounterMetricFamily(
            "custody_sessions_lost",
            "sessions ended `session_lost`: a gap in the ownership stream whose writer died",
            labels=[LABEL],
        )
        steps = GaugeMetricFamily(
            "custody_ledger_steps_checked",
            "forward steps whose writes were checked against the ledger, or could not be",
            labels=["result", LABEL],
        )
        for replica, consumer in sorted(self.replicas.consumers.items()):
            led = consumer.ledger
            for kind in KINDS:
                violations.add_metric([kind, replica], led.found[kind])
            held = led.leaked()
            for pool in led.names:
                leaked.add_metric([pool, replica], len(held.get(pool, [])))
            applied.add_metric([replica], led.events_applied)
            refused.add_metric([replica], consumer.refused)
            fenced.add_metric([replica], consumer.fenced)
            lost.add_metric([replica], consumer.sessions_lost)
            steps.add_metric(["checked", replica], consumer.checker.checked)
            steps.add_metric(["unchecked", replica], consumer.checker.unchecked)
        yield from (violations, leaked, applied, refused, fenced, lost, steps)
        yield from self.replicas.loop_faults.collect()
