"""The GPU check (scripts/gpu-check.sh, docs/gpu.md): one prepared run, time-boxed to five
minutes, that installs custody offline on a machine with one NVIDIA GPU and runs its
kernels, executor, a stack and two benchmarks there, writing a summary after each stage.
This package imports nothing beyond the standard library and `packaging` at the top, so
it runs before the install it performs."""
