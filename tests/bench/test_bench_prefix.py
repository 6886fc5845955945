"""`custody bench prefix`, shrunk (100-token shared prefixes, chunks of 64, four requests
or sessions a series) on its two stacks. Behaviour, not speed: with junctions on, every
request from the third reuses the shared prefix less at most one page, requests and
sessions alike; off, a prefix that ends off a chunk end is reused only to the chunk end
before it; a reused state gives the tokens a cold run gives; the report holds every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from custody.bench import harness, prefix, prefix_report
from custody.bench.prefix_workloads import FORK_HEADLINE, JUNCTION_HEADLINE, Series

PAGE, CHUNK = 16, 64
WORKLOADS = (
    Series("shared_100", "small", (100,) * 4, (40,) * 4, headline=JUNCTION_HEADLINE),
    Series("wobble_64", "small", (64, 61, 67, 62, 66), (20,) * 5),
    Series("fork_100", "small", (100,) * 4, (24, 30, 36, 42), True, FORK_HEADLINE),
)


def test_junctions_reuse_the_shared_prefix_from_the_third_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(prefix_report, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    out = prefix.run(workloads=WORKLOADS, chunk_size=CHUNK, page_size=PAGE)

    for name in ("shared_100", "fork_100"):  # 100 is past the chunk end at 64
        f = out["workloads"][name]
        on, off = f["on"]["cached_tokens"], f["off"]["cached_tokens"]
        assert on[0] == off[0] == 0 and on[1] == off[1] == CHUNK, name  # the gap, found
        assert all(c >= s - PAGE for c, s in zip(on[2:], f["shared"][2:], strict=True)), name
        assert off[2:] == [CHUNK] * 2, name  # only the chunk end's state, every time
        assert f["on"]["state_gap_tokens"] > 0 and f["on"]["junction_checkpoints"] >= 1, name
        assert f["off"]["junction_checkpoints"] == 0, name
    wobble = out["workloads"]["wobble_64"]
    # 67 and 66 resume at the chunk end at 64; 62 at the junction 61 left (paged: 48)
    assert wobble["on"]["cached_tokens"][2:] == [64, 48, 64]
    assert wobble["off"]["cached_tokens"][2:] == [64, 0, 64]

    for key in (JUNCTION_HEADLINE, FORK_HEADLINE):
        assert out[key] >= 0.95 and out[f"{key}_met"] is True and out[f"{key}_target"]
        assert out[f"{key}_off"] < out[key]
    for f in out["workloads"].values():
        for mode in ("on", "off"):
            assert f[mode]["outputs_equal_cold"] is True
            warm, cold = f[mode]["check_cached_tokens_warm_cold"]
            assert warm > 0 and cold == 0
            assert f[mode]["first_ttft_ms"] > 0 and f[mode]["ttft_median_ms"] > 0
    assert out["outputs_equal_cold"] is True
    assert out["sglang_reference"]["driven"] is False and out["sglang_reference"]["reason"]

    written = json.loads((tmp_path / "prefix.json").read_text())
    assert written == {k: v for k, v in out.items() if k != "table"}
    assert "| fork_100 (sessions) | 4 | 100 |" in (tmp_path / "prefix.md").read_text()
    assert (tmp_path / "prefix.png").stat().st_size > 0
