"""Benchmarks: each measures custody and its reference in one run (see harness.py)."""

from collections.abc import Callable

from custody.bench import allocators, e2e, events, executor, sessions

BENCHMARKS: dict[str, Callable[[int], dict]] = {
    "allocators": allocators.run,
    "e2e": e2e.run,
    "events": events.run,
    "executor": executor.run,
    "sessions": sessions.run,
}
