"""`--dtype`: one setting decides the model's dtype and its pools' (KV and conv state;
the SSM state's is the config's `mamba_ssm_cache_dtype`, float32 here), and the tiers'
sizes every service derives from it (each dtype's round trip through the tiers is in
test_ssm_cache_dtype.py). bfloat16 runs on CPU and agrees with float32 within a bf16
tolerance; float16 loads and runs a tiny step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from custody.inprocess import InProcess
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.tiers import build_tiers
from services.executor.weights import load_model, model_dtype
from services.scheduler.engine.setup import build_engine
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.dtypes import resolve_dtype
from shared.messages.forward import StepRow
from shared.model_config import builtin_config
from shared.tokenizer import ByteTokenizer
from tests.services_harness import POOLS

CPU = torch.device("cpu")
PROMPT = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(5)).tolist()
# bf16 keeps 8 bits of mantissa: logits within 5% of their largest magnitude (measured on
# the built-in model: 1.3%; on transformers' own bf16 run of a test model, 3.2%).
BF16_TOLERANCE = 0.05


def pools_of(model, dtype: torch.dtype | None = None) -> DevicePools:
    sizes = PoolSizes(kv_pages=32, page_size=4, mamba_slots=6)
    return DevicePools(model.cfg, sizes, CPU, dtype or model_dtype(model))


def generate(
    runner: ModelRunner, n: int, feed: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy: a prefill of PROMPT, then n decode steps, each fed the token sampled last
    (or `feed`'s, so two models see the same inputs); the tokens and every step's logits."""
    kv = torch.arange(4, 4 + len(PROMPT) + n)
    first = StepRow.of(PROMPT, 0, kv[: len(PROMPT)], 1)
    out = runner.execute([first], DeferredOps(clears=[1]), keep_logits=True)
    tokens, logits = list(out.tokens), [out.logits]
    for i, pos in enumerate(range(len(PROMPT), len(PROMPT) + n)):
        fed = tokens[-1] if feed is None else feed[i]
        step = StepRow.of([fed], pos, kv[: pos + 1], 1)
        out = runner.execute([step], DeferredOps(), keep_logits=True)
        tokens += out.tokens
        logits.append(out.logits)
    return tokens, torch.cat(logits)


def test_a_bfloat16_model_generates_on_cpu_and_agrees_with_float32():
    fp32 = load_model(None, CPU, "float32")
    bf16 = load_model(None, CPU, "bfloat16")
    pools = pools_of(bf16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert (pools.k.dtype, pools.conv.dtype, pools.ssm.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    fed, expected = generate(ModelRunner(fp32, pools_of(fp32)), 6)
    tokens, _ = generate(ModelRunner(bf16, pools), 6)
    assert len(tokens) == 7
    pools.reset()
    _, got = generate(ModelRunner(bf16, pools), 6, feed=fed)  # the same inputs as fp32's
    assert (got - expected).abs().max() <= BF16_TOLERANCE * expected.abs().max()


def test_a_bfloat16_model_runs_over_pools_of_another_dtype():
    """Attention and Mamba convert what they read from and write to a pool: a bf16 model
    over float32 pools ran into dtype errors in the conv and in attention. A float32 pool
    holds a bf16 value exactly, so the logits are the same bits."""
    model = load_model(None, CPU, "bfloat16")
    fed, mixed = generate(ModelRunner(model, pools_of(model, torch.float32)), 3)
    _, same = generate(ModelRunner(model, pools_of(model)), 3, feed=fed)
    assert torch.equal(mixed, same)


def test_a_float16_model_loads_and_runs_a_tiny_step():
    model = load_model(None, CPU, "float16")
    assert model.lm_head.weight.dtype == torch.float16
    tokens, logits = generate(ModelRunner(model, pools_of(model)), 1)
    assert len(tokens) == 2 and torch.isfinite(logits).all()


def test_auto_is_the_checkpoints_dtype_on_a_gpu_and_float32_on_cpu():
    cfg = dataclasses.replace(builtin_config(), torch_dtype="bfloat16")
    assert resolve_dtype("auto", cfg, gpu=True) == "bfloat16"
    assert resolve_dtype("auto", cfg, gpu=False) == "float32"
    assert resolve_dtype("auto", builtin_config(), gpu=True) == "float32"  # none saved
    assert resolve_dtype("float16", cfg, gpu=False) == "float16"
    assert load_model(None, CPU).lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        Settings(dtype="int8").check()


def test_the_scheduler_and_the_executor_size_the_tiers_alike_in_bfloat16(tmp_path: Path):
    """KV and conv state take 2 bytes, SSM state 4; the scheduler's tier pools have
    exactly the executor's slots, and the host tier stays within its byte budget."""
    cfg = builtin_config()
    settings = Settings(**POOLS, dtype="bfloat16", state_dir=tmp_path, host_state_bytes=1 << 22)
    half, full = settings.tier_sizes(cfg), dataclasses.replace(settings, dtype="float32")
    assert half.shapes.kv_page_bytes * 2 == full.tier_sizes(cfg).shapes.kv_page_bytes
    conv = len(cfg.mamba_layers) * cfg.conv_dim * (cfg.conv_kernel - 1)
    ssm = len(cfg.mamba_layers) * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size
    assert half.shapes.mamba_slot_bytes == 2 * conv + 4 * ssm
    assert half.host_kv_pages > full.tier_sizes(cfg).host_kv_pages
    assert Settings(dtype="auto").tier_sizes(cfg) == Settings(dtype="float32").tier_sizes(cfg)
    model = load_model(None, CPU, settings.dtype)
    device = DevicePools(cfg, PoolSizes(64, 4, 8), CPU, model_dtype(model))
    host = build_tiers(settings, cfg, device).host
    engine = build_engine(settings, cfg, ByteTokenizer(), strict=True)
    assert (host.kv_pages, host.mamba_slots) == (half.host_kv_pages, half.host_mamba_slots)
    assert engine.pools.host_kv.capacity == host.kv_pages
    held = sum(t.numel() * t.element_size() for t in host.kv_tensors + host.state_tensors)
    assert held <= settings.host_state_bytes + half.shapes.kv_page_bytes + conv * 2 + ssm * 4


def test_the_in_process_runtime_generates_in_bfloat16():
    local = InProcess(Settings(**POOLS, dtype="bfloat16"))
    assert local.runner.pools.k.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    req = local.engine.submit(Request("r", np.asarray(PROMPT), params))
    local.run_until_idle()
    assert len(req.output) == 5
    bf16 = load_model(None, CPU, "bfloat16")
    assert req.output == generate(ModelRunner(bf16, pools_of(bf16)), 4)[0]
