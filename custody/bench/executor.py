"""`custody bench executor`: the built-in model on custody's executor against
transformers' NemotronHForCausalLM holding the very same weights, in one process.

Both sides do the same work, step for step, under `torch.inference_mode`, with torch on
all cores but one as the executor service sets it on a CPU host:

- decode: after an untimed 64-token prompt, one forward per token with the cache, greedy
  argmax, the tokens read back to the host, at batch 1 and 8 on the same prompts. Custody
  goes through its runner (checks, pools, deferred ops, sampling); transformers calls the
  model with the hybrid `DynamicCache` its own `generate` builds (`DynamicCache(config=
  ...)`: KV for the attention layers, conv and SSM state for the Mamba layers) and
  `logits_to_keep=1`, but not `generate`, whose loop bookkeeping is no part of a step;
- prefill: one 512-token prompt into an empty cache, logits of the last position only
  (custody's runner applies `lm_head` to the sampled positions; transformers gets
  `logits_to_keep=1`), then the argmax;
- max_abs_logit_diff: the largest logit difference between the two over decode steps of
  8 rows on custody's compiled decode path (and over a prompt's last position, prefill
  being eager), and whether the greedy decode tokens agree;
- the same decode at batch 8 and the same logit check on a mixture-of-experts variant of
  the built-in model (`MOE`: its MLP layers made MoE layers; `ratio_decode_b8_moe`,
  `max_abs_logit_diff_moe`), transformers running its own experts as it does by default.

Custody's decode runs compiled (services/executor/compiled_decode.py), as the services
run it by default; the eager decode is measured beside it (`ratio_decode_b8_eager`), and
the compilation's time is reported (`compile_seconds`, paid once at start-up).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from custody.bench.harness import RESULTS_DIR, progress, table, write_results
from custody.bench.harness import Row as ResultRow
from services.executor.compiled_decode import CompiledDecode
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import builtin_model
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.model_config import ModelConfig, builtin_config

PROMPT, DECODE_STEPS, PREFILL = 64, 32, 512
# the built-in model with its MLP layers as MoE layers: 8 experts in 4 groups, 2 groups
# and 2 experts a token, a shared expert, a non-trivial scaling
MOE = dataclasses.replace(
    builtin_config(),
    layers_block_type=["moe" if k == "mlp" else k for k in builtin_config().layers_block_type],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    moe_shared_expert_intermediate_size=128,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)


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


def _ours_decode(runner: ModelRunner, batch: int, out: list | None = None) -> float:
    """Seconds per decode step; the sampled tokens go to `out` if given."""
    runner.pools.reset()
    prompts = _prompts(batch, PROMPT)
    span = PROMPT + DECODE_STEPS + 1
    kv = [torch.arange(1 + i * span, 1 + (i + 1) * span) for i in range(batch)]
    rows = [StepRow.of(prompts[i], 0, kv[i][:PROMPT], i + 1) for i in range(batch)]
    tokens = runner.execute(rows, DeferredOps(clears=list(range(1, batch + 1)))).tokens
    start = time.perf_counter()
    for step in range(DECODE_STEPS):
        pos = PROMPT + step
        rows = [StepRow.of([tokens[i]], pos, kv[i][: pos + 1], i + 1) for i in range(batch)]
        tokens = runner.execute(rows, DeferredOps()).tokens
        if out is not None:
            out.append(tokens)
    return (time.perf_counter() - start) / DECODE_STEPS


def _hf_step(hf, ids: torch.Tensor, cache) -> list[int]:
    """One forward with the cache, last position's logits only, greedy, to the host."""
    logits = hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1].argmax(dim=-1).tolist()


def _hf_decode(hf, batch: int, out: list | None = None) -> float:
    from transformers import DynamicCache

    prompts = _prompts(batch, PROMPT)
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        tokens = _hf_step(hf, prompts, cache)
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            tokens = _hf_step(hf, torch.tensor(tokens)[:, None], cache)
            if out is not None:
                out.append(tokens)
        return (time.perf_counter() - start) / DECODE_STEPS


def _ours_prefill(runner: ModelRunner) -> float:
    runner.pools.reset()
    prompt = _prompts(1, PREFILL)[0]
    start = time.perf_counter()
    row = StepRow.of(prompt, 0, torch.arange(1, PREFILL + 1), 1)
    runner.execute([row], DeferredOps(clears=[1]))
    return time.perf_counter() - start


def _hf_prefill(hf) -> float:
    from transformers import DynamicCache

    prompt = _prompts(1, PREFILL)
    with torch.inference_mode():
        start = time.perf_counter()
        _hf_step(hf, prompt, DynamicCache(config=hf.config.get_text_config(decoder=True)))
        return time.perf_counter() - start


def _logit_diff(runner: ModelRunner, hf, batch: int = 8, steps: int = 8) -> float:
    """The largest |logit difference| over a prompt's last position and `steps` decode
    steps of `batch` rows (custody's tokens fed to both sides)."""
    from transformers import DynamicCache

    runner.pools.reset()
    prompts = _prompts(batch, PROMPT)
    span = PROMPT + steps + 1
    kv = [torch.arange(1 + i * span, 1 + (i + 1) * span) for i in range(batch)]
    rows = [StepRow.of(prompts[i], 0, kv[i][:PROMPT], i + 1) for i in range(batch)]
    ops = DeferredOps(clears=list(range(1, batch + 1)))
    worst = 0.0
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        fed = prompts
        for step in range(steps + 1):
            ours = runner.execute(rows, ops, keep_logits=True)
            theirs = hf(input_ids=fed, past_key_values=cache, use_cache=True, logits_to_keep=1)
            worst = max(worst, float((ours.logits - theirs.logits[:, -1].float()).abs().max()))
            pos, ops = PROMPT + step, DeferredOps()
            fed = torch.tensor(ours.tokens)[:, None]
            rows = [
                StepRow.of([ours.tokens[i]], pos, kv[i][: pos + 1], i + 1) for i in range(batch)
            ]
    return worst


def _same_tokens(runner: ModelRunner, hf, batch: int) -> bool:
    """Greedy decode gives the same tokens on both sides (the two do the same work)."""
    ours: list[list[int]] = []
    theirs: list[list[int]] = []
    _ours_decode(runner, batch, ours)
    _hf_decode(hf, batch, theirs)
    return ours == theirs


def _specs(runner: ModelRunner, eager: ModelRunner, hf) -> list[tuple]:
    """(key, what, ours, theirs, target, tokens per operation)."""
    return [
        (
            "ratio_decode_b1",
            "decode step, batch 1 (compiled)",
            lambda: _ours_decode(runner, 1),
            lambda: _hf_decode(hf, 1),
            0,
            1,
        ),
        (
            "ratio_decode_b8",
            "decode step, batch 8 (compiled)",
            lambda: _ours_decode(runner, 8),
            lambda: _hf_decode(hf, 8),
            2.0,
            8,
        ),
        (
            "ratio_decode_b8_eager",
            "decode step, batch 8 (eager)",
            lambda: _ours_decode(eager, 8),
            lambda: _hf_decode(hf, 8),
            0,
            8,
        ),
        (
            "ratio_prefill_512",
            f"prefill of {PREFILL} tokens, last logits",
            lambda: _ours_prefill(eager),
            lambda: _hf_prefill(hf),
            0,
            PREFILL,
        ),
    ]


def run(repeats: int = 5) -> dict:
    threads = torch.get_num_threads()
    # As the executor service runs on a CPU host (a core left to the others), for both.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    try:
        return _measure(repeats)
    finally:
        torch.set_num_threads(threads)


class Sides:
    """A model on custody's executor (compiled and eager) and its transformers twin."""

    def __init__(self, cfg: ModelConfig) -> None:
        torch.manual_seed(0)
        model = builtin_model(cfg)
        self.hf = _transformers_twin(model)
        self.pools = DevicePools(
            model.cfg,
            PoolSizes(kv_pages=8 * (PROMPT + DECODE_STEPS + 1) + 8, page_size=1, mamba_slots=16),
            torch.device("cpu"),
        )
        self.eager = ModelRunner(model, self.pools)
        self.compiled = CompiledDecode(model, self.pools, max_rows=8)
        self.runner = ModelRunner(model, self.pools, compiled=self.compiled)
        self.runner.warm_up()  # compiles every bucket, as the executor does before its heartbeat


def _measure(repeats: int) -> dict:
    dense, moe = Sides(builtin_config()), Sides(MOE)
    runner, hf = dense.runner, dense.hf
    specs = _specs(runner, dense.eager, hf)
    specs.append(
        (
            "ratio_decode_b8_moe",
            "decode step, batch 8, MoE variant (compiled)",
            lambda: _ours_decode(moe.runner, 8),
            lambda: _hf_decode(moe.hf, 8),
            0,
            8,
        )
    )
    for _, _, ours, theirs, _, _ in specs:  # warm-up, untimed
        ours(), theirs()
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
    extra["decode_tokens_equal"] = _same_tokens(runner, hf, 8)
    extra["max_abs_logit_diff_moe"] = _logit_diff(moe.runner, moe.hf)
    extra["decode_tokens_equal_moe"] = _same_tokens(moe.runner, moe.hf, 8)
    extra["target_decode_b8"] = {"ratio": 2.0, "met": rows[1].ratio >= 2.0}
    extra["compile_seconds"] = round(dense.compiled.compile_seconds, 1)
    extra["compile_seconds_moe"] = round(moe.compiled.compile_seconds, 1)
    extra["torch_threads"] = torch.get_num_threads()
    extra["load_average_1m"] = os.getloadavg()[0]
    extra["bytes_per_kv_token"] = dense.pools.bytes_per_kv_token()
    extra["bytes_per_mamba_slot"] = dense.pools.bytes_per_mamba_slot()
    payload = write_results("executor", rows, extra | {"repeats": repeats})
    payload["table"] = (
        table(rows) + f"\n\nmax |logit difference| (compiled decode, batch 8): "
        f"{extra['max_abs_logit_diff']:.2e}; compiled in {extra['compile_seconds']} s; "
        f"greedy decode tokens equal (batch 8, {DECODE_STEPS} steps): "
        f"{extra['decode_tokens_equal']}; MoE variant: max |logit difference| "
        f"{extra['max_abs_logit_diff_moe']:.2e}, tokens equal "
        f"{extra['decode_tokens_equal_moe']}"
    )
    (RESULTS_DIR / "executor.md").write_text(payload["table"] + "\n")
    return payload
