#!/usr/bin/env bash
# Build `custody bench spec`'s copy target (custody/bench/spec_targets.py): a small
# NemotronH trained on one thread, in under a minute, to continue copying its prompt.
# `scripts/build-spec-targets.sh DIR` writes the checkpoint into DIR; without DIR it fills
# the bench's cache (~/.cache/custody/spec/copy-<recipe>) unless already there. Prints the
# checkpoint, the sha256 of its weights and the seconds taken, as JSON; two builds write
# the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
exec "$python" -m custody.bench.spec_targets "$@"
