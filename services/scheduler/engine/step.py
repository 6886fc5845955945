"""A forward step as the scheduler plans it: everything the executor needs, and the
per-step facts (which snapshot goes where, at what length, which working slot holds the
result) that completion must use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.cache.node import CacheNode
from services.scheduler.records.row_plan import RowPlan
from shared.deferred_ops import DeferredOps
from shared.wire import WireRow, step_body

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

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def wire_rows(self) -> list[WireRow]:
        """The rows as the executor receives them."""
        return [
            WireRow(
                r.rid,
                r.tokens,
                r.start,
                r.kv_indices,
                r.mamba_slot,
                r.mamba_out,
                r.snapshot_slot,
                r.snapshot_len,
                r.sample,
                r.params.temperature,
                r.params.top_p,
                r.params.top_k,
                r.params.seed,
                r.future,
                r.owner,
                r.track_owner,
                r.session_owner,
            )
            for r in self.rows
        ]

    def wire_body(
        self, executor_epoch: str, pools: Pools, misroute: MisrouteWrite | None = None
    ) -> dict:
        """The step message's body. Call it right after planning, with no await in
        between: the ledger's event count is then the point the plan was made at, which
        the session store checks every write of the step against. `misroute` is the
        test-only fault hook (misroute.py)."""
        rows = self.wire_rows()
        if misroute is not None:
            misroute.apply(rows)
        return step_body(
            self.step_id,
            self.after,
            executor_epoch,
            rows,
            self.ops.clears,
            self.ops.copies,
            ledger_seq=pools.ledger.events.next_seq,
            page_size=pools.config.page_size,
            op_owners=self.ops.owners,
        )
