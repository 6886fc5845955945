"""`custody up`'s supervisor: the restart delay doubles while a service keeps dying and
drops back to the first once the service has run 60 s, on an injected clock."""

from __future__ import annotations

from custody import up
from custody.up import Backoff, Stack
from shared.config import Settings


def test_the_delay_doubles_to_the_ceiling_and_resets_after_a_healthy_run():
    backoff = Backoff(first=0.5, ceiling=4.0, healthy_seconds=60.0)
    now, delays = 0.0, []
    for _ in range(6):  # each life lasts 1 s
        now += 1.0
        delays.append(backoff.exited(now))
        now += delays[-1]
        backoff.started(now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.exited(now + 59.9) == 4.0  # not healthy long enough
    backoff.started(now + 70.0)
    assert backoff.exited(now + 130.0) == 0.5  # ran 60 s: back to the first delay
    backoff.started(now + 130.5)
    assert backoff.exited(now + 131.0) == 1.0  # and doubling again


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_stack_restarts_a_dying_service_later_each_time_until_it_ran_60_s(monkeypatch):
    """A real child process that exits at once ('python -m' of no module)."""
    monkeypatch.setattr(up, "SERVICES", {"flaky": "custody.no_such_module"})
    clock = Clock()
    stack = Stack(Settings(redis_url="redis://127.0.0.1:1", compile=False), clock=clock).start_all()
    try:

        def restart_after(delay: float) -> None:
            stack.children["flaky"].wait()
            restarts = stack.restarts["flaky"]
            stack.supervise_once()  # notices the exit now
            clock.now += delay - 0.01
            stack.supervise_once()
            assert stack.restarts["flaky"] == restarts
            clock.now += 0.01
            stack.supervise_once()
            assert stack.restarts["flaky"] == restarts + 1

        for delay in (0.5, 1.0, 2.0):
            clock.now += 1.0
            restart_after(delay)
        clock.now += 60.0  # this life ran 60 s before it exited
        restart_after(0.5)
        clock.now += 1.0
        restart_after(1.0)
    finally:
        stack.stop()
