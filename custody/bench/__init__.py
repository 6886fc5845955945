"""Benchmarks: each measures custody and its reference in one run (see harness.py).

Importing the package loads no benchmark (they need torch); `custody bench` imports
each through `custody.cli.benchmarks()`."""
