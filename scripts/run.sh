#!/usr/bin/env bash
# Create or reuse .venv, install custody with its benchmark extras and the SGLang wheel its
# allocators are measured against, then run the main job: `custody up` (a private Redis,
# the scheduler, the executor and the session store, built-in model; Ctrl-C stops it).
# Extra arguments replace it: `./scripts/run.sh demo`, `./scripts/run.sh bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[bench]'
.venv/bin/pip install -q --no-deps sglang==0.5.23
if [ "$#" -eq 0 ]; then set -- up; fi
exec .venv/bin/custody "$@"
