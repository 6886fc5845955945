"""A forward step as the scheduler plans it: everything the executor needs, and the
per-step facts (which snapshot goes where, at what length, which working slot holds the
result) that completion must use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.cache.node import CacheNode
from services.scheduler.records.row_plan import RowPlan
from services.scheduler.sessions.tier_moves import TierBatch
from shared.deferred_ops import DeferredOps
from shared.messages.forward import Step
from shared.messages.tiers import TierMove

if TYPE_CHECKING:
    from services.scheduler.allocators.pools import Pools
    from services.scheduler.engine.misroute import MisrouteWrite


@dataclass
class StepPlan:
    step_id: int
    rows: list[RowPlan]
    ops: DeferredOps
    after: int | None = None  # the step in flight when this one was planned
    copy_sources: list[CacheNode] = field(default_factory=list)  # locked until the step ran
    tier: TierBatch = field(default_factory=TierBatch)  # state moved between tiers first

    @property
    def moves(self) -> list[TierMove]:
        return [f.move for f in self.tier.flights]

    @property
    def discards(self) -> list[int]:
        return self.tier.discards

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def message(
        self, epoch: str, executor_epoch: str, pools: Pools, misroute: MisrouteWrite | None = None
    ) -> Step:
        """The step message, for scheduler life `epoch`: its rows are the plan's own. Call
        it right after planning, with no await in between: the ledger's event count is
        then the point the plan was made at, which the session store checks every write
        of the step against. `misroute` is the test-only fault hook (misroute.py)."""
        step = Step.of(
            epoch,
            self.step_id,
            executor_epoch,
            [r.wire for r in self.rows],
            self.ops,
            after=self.after,
            ledger_seq=pools.ledger.events.next_seq,
            page_size=pools.config.page_size,
            moves=self.moves,
            discards=self.discards,
        )
        return step if misroute is None else misroute.apply(step)
