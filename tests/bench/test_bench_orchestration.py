"""`custody bench orchestration`'s one CI cell: the real scheduler, store and Redis
against the stand-in executor, with streaming clients. Behaviour, not speed: every
client decodes, each step carries every row, a decode row's step bytes are those of a
delta (a whole 1K context would be 4 KB a row), and every figure is reported."""

from __future__ import annotations

from custody.bench.orchestration import Cell, measure_cell
from custody.bench.scheduler_core import per_row_step_us


def test_one_cell_decodes_every_client_and_reports_every_figure():
    got = measure_cell(Cell(8, 1024, 10), window=1.0)
    assert 0 <= got["idle_share"] <= 1 and got["steps_per_s"] > 0
    assert got["rows_per_step"] == 8  # every client in every step
    assert 0 < got["step_bytes_per_row"] < 1024  # a delta, not the 1K context's indices
    assert got["scheduler_cpu_us_per_row_step"] > 0 and got["itl_ms_p50"] > 0
    assert set(got["cores_used"]) >= {"scheduler", "session-store", "executor", "clients"}
    assert isinstance(got["saturated"], bool)
    each = got["cpu_us_per_row_step"]  # every process's own figure, the clients' not
    assert set(each) >= {"scheduler", "store", "executor"} and "clients" not in each
    assert all(v > 0 for v in each.values()), each
    per_step = got["cpu_ms_per_step"]
    assert got["max_process_cpu_ms_per_step"] == max(per_step.values())
    assert got["sum_process_cpu_ms_per_step"] >= got["max_process_cpu_ms_per_step"]


def test_the_scheduler_core_alone_is_timed_over_steps_of_every_row():
    assert per_row_step_us(8, context=64, steps=20) > 0
