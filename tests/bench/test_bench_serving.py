"""A CI smoke of `custody bench serving`: SGLang's own bench_serving, unmodified, runs to
completion against a custody stack with both of its SGLang backends, every request
served, and reports its figures (throughput, TTFT, cache hits) into the results file.
It cannot judge the figures themselves (a few requests on a shared CI machine); the
recorded run is bench-results/serving.{json,md}."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from custody.bench import serving

SMALL = serving.Workload(
    gsp_num_groups=2,
    gsp_prompts_per_group=3,
    gsp_system_prompt_len=64,
    gsp_question_len=16,
    gsp_output_len=8,
    max_concurrency=2,
)


def test_bench_serving_runs_against_custody_and_reports_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(serving, "RESULTS_DIR", tmp_path)
    out = serving.run(workload=SMALL, compile=False)
    written = json.loads((tmp_path / "serving.json").read_text())
    assert written["results"] == out["results"]
    for backend in serving.BACKENDS:
        figures = out["results"][backend]
        assert figures["completed"] == SMALL.requests, backend
        assert figures["request_throughput"] > 0 and figures["median_ttft_ms"] > 0
        assert figures["total_prompt_tokens"] > 0
        assert 0 <= figures["total_cached_tokens"] <= figures["total_prompt_tokens"]
    assert "| cached tokens |" in (tmp_path / "serving.md").read_text()
