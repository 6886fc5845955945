"""`custody bench executor`: the built-in model on custody's executor against
transformers' NemotronHForCausalLM holding the very same weights, in one process.

- decode: tokens per second at batch 1 and 8 after a 64-token prompt; custody runs one
  step per token through its runner (pools, deferred ops, sampling); transformers runs
  `generate` (greedy), whose prefill time is measured separately and taken out;
- prefill: tokens per second for one 512-token prompt (transformers: one forward);
- max_abs_logit_diff: the largest logit difference between the two on a prompt.
"""

from __future__ import annotations

import statistics
import time

import torch

from custody.bench.harness import Row as ResultRow
from custody.bench.harness import progress, table, write_results
from services.executor.batch import Row
from services.executor.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import builtin_model
from shared.deferred_ops import DeferredOps

PROMPT, DECODE_STEPS, PREFILL = 64, 32, 512


def _transformers_twin(model):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    hf = NemotronHForCausalLM(NemotronHConfig(**model.cfg.to_dict())).float().eval()
    state = {
        ("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v
        for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, strict=True)
    return hf


def _prompts(batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(0, 256, (batch, length), generator=g)


def _ours_decode(runner: ModelRunner, batch: int) -> float:
    runner.pools.reset()
    prompts = _prompts(batch, PROMPT)
    span = PROMPT + DECODE_STEPS + 1
    kv = [torch.arange(1 + i * span, 1 + (i + 1) * span) for i in range(batch)]
    rows = [Row(prompts[i], 0, kv[i][:PROMPT], i + 1) for i in range(batch)]
    tokens = runner.execute(rows, DeferredOps(clears=list(range(1, batch + 1)))).tokens
    start = time.perf_counter()
    for step in range(DECODE_STEPS):
        pos = PROMPT + step
        rows = [Row(torch.tensor([tokens[i]]), pos, kv[i][: pos + 1], i + 1) for i in range(batch)]
        tokens = runner.execute(rows, DeferredOps()).tokens
    return (time.perf_counter() - start) / DECODE_STEPS


def _hf_generate(hf, prompts: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def _hf_decode(hf, batch: int) -> float:
    prompts = _prompts(batch, PROMPT)
    return (
        _hf_generate(hf, prompts, DECODE_STEPS + 1) - _hf_generate(hf, prompts, 1)
    ) / DECODE_STEPS


def _ours_prefill(runner: ModelRunner) -> float:
    runner.pools.reset()
    prompt = _prompts(1, PREFILL)[0]
    start = time.perf_counter()
    runner.execute([Row(prompt, 0, torch.arange(1, PREFILL + 1), 1)], DeferredOps(clears=[1]))
    return time.perf_counter() - start


def _hf_prefill(hf) -> float:
    prompt = _prompts(1, PREFILL)
    start = time.perf_counter()
    with torch.no_grad():
        hf(prompt)
    return time.perf_counter() - start


def _logit_diff(runner: ModelRunner, hf) -> float:
    runner.pools.reset()
    prompt = _prompts(1, 200)[0]
    ours = runner.execute(
        [Row(prompt, 0, torch.arange(1, 201), 1)], DeferredOps(clears=[1]), keep_logits=True
    ).logits[0]
    with torch.no_grad():
        theirs = hf(prompt[None]).logits[0, -1].float()
    return float((ours - theirs).abs().max())


def run(repeats: int = 5) -> dict:
    torch.manual_seed(0)
    model = builtin_model()
    hf = _transformers_twin(model)
    pools = DevicePools(
        model.cfg,
        PoolSizes(kv_pages=8 * (PROMPT + DECODE_STEPS + 1) + 8, page_size=1, mamba_slots=16),
        torch.device("cpu"),
    )
    runner = ModelRunner(model, pools)
    specs = [
        (
            "ratio_decode_b1",
            "decode step, batch 1",
            lambda: _ours_decode(runner, 1),
            lambda: _hf_decode(hf, 1),
            0,
            1,
        ),
        (
            "ratio_decode_b8",
            "decode step, batch 8",
            lambda: _ours_decode(runner, 8),
            lambda: _hf_decode(hf, 8),
            2.0,
            8,
        ),
        (
            "ratio_prefill",
            f"prefill of {PREFILL} tokens",
            lambda: _ours_prefill(runner),
            lambda: _hf_prefill(hf),
            0,
            PREFILL,
        ),
    ]
    rows, extra = [], {}
    for key, what, ours, theirs, target, tokens in specs:
        a, b = [], []
        for i in range(repeats):
            a.append(ours())
            b.append(theirs())
            progress(key, i + 1, repeats)
        ours_s, ref_s = statistics.median(a), statistics.median(b)
        rows.append(ResultRow(key, what, "s/step", ours_s, ref_s, "transformers", target))
        extra[key.replace("ratio_", "tokens_per_s_")] = {
            "custody": tokens / ours_s,
            "transformers": tokens / ref_s,
        }
    extra["max_abs_logit_diff"] = _logit_diff(runner, hf)
    extra["bytes_per_kv_token"] = pools.bytes_per_kv_token()
    extra["bytes_per_mamba_slot"] = pools.bytes_per_mamba_slot()
    payload = write_results("executor", rows, extra | {"repeats": repeats})
    payload["table"] = (
        table(rows) + f"\n\nmax |logit difference|: {extra['max_abs_logit_diff']:.2e}"
    )
    return payload
