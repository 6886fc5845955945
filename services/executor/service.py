"""The executor service: reads forward steps from Redis, runs them, publishes results.

Each life of the process has its own epoch, announced with a heartbeat key. A step names
the executor epoch it was planned for: a step planned for an earlier life (whose device
state died with it) is acknowledged and dropped, never run against empty pools. Steps run
in stream order, each only right after the step it was planned on (step_chain.py), and
only from the live scheduler (fence.py). A step that fails is answered with its cause and
the process serves on: one bad step must not take every session's device state with it.
A message that is not a step of the wire format is refused the same way, counted in
`custody_malformed_messages_total` (by stream), and acknowledged.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import redis
import torch
from prometheus_client import Counter, Gauge, Histogram

from services.executor.compiled_decode import CompiledDecode
from services.executor.fence import SchedulerFence
from services.executor.grammars import grammars_for
from services.executor.metrics_http import serve_metrics
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.refusal import BatchRefused
from services.executor.runner import ModelRunner, StepFailed
from services.executor.step_chain import StepChain
from services.executor.step_io import StepIO
from services.executor.tiers import build_tiers
from services.executor.weights import load_model, model_dtype
from shared import streams
from shared.config import Settings
from shared.messages.envelope import WireError, encode
from shared.messages.forward import Step, StepHead, StepResult, decode_step, decode_step_head
from shared.redis_client import connect
from shared.retry import DEPENDENCY_FAULTS, Retry, background_faults, when_up
from shared.service_main import start

log = logging.getLogger("custody.executor")
STEPS = Counter(
    "custody_executor_steps_total",
    "forward steps by outcome: ok, refused, error, stale (an earlier executor life), fenced",
    ["outcome"],
)
# counted with the step's `ok`, so rows per step read from the three agree at any moment
STEP_BYTES = Counter(
    "custody_step_bytes", "bytes of the steps run (a row's KV indices travel as deltas)"
)
STEP_ROWS = Counter("custody_step_rows", "rows of the steps run")
FORWARD = Histogram("custody_forward_seconds", "deferred ops + forward + sampling of one step")
OPS_BYTES = Counter("custody_deferred_op_bytes_total", "bytes moved by deferred clears and copies")
OPS_TIME = Histogram("custody_deferred_op_seconds", "time to apply one step's deferred state ops")
DECODE_COMPILED = Gauge(
    "custody_decode_compiled", "1 while decode steps run compiled (compiled_decode.py), else 0"
)
MALFORMED = Counter(
    "custody_malformed_messages", "messages refused as not of the wire format", ["stream"]
)
FAULTS = background_faults()


class ExecutorService:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        starting = Retry("executor_start", log)  # no metrics yet: logged, not counted
        self.epoch = secrets.token_hex(8)
        self.name = f"executor-{self.epoch}"  # its consumer, and its connections' name
        self.client = when_up(lambda: connect(settings.redis_url, client_name=self.name), starting)
        self.keys = streams.Keys(settings.replica)
        self.runner = self.load_runner()
        self.chain = StepChain()
        self.fence = SchedulerFence(self.client, self.keys.scheduler_epoch)
        self._next_beat = 0.0  # monotonic time of the next heartbeat
        # retried at least once a heartbeat: the alive key must not lapse for a backoff
        beat = settings.heartbeat_seconds
        self.beating = Retry("executor_heartbeat", log, FAULTS, ceiling=beat)
        group = self.keys.forward, streams.EXECUTOR_GROUP
        when_up(lambda: streams.ensure_group(self.client, *group), starting)
        self.io = StepIO(
            self.client,
            self.keys,
            self.name,
            settings.stream_maxlen,
            lambda thread: Retry(thread, log, FAULTS, ceiling=beat),
            block_ms=int(beat * 500),
        )
        self.stopped = threading.Event()
        if self.runner.grammars is not None:
            checks = when_up(lambda: connect(settings.redis_url), starting)  # its own link
            retry = Retry("grammar_checks", log, FAULTS)
            threading.Thread(
                target=self.runner.grammars.serve_checks,
                args=(checks, self.keys, retry, self.stopped),
                daemon=True,
            ).start()

    def stop(self) -> None:
        """Its reader and its check thread end. A process ends them by ending; a service
        made in process (as tests make one) would otherwise answer the steps and the
        grammar checks of whatever executor comes after it on the same Redis names."""
        self.io.stop()
        self.stopped.set()

    def load_runner(self) -> ModelRunner:
        """The model on its device, its pools and tiers, warmed up. (The orchestration
        bench's stand-in executor replaces this, and only this: custody/bench/.)"""
        settings = self.settings
        gpu = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda" if gpu else "cpu")
        if device.type == "cpu":
            # On a CPU host the scheduler, Redis and the session store need a core while a
            # forward runs (the scheduler plans the next step meanwhile); torch's idle
            # threads spin-waiting on every core would take it from them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
        model = load_model(
            settings.model, device, settings.dtype, settings.load_format, settings.drafts_by_head
        )
        pools = DevicePools(
            model.cfg,
            PoolSizes(settings.kv_pages, settings.page_size, settings.mamba_slots),
            model.lm_head.weight.device,
            model_dtype(model),
            mtp=model.mtp is not None,
        )
        mover = build_tiers(settings, model.cfg, pools, mark=self._mark_in_flight)
        compiled = (
            CompiledDecode(model, pools, settings.max_running_requests)
            if settings.compile
            else None
        )
        grammars = grammars_for(settings, model.cfg)
        runner = ModelRunner(model, pools, mover, compiled, grammars, settings.max_running_requests)
        started = time.perf_counter()
        runner.warm_up()  # before the first heartbeat: no step waits for set-up
        DECODE_COMPILED.set_function(lambda: runner.compiled is not None)
        log.info(
            "warmed up in %.2f s (%s, decode %s; %d B per KV token, %d B per Mamba slot)",
            time.perf_counter() - started,
            pools.dtype,
            "compiled" if runner.compiled else "eager",
            pools.bytes_per_kv_token(),
            pools.bytes_per_mamba_slot(),
        )
        return runner

    def _mark_in_flight(self, counts: dict[str, int]) -> None:
        """For fault drills: what a step's tier moves are while they run ({}: done). A
        Redis that cannot be told must not fail the step."""
        try:
            if counts:
                self.client.hset(self.keys.tier_in_flight, mapping=counts)
            else:
                self.client.delete(self.keys.tier_in_flight)
        except redis.RedisError as err:
            log.warning("could not mark tier moves in flight: %s", err)

    def heartbeat(self) -> None:
        """Once a heartbeat: the alive key, and the fence read again. A Redis fault is
        counted and logged and the beat tried again after a backoff, never raised: the
        steps read go on (the key lapses only if the fault outlasts its expiry)."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        try:
            self.client.set(
                self.keys.executor_alive,
                self.epoch,
                px=int(self.settings.executor_timeout_seconds * 1000),
            )
            self.fence.refresh()
        except DEPENDENCY_FAULTS as err:
            self._next_beat = now + self.beating.failed(err)
            return
        self.beating.ok()
        self._next_beat = now + self.settings.heartbeat_seconds

    def serve_forever(self) -> None:
        """Serve until killed. Redis away or refusing (any error class, shared/retry.py)
        is waited out by the thread that met it (step_io.py, the heartbeat): exiting
        would lose every session's device state. A fault of the loop itself still ends
        the process, whose state is then in doubt: the supervisor starts a new life, and
        the scheduler re-queues (the device-lost path)."""
        log.info("executor %s ready", self.epoch)
        self.io.start()
        while True:
            self.heartbeat()
            self.serve_one(timeout=self.settings.heartbeat_seconds / 2)

    def serve_one(self, timeout: float) -> bool:
        """Run the next entry of the forward stream if one comes within `timeout`, and
        hand its answer to the writer; False if none came."""
        entry = self.io.next(timeout)
        if entry is None:
            return False
        result = None if entry.raw is None else self.run_entry(entry.raw, entry.step, entry.error)
        self.io.answer(entry.entry_id, result)
        return True

    def run_step(self, raw: bytes) -> bytes | None:
        """The result to publish for one step message, or None when nobody waits for one
        (planned for an earlier life, from a fenced scheduler, or too malformed to say
        whose it is). No step ends the process: whatever it raises refuses it, named in
        its result."""
        try:
            return self.run_entry(raw, decode_step(raw), None)
        except WireError as err:
            return self.run_entry(raw, None, err)

    def run_entry(self, raw: bytes, step: Step | None, error: WireError | None) -> bytes | None:
        """`run_step` of a message decoded already (the reader thread decodes ahead)."""
        if step is None:
            return self._malformed(raw, error or WireError("no step"))
        if not self._for_me(step.epoch, step.step, step.executor_epoch):
            return None
        sampling = [r.rid for r in step.rows if r.sample]
        try:
            self.chain.resolve(step.epoch, step.after, step.rows)
            ops = step.ops()
            with FORWARD.time():
                result = self.runner.execute(
                    step.rows, ops, moves=step.moves, discards=step.discards
                )
        except Exception as err:
            return self._refused(step, sampling, err)
        self.chain.ran(step.epoch, step.step, sampling, result.last_tokens())
        STEP_BYTES.inc(len(raw))
        STEP_ROWS.inc(len(step.rows))
        STEPS.labels("ok").inc()
        OPS_TIME.observe(self.runner.last_ops_seconds)
        OPS_BYTES.inc(self.runner.last_ops_bytes)
        return encode(result.reply(self.epoch, step.step, step.epoch, sampling))

    def _for_me(self, scheduler: str, step: int, planned_for: str) -> bool:
        """A step is run (or answered) only if planned for this life, by the live
        scheduler; the others are counted and dropped."""
        if planned_for != self.epoch:
            STEPS.labels("stale").inc()
            return False  # planned for a previous life of the executor
        if not self.fence.admits(scheduler):
            STEPS.labels("fenced").inc()
            log.warning("step %s of scheduler %s fenced: it was replaced", step, scheduler)
            return False  # nobody waits for it: that scheduler is gone
        return True

    def _malformed(self, raw: bytes, err: WireError) -> bytes | None:
        """Count and log a step that does not decode; answer it (breaking the chain) when
        its head still says whose it is, so its scheduler does not wait for it."""
        MALFORMED.labels("forward").inc()
        log.error("refused a malformed step: %s", err)
        try:
            head = decode_step_head(raw)
        except WireError:
            STEPS.labels("refused").inc()
            return None  # not a step of the chain: a step planned on it is refused anyway
        if not self._for_me(head.epoch, head.step, head.executor_epoch):
            return None
        return self._refused(head, [], err)

    def _refused(self, step: StepHead, rids: list[str], err: Exception) -> bytes:
        """Count and log a refused or failed step, break the chain, name the cause."""
        if isinstance(err, BatchRefused | WireError):
            STEPS.labels("refused").inc()
            log.error("step %s refused: %s", step.step, err)
            cause = str(err)
        else:
            STEPS.labels("error").inc()
            log.exception("step %s failed", step.step)
            cause = str(err) if isinstance(err, StepFailed) else f"{type(err).__name__}: {err}"
        self.chain.broken()
        ops_ran = isinstance(err, StepFailed) and err.ops_ran
        result = StepResult.of(
            self.epoch, step.step, step.epoch, rids, error=cause, ops_ran=ops_ran
        )
        return encode(result)


def main(argv: list[str] | None = None) -> None:
    settings = start("executor", argv)
    serve_metrics(settings.host, settings.executor_metrics_port, settings.replica)
    ExecutorService(settings).serve_forever()


if __name__ == "__main__":
    main()
