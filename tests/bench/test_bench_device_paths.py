"""The GPU runs of `custody bench executor` and `orchestration` (`--device cuda`), run
here on the CPU at a small shape, so the code the GPU check runs is not run first there:
the executor bench's figures come out in their units, written as they come; the
orchestration bench serves a config-only checkpoint (`--load-format dummy`, ids-only)
with the real executor, each process pinned to cores it has.

What these cannot show: anything about a GPU (streams, graphs, the 8B shape's memory)."""

from __future__ import annotations

import dataclasses
import json

import torch

from custody.bench import executor_device, orchestration
from shared.model_config import builtin_config


def test_the_executor_bench_measures_each_batch_and_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(executor_device, "RESULTS_DIR", tmp_path)
    plan = executor_device.Plan(
        shape=builtin_config(),
        batches=(1, 3),
        context=12,
        steps=2,
        copy_bytes=1 << 20,
        dtype=torch.float32,
        modes=("eager",),  # the compiled path is tests/executor/test_compiled_decode.py's
    )
    result = executor_device.run(device=torch.device("cpu"), plan=plan)
    saved = json.loads((tmp_path / "executor-cpu.json").read_text())
    assert saved["complete"] and set(saved["eager"]) == {"b1", "b3"}
    assert all(isinstance(v, float) and v > 0 for v in saved["transformers"].values())
    assert saved["weight_bytes"] == sum(
        p.numel() * 4 for n, p in _model_params() if n != "backbone.embeddings.weight"
    )
    bound = saved["weight_bytes"] / saved["bandwidth"]["bytes_per_s"]
    assert saved["weight_read_bound_s"] == bound
    assert saved["batch1_over_bound"] == round(saved["eager"]["b1"] / bound, 2)
    assert "| 3 | not reached |" in result["table"]  # no compiled figure: said so


def _model_params():
    from services.executor.weights import builtin_model

    return builtin_model().named_parameters()


def test_the_orchestration_bench_runs_the_real_executor_on_a_dummy_checkpoint(tmp_path):
    # the tiny model decodes a step in about a millisecond here: 4,096 tokens a client
    # outlast the warm-up and the window many times over (512, the 8B's, did not always)
    cfg = dataclasses.replace(builtin_config(), max_position_embeddings=8192)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    seen = []
    results = orchestration.measure_on_device(
        tmp_path, "cpu", batches=(2,), context=64, window=0.5, done=seen.append, output=4096
    )
    cell = results["b2_ctx0k_device"]
    assert seen == [results]
    assert cell["rows_per_step"] == 2.0 and 0 <= cell["idle_share"] <= 1
    assert {"scheduler", "executor", "session-store", "redis", "clients"} <= set(cell["cores_used"])
