"""`custody bench scaleout`, shrunk (4 sessions of 3 turns, one request per prefix per
phase): every figure is reported and written, sessions stay on the replica that holds
their state, and the second router really routes at random. Speed is not judged here."""

import json

import pytest

from custody.bench import harness, scaleout
from custody.bench.scaleout_report import TARGETS


def test_scaleout_keeps_sessions_on_their_replica_and_reports_every_figure(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    out = scaleout.run(repeats=1, clients=4, turns=3, rounds=1)
    assert out["affinity_hit_rate"] == 1.0 and out["returning_turns"] == 4 * 2
    assert out["affinity_counts_match_placement"]
    assert out["router_overhead_requests"] == 4 * (3 + 2)  # open, turns, close
    assert 0 < out["router_overhead_p50_ms"] <= out["router_overhead_p99_ms"]
    first = out["router_first"]  # root here: the diagnostic pass runs, on its own sessions
    assert first["router_overhead_by_kind"]["turn"]["requests"] == 4 * (3 + 1)  # and close
    for key in TARGETS:
        assert f"{key}_target" in out and isinstance(out[f"{key}_met"], bool)
    sizes, phases = out["prefix_sizes"], out["prefix_phases"]
    assert sizes["L"] * sizes["P"] == 2 * sizes["cache_capacity_tokens_per_replica"]
    assert phases["iid"]["random"]["decisions"] == {"random": sizes["P"]}
    assert "random" not in phases["iid"]["prefix"]["decisions"]
    assert set(out["prefix_hit_tokens"]["iid"]) == {"prefix", "random", "one_replica"}
    assert out["compile"] is False
    assert json.loads((tmp_path / "scaleout.json").read_text())["affinity_hit_rate"] == 1.0
    assert "prefix_hit_tokens_ratio_vs_random" in (tmp_path / "scaleout.md").read_text()
    assert (tmp_path / "scaleout.png").stat().st_size > 0
