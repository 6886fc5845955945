"""What every benchmark shares: timing by medians, side-by-side rows, result files.

Each figure is measured for custody and for its reference in the same process, with
their repeats interleaved so machine noise hits both alike, and reported as medians
with the ratio (how many times faster custody is).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS_DIR = Path("bench-results")


@dataclass
class Row:
    key: str  # JSON key of the ratio, e.g. "ratio_paged_extend"
    what: str
    unit: str
    ours_s: float  # median seconds per operation
    reference_s: float
    reference: str
    target: float  # 0: no target for this figure

    @property
    def ratio(self) -> float:
        return self.reference_s / self.ours_s


def side_by_side(
    ours: Callable[[], float], reference: Callable[[], float], repeats: int, label: str
) -> tuple[float, float]:
    """Interleave single repeats of both; medians of seconds per operation."""
    a, b = [], []
    for i in range(repeats):
        a.append(ours())
        b.append(reference())
        progress(label, i + 1, repeats)
    return statistics.median(a), statistics.median(b)


def progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r{label:<32} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def table(rows: list[Row]) -> str:
    lines = [
        "| operation | custody | reference | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.target:
            verdict = f">= {r.target:g}x {'met' if r.ratio >= r.target else 'NOT met'}"
        else:
            verdict = "none"
        lines.append(
            f"| {r.what} | {_fmt(r.ours_s)} | {_fmt(r.reference_s)} ({r.reference}) "
            f"| {r.ratio:.1f}x | {verdict} |"
        )
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def write_results(name: str, rows: list[Row], extra: dict) -> dict:
    payload = {r.key: round(r.ratio, 3) for r in rows}
    payload.update(extra)
    payload["rows"] = [asdict(r) | {"ratio": r.ratio} for r in rows]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / f"{name}.md").write_text(table(rows) + "\n")
    plot(
        name,
        f"{name}: custody vs {rows[0].reference}",
        [r.what for r in rows],
        {
            "custody": [r.ours_s * 1e6 for r in rows],
            rows[0].reference: [r.reference_s * 1e6 for r in rows],
        },
        "microseconds per operation",
        log=True,
    )
    return payload


def plot(
    name: str,
    title: str,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    log: bool = False,
) -> Path:
    """A grouped bar chart of each series over `labels`, saved as bench-results/<name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=label)
    ax.set_xticks(
        [x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels, fontsize=8
    )
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@contextlib.contextmanager
def first_for_cpu(pids: list[int]) -> Iterator[str | None]:
    """The processes `pids` ahead of every other for the CPU (nice -10) while the body
    runs: on two cores shared by every process of a stack, a front woken by a request
    may wait for a core that its own pod would give it at once. Yields None, or why it
    could not (no permission: the body runs as it is)."""
    try:
        for pid in pids:
            os.setpriority(os.PRIO_PROCESS, pid, -10)
    except PermissionError as err:
        yield f"not measured: {err}"
        return
    try:
        yield None
    finally:
        for pid in pids:
            os.setpriority(os.PRIO_PROCESS, pid, 0)
