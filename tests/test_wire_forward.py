"""The forward path's typed wire: a step and a result survive the round trip; every
malformed message is refused with its reason; the scheduler sends its plan's own rows
(the misroute fault only on the wire); and the scheduler, as the results' consumer,
counts a malformed result, passes over it and completes the step with the next, unless
what can be read of it says it answers the step in flight: then that step's outcome is
unknown and the device state is treated as lost, never waited for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from services.scheduler.engine.misroute import MisrouteWrite
from services.scheduler.records.request import Status
from shared import streams
from shared.deferred_ops import DeferredOps
from shared.messages.envelope import WireError, encode
from shared.messages.forward import (
    Step,
    StepResult,
    StepRow,
    decode_result,
    decode_step,
    decode_step_head,
)
from shared.messages.grammar import RowGrammar
from shared.messages.sampling import Penalties, RowScores
from tests.engine.driver import Driver
from tests.test_scheduler_loop import plain, started


def a_step(edit: Callable[[list[StepRow]], None] = lambda rows: None) -> Step:
    """A step of two rows; `edit` changes them before they become its columns."""
    ops = DeferredOps()
    ops.clear(3, owner=7)
    ops.copy(1, 4, owner=9)
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**64 - 1}
    owners = {"owner": 11, "track_owner": 12, "session_owner": 13}
    rows = [
        StepRow.of([5, 6], 2, [8, 9, 10, 11], 1, rid="a", mamba_out=2, **sampling, **owners),
        StepRow.of([-1], 3, [16, 17, 18, 19], 6, rid="b", future=True, sample=False),
    ]
    rows[0].snapshot_slot, rows[0].snapshot_len = 5, 4
    edit(rows)
    return Step.of("sched", 4, "exec", rows, ops, after=3, ledger_seq=21, page_size=4)


def test_a_step_and_a_result_survive_the_round_trip():
    step = a_step()
    back = decode_step(encode(step))
    assert back == step and back.step == 4 and back.after == 3
    assert back.rows[0].tokens.tolist() == [5, 6] and back.rows[0].end == 4
    assert back.rows[0].kv_indices.tolist() == [8, 9, 10, 11] and back.rows[1].future
    assert back.clears.tolist() == [3] and back.copies.tolist() == [[1, 4]]
    assert (back.clear_owners.tolist(), back.copy_owners.tolist()) == ([7], [9])
    assert back.ops() == DeferredOps([3], [(1, 4)])
    assert decode_step_head(encode(step)).executor_epoch == "exec"
    result = StepResult.of("exec", 4, "sched", ["a"], [17], [-0.25])
    back = decode_result(encode(result))
    assert back == result and (back.step, back.executor_epoch) == (4, "exec")
    assert back.tokens.tolist() == [17] and back.logprobs.tolist() == [-0.25]
    refused = StepResult.of("exec", 5, "sched", ["a"], error="refused", ops_ran=True)
    assert decode_result(encode(refused)) == refused


def test_penalties_and_top_logprobs_survive_the_round_trip():
    def penalise(rows: list[StepRow]) -> None:
        rows[1].penalties = Penalties.of(1.3, 0.5, -0.5, [7, 3, 7, 9], [4, 4, 2])
        rows[1].top_logprobs, rows[1].min_p = 3, 0.05

    back = decode_step(encode(a_step(penalise))).rows[1]
    assert back.penalties.prompt_ids.tolist() == [3, 7, 9]  # distinct, for repetition
    assert back.penalties.output_ids.tolist() == [4, 4, 2]
    assert (back.top_logprobs, back.min_p, back.penalties.presence) == (3, 0.05, -0.5)
    assert Penalties.of(1.0, 0.5, 0, [7, 3], []).prompt_ids.tolist() == []  # not needed
    top = [([5, 1], [-0.5, -1.25]), ([], []), ([2], [-3.0])]
    result = StepResult.of("exec", 4, "sched", ["a", "b", "c"], [5, 6, 2], [-0.5] * 3, top=top)
    back = decode_result(encode(result))
    assert [(i.tolist(), lp.tolist()) for i, lp in back.top] == top
    plain = decode_result(encode(StepResult.of("exec", 4, "sched", ["a"], [5], [-0.5])))
    assert plain.top_counts.tobytes() == b"" and plain.top == [((), ())]


def test_input_scores_survive_the_round_trip():
    """A row scoring positions of its input, and the result's scores of it."""

    def score(rows: list[StepRow]) -> None:
        rows[0].scored_from, rows[0].scored = rows[0].start, np.array([6], dtype="<i4")

    row = a_step(score).rows[0]
    back = decode_step(encode(a_step(score))).rows[0]
    assert (back.scored_from, back.scored.tolist()) == (row.start, row.tokens[1:].tolist())
    top = [([5, 1], [-0.5, -1.25]), ([2], [-3.0])]
    scores = [RowScores.of("a", [-0.5, -3.0], top)]
    result = StepResult.of("exec", 4, "sched", [], scores=scores)
    got = decode_result(encode(result)).scores[0]
    assert got.logprobs.tolist() == [-0.5, -3.0]
    assert [(i.tolist(), lp.tolist()) for i, lp in got.top] == top


def raw_of(message: msgspec.Struct) -> dict:
    return msgspec.msgpack.decode(encode(message))


def broken_steps() -> dict[str, tuple[dict, str]]:
    """Each a step with one fault, and what its refusal names."""
    cases: dict[str, tuple[dict, str]] = {}

    def case(name: str, reason: str, path: tuple, value: object) -> None:
        raw = raw_of(a_step())
        *inner, last = path
        target = raw
        for key in inner:
            target = target[key]
        target[last] = value
        cases[name] = (raw, reason)

    case("wrong version", "$.v", ("v",), 1)
    case("unknown kind", "$.kind", ("kind",), "bogus")
    case("a result's kind", "$.kind", ("kind",), "result")
    case("wrong type", "Expected `int`, got `str`", ("seq",), "4")
    case("rows not columns", "Expected `object`", ("rows",), [1])
    case("columns of other lengths", "rows: 1 row for 2 rows", ("rows", "row"), b"\0" * 4)
    case("truncated tokens", "packed <i4 array of 7 bytes", ("rows", "tokens"), b"\0" * 7)
    case(
        "tokens against counts",
        "rows: 2 tokens where the counts say 3",
        ("rows", "tokens"),
        b"\0" * 8,
    )
    case("truncated owners", "packed <i8 array of 4 bytes", ("clear_owners",), b"\0" * 4)
    case(
        "kv against tokens",
        "KV indices from position 0 for 2 tokens from 2 (3 in the step)",
        ("rows", "kv"),
        b"\0" * 12,
    )
    starts = (np.array([-1, 3]).astype("<i8")).tobytes()
    case("negative start", "from position 0 for 2 tokens from -1", ("rows", "start"), starts)
    deltas = np.array([3, 0]).astype("<i8").tobytes()
    case(
        "a delta past the start", "from position 3 for 2 tokens from 2", ("rows", "kv_from"), deltas
    )
    cases["a delta past the start"][0]["rows"]["row"] = np.array([1, 0]).astype("<i4").tobytes()
    deltas = np.array([2, 0]).astype("<i8").tobytes()
    case("a delta of no row", "KV indices from position 2 for 2", ("rows", "kv_from"), deltas)
    case("odd copies", "copies: 3 slots", ("copies",), b"\0" * 12)
    case("owners against clears", "2 owners for 1 clears", ("clear_owners",), b"\0" * 16)
    case("owners against copies", "0 owners for 1 copies", ("copy_owners",), b"")
    cut = {0: {"output": b"\0" * 5}}
    case("truncated penalised ids", "packed <i4 array of 5", ("rows", "penalties"), cut)
    counts = np.array([3, 0]).astype("<i4").tobytes()
    case(
        "scored past the row",
        "3 scored positions from 0 outside 2..3",
        ("rows", "scored_counts"),
        counts,
    )
    cases["scored past the row"][0]["rows"]["scored"] = b"\0" * 12
    grammar = {1: {"key": "k", "accepted": 0}}
    case(
        "a grammar on no sampling row",
        "a grammar on a row that samples",
        ("rows", "grammars"),
        grammar,
    )
    return cases


@pytest.mark.parametrize("name", list(broken_steps()))
def test_a_malformed_step_is_refused_with_its_reason(name):
    raw, reason = broken_steps()[name]
    with pytest.raises(WireError, match="malformed message") as refused:
        decode_step(msgspec.msgpack.encode(raw))
    assert reason in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("tokens", b"\0" * 8, "2 tokens and 1 log probabilities for 1 rows"),
        ("logprobs", b"\0" * 3, "packed <f4 array of 3 bytes"),
        ("rids", "a", "Expected `array`, got `str`"),
        ("v", 3, "$.v"),
        ("top_counts", b"\2\0\0\0" * 2, "top counts [2, 2] for 1 rows"),
        ("top_ids", b"\0" * 4, "1 top ids and 2 logprobs for counts summing to 2"),
        ("top_logprobs", b"\0" * 12, "2 top ids and 3 logprobs"),
    ],
)
def test_a_malformed_result_is_refused_with_its_reason(field, value, reason):
    top = [([3, 4], [-0.5, -0.75])]
    raw = raw_of(StepResult.of("exec", 4, "sched", ["a"], [17], [-0.25], top=top))
    raw[field] = value
    with pytest.raises(WireError, match="malformed message") as refused:
        decode_result(msgspec.msgpack.encode(raw))
    assert reason in str(refused.value)


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"not msgpack at all", encode(a_step())[:-3]])
def test_bytes_that_are_no_message_are_refused(raw):
    for decode in (decode_step, decode_step_head, decode_result):
        with pytest.raises(WireError, match="malformed message"):
            decode(raw)


def test_the_step_carries_the_plans_own_rows_and_misroutes_only_the_wire():
    d = Driver(page_size=4)
    d.generate(list(range(1, 10)), max_new=3)
    plan = d.engine.plan_step()
    (row,) = plan.rows
    step = plan.message("sched", "exec", d.pools)
    assert step.rows[0] is row.wire and step.ledger_seq == d.pools.ledger.events.next_seq
    misrouted = plan.message("sched", "exec", d.pools, MisrouteWrite(d.pools.mamba, armed=True))
    free = int(np.flatnonzero(d.pools.mamba.owner_view == 0)[-1])
    assert misrouted.rows[0].mamba_out == free != row.mamba_out
    assert plan.rows[0].wire is row.wire and decode_step(encode(misrouted)) == misrouted


def one_step_in_flight(redis_url: str) -> tuple:
    """A scheduler on real Redis with request "r1" published in one step, awaiting its
    result: (event loop, scheduler, request, plan)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    service = started(redis_url)
    req = plain("r1")
    service.engine.submit(req)
    return loop, service, req, loop.run_until_complete(service.loop.publish_next())


def test_the_scheduler_counts_malformed_results_and_completes_the_step(redis_url, redis_client):
    loop, service, req, plan = one_step_in_flight(redis_url)
    link = service.link
    mine = StepResult.of(link.epoch, plan.step_id, link.scheduler_epoch, ["r1"], [5], [-0.5])
    other = StepResult.of(link.epoch, plan.step_id + 7, link.scheduler_epoch, ["r1"], [5], [0.0])
    no_row = raw_of(other) | {"rids": []}  # a token for no row, answering another step
    for message in (b"garbage", encode(a_step()), msgspec.msgpack.encode(no_row), encode(mine)):
        redis_client.xadd(streams.SINGLE.results, {"m": message})
    loop.run_until_complete(service.loop.complete_oldest())
    assert req.output == [5] and service.link.malformed == 3
    exposition = loop.run_until_complete(service.loop.metrics.render(service.redis)).decode()
    assert 'custody_malformed_messages_total{stream="results",replica="0"} 3.0' in exposition
    loop.close()


def test_a_malformed_answer_to_the_step_in_flight_takes_the_device_lost_path(
    redis_url, redis_client
):
    """The executor answered the step, but not readably: whether it ran is unknown, so its
    requests are re-queued (as suspects) and their slots returned, at once."""
    loop, service, req, plan = one_step_in_flight(redis_url)
    link = service.link
    mine = StepResult.of(link.epoch, plan.step_id, link.scheduler_epoch, ["r1"], [5], [-0.5])
    redis_client.xadd(
        streams.SINGLE.results, {"m": msgspec.msgpack.encode(raw_of(mine) | {"rids": []})}
    )
    loop.run_until_complete(service.loop.complete_oldest())
    assert link.malformed == 1 and link.losses == 1 and link.epoch == "executor-under-test"
    assert req.status is Status.WAITING and req.output == [] and not service.engine.in_flight
    assert service.engine.check().ok
    loop.close()


def test_rows_of_every_shape_come_back_from_their_columns_as_they_were():
    """Deltas and whole contexts, seeds and none (the largest one too), penalties, a
    grammar and input scores on some rows, empty rows: each row as it was sent."""
    rng = np.random.default_rng(7)
    rows = []
    for i in range(60):
        n, start = int(rng.integers(0, 5)), int(rng.integers(0, 40))
        kv_from = 0 if i % 3 == 0 else int(rng.integers(0, start + 1))
        scored = rng.integers(0, 99, int(rng.integers(0, n + 1))) if i % 4 == 0 else []
        rows.append(
            StepRow.of(
                rng.integers(0, 99, n),
                start,
                rng.integers(1, 999, start + n - kv_from),
                i + 1,
                rid=f"r{i}",
                kv_from=kv_from,
                row=i + 1,
                mamba_out=i + 100,
                sample=i % 5 != 0,
                seed=None if i % 2 else [0, 2**64 - 1, 12345][i % 3],
                temperature=float(rng.random()),
                top_k=int(rng.integers(-1, 50)),
                scored_from=start,
                scored=scored,
                penalties=Penalties.of(1.2, 0.1, 0.0, [3, 4], [5]) if i % 7 == 0 else None,
                grammar=RowGrammar(key="g", accepted=2) if i % 5 == 1 else None,
                owner=i + 1000,
                future=bool(i % 2),
            )
        )
    step = Step.of("sched", 9, "exec", rows, DeferredOps())
    back = decode_step(encode(step))
    assert back.rows == rows and back.columns == step.columns
    assert back.rows is not step.rows and step.rows is rows  # the planner's own, unbuilt


def test_a_row_whose_slot_fits_no_wire_column_is_refused_at_encoding_not_wrapped():
    """numpy narrows an array by wrapping it round: the columns check instead."""
    row = StepRow.of([1], 0, [5], 2**31, rid="a")
    with pytest.raises(OverflowError, match="does not fit int32"):
        Step.of("sched", 1, "exec", [row], DeferredOps())


def test_a_step_of_no_rows_travels():
    """A step may only move state between tiers: no rows, every column empty."""
    step = Step.of("sched", 2, "exec", [], DeferredOps([3]))
    back = decode_step(encode(step))
    assert back == step and back.rows == [] and back.columns.rids == []
