"""The executor service: reads forward steps from Redis, runs them, publishes results.

Each life of the process has its own epoch, announced with a heartbeat key. A step names
the executor epoch it was planned for: a step planned for an earlier life (whose device
state died with it) is acknowledged and dropped, never run against empty pools. Steps run
in stream order, each only right after the step it was planned on (step_chain.py), and
only from the live scheduler (fence.py). A step that fails is answered with its cause and
the process serves on: one bad step must not take every session's device state with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import time

import redis
import torch
from prometheus_client import Counter, Histogram, start_http_server

from services.executor.fence import SchedulerFence
from services.executor.model.batch import Row
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import BatchRefused, ModelRunner, StepFailed
from services.executor.step_chain import StepChain
from services.executor.weights import load_model
from shared import streams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.wire import WireError, WireRow, decode, encode, result_body, unpack_ints

log = logging.getLogger("custody.executor")
STEPS = Counter(
    "custody_executor_steps_total",
    "forward steps by outcome: ok, refused, error, stale (an earlier executor life), fenced",
    ["outcome"],
)
FORWARD = Histogram("custody_forward_seconds", "deferred ops + forward + sampling of one step")
OPS_BYTES = Counter("custody_deferred_op_bytes_total", "bytes moved by deferred clears and copies")
OPS_TIME = Histogram("custody_deferred_op_seconds", "time to apply one step's deferred state ops")


class ExecutorService:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = redis.Redis.from_url(settings.redis_url)
        self.epoch = secrets.token_hex(8)
        self.name = f"executor-{self.epoch}"
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            # On a CPU host the scheduler, Redis and the session store need a core while a
            # forward runs (the scheduler plans the next step meanwhile); torch's idle
            # threads spin-waiting on every core would take it from them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
        model = load_model(settings.model, device)
        self.pools = DevicePools(
            model.cfg,
            PoolSizes(settings.kv_pages, settings.page_size, settings.mamba_slots),
            model.lm_head.weight.device,
        )
        self.runner = ModelRunner(model, self.pools)
        self.chain = StepChain()
        self.fence = SchedulerFence(self.client)
        self._beat = 0.0
        streams.ensure_group(self.client, streams.FORWARD, streams.EXECUTOR_GROUP)

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._beat >= self.settings.heartbeat_seconds:
            self.client.set(
                streams.EXECUTOR_ALIVE,
                self.epoch,
                px=int(self.settings.executor_timeout_seconds * 1000),
            )
            self.fence.refresh()
            self._beat = now

    def serve_forever(self) -> None:
        log.info(
            "executor %s ready (%d B per KV token, %d B per Mamba slot)",
            self.epoch,
            self.pools.bytes_per_kv_token(),
            self.pools.bytes_per_mamba_slot(),
        )
        while True:
            try:
                self.heartbeat()
                self.serve_once(block_ms=int(self.settings.heartbeat_seconds * 500))
            except redis.ConnectionError as err:
                log.warning("redis unavailable (%s); retrying", err)
                time.sleep(0.5)

    def serve_once(self, block_ms: int) -> int:
        reply = self.client.xreadgroup(
            streams.EXECUTOR_GROUP, self.name, {streams.FORWARD: ">"}, count=8, block=block_ms
        )
        handled = 0
        for entry_id, fields in reply[0][1] if reply else []:  # in stream order
            self.heartbeat()
            result = self.run_step(fields.get(b"m", b"")) if fields else None
            pipe = self.client.pipeline(transaction=False)
            if result is not None:
                pipe.xadd(
                    streams.RESULTS,
                    {"m": result},
                    maxlen=self.settings.stream_maxlen,
                    approximate=True,
                )
            pipe.xack(streams.FORWARD, streams.EXECUTOR_GROUP, entry_id)
            pipe.execute()
            handled += 1
        return handled

    def run_step(self, raw: bytes) -> bytes | None:
        """The result to publish for one step message, or None when nobody waits for one
        (undecodable, planned for an earlier life, or from a fenced scheduler). No step
        ends the process: whatever it raises refuses it, named in its result."""
        try:
            msg = decode(raw)
            scheduler, step, planned_for = msg["epoch"], msg["step"], msg["executor_epoch"]
            if not isinstance(step, int) or not isinstance(scheduler, str):
                raise WireError(f"step {step!r} of scheduler {scheduler!r}")
        except Exception as err:
            STEPS.labels("refused").inc()
            log.error("refused an undecodable step: %s", err)
            return None  # not a step of the chain: a step planned on it is refused anyway
        if planned_for != self.epoch:
            STEPS.labels("stale").inc()
            return None  # planned for a previous life of the executor
        if not self.fence.admits(scheduler):
            STEPS.labels("fenced").inc()
            log.warning("step %s of scheduler %s fenced: it was replaced", step, scheduler)
            return None  # nobody waits for it: that scheduler is gone
        sampling: list[str] = []
        try:
            rows, ops = _step_of(msg)
            sampling = [r.rid for r in rows if r.sample]
            self.chain.resolve(scheduler, msg.get("after"), rows)
            with FORWARD.time():
                result = self.runner.execute([Row.from_wire(r) for r in rows], ops)
        except Exception as err:
            return self._refused(step, scheduler, sampling, err)
        self.chain.ran(scheduler, step, sampling, result.tokens)
        STEPS.labels("ok").inc()
        OPS_TIME.observe(self.runner.last_ops_seconds)
        OPS_BYTES.inc((len(ops.clears) + len(ops.copies)) * self.pools.bytes_per_mamba_slot())
        return encode(
            "result",
            self.epoch,
            step,
            result_body(step, scheduler, self.epoch, sampling, result.tokens, result.logprobs),
        )

    def _refused(self, step: int, scheduler: str, rids: list[str], err: Exception) -> bytes:
        """Count and log a refused or failed step, break the chain, name the cause."""
        if isinstance(err, BatchRefused):
            STEPS.labels("refused").inc()
            log.error("step %s refused: %s", step, err)
            cause = str(err)
        else:
            STEPS.labels("error").inc()
            log.exception("step %s failed", step)
            cause = str(err) if isinstance(err, StepFailed) else f"{type(err).__name__}: {err}"
        self.chain.broken()
        ops_ran = isinstance(err, StepFailed) and err.ops_ran
        body = result_body(step, scheduler, self.epoch, rids, [], [], cause, ops_ran=ops_ran)
        return encode("result", self.epoch, step, body)


def _step_of(msg: dict) -> tuple[list[WireRow], DeferredOps]:
    rows = [WireRow.from_body(b) for b in msg["rows"]]
    copies = unpack_ints(msg["copies"], "<i4").reshape(-1, 2).tolist()
    clears = unpack_ints(msg["clears"], "<i4").tolist()
    return rows, DeferredOps(clears, [tuple(c) for c in copies])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="custody executor service")
    Settings.add_arguments(parser)
    settings = Settings.resolve(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s executor %(message)s")
    start_http_server(settings.executor_metrics_port, addr=settings.host)
    ExecutorService(settings).serve_forever()


if __name__ == "__main__":
    main()
