#!/usr/bin/env bash
# Create or reuse .venv, install custody with its test extras, then lint and run every test.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned to the CPU build, so no later requirement pulls a CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
