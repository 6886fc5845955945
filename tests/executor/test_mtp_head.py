"""A checkpoint's multi-token-prediction head drafting (NEXTN): loaded with dense and MoE
targets, its K and V in the KV pool's extra layer, its guesses verified, so greedy
outputs equal those without speculation whatever it guesses (these heads are untrained);
a checkpoint without `mtp.*` weights, and a head of another pattern, refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from custody.inprocess import InProcess
from services.executor.weights import builtin_model, load_model
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.model_config import ModelConfig, builtin_config

HEAD = {
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
}
MOE_TARGET = ["linear_attention", "moe", "full_attention", "linear_attention", "mlp"]


def checkpoint(directory: Path, cfg: ModelConfig, with_head: bool = True) -> Path:
    """`cfg`'s seeded random weights, the head's too unless `with_head` is False."""
    model = builtin_model(cfg, mtp=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not with_head:
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg.to_dict()))
    return directory


def settings(model: Path, algorithm: str = "") -> Settings:
    return Settings(
        model=model,
        tokenizer="byte",
        compile=False,
        page_size=4,
        kv_pages=128,
        mamba_slots=24,
        max_running_requests=2,
        context_len=256,
        chunk_size=16,
        max_step_tokens=64,
        track_interval=8,
        speculative_algorithm=algorithm,
    )


def outputs(local: InProcess) -> list[list[int]]:
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(2):
        prompt = rng.integers(1, 200, size=21 + 7 * i)  # two prefill chunks and more
        reqs.append(
            local.engine.submit(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=14)))
        )
    local.run_until_idle()
    assert local.engine.check(idle=True).ok
    return [r.output for r in reqs]


@pytest.mark.parametrize("layers", [None, MOE_TARGET], ids=["dense", "moe"])
def test_the_head_drafts_and_greedy_outputs_stay_those_of_the_target(tmp_path, layers):
    cfg = dataclasses.replace(builtin_config(), **HEAD)
    if layers:
        cfg = dataclasses.replace(cfg, layers_block_type=layers)
    path = checkpoint(tmp_path, cfg)
    spec = InProcess(settings(path, "NEXTN"))
    assert spec.model.mtp is not None and spec.runner.pools.k.shape[0] == 2
    got = outputs(spec)
    assert got == outputs(InProcess(settings(path)))
    accepted = spec.engine.completion.accepted
    assert accepted.steps > 5 and accepted.drafted > 2 * accepted.steps  # the head guessed


def test_a_checkpoint_without_the_head_or_with_another_is_refused_by_name(tmp_path):
    cfg = dataclasses.replace(builtin_config(), **HEAD)
    bare = checkpoint(tmp_path, cfg, with_head=False)
    with pytest.raises(ValueError, match=r"no multi-token-prediction weights \(mtp\.\*\)"):
        load_model(bare, torch.device("cpu"), mtp=True)
    other = dataclasses.replace(cfg, mtp_hybrid_override_pattern="*-")
    with pytest.raises(ValueError, match="is not one attention layer then one mixture"):
        settings(bare, "EAGLE").check_speculation(other)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        settings(bare, "NEXTN").check_speculation(builtin_config())


def test_the_routed_experts_op_has_the_plain_computation_s_gradients():
    """Training a head goes through its MoE layer (custody/bench/spec_head.py)."""
    from services.executor.model.moe import _routed_experts_plainly

    torch.manual_seed(0)
    x, weights = torch.randn(5, 8, requires_grad=True), torch.rand(5, 2, requires_grad=True)
    up, down = torch.randn(4, 16, 8, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    indices = torch.randint(0, 4, (5, 2))
    fast = torch.ops.custody.routed_experts(x, weights, indices, up, down)
    plain = _routed_experts_plainly(x, weights, indices, up, down)
    assert torch.allclose(fast, plain, atol=1e-5)
    grad = torch.randn_like(fast)
    for a, b in zip(
        torch.autograd.grad(fast, (x, weights, up, down), grad),
        torch.autograd.grad(plain, (x, weights, up, down), grad),
        strict=True,
    ):
        assert torch.allclose(a, b, atol=1e-5)
