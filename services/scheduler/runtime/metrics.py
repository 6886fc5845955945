"""The scheduler's Prometheus metrics.

Pool occupancy, sessions, queues and counters are read from live state at scrape time
(the ledger's owner tables, the engine's queues), so a metric can never drift from what
it measures; KV utilisation alone reads counts the prefix cache keeps as it changes, which
its integrity check holds against a walk. Latencies are histograms observed a step at a time
(latency_histogram.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.scheduler.runtime.latency_histogram import StepHistogram
from shared import streams
from shared.retry import DEPENDENCY_FAULTS, background_faults

if TYPE_CHECKING:
    from services.scheduler.engine.core import EngineCore
    from services.scheduler.runtime.executor_link import ExecutorLink
    from services.scheduler.runtime.outbox import OwnershipOutbox

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class LiveState(Collector):
    def __init__(
        self,
        engine: EngineCore,
        link: ExecutorLink,
        outbox: OwnershipOutbox,
        loop_faults: Callable[[], int],
    ):
        self.engine = engine
        self.link = link
        self.outbox = outbox
        self.loop_faults = loop_faults
        self.stream_lag: dict[str, int] = {}  # read fresh by `SchedulerMetrics.render`

    def collect(self) -> Iterator:
        engine, pools = self.engine, self.engine.pools
        capacity = GaugeMetricFamily("custody_pool_capacity", "slots in the pool", labels=["pool"])
        free = GaugeMetricFamily("custody_pool_free", "free slots", labels=["pool"])
        held = GaugeMetricFamily(
            "custody_pool_held", "slots held, by owner kind", labels=["pool", "owner_kind"]
        )
        for pool in pools.ledger.by_id:
            capacity.add_metric([pool.name], pool.capacity)
            free.add_metric([pool.name], pool.free_count)
            for kind, n in pool.held_by_kind().items():
                if kind.name != "FREE":
                    held.add_metric([pool.name, kind.name.lower()], n)
        yield from (capacity, free, held)
        yield _gauge("custody_requests_running", "requests running", len(engine.running))
        yield _gauge("custody_requests_queued", "requests waiting", len(engine.waiting))
        yield _gauge(
            "custody_kv_utilization",
            "the fuller of the KV pages and Mamba slots in use, 0..1; what the prefix cache "
            "could evict now counts as free (the Model Server Protocol's KV utilisation)",
            self.kv_utilization(),
        )
        yield _counter(
            "custody_invariant_check_failures",
            "ownership invariant violations found",
            engine.guard.failures,
        )
        yield _counter("custody_retractions", "running requests preempted", engine.retractions)
        yield _counter(
            "custody_ownership_trimmed_unread",
            "ownership stream entries trimmed before the session store read them (a gap)",
            self.outbox.trimmed_unread,
        )
        yield _counter(
            "custody_dropped_rows",
            "rows of steps in flight whose request ended or was re-queued first (wasted work)",
            engine.in_flight.dropped_rows,
        )
        yield _counter("custody_prefix_cache_queries", "prefix cache lookups", engine.cache_queries)
        yield _counter(
            "custody_prefix_cache_hits", "prefix cache lookups that matched", engine.cache_hits
        )
        yield _counter(
            "custody_prefix_cache_hit_tokens",
            "tokens served from the prefix cache",
            engine.cache_hit_tokens,
        )
        yield _counter(
            "custody_executor_restarts",
            "executor losses seen (device state lost)",
            self.link.losses,
        )
        yield _counter(
            "custody_quarantined_requests",
            "requests failed as poison: their step was executing at two executor losses",
            engine.quarantined,
        )
        yield _counter(
            "custody_scheduler_loop_faults",
            "faults of the scheduler loop itself, survived by the device-lost path",
            self.loop_faults(),
        )
        yield from self._prefix()
        yield from self._speculation()
        yield from self._sessions()
        yield from self._per_stream()
        yield from self._tiers()

    def kv_utilization(self) -> float:
        """The fuller pool of the two a hybrid model's request needs, without counting
        cache entries eviction would give up for it: an endpoint picker reading a full but
        reclaimable cache as busy would send nothing to a replica with room. O(1): the
        cache keeps its evictable counts as it changes."""
        kv, mamba, cache = self.engine.pools.kv_pages, self.engine.pools.mamba, self.engine.cache
        kv_used = kv.capacity - kv.free_count - cache.evictable_pages
        mamba_used = mamba.capacity - mamba.free_count - cache.evictable_states
        return max(kv_used / kv.capacity, mamba_used / mamba.capacity)

    def _speculation(self) -> Iterator:
        """Verify steps and what they accepted (docs/speculative.md); the speculative
        slots in use are `custody_pool_held{pool="mamba",owner_kind="speculative"}`."""
        accepted = self.engine.completion.accepted
        yield _counter("custody_spec_verify_steps", "verify rows run", accepted.steps)
        yield _counter("custody_spec_draft_tokens", "drafts verified", accepted.drafted)
        yield _counter("custody_spec_accepted_tokens", "drafts accepted", accepted.accepted)
        by_position = CounterMetricFamily(
            "custody_spec_position",
            "per draft position (0: the first draft of a row): rows that had a draft there "
            "(offered) and those whose draft there was accepted (accepted)",
            labels=["position", "outcome"],
        )
        for i, (offered, taken) in enumerate(
            zip(accepted.offered_at, accepted.at_position, strict=True)
        ):
            by_position.add_metric([str(i), "offered"], offered)
            by_position.add_metric([str(i), "accepted"], taken)
        yield by_position

    def _prefix(self) -> Iterator:
        """Prefix reuse that silently does not happen: KV cached but no state there."""
        admission, engine = self.engine.admission, self.engine
        matched = CounterMetricFamily(
            "custody_prefix_tokens",
            "prompt positions the prefix cache held at admission: their KV (kv_matched), "
            "and up to the deepest state, the part reused (state_matched)",
            labels=["kind"],
        )
        matched.add_metric(["kv_matched"], admission.kv_matched_tokens)
        matched.add_metric(["state_matched"], admission.cache_hit_tokens)
        yield matched
        yield _counter(
            "custody_prefix_state_gap_tokens",
            "positions whose KV was cached with no state there at admission (reuse lost; "
            "a junction checkpoint is planned, so the next request finds the state)",
            admission.state_gap_tokens,
        )
        taken = CounterMetricFamily(
            "custody_prefix_checkpoints",
            "states cached where prefixes diverge (junction) or every "
            "--state-checkpoint-interval positions (interval)",
            labels=["kind"],
        )
        for kind in ("junction", "interval"):
            taken.add_metric([kind], engine.endings.checkpoints[kind])
        yield taken
        yield _counter(
            "custody_prefix_states_evicted",
            "cached Mamba states evicted (a junction's and a chunk end's alike)",
            engine.cache.states_evicted,
        )

    def _sessions(self) -> Iterator:
        """The sessions: how many are open, and what became of some."""
        sessions = self.engine.sessions
        yield _gauge("custody_sessions_open", "open streaming sessions", len(sessions.sessions))
        yield _counter(
            "custody_sessions_expired",
            "sessions closed by their idle timeout (--session-idle-timeout, or their own)",
            sessions.expired,
        )
        yield _counter(
            "custody_session_records_conflicting",
            "session records taken back from history only: their slots did not add up, or "
            "another record claimed them",
            sessions.conflicting_records,
        )
        redo = "chat replies re-encoded from their text or rendered anew (docs/chat.md)"
        yield _counter("custody_session_reencodes", redo, sessions.reencoded)
        kept = "of them, the session resuming at the reply's start, not the turn's"
        yield _counter("custody_session_reply_starts", kept, sessions.reply_starts)
        branched = "turns that left their session's state to resume from the prefix cache"
        yield _counter("custody_session_branch_turns", branched, sessions.branch_turns)
        yield _counter("custody_session_forks", "sessions opened by /fork_session", sessions.forks)

    def _tiers(self) -> Iterator:
        """Session state below the device: where it is, what moved, what was given up."""
        sessions = self.engine.sessions
        where = GaugeMetricFamily(
            "custody_sessions_by_tier", "open sessions by where their state is", labels=["tier"]
        )
        tiers = [s.state_tier or "none" for s in sessions.sessions.values()]
        for tier in ("device", "host", "disk", "none"):
            where.add_metric([tier], tiers.count(tier))
        moved = CounterMetricFamily(
            "custody_tier_moves_planned",
            "session state moves planned: hibernate, spill, load, restore",
            labels=["kind"],
        )
        for kind, n in sessions.moves.moved.items():
            moved.add_metric([kind], n)
        dropped = CounterMetricFamily(
            "custody_tier_states_dropped",
            "states given up because a full tier could not take them (re-prefilled)",
            labels=["tier"],
        )
        for tier, n in sessions.moves.dropped.items():
            dropped.add_metric([tier], n)
        dropped.add_metric(["device"], sessions.states_dropped)
        yield from (where, moved, dropped)
        yield _counter(
            "custody_tier_failed_loads",
            "blobs that failed their check at a load (the session re-prefilled)",
            sessions.moves.failed_loads,
        )

    def _per_stream(self) -> Iterator:
        lag = GaugeMetricFamily(
            "custody_stream_lag_entries", "entries not yet read by a group", labels=["stream"]
        )
        for stream, entries in self.stream_lag.items():
            lag.add_metric([stream], entries)
        yield lag
        malformed = CounterMetricFamily(
            "custody_malformed_messages",
            "messages refused as not of the wire format",
            labels=["stream"],
        )
        malformed.add_metric(["results"], self.link.malformed)  # the stream it reads
        yield malformed


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class SchedulerMetrics:
    """Latency histograms, observed by the intake and the step loop; the live state is
    registered (`watch`) once those exist."""

    def __init__(self, keys: streams.Keys) -> None:
        self.keys = keys
        self.registry = CollectorRegistry()
        self.live: LiveState | None = None
        self.ttft = StepHistogram(
            "custody_ttft_seconds", "time to first token", BUCKETS, self.registry
        )
        self.itl = StepHistogram(
            "custody_inter_token_latency_seconds",
            "time between tokens",
            BUCKETS,
            self.registry,
        )
        self.e2e = StepHistogram(
            "custody_request_seconds",
            "arrival to end of a request",
            BUCKETS,
            self.registry,
        )
        self.step = StepHistogram(
            "custody_step_seconds",
            "one pass of the scheduling loop with work in flight (plan and publish a step, "
            "wait for and complete the oldest); their sum is the loop's busy time",
            BUCKETS,
            self.registry,
        )
        self.turnaround = StepHistogram(
            "custody_step_turnaround_seconds",
            "a step's result read to the next step on the stream: the part of the pipeline "
            "the executor's forward must cover, or it waits (bench e2e's overhead_share)",
            BUCKETS,
            self.registry,
        )
        self.header_turns = Counter(
            "custody_header_session_turns",
            "chat requests bound to a session by --session-header, by outcome: opened, "
            "resumed, reseeded (another conversation), stateless (a turn in flight)",
            ["outcome"],
            registry=self.registry,
        )
        self.retention_hints = Counter(
            "custody_retention_hints",
            "turns that gave their session a retention hint (cache_control), by TTL",
            ["ttl"],
            registry=self.registry,
        )
        for ttl in ("5m", "1h"):  # exported at 0 before the first
            self.retention_hints.labels(ttl)
        self.edge_worker_exits = Counter(
            "custody_edge_worker_exits",
            "edge worker processes that exited while the core ran (a crash, a kill, an OOM); "
            "each is started again",
            registry=self.registry,
        )
        self.edge_links_closed = Counter(
            "custody_edge_links_closed",
            "edge worker links the core closed, by reason: bad_frame (a frame that does not "
            "decode), unread (the worker stopped reading its news); their calls are aborted",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("bad_frame", "unread"):  # exported at 0 before the first
            self.edge_links_closed.labels(reason)
        self.edge_calls = Gauge(
            "custody_edge_calls",
            "calls of edge workers the core is serving (queued or running)",
            registry=self.registry,
        )
        self.faults = background_faults(self.registry)  # the registration and step loops'

    def watch(self, live: LiveState) -> None:
        self.live = live
        self.registry.register(live)

    async def render(self, client: aioredis.Redis) -> bytes:
        """The exposition, with each stream's lag read fresh: entries not yet read, or
        read and not acknowledged, by each consumer group. Every sample carries this
        replica's `replica` label (shared/metrics_labels.py). With Redis away, the lag
        last read is kept: every other sample is still served."""
        from shared.metrics_labels import with_replica

        for stream, name in (("ownership", self.keys.ownership), ("forward", self.keys.forward)):
            try:
                groups = await client.xinfo_groups(name)
            except DEPENDENCY_FAULTS:  # no stream yet; or Redis away
                continue
            self.live.stream_lag[stream] = sum(
                int(g.get("lag") or 0) + int(g["pending"]) for g in groups
            )
        return with_replica(generate_latest(self.registry), self.keys.replica)
