#!/usr/bin/env bash
# Create or reuse .venv, install custody with its test extras, then lint and run every test.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Prometheus and promtool, for the dashboard and alert tests: as root, Debian's package.
# Its daemon must not start (this may be a container without systemd, and the tests run their
# own): a policy-rc.d exiting 101 forbids it during the install, and any process left running
# the freshly installed binary is stopped.
install_prometheus() (
    command -v prometheus >/dev/null && command -v promtool >/dev/null && exit 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || exit 0
    policy=/usr/sbin/policy-rc.d saved=$(mktemp)
    if [ -e "$policy" ]; then cp -p "$policy" "$saved"; else rm -f "$saved"; fi
    trap 'if [ -e "$saved" ]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi' EXIT
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
    for exe in /proc/[0-9]*/exe; do
        if [ "$(readlink "$exe" 2>/dev/null)" = /usr/bin/prometheus ]; then
            pid=${exe#/proc/}
            kill "${pid%/exe}" 2>/dev/null || true
        fi
    done
)
install_prometheus

# torch first, pinned to the CPU build, so no later requirement pulls a CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
# SGLang's wheel without its dependencies: its streaming-session kit runs against custody
# (tests/peers/), and its allocators are the benchmarks' reference
.venv/bin/pip install -q --no-deps sglang==0.5.23
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the GPU check's wheel folder, built from the registry, and its dry run (docs/gpu.md)
bash scripts/gpu-wheels.sh
# Two workers (CI has two cores; one test process keeps about one busy), a file to a
# worker so a module's stack is shared; then, alone, the tests marked `solo`, whose
# faults are timed against leases. Exit 5 (no test selected by the arguments) is no fault.
pytest() {
    local status=0
    .venv/bin/python -m pytest "$@" || status=$?
    [ "$status" = 5 ] && status=0
    return "$status"
}
pytest -n 2 --dist loadfile -m "not solo" --durations=30 "$@"  # and where the time goes
pytest -m solo --durations=5 "$@"
