#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with one NVIDIA GPU and the image's torch,
# Triton and transformers (no network), `scripts/gpu-check.sh OUTDIR` installs custody
# and the wheels of .gpu-wheels/ (scripts/gpu-wheels.sh fills it here) and runs the
# stages, at most five minutes in all, writing OUTDIR/gpu.json and OUTDIR/gpu.md after
# each. `scripts/gpu-check.sh --dry-run` checks all that can be checked without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && [ "${1:-}" = --dry-run ] && python=.venv/bin/python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m custody.gpu_check "$@"
