"""`custody bench orchestration|e2e --baseline REV`, without a benchmark: the flag is
refused where it does not apply and for a revision that does not exist; the baseline's
tree is that revision's files and what its services import; runs alternate revision by
revision within each cell; each side's figures are its own medians, reported side by
side under the keys the results files already have."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest

from custody.bench import baseline, e2e, orchestration
from custody.bench.orchestration import Cell
from custody.cli import main
from custody.up import Stack
from shared.config import Settings


def _git_checkout() -> bool:
    try:
        found = subprocess.run(
            ["git", "-C", str(baseline.REPO), "rev-parse", "--verify", "HEAD^{commit}"],
            capture_output=True,
        )
    except FileNotFoundError:
        return False
    return found.returncode == 0


needs_git = pytest.mark.skipif(not _git_checkout(), reason="not in a git checkout")


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "sessions", "--baseline", "HEAD"],
        ["bench", "--baseline", "HEAD"],  # every benchmark
        ["bench", "orchestration", "--device", "cuda", "--baseline", "HEAD"],
    ],
)
def test_the_cli_refuses_baseline_where_it_does_not_apply(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "--baseline" in capsys.readouterr().err


@needs_git
@pytest.mark.parametrize("name", ["orchestration", "e2e"])
def test_the_cli_refuses_a_revision_that_does_not_exist(name, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--baseline", "no-such-revision-0123"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline 'no-such-revision-0123': no such revision" in err
    assert "Traceback" not in err


def test_cells_are_named_from_the_sweep():
    assert orchestration.cells_named(["b64_ctx1k_10ms", "b8_ctx32k_2ms", "b64_ctx1k_10ms"]) == [
        Cell(64, 1024, 10),
        Cell(8, 32768, 2),
    ]
    with pytest.raises(ValueError, match="no cell b9_ctx1k_10ms; the sweep's cells are b8_"):
        orchestration.cells_named(["b9_ctx1k_10ms"])
    with pytest.raises(ValueError, match="no cell given"):
        orchestration.cells_named([])


@needs_git
def test_the_tree_is_the_revisions_files_and_is_removed_after():
    sha = baseline.revision("HEAD")
    assert len(sha) == 40
    path = "custody/bench/orchestration.py"  # the commit's, whatever the working tree holds
    committed = subprocess.run(
        ["git", "-C", str(baseline.REPO), "show", f"{sha}:{path}"], capture_output=True, check=True
    ).stdout
    with baseline.tree(sha, ["custody.bench.standin_executor"]) as root:
        assert (root / path).read_bytes() == committed
        assert not (root / ".git").exists()
        with pytest.raises(RuntimeError, match=f"revision {sha[:7]} has no custody.bench.nope"):
            baseline._check_modules(root, sha, ["custody.bench.nope"])
    assert not root.exists()


def test_a_stack_with_a_source_runs_that_trees_modules(tmp_path: Path):
    source = tmp_path / "tree"
    source.mkdir()
    (source / "probe.py").write_text(
        "import os, pathlib, sys\n"
        "seen = pathlib.Path(os.environ['CUSTODY_STATE_DIR']) / 'seen'\n"
        "seen.write_text('\\n'.join([__file__, os.getcwd(), os.environ['PYTHONPATH']]))\n"
    )
    settings = Settings.ephemeral(redis_url="redis://127.0.0.1:1", state_dir=tmp_path)
    stack = Stack(settings, plan=lambda s: {"probe": ("probe", s)}, source=source)
    try:
        stack.start_all()
        assert stack.children["probe"].wait(timeout=30) == 0
    finally:
        stack.stop()
    module, cwd, pythonpath = (tmp_path / "seen").read_text().splitlines()
    assert Path(module) == source / "probe.py" and Path(cwd) == source
    assert pythonpath == str(source)


def test_runs_alternate_side_by_side_within_each_item_and_repeat():
    calls: list[tuple[int, str, str]] = []

    def measure(repeat: int, item: str, side: str) -> float:
        calls.append((repeat, item, side))
        return len(calls)

    runs = baseline.alternate(2, ["a", "b"], ["this", "baseline"], measure, "test")
    assert calls == [
        (0, "a", "this"),
        (0, "a", "baseline"),
        (0, "b", "this"),
        (0, "b", "baseline"),
        (1, "a", "this"),
        (1, "a", "baseline"),
        (1, "b", "this"),
        (1, "b", "baseline"),
    ]
    assert runs == {"this": {"a": [1, 5], "b": [3, 7]}, "baseline": {"a": [2, 6], "b": [4, 8]}}


def _cell_run(idle: float, scheduler_us: float) -> dict:
    return {
        "idle_share": idle,
        "saturated": False,
        "scheduler_cpu_us_per_step": scheduler_us * 8,
        "scheduler_cpu_us_per_row_step": scheduler_us,
        "cpu_us_per_row_step": {"scheduler": scheduler_us, "store": 20.0},
        "max_process_cpu_ms_per_step": scheduler_us * 8e-3,
        "sum_process_cpu_ms_per_step": scheduler_us * 9e-3,
        "step_bytes_per_row": 330.0,
        "itl_ms_p50": 10.5,
        "itl_ms_p99": 12.0,
        "machine_share": 0.5,
        "load_average": 1.2,
    }


def test_orchestration_keeps_each_sides_median_run_and_reports_both():
    cell = Cell(8, 1024, 10)
    ours = [_cell_run(0.3, 61.0), _cell_run(0.1, 58.0), _cell_run(0.2, 60.0)]
    theirs = [_cell_run(0.5, 90.0), _cell_run(0.7, 95.0), _cell_run(0.6, 93.0)]
    core = {"scheduler_core_us_per_row_step_b64": 17.8, "scheduler_core_us_per_row_step_b256": 19.1}
    payload = orchestration.summary({cell: ours}, core)
    base = {"revision": "5000829" + "0" * 33, **orchestration.summary({cell: theirs}, {})}
    assert payload["idle_share_b8_ctx1k_10ms"] == 0.2  # the median run, whole
    assert payload["scheduler_cpu_us_per_row_step_b8_ctx1k_10ms"] == 60.0
    assert base["idle_share_b8_ctx1k_10ms"] == 0.6
    assert base["scheduler_cpu_us_per_row_step_b8_ctx1k_10ms"] == 93.0
    alone = orchestration.report(payload, 3)
    payload["baseline"] = base
    assert set(base) - {"revision"} == set(payload) - {"baseline"} - core.keys()
    table = orchestration.report(payload, 3)
    assert "| b8_ctx1k_10ms | 0.200 | 480 us / 60.0 us |" in table
    assert "| b8_ctx1k_10ms @ 5000829 | 0.600 | 744 us / 93.0 us |" in table
    assert "median idle share of 3" in table
    assert "b64 17.8 us, b256 19.1 us" in table
    assert "Baseline 5000829's engine core: not measured" in table
    assert "5000829" not in alone and "| b8_ctx1k_10ms | 0.200 |" in alone


def _e2e_run(tokens_per_s: float, share: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "ttft": [0.01], "itl": [0.004], "overhead_share": share}


def test_e2e_reports_each_sides_medians_in_columns_and_the_verdict():
    def side(shares: list[float]) -> dict[str, list[dict]]:
        return {name: [_e2e_run(1000.0 + s, s) for s in shares] for name in e2e.CONFIGS}

    payload = e2e.summary(side([0.12, 0.08, 0.3]), 3)
    base = {"revision": "5000829" + "0" * 33, **e2e.summary(side([0.2, 0.16, 0.18]), 3)}
    assert payload["overhead_share"] == 0.12 and base["overhead_share"] == 0.18
    assert payload["tokens_per_s"] == 1000.1 and payload["eager"]["overhead_share"] == 0.12
    assert e2e.report(payload).startswith("| figure | value |\n|---|---|\n")
    payload["baseline"] = base
    assert set(base) - {"revision"} == set(payload) - {"baseline"}
    table = e2e.report(payload)
    assert table.startswith("| figure | this revision | baseline 5000829 |\n|---|---|---|\n")
    assert "| overhead_share (target <= 0.1) | 0.120 NOT met (" in table
    assert "| 0.180 NOT met (" in table
    assert table.endswith("| overhead_share below the baseline's | yes: 0.120 against 0.180 | |")
    base["overhead_share"] = 0.1
    assert "below the baseline's | NO: 0.120 against 0.100" in e2e.report(payload)


@needs_git
def test_the_revision_outside_a_checkout_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="needs a git checkout"):
        baseline.revision("HEAD", repo=tmp_path)


def test_the_cpu_plot_has_each_process_of_each_side_by_batch(monkeypatch):
    drawn = {}
    monkeypatch.setattr(orchestration, "plot", lambda name, *args: drawn.update({name: args}))
    runs = {Cell(b, 8192, 10): [_cell_run(0.1, 10.0 * b)] for b in (8, 256)}
    runs[Cell(8, 1024, 10)] = [_cell_run(0.1, 1.0)]  # another context: not plotted
    payload = orchestration.summary(runs, {})
    payload["baseline"] = {"revision": "5000829" + "0" * 33, **copy.deepcopy(payload)}
    for cell in payload["cells"].values():  # an edge worker this side has, the baseline not
        cell["cpu_us_per_row_step"]["edge_0"] = 5.0
    orchestration._plot_cpu(payload)
    _, labels, series, _ = drawn["orchestration-cpu"]
    assert labels == ["b8", "b256"]
    assert series["scheduler"] == [80.0, 2560.0] and series["store"] == [20.0, 20.0]
    assert series["scheduler @ 5000829"] == [80.0, 2560.0]
    assert series["edge_0"] == [5.0, 5.0] and "edge_0 @ 5000829" not in series
