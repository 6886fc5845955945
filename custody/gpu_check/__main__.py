"""`python -m custody.gpu_check OUTDIR | --dry-run | --verify` (scripts/gpu-check.sh).

OUTDIR: run every stage (stages.py) within the total budget, rewriting OUTDIR/gpu.json
and OUTDIR/gpu.md after each, and OUTDIR/gpu.log with every command's output.
--dry-run: here, without a GPU: the wheel folder against what the check imports
(wheels.py), each stage's test selection, the budgets, and the sizes that travel.
--verify: on the GPU machine after the install: what is installed against the same.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from custody.gpu_check import summary, wheels
from custody.gpu_check.stages import (
    MARKERS,
    PYTEST,
    STAGES,
    TEST_FILES,
    TOTAL_SECONDS,
    Outcome,
    run_stage,
)

TRAVEL_LIMIT = 64 << 20  # what the device tool carries: the repository and the folder
MACHINE = """
import json, platform, torch, triton
print(json.dumps({
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
    "python": platform.python_version(),
}))
"""


def machine() -> dict:
    """The GPU, its driver and the image's torch, Triton and Python; what cannot be read
    says so."""
    found: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    for key, command in (
        ("torch", [sys.executable, "-c", MACHINE]),
        ("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
    ):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            text = done.stdout.strip() or done.stderr.strip()[-200:]
        except (OSError, subprocess.TimeoutExpired) as err:
            text = f"unreadable: {err}"
        found |= json.loads(text) if key == "torch" and text.startswith("{") else {key: text}
    return found


def run(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu.log"
    log.write_text("")
    info, outcomes = machine(), []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="custody-gpu-") as work:
        for stage in STAGES:
            left = TOTAL_SECONDS - (time.monotonic() - start)
            if left < 5:
                outcomes.append(Outcome(stage.name, "not run: the total was spent"))
            else:
                outcomes.append(run_stage(stage, Path(work), min(stage.budget, left), log))
            summary.write(out, info, outcomes, TOTAL_SECONDS)
            print(f"{stage.name}: {outcomes[-1].status} ({outcomes[-1].seconds} s)", flush=True)
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def dry_run() -> list[str]:
    problems = wheels.dry_run_problems()
    for stage, marker in MARKERS.items():
        command = [*PYTEST, "--collect-only", "-m", marker, "tests/gpu"]
        done = subprocess.run(command, cwd=wheels.ROOT, capture_output=True, text=True)
        lines = done.stdout.splitlines()  # "path::test" or, quieter, "path: count"
        files = {line.split("::")[0].split(":")[0].rsplit("/", 1)[-1] for line in lines}
        missing = TEST_FILES[stage] - files
        if done.returncode not in (0, 5) or missing:
            problems.append(f"stage {stage} ({marker!r}) does not select {sorted(missing)}")
    if any(stage.budget <= 0 for stage in STAGES) or TOTAL_SECONDS > 300:
        problems.append("each stage needs a budget, and the whole check at most 300 s")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=wheels.ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    size = sum((wheels.ROOT / f).stat().st_size for f in tracked if (wheels.ROOT / f).is_file())
    size += sum(w.stat().st_size for w in wheels.WHEELS_DIR.glob("*.whl"))
    if size > TRAVEL_LIMIT:
        problems.append(f"the repository and the wheels weigh {size / 2**20:.1f} MiB, over 64")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("outdir", nargs="?", type=Path, help="where the summary goes")
    mode.add_argument("--dry-run", action="store_true", help="check the check, here")
    mode.add_argument("--verify", action="store_true", help="check the install, there")
    args = parser.parse_args(argv)
    if args.outdir is not None:
        return run(args.outdir)
    problems = wheels.verify_installed() if args.verify else dry_run()
    for problem in problems:
        print(f"- {problem}")
    print("gpu check: " + ("ready" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
