#!/usr/bin/env bash
# Fill .gpu-wheels/ (ignored by git) with the wheels scripts/gpu-check.sh installs on the
# GPU machine, which has no network: those of scripts/gpu-wheels.txt, built for CPython
# 3.12 on x86-64 Linux, fetched from the package registry without their dependencies (the
# list names each one the image lacks). Then check the folder (the dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p .gpu-wheels
platforms=()
for tag in manylinux_2_{17,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --dest .gpu-wheels \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    "${platforms[@]}" --platform any -r scripts/gpu-wheels.txt
# a wheel no longer listed (an earlier pin) would be installed too: drop it
"$python" - <<'PY'
import pathlib, re
wanted = {
    re.sub(r"[-_.]+", "_", line.split("==")[0]).lower() + "-" + line.split("==")[1].strip()
    for line in pathlib.Path("scripts/gpu-wheels.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}
for wheel in pathlib.Path(".gpu-wheels").glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    if f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}" not in wanted:
        print(f"removing {wheel.name}: not in scripts/gpu-wheels.txt")
        wheel.unlink()
PY
exec bash scripts/gpu-check.sh --dry-run
