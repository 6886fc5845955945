"""`custody bench scaleout --gateway epp`, shrunk (4 sessions of 2 turns, one request per
prefix per phase): the workload goes through the endpoint picker, every session stays
on the replica its placement names, and every figure is reported and written. Speed is
not judged here."""

import json

import pytest

from custody.bench import harness, scaleout_gateway


def test_the_gateway_bench_keeps_sessions_placed_and_reports_every_figure(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    out = scaleout_gateway.run(repeats=1, clients=4, turns=2, rounds=1)
    assert out["affinity_hit_rate"] == 1.0 and out["returning_turns"] == 4
    assert out["endpoint_is_placement"]
    turns = out["epp_decision_by_kind"]["turn"]
    assert turns["requests"] == 4 * (2 + 1)  # the turns and the close
    assert 0 < turns["p50_ms"] <= turns["p99_ms"]
    assert out["epp_decision_by_kind"]["open"]["requests"] == 4
    assert out["epp_first"]["turn"]["requests"] == 4 * 3  # root here: the diagnostic runs
    phases = out["prefix_phases"]
    assert set(phases) == {"rounds", "iid"} and set(phases["iid"]) == {"prefix", "random"}
    assert set(out["met"]) == {
        "affinity_hit_rate",
        "epp_decision_p99_ms",
        "prefix_hit_tokens_ratio_vs_random_rounds",
    }
    written = json.loads((tmp_path / "scaleout_epp.json").read_text())
    assert written["affinity_hit_rate"] == 1.0
    assert "epp_decision_p99_ms" in (tmp_path / "scaleout_epp.md").read_text()
