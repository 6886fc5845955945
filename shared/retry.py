"""What every background loop does when an iteration fails: count it, log it without
flooding the log, wait with backoff, and go on.

A loop that catches only connection errors ends, silently, the first time Redis refuses
a write instead (an `OOM` under `maxmemory`, `READONLY` after a failover, `CLUSTERDOWN`,
`TRYAGAIN`, `MOVED`, a redis-py `TimeoutError`), while its service keeps answering as if
all were well. So a loop hands every `Exception` to its `Retry` (never a
`BaseException`: cancellation and Ctrl-C still end it), which tells two kinds apart:

- a dependency fault (`DEPENDENCY_FAULTS`: any `redis.exceptions.RedisError`, or the
  builtin `OSError` family, connection and timeout errors included): Redis or the
  network, nothing the loop can fix; a warning without a traceback.
- any other exception: a fault of the loop itself (a bug, bad data); logged with its
  traceback.

Both are counted in `custody_background_faults_total{loop}` and retried after a delay
that doubles with each fault in a row (with jitter, so a restarted Redis is not met by
every loop at once) up to a ceiling, and starts over after a success. Each `Retry` logs
at most one line per `log_every` seconds for each kind, saying how many it held back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from redis.exceptions import RedisError

T = TypeVar("T")
DEPENDENCY_FAULTS: tuple[type[Exception], ...] = (
    RedisError,  # redis-py's own ConnectionError and TimeoutError are RedisErrors
    ConnectionError,
    TimeoutError,
    OSError,
)


def background_faults(
    registry: CollectorRegistry | None = REGISTRY, labels: Sequence[str] = ("loop",)
) -> Counter:
    """The service's `custody_background_faults_total` counter, in `registry` (None: in
    none, for a collector that yields it). `labels` start with `loop`."""
    return Counter(
        "custody_background_faults",
        "failed iterations of a background loop, survived and retried (Redis faults "
        "and faults of the loop itself)",
        list(labels),
        registry=registry,
    )


@dataclass
class _Gate:
    """Lets one line through per `every` seconds; counts those held back."""

    every: float
    next_at: float = float("-inf")
    held: int = 0

    def open(self, now: float) -> int | None:
        """None to hold this line back, else how many were held back since the last."""
        if now < self.next_at:
            self.held += 1
            return None
        held, self.held, self.next_at = self.held, 0, now + self.every
        return held


class Retry:
    """One background loop's fault handling: `wait(err)` (asyncio) or `wait_sync(err)`
    (threads) after a failed iteration, `ok()` after one that succeeded."""

    def __init__(
        self,
        loop: str,
        log: logging.Logger,
        counter: Counter | None = None,
        *,
        labels: Sequence[str] = (),
        about: str = "",
        first: float = 0.2,
        ceiling: float = 2.0,
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`counter` from `background_faults`, labelled (`loop`, *`labels`); `about`
        names what the loop serves in its log lines (a replica, say)."""
        self.log, self.clock = log, clock
        self.name = f"{loop} ({about})" if about else loop
        self.first, self.ceiling = first, ceiling
        self.counted = None if counter is None else counter.labels(loop, *labels)
        self.faults = 0  # every fault this loop survived
        self.streak = 0  # faults in a row, since the last success
        self._gates = {True: _Gate(log_every), False: _Gate(log_every)}

    def failed(self, err: Exception) -> float:
        """Count and (rate-limited) log `err`; returns the seconds to wait before the
        next try."""
        self.faults += 1
        self.streak += 1
        if self.counted is not None:
            self.counted.inc()
        delay = self._delay()
        dependency = isinstance(err, DEPENDENCY_FAULTS)
        held = self._gates[dependency].open(self.clock())
        if held is not None:
            also = f"; {held} more since the last line" if held else ""
            if dependency:
                self.log.warning(
                    "%s: %s: %s (retrying in %.2f s%s)",
                    self.name,
                    type(err).__name__,
                    err,
                    delay,
                    also,
                )
            else:
                self.log.exception(
                    "%s: fault of the loop itself (retrying in %.2f s%s)",
                    self.name,
                    delay,
                    also,
                    exc_info=err,
                )
        return delay

    def _delay(self) -> float:
        """`first` doubled for each fault in a row after the first, up to `ceiling`;
        jittered down by up to half."""
        base = min(self.ceiling, self.first * 2 ** min(self.streak - 1, 32))
        return base * random.uniform(0.5, 1.0)

    def ok(self) -> None:
        """An iteration succeeded: the next fault waits `first` again. A loop cancelled
        during it ends here (`honour_cancellation`)."""
        honour_cancellation()
        self.streak = 0

    async def wait(self, err: Exception) -> None:
        honour_cancellation()
        await asyncio.sleep(self.failed(err))

    def wait_sync(self, err: Exception) -> None:
        time.sleep(self.failed(err))


def honour_cancellation() -> None:
    """Raise the cancellation of the running task if a library swallowed it: redis-py
    can, when it arrives mid-command, and so can Python 3.11's `asyncio.wait_for` when
    what it waits for completes at the same moment. A background loop cancelled then
    would run on for ever (a shutdown that awaits it hangs: one did, in a CI run)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop: a thread's loop (wait_sync)
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def when_up(action: Callable[[], T], retry: Retry) -> T:
    """`action()` once it succeeds, waiting out dependency faults: a service's start-up
    meets a Redis that is restarting as its loops do. (Exiting instead, the service would
    be restarted by its supervisor into the same wait, and each time it would count as a
    crash.) Any other exception is a fault of the start-up itself: raised."""
    while True:
        try:
            return action()
        except DEPENDENCY_FAULTS as err:
            retry.wait_sync(err)
