"""The executor warms up (one forward on the padding sink, and the slot kernels) before
it announces its first heartbeat, and the warm-up writes nothing but the sink."""

from __future__ import annotations

import pytest
import redis
import torch

from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.service import ExecutorService
from services.executor.weights import builtin_model
from shared import streams
from shared.config import Settings


def test_no_heartbeat_until_the_warm_up_forward_has_run(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    seen: list[int] = []  # per forward: whether the heartbeat key existed
    forward = NemotronH.forward

    def watched(self: NemotronH, *args: object) -> torch.Tensor:
        seen.append(redis_client.exists(streams.SINGLE.executor_alive))
        return forward(self, *args)

    monkeypatch.setattr(NemotronH, "forward", watched)
    threads = torch.get_num_threads()
    try:
        service = ExecutorService(
            Settings(redis_url=redis_url, page_size=4, kv_pages=16, mamba_slots=8, compile=False)
        )
    finally:
        torch.set_num_threads(threads)  # the service leaves a core to the others
    assert seen, "no warm-up forward ran before the heartbeat"
    assert not any(seen), "a heartbeat came before the warm-up forward"
    assert not redis_client.exists(streams.SINGLE.executor_alive)
    service.heartbeat()
    service.stop()  # its checks must not answer a later stack's
    assert redis_client.get(streams.SINGLE.executor_alive) == service.epoch.encode()


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_warm_up_writes_only_the_sink_and_leaves_it_zeroed(page_size: int):
    model = builtin_model()
    pools = DevicePools(model.cfg, PoolSizes(8, page_size, 4), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tensors = [pools.k, pools.v, pools.conv, pools.ssm]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in tensors]
    ModelRunner(model, pools).warm_up()
    sinks = [page_size, page_size, 1, 1]  # KV: page 0's token indices; Mamba: slot 0
    for t, old, sink in zip(tensors, before, sinks, strict=True):
        assert torch.equal(t[:, sink:].view(torch.int32), old[:, sink:].view(torch.int32))
        assert not t[:, :sink].any()
