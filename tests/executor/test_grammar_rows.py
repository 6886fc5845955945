"""Constrained rows in the executor's batches, run in process on the built-in model
(byte vocabulary): an unconstrained row's tokens do not depend on a constrained
neighbour, outputs match their grammars, and a row whose matcher disagrees with the
scheduler's count refuses the step before anything runs."""

from __future__ import annotations

import json
import re

import msgspec
import numpy as np
import pytest
import xgrammar as xgr

from custody.inprocess import InProcess
from services.executor.grammars import Grammars
from services.executor.refusal import BatchRefused
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.messages.grammar import GrammarSpec, ReasoningPrefix, RowGrammar

REGEX = GrammarSpec(kind="regex", source=r"[a-z]{3}-\d{2}")


@pytest.fixture(scope="module")
def runtime() -> InProcess:
    return InProcess(Settings.ephemeral(compile=False))


def run(runtime: InProcess, requests: list[Request]) -> None:
    for r in requests:
        runtime.engine.submit(r)
    runtime.run_until_idle()


def plain(rid: str, seed: int) -> Request:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)
    return Request(rid, np.array([72, 105, 33]), params)


def test_a_constrained_neighbour_changes_no_unconstrained_row(runtime):
    alone = [plain(f"alone{i}", i) for i in range(3)]
    run(runtime, alone)
    mixed = [plain(f"mixed{i}", i) for i in range(3)]
    constrained = [
        Request(
            f"c{i}",
            np.array([72, 105]),
            SamplingParams(max_new_tokens=20, temperature=1.0, seed=9 + i, grammar=REGEX),
        )
        for i in range(2)
    ]
    run(runtime, [mixed[0], constrained[0], mixed[1], constrained[1], mixed[2]])
    assert [r.output for r in mixed] == [r.output for r in alone]
    for r in constrained:
        assert r.finish_reason.type == "stop"
        assert re.fullmatch(REGEX.source, bytes(t for t in r.output if t < 256).decode())


def test_a_matcher_that_took_another_count_refuses_the_step(runtime):
    row = StepRow.of([65], 0, [16], 1, rid="ghost", grammar=RowGrammar(key=REGEX.key, accepted=3))
    with pytest.raises(BatchRefused, match="no matcher"):
        runtime.runner.execute([row], DeferredOps())


def thinking(budget: int) -> ReasoningPrefix:
    return ReasoningPrefix(close="</think>", close_ids=tuple(b"</think>"), budget=budget)


@pytest.mark.parametrize("budget", [0, 6])
def test_reasoning_runs_free_to_its_budget_then_its_end_is_forced_and_the_grammar_holds(
    runtime, budget
):
    """The random model never closes its reasoning itself: the executor forces the end
    once the budget is spent, and the answer after it matches the grammar and stops."""
    spec = msgspec.structs.replace(REGEX, reasoning=thinking(budget))
    requests = [
        Request(
            f"think{budget}-{i}",
            np.array([72, 105]),
            SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, grammar=spec),
        )
        for i in range(3)
    ]
    run(runtime, requests)
    for r in requests:
        reasoning, close, answer = bytes(t for t in r.output if t < 256).partition(b"</think>")
        assert close and r.finish_reason.type == "stop", r.output
        assert len(reasoning) <= budget
        assert re.fullmatch(REGEX.source, answer.decode())


@pytest.mark.parametrize("reasoning", [None, thinking(20)], ids=["plain", "thinking"])
def test_a_retracted_constrained_request_ends_as_it_would_have(runtime, reasoning):
    """A pool too small for four long requests retracts some mid-decode; each re-prefills
    its output, which its new matcher replays (its reasoning budget too), and ends as it
    does with room to spare."""
    spec = GrammarSpec(kind="regex", source=r"[a-z]{60}", reasoning=reasoning)

    def requests(tag: str) -> list[Request]:
        params = SamplingParams(max_new_tokens=100, grammar=spec)
        return [Request(f"{tag}{i}", np.array([65 + i] * 8), params) for i in range(4)]

    roomy = requests("roomy")
    run(runtime, roomy)
    tight = InProcess(Settings.ephemeral(compile=False, kv_pages=12, page_size=16, context_len=160))
    cramped = requests("cramped")
    run(tight, cramped)
    assert tight.engine.retractions > 0
    assert [r.output for r in cramped] == [r.output for r in roomy]
    assert all(r.finish_reason.type == "stop" for r in cramped)


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (b"a", True),
        ("é".encode(), True),
        (b"\xed\x9f\xbf", True),  # U+D7FF, the last code point before the surrogates
        (b"\x01", False),  # a control character JSON forbids unescaped
        (b"\xed\xa0\x80", False),  # U+D800: a surrogate, invalid UTF-8 (three U+FFFD)
        (b"\xed\xbf\xbf", False),  # U+DFFF
    ],
)
@pytest.mark.parametrize("bound", [{}, {"maxLength": 1}])
def test_a_json_string_holds_only_what_strict_json_in_utf8_can(value, valid, bound):
    """xgrammar's own string classes let control characters (bounded strings) and UTF-16
    surrogates (every string) through; a hypothesis run saw `maxLength: 1` answered with
    three replacement characters. custody's grammar refuses both, byte by byte."""
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgr.VocabType.RAW)
    schema = {"type": "object", "properties": {"a": {"type": "string", **bound}}}
    spec = GrammarSpec(kind="json_schema", source=json.dumps(schema | {"required": ["a"]}))
    matcher = xgr.GrammarMatcher(Grammars(info, 1).compile(spec, "test"))
    text = b'{"a": "' + value + b'"}'
    assert all(matcher.accept_token(b) for b in text) is valid
