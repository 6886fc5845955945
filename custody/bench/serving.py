"""`custody bench serving`: SGLang's own `bench_serving` (sglang 0.5.23's
`sglang/benchmark/serving.py`, loaded unmodified by sglang_reference.py) against one
`custody up` stack serving the built-in model, with the tokenizer clients load:
`custody tokenizer export`'s files, passed as `--tokenizer DIR`.

It runs the field's client as its users do, through its command line: each backend in
`BACKENDS` (`sglang`: /generate, `sglang-oai-chat`: /v1/chat/completions) over SGLang's
`generated-shared-prefix` dataset (groups of requests sharing a system prompt: the
prefix cache's case), with `--cache-report` so it counts the prompt tokens custody
reused. There is no reference engine beside it: SGLang serves on a GPU, which this
machine lacks. What the figures are: bench_serving's own (its request and token
throughputs, TTFT and time per output token, cached tokens over prompt tokens),
measured by its client; they are written beside the other benchmarks' as
bench-results/serving.{json,md}.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from custody.bench.harness import RESULTS_DIR
from custody.bench.sglang_reference import SGLANG_VERSION
from custody.up import Stack
from services.scheduler.text.tokenizer_files import export_byte_tokenizer
from shared.config import Settings

BACKENDS = ("sglang", "sglang-oai-chat")
# the figures kept from each run's result (those of --cache-report under its
# "cache_report"), with how the table shows them
FIGURES = {
    "completed": "requests completed",
    "request_throughput": "requests/s",
    "output_throughput": "output tokens/s",
    "median_ttft_ms": "TTFT p50 (ms)",
    "p99_ttft_ms": "TTFT p99 (ms)",
    "median_tpot_ms": "TPOT p50 (ms)",
    "total_prompt_tokens": "prompt tokens",
    "total_cached_tokens": "cached tokens",
    "cache_hit_rate_pct": "cache hit (%)",
}


@dataclass(frozen=True)
class Workload:
    """SGLang's generated-shared-prefix dataset, by its flags' names."""

    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 64
    gsp_output_len: int = 32
    max_concurrency: int = 8
    seed: int = 1

    @property
    def requests(self) -> int:
        return self.gsp_num_groups * self.gsp_prompts_per_group

    def flags(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in self.__dict__.items()]


def bench_serving(argv: list[str]) -> dict:
    """Run SGLang's bench_serving command line with `argv` (its `--output-file` given) in
    a process of its own; the result it wrote. Offline: it looks the served model's name
    up on the hub first (its config, for a warning), which would fail after a minute of
    retries instead of at once."""
    out = next(a.split("=", 1)[1] for a in argv if a.startswith("--output-file="))
    main = (
        "from custody.bench.sglang_reference import load_bench_serving as load; load().cli_main()"
    )
    command = [sys.executable, "-c", main, *argv]
    subprocess.run(command, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    result = json.loads(Path(out).read_text().splitlines()[-1])
    return result | result.get("cache_report", {})


def run(repeats: int = 1, workload: Workload | None = None, **overrides: object) -> dict:
    """Each backend once (`repeats` is ignored: bench_serving reports percentiles over
    its own requests); `overrides`: the stack's settings."""
    workload = workload or Workload()
    results = {}
    with contextlib.ExitStack() as running, tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Settings.ephemeral(**overrides))
        running.callback(stack.stop)
        stack.start_all().wait_healthy()
        settings = stack.settings
        tokenizer = export_byte_tokenizer(Path(tmp) / "tokenizer", settings.context_len)
        for backend in BACKENDS:
            argv = [
                f"--backend={backend}",
                f"--base-url=http://127.0.0.1:{settings.port}",
                f"--model={settings.model_name}",
                f"--tokenizer={tokenizer}",
                "--dataset-name=generated-shared-prefix",
                f"--num-prompts={workload.requests}",
                "--cache-report",
                "--flush-cache",
                f"--output-file={Path(tmp) / f'{backend}.jsonl'}",
                *workload.flags(),
            ]
            result = bench_serving(argv)
            results[backend] = {key: result.get(key) for key in FIGURES}
    return report(workload, results)


def report(workload: Workload, results: dict[str, dict]) -> dict:
    lines = ["| figure | " + " | ".join(BACKENDS) + " |", "|---|" + "---|" * len(BACKENDS)]
    for key, label in FIGURES.items():
        cells = [_cell(results[b][key]) for b in BACKENDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    payload = {
        "bench_serving": f"sglang {SGLANG_VERSION} sglang/benchmark/serving.py, unmodified",
        "workload": workload.__dict__,
        "results": results,
        "table": table,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "serving.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "serving.md").write_text(table + "\n")
    return payload


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return "n/a" if value is None else str(value)
