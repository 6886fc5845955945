"""Which step the executor ran last and what it sampled.

A pipelined scheduler plans step N+1 while step N runs: N+1's rows read the state N writes
and feed, as future tokens, what N samples. So a step planned on top of another (its
`after`) may run only right after that step ran, and its future tokens are filled in from
that step's samples. A refused step breaks the chain: everything planned on top of it is
refused too, and never runs against state that step did not write.
"""

from __future__ import annotations

from services.executor.refusal import BatchRefused
from shared.messages.forward import StepRow


class StepChain:
    def __init__(self) -> None:
        self.last: tuple[str, int] | None = None  # (scheduler epoch, step) last run
        self.sampled: dict[str, int] = {}  # rid -> token, by that step

    def resolve(self, scheduler: str, after: int | None, rows: list[StepRow]) -> None:
        """Check that the step follows the one it was planned on and fill in its future
        tokens; BatchRefused otherwise."""
        if after is not None and self.last != (scheduler, after):
            ran = "nothing" if self.last is None else f"step {self.last[1]}"
            raise BatchRefused(f"planned on top of step {after}, but the last step run is {ran}")
        for row in rows:
            if row.future:
                token = self.sampled.get(row.rid)
                if token is None:
                    raise BatchRefused(f"row {row.rid}: step {after} sampled no token for it")
                row.fill_future(token)

    def ran(self, scheduler: str, step: int, rids: list[str], tokens: list[int]) -> None:
        self.last = (scheduler, step)
        self.sampled = dict(zip(rids, tokens, strict=True))

    def broken(self) -> None:
        """A step was refused: nothing may build on what ran before it."""
        self.last, self.sampled = None, {}
