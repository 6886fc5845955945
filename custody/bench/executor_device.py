"""`custody bench executor --device cuda`: custody's executor on a GPU at the published
Nemotron-H 8B shape (custody/bench/published.py), its weights seeded random numbers drawn
on the device (`--load-format dummy`'s), in bfloat16 as a GPU serves it.

What it measures, in this order, writing the results after each figure so a run cut
short (scripts/gpu-check.sh gives it 90 s) still reports what it reached:

- the device's bandwidth: bytes read plus bytes written over the time of a device-to-
  device copy of COPY_BYTES (at least 1 GiB, so caches do not flatter it);
- the weight-read bound of a decode step: the bytes of every weight a step reads (all
  but the input embedding table, of which a step reads one row per token) over that
  bandwidth. A batch-1 step cannot beat it; its ratio to it says how much of the step is
  anything but streaming the weights (launches, small kernels, the host);
- custody's decode step at each batch size, eager and compiled (on CUDA the compiled
  step is replayed from CUDA graphs), through its runner as the executor runs a step:
  checks, pools, sampling, the tokens read back to the host. Every row is first
  prefilled with CONTEXT tokens (untimed); each measurement then decodes the first
  `batch` rows onward from where they are, so contexts stay within one CUDA graph
  context bucket (the shape's max_position_embeddings is set to it: 1024);
- transformers' NemotronHForCausalLM holding the very same weight tensors (no copy), on
  its torch-only path with its hybrid cache: reported beside, not a yardstick. Its CUDA
  Mamba kernels (mamba-ssm, causal-conv1d) cannot be installed on an offline machine,
  and without them it runs the Mamba layers as plain torch code.

On CPU the same code runs a small shape (the tests do), so the GPU run is not its first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from custody.bench.harness import RESULTS_DIR, progress
from custody.bench.published import NEMOTRON_H_8B
from services.executor.compiled_decode import CompiledDecode
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import builtin_model
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.model_config import ModelConfig

BATCHES = (1, 8, 64, 256)
CONTEXT = 800  # prefilled tokens per row
STEPS = 16  # timed decode steps per measurement (after WARM untimed ones)
WARM = 2
PREFILL_ROWS = 16  # rows per untimed prefill step
COPY_BYTES = 2 << 30
SHAPE = dataclasses.replace(NEMOTRON_H_8B, max_position_embeddings=1024)


@dataclasses.dataclass
class Plan:
    """What one run measures: the GPU's (the defaults) or a small one on CPU (tests)."""

    shape: ModelConfig = SHAPE
    batches: tuple[int, ...] = BATCHES
    context: int = CONTEXT
    steps: int = STEPS
    copy_bytes: int = COPY_BYTES
    dtype: torch.dtype = torch.bfloat16
    modes: tuple[str, ...] = ("eager", "compiled")


def bandwidth(device: torch.device, nbytes: int) -> dict:
    """(read + written bytes) / seconds of a device-to-device copy, the median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(6):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    del src, dst
    return {"copy_bytes": nbytes, "copy_seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


def weight_bytes(model: NemotronH) -> int:
    """What a decode step reads of the weights: all of them but the input embedding
    table (one row per token)."""
    table = model.backbone.embeddings.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)


class Rows:
    """`count` rows prefilled with `context` tokens, each in its own slot and KV span,
    decoding onward: a measurement advances the first `batch` of them."""

    def __init__(self, runner: ModelRunner, count: int, context: int, span: int) -> None:
        self.runner, self.span = runner, span
        g = torch.Generator().manual_seed(count * 31 + context)
        vocab = runner.model.cfg.vocab_size
        prompts = torch.randint(0, vocab, (count, context), generator=g)
        self.pos = [context] * count
        self.last: list[int] = []
        for lo in range(0, count, PREFILL_ROWS):
            ids = range(lo, min(count, lo + PREFILL_ROWS))
            rows = [StepRow.of(prompts[i], 0, self.kv(i, context), i + 1) for i in ids]
            ops = DeferredOps(clears=[i + 1 for i in ids])
            self.last += runner.execute(rows, ops).tokens

    def kv(self, i: int, length: int) -> torch.Tensor:
        return torch.arange(1 + i * self.span, 1 + i * self.span + length)

    def step(self, batch: int) -> None:
        rows = [
            StepRow.of([self.last[i]], self.pos[i], self.kv(i, self.pos[i] + 1), i + 1)
            for i in range(batch)
        ]
        self.last[:batch] = self.runner.execute(rows, DeferredOps()).tokens
        for i in range(batch):
            self.pos[i] += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_step(step: Callable[[], None], steps: int, label: str) -> float:
    for _ in range(WARM):
        step()
    times = []
    for k in range(steps):
        start = time.perf_counter()
        step()  # ends reading the tokens back to the host: a whole step
        times.append(time.perf_counter() - start)
        progress(label, k + 1, steps)
    return statistics.median(times)


def _custody_steps(
    model: NemotronH, pools: DevicePools, plan: Plan, mode: str, results: Results
) -> None:
    """custody's decode step at each batch size, `mode` eager or compiled; what it built
    (the compiled graphs, the runner) is freed on return."""
    count = max(plan.batches)
    compiled = CompiledDecode(model, pools, count) if mode == "compiled" else None
    runner = ModelRunner(model, pools, compiled=compiled, max_rows=count)
    runner.warm_up()
    if compiled is not None:
        results.put("compile_seconds", compiled.compile_seconds)
    pools.reset()
    span = pools.sizes.kv_pages // count
    rows = Rows(runner, count, plan.context, span)
    times: dict[str, float] = {}
    for batch in plan.batches:
        times[f"b{batch}"] = _median_step(functools.partial(rows.step, batch), plan.steps, mode)
        results.put(mode, times)


def _transformers_steps(
    model: NemotronH, plan: Plan, device: torch.device, results: Results
) -> None:
    """transformers' decode step at each batch size, on the same weight tensors; a batch
    that does not fit on the device is reported as such."""
    from transformers import DynamicCache, NemotronHConfig, NemotronHForCausalLM

    with torch.device("meta"):
        hf = NemotronHForCausalLM(NemotronHConfig(**model.cfg.to_dict()))
    state = {
        ("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v
        for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, strict=True, assign=True)  # shares custody's tensors
    hf.eval()
    out: dict[str, float | str] = {}
    for batch in plan.batches:
        out[f"b{batch}"] = "out of device memory"  # unless it is measured
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.cfg.vocab_size, (batch, plan.context), generator=g)
        try:
            with torch.inference_mode():
                cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
                logits = hf(
                    input_ids=prompts.to(device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits
                last = logits[:, -1].argmax(-1)

                def step(cache=cache) -> None:
                    nonlocal last
                    ids = last[:, None]
                    result = hf(input_ids=ids, past_key_values=cache, use_cache=True)
                    last = result.logits[:, -1].argmax(-1)
                    last.tolist()

                out[f"b{batch}"] = _median_step(step, plan.steps, f"transformers b{batch}")
            del cache
        except torch.OutOfMemoryError:
            pass
        _empty_cache(device)
        results.put("transformers", out)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Results:
    """The run's figures, rewritten to `<dir>/executor-<device>.{json,md}` as they come."""

    def __init__(self, directory: Path, device: torch.device) -> None:
        self.path = directory / f"executor-{device.type}"
        self.data: dict = {"device": _device_name(device), "complete": False}

    def put(self, key: str, value: object) -> None:
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.with_suffix(".json").write_text(json.dumps(self.data, indent=2) + "\n")
        self.path.with_suffix(".md").write_text(markdown(self.data) + "\n")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _ms(value: object) -> str:
    return f"{value * 1e3:.2f} ms" if isinstance(value, float) else str(value or "not reached")


def markdown(data: dict) -> str:
    """The figures as a table: one line per batch size."""
    lines = [
        f"device: {data['device']}; shape: {data.get('shape', '?')}; "
        f"weights {data.get('weight_bytes', 0) / 1e9:.2f} GB; complete: {data['complete']}",
        "",
        "| batch | custody compiled | custody eager | transformers (torch path) |",
        "|---|---|---|---|",
    ]
    for batch in data.get("batches", []):
        key = f"b{batch}"
        cells = [data.get(part, {}).get(key) for part in ("compiled", "eager", "transformers")]
        lines.append(f"| {batch} | " + " | ".join(_ms(c) for c in cells) + " |")
    if "weight_read_bound_s" in data:
        bound = data["weight_read_bound_s"]
        lines.append(
            f"\nbandwidth {data['bandwidth']['bytes_per_s'] / 1e12:.2f} TB/s (read + written, "
            f"a {data['bandwidth']['copy_bytes'] >> 30} GiB copy); weight-read bound "
            f"{bound * 1e3:.2f} ms; batch-1 step / bound: "
            f"{data.get('batch1_over_bound', 'not reached')}"
        )
    return "\n".join(lines)


def run(repeats: int = 1, device: torch.device | None = None, plan: Plan | None = None) -> dict:
    """The run on `device` (CUDA by default); `repeats` is unused: each figure is the
    median of `plan.steps` steps."""
    device = device or torch.device("cuda")
    plan = plan or Plan()
    results = Results(RESULTS_DIR, device)
    results.put("shape", "Nemotron-H 8B" if plan.shape == SHAPE else "small")
    results.put("batches", list(plan.batches))
    results.put("context", plan.context)
    results.put("bandwidth", bandwidth(device, plan.copy_bytes))
    model = builtin_model(plan.shape, device).to(plan.dtype).eval()
    results.put("weight_bytes", weight_bytes(model))
    bound = weight_bytes(model) / results.data["bandwidth"]["bytes_per_s"]
    results.put("weight_read_bound_s", bound)
    count, span = max(plan.batches), plan.context + (WARM + plan.steps) * len(plan.batches) + 1
    pools = DevicePools(model.cfg, PoolSizes(count * span, 1, count + 1), device, plan.dtype)
    for mode in plan.modes:
        _custody_steps(model, pools, plan, mode, results)
    best = min(results.data[mode].get("b1", float("inf")) for mode in plan.modes)
    if best < float("inf"):
        results.put("batch1_over_bound", round(best / bound, 2))
    del pools
    _empty_cache(device)
    _transformers_steps(model, plan, device, results)
    results.put("complete", True)
    return results.data | {"table": markdown(results.data)}
