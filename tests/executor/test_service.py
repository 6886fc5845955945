"""The executor service in-process on a real Redis: a step that raises is answered with
its cause and the service serves on; steps of a replaced scheduler are fenced."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch
from prometheus_client import REGISTRY

from services.executor.fence import SchedulerFence
from services.executor.model.batch import Row
from services.executor.model.pools import DevicePools
from services.executor.runner import ModelRunner
from services.executor.service import ExecutorService
from shared import streams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.wire import WireRow, decode, encode, step_body

PROMPT = [5, 9, 33, 71, 2, 8]


@pytest.fixture
def service(redis_url: str, redis_client: redis.Redis) -> Iterator[ExecutorService]:
    threads = torch.get_num_threads()
    yield ExecutorService(Settings(redis_url=redis_url, page_size=4, kv_pages=16, mamba_slots=8))
    torch.set_num_threads(threads)  # the service leaves a core to the others


def wire_row(tokens: list[int], **sampling: object) -> WireRow:
    n = len(tokens)
    return WireRow("r", np.array(tokens), 0, np.arange(4, 4 + n), 1, 1, 0, 0, True, **sampling)


def step(
    service: ExecutorService,
    scheduler: str,
    step_id: int,
    rows: list[WireRow] | list[object],
    after: int | None = None,
) -> bytes:
    """A step that clears slot 1 and runs its rows from position 0."""
    body = step_body(step_id, after, service.epoch, [], [1], [])
    body["rows"] = [r.body() if isinstance(r, WireRow) else r for r in rows]
    return encode("step", scheduler, step_id, body)


def outcome(name: str) -> float:
    return REGISTRY.get_sample_value("custody_executor_steps_total", {"outcome": name}) or 0.0


def greedy(service: ExecutorService, tokens: list[int]) -> int:
    """The token a fresh runner picks for `tokens` from empty state."""
    pools = DevicePools(service.runner.model.cfg, service.pools.sizes, torch.device("cpu"))
    row = Row.from_wire(wire_row(tokens))
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
    failed = decode(service.run_step(step(service, "s", 1, [wire_row(PROMPT)])))
    assert failed["error"] == "RuntimeError: boom" and failed["ops_ran"] is ops_ran
    assert outcome("error") == errors + 1
    monkeypatch.undo()
    # the chain is broken: a step planned on the failed one is refused, nothing ran
    refused = decode(service.run_step(step(service, "s", 2, [wire_row([7])], after=1)))
    assert "planned on top of step 1" in refused["error"] and refused["ops_ran"] is False
    ok = decode(service.run_step(step(service, "s", 3, [wire_row(PROMPT)])))
    assert ok["error"] is None and ok["rids"] == ["r"]
    assert np.frombuffer(ok["tokens"], "<i4").tolist() == [greedy(service, PROMPT)]


def test_rows_that_do_not_decode_are_answered_and_the_service_serves_on(service):
    failed = decode(service.run_step(step(service, "s", 1, ["not a row"])))
    assert failed["error"].startswith("TypeError") and failed["ops_ran"] is False
    ok = decode(service.run_step(step(service, "s", 2, [wire_row(PROMPT)])))
    assert ok["error"] is None


def test_degenerate_sampling_parameters_still_give_a_token(service):
    row = wire_row(PROMPT, temperature=1e-40, top_p=1e-9, top_k=1, seed=2**64 - 1)
    ok = decode(service.run_step(step(service, "s", 1, [row])))
    assert ok["error"] is None
    assert np.frombuffer(ok["tokens"], "<i4").tolist() == [greedy(service, PROMPT)]


def test_steps_of_a_replaced_scheduler_are_acknowledged_and_dropped(service, redis_client):
    assert service.run_step(step(service, "A", 1, [wire_row(PROMPT)])) is not None  # no key
    redis_client.set(streams.SCHEDULER_EPOCH, "B")
    fenced = outcome("fenced")
    for scheduler, step_id in (("A", 2), ("B", 1)):
        redis_client.xadd(
            streams.FORWARD, {"m": step(service, scheduler, step_id, [wire_row([3])])}
        )
    assert service.serve_once(block_ms=100) == 2
    assert outcome("fenced") == fenced + 1
    published = [decode(f[b"m"]) for _, f in redis_client.xrange(streams.RESULTS)]
    assert [(m["scheduler_epoch"], m["step"], m["error"]) for m in published] == [("B", 1, None)]
    pending = redis_client.xpending(streams.FORWARD, streams.EXECUTOR_GROUP)
    assert pending["pending"] == 0


def test_the_fence_reads_the_key_again_only_for_another_epoch(redis_client):
    fence = SchedulerFence(redis_client)
    assert fence.admits("A")  # no key: an older scheduler, admitted
    redis_client.set(streams.SCHEDULER_EPOCH, "B")
    assert not fence.admits("A") and fence.admits("B")
    redis_client.set(streams.SCHEDULER_EPOCH, "C")
    assert fence.admits("B")  # cached: no read while steps come from the live epoch
    assert fence.admits("C") and not fence.admits("B")
