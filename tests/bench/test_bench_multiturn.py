"""`custody bench multiturn`, shrunk (3 clients x 3 rounds, one rate) through the three
services on the test Redis. Behaviour, not speed: both modes answer every round with the
same tokens (greedy, the same prompts; the stateless resend carries the ids the server
returned), a session reuses its whole history, and the report holds every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from custody.bench import multiturn
from custody.bench.multiturn_workload import MODES, Turn, Workload
from custody.up import Stack

WORKLOAD = Workload(
    num_clients=3,
    num_rounds=3,
    request_length=64,
    sub_question_input_length=16,
    output_length=8,
    request_rates=(20.0,),
)
NEW = (64, 16, 16)  # each round's new tokens
PAGE = 16  # what a reuse may fall short of the history by


def _by_round(runs: multiturn.Runs, mode: str) -> dict[tuple[int, int], Turn]:
    (turns, seconds), *more = runs["20"][mode]
    assert not more and seconds > 0
    return {(t.client, t.round): t for t in turns}


def test_sessions_and_stateless_answer_every_round_alike(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    runs = multiturn.sweep(stack.settings.port, WORKLOAD)
    sessions, stateless = (_by_round(runs, mode) for mode in MODES)
    every = {(c, r) for c in range(3) for r in (1, 2, 3)}
    assert set(sessions) == set(stateless) == every
    for key, turn in sessions.items():
        other = stateless[key]
        assert len(turn.output_ids) == WORKLOAD.output_length
        assert turn.output_ids == other.output_ids, key
        before = NEW[: turn.round - 1]  # the earlier rounds' prompts, each answered by 8
        assert turn.history == other.history == sum(before) + 8 * len(before)
        assert turn.prompt_tokens == other.prompt_tokens == turn.history + NEW[turn.round - 1]
        if turn.round > 1:
            assert turn.cached_tokens >= turn.history - PAGE, key
        assert 0 < turn.ttft_s <= turn.latency_s

    monkeypatch.setattr(multiturn, "RESULTS_DIR", tmp_path)
    payload = multiturn.report(WORKLOAD, 1, runs)
    written = json.loads((tmp_path / "multiturn.json").read_text())
    assert written == {k: v for k, v in payload.items() if k != "table"}
    for mode in MODES:
        figures = written["rates"]["20"][mode]
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert figures["requests"] == 9 and figures["output_token_throughput"] > 0
        assert [r["requests"] for r in figures["rounds"]] == [3, 3, 3]
    assert written["rates"]["20"]["sessions"]["rounds"][2]["cache_hit_rate"] > 0.5
    assert (tmp_path / "multiturn.png").stat().st_size > 0
    assert "| 20 | stateless | 3 |" in (tmp_path / "multiturn.md").read_text()
