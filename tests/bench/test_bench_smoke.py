"""Cheap smoke tests of the benchmarks: they compare like with like. The events sweep
divides entries/s by entries/s of the same byte size, and the executor's two sides do
the same decode work (one cached forward per token, greedy), so give the same tokens."""

import pytest
import redis

from custody.bench import events
from custody.up import Stack


def test_events_sweep_reports_entries_against_entries_of_the_same_size(
    redis_url: str, redis_client: redis.Redis
):
    per = events.sweep(redis_url, (16,), 1, seconds=0.3, raw_seconds=0.2)
    r = per["16"]
    assert r["events_per_entry"] == 16.0 and r["violations"] == 0
    assert r["entries_per_s"] > 0 and r["raw_xadd_entries_per_s"] > 0
    assert r["events_per_s"] == pytest.approx(16 * r["entries_per_s"], rel=0.01)
    assert r["entries_ratio"] == pytest.approx(
        r["entries_per_s"] / r["raw_xadd_entries_per_s"], rel=0.01
    )
    assert r["entry_bytes"] > 16  # the raw entries were sized from custody's own
    assert 0 < r["lag_p50_ms"] <= r["lag_p99_ms"]
    assert not redis_client.exists("custody:raw", "custody:ownership")


@pytest.mark.parametrize("moe", [False, True])
def test_executor_decode_gives_the_same_tokens_as_transformers(moe: bool):
    """The dense built-in model, and its MoE variant (`ratio_decode_b8_moe`)."""
    pytest.importorskip("transformers")
    import torch

    from custody.bench import executor as ex
    from services.executor.model.pools import DevicePools, PoolSizes
    from services.executor.runner import ModelRunner
    from services.executor.weights import builtin_model

    torch.manual_seed(0)
    model = builtin_model(ex.MOE if moe else None)
    hf = ex._transformers_twin(model)
    sizes = PoolSizes(
        kv_pages=2 * (ex.PROMPT + ex.DECODE_STEPS + 1) + 8, page_size=1, mamba_slots=4
    )
    runner = ModelRunner(model, DevicePools(model.cfg, sizes, torch.device("cpu")))
    assert ex._same_tokens(runner, hf, 2)
    assert ex._logit_diff(runner, hf, batch=2) < 1e-4


def test_the_cli_knows_every_benchmark_without_importing_one():
    """`custody bench`'s choices are listed without torch; they must name every entry."""
    from custody.cli import BENCHMARK_NAMES, benchmarks

    assert sorted(benchmarks()) == sorted(BENCHMARK_NAMES)


def test_over_capacity_sessions_resume_from_saved_state():
    """The over-capacity scenario, shrunk (512-token histories, 3x what the device holds,
    one repeat): every figure is reported and second turns do resume; speed is not
    judged here."""
    from custody.bench import over_capacity

    out = over_capacity.run(repeats=1, history=512, factor=3, kv_pages=128, context_len=2048)
    for key in ("resumed_share", "ttft_ratio_host_at_4k", "ttft_ratio_disk_at_4k"):
        assert f"{key}_target" in out and isinstance(out[f"{key}_met"], bool)
    assert out["ttft_ratio_vs_prefix_cache_at_4k"] > 0
    assert out["resumed_share"] > 0
    detail = out["over_capacity"]
    assert detail["sessions"] == 3 * detail["device_capacity_sessions"] == 12
    for tier in ("host", "disk", "device"):
        assert detail[tier]["turns_placed"] == 1  # the state reached the tier timed
        assert detail[tier]["session_ttft_s"] > 0 and detail[tier]["reference_ttft_s"] > 0
    assert detail["pools"]["disk_slots"] > 0 and "disk_note" in detail
    assert "| disk |" in out["table"]


def test_the_sessions_bench_stops_on_a_reference_that_reused_the_cache(stack: Stack):
    """The timing loop's references and turns pass their checks on the real services; a
    reference whose salt was used before finds its tokens cached, and the bench raises
    rather than publish that ratio."""
    from custody.bench import sessions

    port = stack.settings.port
    (row,) = sessions.measure(port, stack.settings.page_size, repeats=1, lengths=(64,))
    assert row["history"] == 64 and row["session_ttft_s"] > 0 and row["recompute_ttft_s"] > 0
    tokens = list(range(3, 67))
    sessions._recompute(port, tokens, "used")
    with pytest.raises(RuntimeError, match=r"reused [1-9]\d* cached tokens of 64"):
        sessions._recompute(port, tokens, "used")
