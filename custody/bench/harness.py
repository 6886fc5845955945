"""What every benchmark shares: timing by medians, side-by-side rows, result files.

Each figure is measured for custody and for its reference in the same process, with
their repeats interleaved so machine noise hits both alike, and reported as medians
with the ratio (how many times faster custody is).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
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
    return payload
