"""The tier drill: for each kind of move, an executor killed while one is in flight, made
certain rather than left to chance.

For each kind it opens a session (tenant A), runs a turn, puts the session's state where
the move starts with the operator route `/place_session` (device for a hibernate, host
for a spill or a restore, disk for a load), asks for the move in a thread, and kills the
executor once the executor's in-flight mark shows that kind. The kill counts only if the
mark the dead executor left shows it (`Chaos.kill_in_move`); otherwise the drill tries
again, a bounded number of times. Once an executor is back, the session takes one more
turn: its output joins the greedy outputs the verdict replays, so a turn resumed after a
kill in any move (from disk after a load, re-prefilled after the others) is checked token
by token. The drill runs while the greedy workers load the stack, so the step it kills
may carry their moves too, and a session placed by the drill may be moved by the policy
first: then the attempt misses and is retried.
"""

from __future__ import annotations

import random
import threading
import time

from custody.soak.chaos import Chaos
from custody.soak.client import NO_ANSWER, Reply, call
from custody.soak.greedy import CLOSED, Greedy
from custody.soak.tally import OK, Tally
from shared.session_ids import scoped_session_id, tenant_of

# kind: (the tiers the session is placed in first, in order; the tier the move goes to)
SETUP: dict[str, tuple[tuple[str, ...], str]] = {
    "hibernate": (("device",), "host"),
    "spill": (("host",), "disk"),
    "load": (("host", "disk"), "host"),
    "restore": (("host",), "device"),
}
ATTEMPTS = 4  # per kind
WATCH_SECONDS = 20.0  # for the move to show in the mark, per attempt
BUDGET_SECONDS = 150.0  # no attempt starts after this: the drill's bound on a run's length


class TierDrill:
    def __init__(
        self,
        port: int,
        tally: Tally,
        greedy: Greedy,
        chaos: Chaos,
        tenant: str | None,
        operator: str | None,
    ) -> None:
        self.port, self.tally, self.greedy, self.chaos = port, tally, greedy, chaos
        self.tenant, self.operator = tenant, operator
        self.rng = random.Random(7)
        self.attempts: dict[str, int] = {}
        self.hits: dict[str, bool] = {}

    def run(self, kinds: tuple[str, ...] = tuple(SETUP)) -> None:
        """Each kind until one attempt hits, at most ATTEMPTS times, within the budget."""
        deadline = time.monotonic() + BUDGET_SECONDS
        for kind in kinds:
            self.hits[kind], self.attempts[kind] = False, 0
            while self.attempts[kind] < ATTEMPTS and time.monotonic() < deadline:
                self.attempts[kind] += 1
                if self.once(kind):
                    self.hits[kind] = True
                    break

    def report(self) -> dict:
        """Per kind: the attempts made and whether one hit."""
        return {k: {"attempts": self.attempts[k], "hit": self.hits[k]} for k in self.hits}

    def once(self, kind: str) -> bool:
        """One attempt: True when the executor died with a `kind` move in flight."""
        before, target = SETUP[kind]
        epoch = self.wait_executor(None)
        reply = call(self.port, "/open_session", {}, self.tenant)
        self.tally.judge("drill_open_session", reply, OK)
        if reply.status != 200 or not isinstance(reply.body, str):
            return False
        sid = reply.body
        with self.greedy.lock:
            self.greedy.opened[sid] = self.tenant
        try:
            history = self.turn(sid, [], self.rng.randint(24, 160))
            if history is None or not all(self.place(sid, tier) == tier for tier in before):
                return False
            moving = threading.Thread(target=self.place, args=(sid, target))
            moving.start()
            hit = self.chaos.kill_in_move(
                lambda kinds: kind in kinds, WATCH_SECONDS, lambda: not moving.is_alive()
            )
            moving.join(timeout=120)
            if hit:
                self.wait_executor(epoch)
            self.turn(sid, history, self.rng.randint(1, 12))
            return kind in hit
        finally:
            reply = call(self.port, "/close_session", {"session_id": sid}, self.tenant)
            self.tally.judge("drill_close_session", reply, CLOSED)

    def turn(self, sid: str, history: list[int], new: int) -> list[int] | None:
        """One greedy turn of `new` random tokens, its output kept for the replay; the
        history after it, or None if it did not end normally."""
        tokens = [self.rng.randrange(256) for _ in range(new)]
        body = {
            "input_ids": tokens,
            "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
        }
        reply = call(self.port, "/generate", body, self.tenant)
        self.tally.judge("drill_turn", reply, OK)
        output = self.greedy.record(history + tokens, reply)
        if reply.status != 200 or reply.aborted:
            return None
        return history + tokens + output

    def place(self, sid: str, tier: str) -> str | None:
        """Ask for `sid`'s state in `tier`; where it is once the route answers. The
        operator route names the session by its id, the name scoped to its key's tenant."""
        tenant = None if self.tenant is None else tenant_of(self.tenant)
        body = {"session_id": scoped_session_id(tenant, sid), "tier": tier}
        reply = call(self.port, "/place_session", body, self.operator, timeout=90)
        self.tally.judge("drill_place_session", reply, OK)
        return reply.body.get("tier") if reply.status == 200 and reply.is_dict else None

    def wait_executor(self, old: str | None, timeout: float = 90) -> str | None:
        """The scheduler's executor epoch once it has one other than `old`."""
        deadline = time.monotonic() + timeout
        while True:
            reply: Reply = call(self.port, "/health", timeout=5)
            epoch = reply.body.get("executor") if reply.is_dict else None
            if (epoch and epoch != old) or time.monotonic() > deadline:
                return epoch
            time.sleep(0.5 if reply.outcome == NO_ANSWER else 0.2)
