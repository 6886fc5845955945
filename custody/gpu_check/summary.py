"""The GPU check's summary, `gpu.json` and `gpu.md` in the output folder, rewritten after
every stage so a run cut short still says what it reached: the machine, each stage's
status, time and figures (the tests' outcomes and recorded properties from their JUnit
XML, the benchmarks' result files)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from custody.gpu_check.stages import Outcome


def write(out: Path, machine: dict, outcomes: list[Outcome], total: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "total_budget_s": total, "stages": [asdict(o) for o in outcomes]}
    (out / "gpu.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "gpu.md").write_text(markdown(data) + "\n")


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        "# GPU check",
        "",
        f"{m.get('gpu', '?')}, driver {m.get('driver', '?')}; torch {m.get('torch', '?')} "
        f"(CUDA {m.get('cuda', '?')}), Triton {m.get('triton', '?')}, Python "
        f"{m.get('python', '?')}; {m.get('date', '?')}",
        "",
        "| stage | status | seconds / budget | figures |",
        "|---|---|---|---|",
    ]
    for stage in data["stages"]:
        lines.append(
            f"| {stage['name']} | {stage['status']} | {stage['seconds']} / {stage['budget']} "
            f"| {_brief(stage['figures'])} |"
        )
    for stage in data["stages"]:
        tests = stage["figures"].get("tests", {})
        bad = {k: v for k, v in tests.items() if not v.startswith(("passed", "skipped"))}
        if bad:
            lines += ["", f"## {stage['name']}: what failed", ""]
            lines += [f"- {name}: {outcome}" for name, outcome in bad.items()]
        if stage["status"] not in ("passed", "not run") and not bad:
            lines += ["", f"## {stage['name']}: the end of its output", "", "```"]
            lines += [stage["tail"][-1500:], "```"]
    return "\n".join(lines)


def _brief(figures: dict) -> str:
    """A stage's figures in a cell: test counts and properties, or a bench's key lines."""
    if "counts" in figures:
        parts = [", ".join(f"{n} {k}" for k, n in figures["counts"].items())]
        parts += [f"{k} {_fmt(v)}" for k, v in figures.get("properties", {}).items()]
        return "; ".join(parts)
    if "compiled" in figures or "eager" in figures:
        steps = figures.get("compiled") or figures.get("eager") or {}
        shown = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in steps.items())
        return f"decode steps {shown}; b1 / weight-read bound {figures.get('batch1_over_bound')}"
    if "cells" in figures:
        return "; ".join(
            f"{k}: idle {c['idle_share']}, scheduler {c['scheduler_cpu_us_per_row_step']} us "
            "per row-step"
            for k, c in figures["cells"].items()
        )
    return ", ".join(f"{k} {v}" for k, v in figures.items())[:300]


def _fmt(value: float | str) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
