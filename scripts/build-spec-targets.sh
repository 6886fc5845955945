#!/usr/bin/env bash
# Build `custody bench spec`'s checkpoints (custody/bench/spec_targets.py, spec_head.py):
# small NemotronH targets trained on one thread, each in under a minute, and MTP heads
# trained on their greedy continuations, each in under a minute once its target is built.
#   scripts/build-spec-targets.sh [--chain] [DIR]   the copy (or chain) target
#   scripts/build-spec-targets.sh head copy|chain [DIR]   that target with its head
# DIR receives the checkpoint; without it the bench's cache (~/.cache/custody/spec/) is
# filled unless already there. Prints the checkpoint, the sha256 of its weights and the
# seconds taken (a head's: its own training, not its target's), as JSON; two builds
# write the same bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
if [ "${1:-}" = head ]; then
    shift
    exec "$python" -m custody.bench.spec_head "$@"
fi
exec "$python" -m custody.bench.spec_targets "$@"
