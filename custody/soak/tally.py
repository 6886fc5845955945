"""Every reply a soak client gets, counted by request kind and outcome, and judged against
what the specified behaviour promises for that kind: a status other than the expected one,
or any 5xx, is an unexpected status and fails the soak.

Chaos excuses exactly three outcomes, for every kind: no answer and a body cut off (the
scheduler was killed under the call), and a 200 whose request ended by abort (a step
refused around an executor restart). Without chaos none is excused. A request failed by
the poison-quarantine rule (a 200 abort whose message says "quarantined") is counted
apart and is never unexpected unless it is a 5xx.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Collection

from custody.soak.client import NO_ANSWER, Reply

INVALID = "4xx"  # bad input, refused before anything moved: 400, 413 or 422
INVALID_STATUSES = {"400", "413", "422"}
OK = frozenset({"200"})
REFUSED = frozenset({INVALID})


class Tally:
    def __init__(self, chaos: bool) -> None:
        self.chaos = chaos
        self.lock = threading.Lock()
        self.statuses: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.hostile: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.events: Counter[str] = Counter()  # what happened that is not a reply
        self.unexpected = 0
        self.examples: dict[str, str] = {}
        self.quarantined = 0

    def judge(
        self, kind: str, reply: Reply, expected: Collection[str], hostile: bool = False
    ) -> bool:
        """Count `reply` under `kind`; True when `expected` (or chaos) allows it."""
        quarantined = "quarantined" in reply.text
        ok = self.allowed(reply.outcome, expected, quarantined)
        with self.lock:
            self.quarantined += quarantined
        detail = f"expected {sorted(expected)}: {reply.text[:300]}"
        self.count(kind, reply.outcome, ok, hostile, detail)
        return ok

    def count(self, kind: str, outcome: str, ok: bool, hostile: bool, detail: str) -> None:
        """Count one outcome; one that is not `ok` is an unexpected status."""
        with self.lock:
            (self.hostile if hostile else self.statuses)[kind][outcome] += 1
            if not ok:
                self.unexpected += 1
                self.examples.setdefault(f"{kind} {outcome}", detail)  # the first of each

    def allowed(self, outcome: str, expected: Collection[str], quarantined: bool) -> bool:
        if outcome.startswith("5"):
            return False
        if outcome in expected or (INVALID in expected and outcome in INVALID_STATUSES):
            return True
        if quarantined and outcome == "200/abort":
            return True
        return self.chaos and (outcome in (NO_ANSWER, "200/abort") or outcome.endswith("/cut"))

    def note(self, event: str) -> None:
        with self.lock:
            self.events[event] += 1
