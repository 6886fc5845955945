"""Applying a step the executor ran: each row's request takes its computed positions,
its state and snapshot, and the token it sampled; a request that stops ends (endings.py),
and a prefill chunk's snapshot feeds the prefix cache at once."""

from __future__ import annotations

from services.scheduler.engine.drafts import Acceptance
from services.scheduler.engine.endings import Endings
from services.scheduler.engine.in_flight import InFlight
from services.scheduler.engine.queue import RequestQueue
from services.scheduler.engine.step import StepPlan
from services.scheduler.engine.stopping import finish_reason, length_limit
from services.scheduler.records.finish import FinishReason
from services.scheduler.records.request import Request
from services.scheduler.records.row_plan import RowPlan
from services.scheduler.sessions.manager import SessionManager
from shared.messages.forward import StepResult


class Completion:
    def __init__(
        self,
        queue: RequestQueue,
        in_flight: InFlight,
        sessions: SessionManager,
        endings: Endings,
        eos_token_ids: frozenset[int],
        context_len: int,
    ) -> None:
        self.queue, self.in_flight, self.sessions, self.endings = (
            queue,
            in_flight,
            sessions,
            endings,
        )
        self.eos_token_ids, self.context_len = eos_token_ids, context_len
        self.accepted = Acceptance()  # what verify steps kept, for /server_info and metrics

    def apply(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply the executor's result of `plan` (run, not refused); returns the requests
        that ended."""
        self.in_flight.pop_oldest(plan)
        self.sessions.moves.landed(plan.tier, set(result.failed_moves))
        rids = result.rids
        tokens, logprobs = result.per_row()
        sampled = dict(zip(rids, tokens, strict=True))
        logprob_of = dict(zip(rids, logprobs, strict=True))
        top = dict(zip(rids, result.top, strict=True))
        scores = {s.rid: s for s in result.scores}
        grammar_ended = set(result.grammar_ended)
        head_drafts = result.drafts_by_row()
        ended = []
        by_rid = self.queue.by_rid
        for row in plan.rows:
            if row.dropped:
                continue
            wire = row.wire  # its fields read once each: this loop runs for every row
            rid, snapshot = wire.rid, wire.snapshot_slot
            req = by_rid[rid]
            if req.inflight[0] is not row:
                raise RuntimeError(f"{rid}: rows completed out of order")
            req.inflight.pop(0)
            if wire.sample:
                req.head_drafts = head_drafts.get(rid, [])
            if wire.drafts:
                self._verified(req, row, sampled[rid], logprob_of[rid])
                if req.finish_reason is not None:
                    self.endings.finish(req)
                    ended.append(req)
                continue
            req.computed = wire.end
            if len(wire.scored):
                got = scores[rid]
                req.record_scores(wire.scored_from, got.logprobs.tolist(), got.top)
            req.slots.state.commit(wire.mamba_out)
            if snapshot:
                req.slots.track.record(snapshot, wire.snapshot_len)
            start = req.turn_start
            if snapshot and row.prefill and (start is None or start.rollback is None):
                # a chunk's state is reachable at once (scenario P6, docs/scenarios.md): a
                # plain request's, and a session turn's that began with no state of its
                # session (its first), whose prompt other sessions may share (a fleet's
                # system prompt); the session keeps a lock on the path (docs/ownership.md).
                # Before the token: a turn that ends on this row gives its chunk too.
                self.endings.cache_prefix(req)
            if wire.sample:
                token = sampled[rid][0]
                req.record(token, logprob_of[rid][0], top[rid])
                req.finish_reason = finish_reason(req, token, self.eos_token_ids, self.context_len)
                if req.finish_reason is None and rid in grammar_ended:
                    req.finish_reason = FinishReason("stop", matched=token)  # only end is left
            elif wire.end == req.length:  # a prefill-only request, its prompt computed
                req.finish_reason = length_limit(req, self.context_len)
            if req.finish_reason is not None:
                self.endings.finish(req)
                ended.append(req)
        return ended

    def _verified(
        self, req: Request, row: RowPlan, tokens: list[int], logprobs: list[float]
    ) -> None:
        """A verify row ran and gave `tokens` (its accepted drafts and one more): record
        them up to the first that ends the request, then commit exactly the state of the
        positions that count, in one transaction (spec_slots.py), and drop the rest: the
        KV pages past them and a snapshot beyond them."""
        wire = row.wire
        drafts = wire.tokens[1:].tolist()
        if len(tokens) > wire.drafts + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
            raise RuntimeError(f"{req.rid}: verified tokens {tokens} do not follow drafts {drafts}")
        self.accepted.record(wire.drafts, len(tokens) - 1)
        kept = 0
        for token, logprob in zip(tokens, logprobs, strict=True):
            req.record(token, logprob, None)
            kept += 1
            req.finish_reason = finish_reason(req, token, self.eos_token_ids, self.context_len)
            if req.finish_reason is not None:
                break
        # position start + i fed the token before tokens[i]: the first `kept` count
        req.computed = wire.start + kept
        slots = req.slots
        slots.spec.commit(slots.state, wire.mamba_out, kept, wire.drafts)
        self.in_flight.pools.kv.free_tail(slots.row.slot, req.computed, "reject")
        if wire.snapshot_slot and wire.snapshot_len <= req.computed:
            slots.track.record(wire.snapshot_slot, wire.snapshot_len)
        elif wire.snapshot_slot:
            slots.track.cancel(wire.snapshot_slot)
