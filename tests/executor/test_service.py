"""The executor service in-process on a real Redis: a step that raises is answered with
its cause and the service serves on; a malformed step is refused, counted and
acknowledged; steps of a replaced scheduler are fenced."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import redis
import torch
from prometheus_client import REGISTRY

from services.executor.fence import SchedulerFence
from services.executor.model.pools import DevicePools
from services.executor.runner import ModelRunner
from services.executor.service import ExecutorService
from shared import streams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.envelope import encode
from shared.messages.forward import Step, StepRow, decode_result

PROMPT = [5, 9, 33, 71, 2, 8]


@pytest.fixture
def service(redis_url: str, redis_client: redis.Redis) -> Iterator[ExecutorService]:
    threads = torch.get_num_threads()
    service = ExecutorService(
        Settings(redis_url=redis_url, page_size=4, kv_pages=16, mamba_slots=8, compile=False)
    )
    yield service
    service.stop()  # its reader and checks must not take the next test's
    torch.set_num_threads(threads)  # the service leaves a core to the others


def wire_row(tokens: list[int], **sampling: object) -> StepRow:
    n = len(tokens)
    return StepRow.of(tokens, 0, np.arange(4, 4 + n), 1, rid="r", **sampling)


def step(
    service: ExecutorService,
    scheduler: str,
    step_id: int,
    rows: list[StepRow],
    after: int | None = None,
) -> bytes:
    """A step that clears slot 1 and runs its rows from position 0."""
    ops = DeferredOps(clears=[1])
    return encode(Step.of(scheduler, step_id, service.epoch, rows, ops, after=after))


def outcome(name: str) -> float:
    return REGISTRY.get_sample_value("custody_executor_steps_total", {"outcome": name}) or 0.0


def malformed() -> float:
    labels = {"stream": "forward"}
    return REGISTRY.get_sample_value("custody_malformed_messages_total", labels) or 0.0


def greedy(service: ExecutorService, tokens: list[int]) -> int:
    """The token a fresh runner picks for `tokens` from empty state."""
    pools = DevicePools(service.runner.model.cfg, service.runner.pools.sizes, torch.device("cpu"))
    row = wire_row(tokens)
    return ModelRunner(service.runner.model, pools).execute([row], DeferredOps()).tokens[0]


def raise_boom(*_: object) -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize(("where", "ops_ran"), [("validate", False), ("forward", True)])
def test_a_step_that_raises_is_answered_with_its_cause_and_the_next_runs(
    service, monkeypatch, where, ops_ran
):
    target = service.runner if where == "validate" else service.runner.model
    monkeypatch.setattr(target, where, raise_boom)
    errors = outcome("error")
    failed = decode_result(service.run_step(step(service, "s", 1, [wire_row(PROMPT)])))
    assert failed.error == "RuntimeError: boom" and failed.ops_ran is ops_ran
    assert outcome("error") == errors + 1
    monkeypatch.undo()
    # the chain is broken: a step planned on the failed one is refused, nothing ran
    refused = decode_result(service.run_step(step(service, "s", 2, [wire_row([7])], after=1)))
    assert "planned on top of step 1" in refused.error and refused.ops_ran is False
    ok = decode_result(service.run_step(step(service, "s", 3, [wire_row(PROMPT)])))
    assert ok.error is None and ok.rids == ["r"]
    assert ok.tokens.tolist() == [greedy(service, PROMPT)]


def test_rows_that_do_not_decode_are_answered_and_the_service_serves_on(service):
    """The step's head still says whose it is: its scheduler gets the reason."""
    raw = msgspec.msgpack.decode(step(service, "s", 1, [wire_row(PROMPT)]))
    raw["rows"]["rids"] = "not the rows' ids"
    before = malformed()
    failed = decode_result(service.run_step(msgspec.msgpack.encode(raw)))
    assert "malformed" in failed.error and "rows.rids" in failed.error
    assert failed.ops_ran is False and malformed() == before + 1
    ok = decode_result(service.run_step(step(service, "s", 2, [wire_row(PROMPT)])))
    assert ok.error is None


def test_a_message_that_is_no_step_is_counted_acknowledged_and_passed_over(service, redis_client):
    """Nothing says whose it is: no answer, and the step after it is served."""
    before, refused = malformed(), outcome("refused")
    redis_client.xadd(streams.SINGLE.forward, {"m": b"not a step"})
    redis_client.xadd(streams.SINGLE.forward, {"m": step(service, "s", 1, [wire_row(PROMPT)])})
    serve(service, 2)
    assert malformed() == before + 1 and outcome("refused") == refused + 1
    (published,) = [decode_result(f[b"m"]) for _, f in redis_client.xrange(streams.SINGLE.results)]
    assert (published.step, published.error) == (1, None)
    assert redis_client.xpending(streams.SINGLE.forward, streams.EXECUTOR_GROUP)["pending"] == 0


def test_degenerate_sampling_parameters_still_give_a_token(service):
    row = wire_row(PROMPT, temperature=1e-40, top_p=1e-9, top_k=1, seed=2**64 - 1)
    ok = decode_result(service.run_step(step(service, "s", 1, [row])))
    assert ok.error is None
    assert ok.tokens.tolist() == [greedy(service, PROMPT)]


def test_steps_of_a_replaced_scheduler_are_acknowledged_and_dropped(service, redis_client):
    assert service.run_step(step(service, "A", 1, [wire_row(PROMPT)])) is not None  # no key
    redis_client.set(streams.SINGLE.scheduler_epoch, "B")
    fenced = outcome("fenced")
    for scheduler, step_id in (("A", 2), ("B", 1)):
        redis_client.xadd(
            streams.SINGLE.forward, {"m": step(service, scheduler, step_id, [wire_row([3])])}
        )
    serve(service, 2)
    assert outcome("fenced") == fenced + 1
    published = [decode_result(f[b"m"]) for _, f in redis_client.xrange(streams.SINGLE.results)]
    assert [(m.scheduler_epoch, m.step, m.error) for m in published] == [("B", 1, None)]
    pending = redis_client.xpending(streams.SINGLE.forward, streams.EXECUTOR_GROUP)
    assert pending["pending"] == 0


def test_the_fence_reads_the_key_again_only_for_another_epoch(redis_client):
    fence = SchedulerFence(redis_client, streams.SINGLE.scheduler_epoch)
    assert fence.admits("A")  # no key: an older scheduler, admitted
    redis_client.set(streams.SINGLE.scheduler_epoch, "B")
    assert not fence.admits("A") and fence.admits("B")
    redis_client.set(streams.SINGLE.scheduler_epoch, "C")
    assert fence.admits("B")  # cached: no read while steps come from the live epoch
    assert fence.admits("C") and not fence.admits("B")


def serve(service: ExecutorService, entries: int) -> None:
    """Run `entries` entries as the service's loop does, then wait for their answers."""
    service.io.start()
    for _ in range(entries):
        assert service.serve_one(timeout=5)
    assert service.io.flush(timeout=5)


def test_answers_refused_by_redis_wait_and_are_written_once_it_takes_writes(service, redis_client):
    """OOM refuses the writer's answers: they wait (the compute thread runs on), and
    once Redis takes writes again both are written, in order, and nothing stays
    pending: the scheduler is never left waiting for good."""
    for step_id in (1, 2):
        redis_client.xadd(
            streams.SINGLE.forward, {"m": step(service, "s", step_id, [wire_row(PROMPT)])}
        )
    saved = redis_client.config_get("maxmemory*")
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    try:
        service.io.start()
        assert service.serve_one(timeout=5) and service.serve_one(timeout=5)
        assert not service.io.flush(timeout=0.5)
        assert redis_client.xlen(streams.SINGLE.results) == 0
    finally:
        redis_client.config_set("maxmemory", saved["maxmemory"])
        redis_client.config_set("maxmemory-policy", saved["maxmemory-policy"])
    assert service.io.flush(timeout=10)
    published = [decode_result(f[b"m"]) for _, f in redis_client.xrange(streams.SINGLE.results)]
    assert [(m.step, m.error) for m in published] == [(1, None), (2, None)]
    pending = redis_client.xpending(streams.SINGLE.forward, streams.EXECUTOR_GROUP)
    assert pending["pending"] == 0


def read_faults() -> float:
    labels = {"loop": "executor_read"}
    return REGISTRY.get_sample_value("custody_background_faults_total", labels) or 0.0


def kill_blocked_read(client: redis.Redis, name: str) -> None:
    """Close the reader's connection (of the service named `name`) while it waits in a
    read: its fault. Only a connection blocked now (flag `b`): an idle one of the pool
    whose last command was a read is not the reader's, and killing it faults nothing.
    A kill that lands just after the read's wait ran out (between two reads) faults
    nothing either: redis-py reconnects a closed idle connection without a word, as no
    reply was in flight. So: kill until the reader counts the fault."""
    before = read_faults()
    for _ in range(100):
        listed = client.client_list()
        blocked = [
            c
            for c in listed
            if c["cmd"] == "xreadgroup" and c["name"] == name and "b" in c["flags"]
        ]
        if blocked:
            client.client_kill_filter(_id=blocked[0]["id"])
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                if read_faults() > before:
                    return
                time.sleep(0.01)
        time.sleep(0.05)
    raise AssertionError("the reader never faulted in a read")


def test_an_entry_whose_read_reply_was_lost_is_read_back_after_the_fault(service, redis_client):
    """A read Redis delivered but whose reply never arrived leaves the entry pending
    for this consumer, never to be read with ">" again: after a fault the reader reads
    its pending entries first. The entry runs once; the one after it too."""
    group, forward = streams.EXECUTOR_GROUP, streams.SINGLE.forward
    redis_client.xadd(forward, {"m": step(service, "s", 1, [wire_row(PROMPT)])})
    # delivered to the executor's consumer behind its reader's back: the reply "lost"
    redis_client.xreadgroup(group, service.name, {forward: ">"}, count=1)
    service.io.start()
    assert not service.serve_one(timeout=0.5)  # the reader never sees it
    kill_blocked_read(redis_client, service.name)
    redis_client.xadd(forward, {"m": step(service, "s", 2, [wire_row([3])])})
    assert service.serve_one(timeout=10) and service.serve_one(timeout=10)
    assert service.io.flush(timeout=5)
    published = [decode_result(f[b"m"]) for _, f in redis_client.xrange(streams.SINGLE.results)]
    assert [m.step for m in published] == [1, 2]
    assert redis_client.xpending(forward, group)["pending"] == 0
