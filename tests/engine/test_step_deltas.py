"""Step rows carry KV deltas (allocators/request_rows.py, `delta`): a decoding row's
message is the same size at any context, a row sends its whole context when it starts,
and what the data model's page tables resolve equals the row table at planning (the
Driver checks that for every step of every engine test)."""

from __future__ import annotations

import numpy as np

from services.scheduler.engine.step import StepPlan
from shared.messages.envelope import encode
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver


def decode_step_bytes(context: int) -> tuple[int, list[StepPlan]]:
    """Bytes of a decode step of 2 requests at `context`, and every plan of the run."""
    d = Driver(page_size=4, kv_pages=2048, context=8192)
    reqs = [d.generate((np.arange(context) + i) % VOCAB, max_new=40) for i in range(2)]
    plans: list[StepPlan] = []
    plan_step = d.engine.plan_step

    def planned() -> StepPlan | None:
        plan = plan_step()
        if plan is not None:
            plans.append(plan)
        return plan

    d.engine.plan_step = planned
    d.run()
    for req in reqs:
        assert req.output == reference(list(req.prompt), 40, VOCAB)
    decode = [p for p in plans if all(len(r.tokens) == 1 for r in p.rows) and len(p.rows) == 2]
    return len(encode(decode[-1].message("e", "x", d.pools))), plans


def test_a_decoding_step_is_as_large_at_any_context():
    short, _ = decode_step_bytes(64)
    long, plans = decode_step_bytes(4000)
    assert long <= short + 64  # the positions' numbers grow a few bytes, not the contexts
    first = {}
    for plan in plans:
        for row in plan.rows:
            first.setdefault(row.rid, row.wire)
    assert all(w.kv_from == 0 and len(w.kv_indices) == w.end for w in first.values())
