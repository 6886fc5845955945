"""vLLM's penalties end to end: a penalised, seeded generation gives the same tokens
(and log probabilities) uninterrupted, after a retract and across an executor killed
mid-generation, because no token counts are kept between steps (each penalised row
carries the ids it counts; shared/messages/sampling.py); and the penalties do change
what is generated. Bad ranges are 400s in both APIs; nulls mean defaults."""

from __future__ import annotations

import json

import numpy as np
import pytest

from custody.inprocess import InProcess
from services.scheduler.http.schemas import decode_body, request_schemas
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import InvalidRequest, SamplingParams
from shared.config import Settings
from tests.services_harness import POOLS, kill_executor_during

PROMPT = list(range(40, 70))
PENALISED = {
    "temperature": 0.8,
    "top_k": 40,
    "min_p": 0.02,
    "seed": 11,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.4,
    "presence_penalty": 0.3,
    "ignore_eos": True,
}


def generate(n: int, retract_after: int | None = None, **sampling: object) -> Request:
    """A request run to its end in one process; with `retract_after`, retracted once
    that many tokens are out (it re-prefills prompt and output, then goes on)."""
    local = InProcess(Settings(**POOLS))
    params = SamplingParams(max_new_tokens=n, top_logprobs=3, **sampling)
    req = local.engine.submit(Request("x", np.asarray(PROMPT), params))
    while retract_after is not None and len(req.output) < retract_after:
        local.step()
    if retract_after is not None:
        local.engine.retract(req)
        assert local.engine.retractions == 1 and req.computed == 0
    local.run_until_idle()
    assert len(req.logprobs) == len(req.top_logprobs) == len(req.output) == n
    return req


def test_a_penalised_generation_is_the_same_after_a_retract():
    whole = generate(40, **PENALISED)
    retracted = generate(40, retract_after=17, **PENALISED)
    assert retracted.output == whole.output
    assert np.allclose(retracted.logprobs, whole.logprobs, atol=1e-4)
    assert [ids for ids, _ in retracted.top_logprobs] == [ids for ids, _ in whole.top_logprobs]


def test_penalties_change_the_generation_away_from_repeats():
    plain = generate(60, ignore_eos=True).output  # greedy: the tiny model repeats itself
    penalised = generate(60, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.output != plain
    repeats = lambda out: len(out) - len(set(out))  # noqa: E731
    assert repeats(penalised.output) < repeats(plain)


def test_a_penalised_generation_is_the_same_across_an_executor_restart(stack):
    """The service pipelines (each decode row feeds the token the step before sampled as
    a future token, which the executor counts), and a killed executor's successor
    re-prefills: both must give the tokens of one uninterrupted in-process run."""
    port, n = stack.settings.port, 600
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, **PENALISED}}
    out = kill_executor_during(stack, port, "/generate", body)
    assert out["output_ids"] == generate(n, **PENALISED).output


SCHEMAS = request_schemas(vocab_size=256, context_len=1024)
BAD = [
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.5),
    ("repetition_penalty", 1e999),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -3),
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("top_k", -2),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_ranges_are_400s_naming_the_field_in_both_apis(field, value):
    raw = lambda body: json.dumps(body).replace("Infinity", "1e999").encode()  # noqa: E731
    bodies = [
        (SCHEMAS.generate, {"input_ids": [1], "sampling_params": {field: value}}),
        (SCHEMAS.completions, {"prompt": [1], field: value}),
        (SCHEMAS.chat_completions, {"messages": [{"role": "user", "content": "x"}], field: value}),
    ]
    for schema, body in bodies:
        with pytest.raises(InvalidRequest, match=field):
            decode_body(raw(body), schema)
    with pytest.raises(InvalidRequest, match="not valid JSON"):  # JSON has no NaN
        decode_body(b'{"prompt": [1], "%s": NaN}' % field.encode(), SCHEMAS.completions)


@pytest.mark.parametrize(
    "params",
    [{"min_p": float("nan")}, {"repetition_penalty": float("inf")}, {"presence_penalty": -2.01}],
)
def test_the_engine_refuses_what_no_schema_let_through(params):
    with pytest.raises(InvalidRequest):
        SamplingParams(**params).validate(256)


def test_nulls_mean_defaults_and_values_reach_the_sampling_parameters():
    nulls = dict.fromkeys(["top_k", "min_p", "stop_token_ids", "ignore_eos"], None)
    nulls |= dict.fromkeys(["repetition_penalty", "frequency_penalty", "presence_penalty"], None)
    body = decode_body(json.dumps({"prompt": [1], **nulls}).encode(), SCHEMAS.completions)
    assert body.engine_params(4) == SamplingParams(max_new_tokens=4, temperature=1.0)
    given = {"top_k": 0, "min_p": 0.1, "stop_token_ids": [7], "ignore_eos": True}
    given |= {"repetition_penalty": 1.2, "frequency_penalty": -0.5, "presence_penalty": 2}
    chat = {"messages": [{"role": "user", "content": "x"}], **given}
    params = decode_body(json.dumps(chat).encode(), SCHEMAS.chat_completions).engine_params(4)
    expected = given | {"top_k": -1, "stop_token_ids": (7,)}  # vLLM's 0: off
    assert {name: getattr(params, name) for name in given} == expected
    sglang = {"input_ids": [1], "sampling_params": given | {"top_k": 3}}
    sampling = decode_body(json.dumps(sglang).encode(), SCHEMAS.generate).sampling()
    assert sampling.engine_params(4).presence_penalty == 2 and sampling.engine_params(4).top_k == 3
