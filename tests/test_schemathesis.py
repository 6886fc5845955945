"""The live API fuzzed by schemathesis against its own /openapi.json: every route, with
bodies the document allows (positive) and bodies it forbids (negative). Fails on any 5xx,
any reply the document does not describe (status, content type, body, or one event of a
stream), a stream that does not end with `data: [DONE]`, a negative body that is not
refused with a 4xx, a service that restarts, or a violation in the independent ledger.

The stack has a context of 256 tokens and small pools, so every request is cheap: the
schema bounds max_new_tokens below the context, so nothing generates for long.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.services_harness import call, ledger_when_idle, stack_settings, start_stack

EXAMPLES = 20  # per route and mode: some 300 requests in all
BUDGET_SECONDS = 180
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def small_stack(redis_url, redis_client):
    running = start_stack(
        stack_settings(
            redis_url,
            context_len=256,
            kv_pages=128,
            mamba_slots=16,
            max_running_requests=4,
            chunk_size=32,
            max_step_tokens=64,
        )
    )
    yield running
    running.stop()


# the events a named stream (the Responses and Messages APIs') ends with
LAST_EVENTS = {"response.completed", "response.incomplete", "message_stop", "error"}


def stream_ends_with_done(ctx, response, case) -> bool | None:
    """A streamed reply is `data:` events only, each JSON, the last `data: [DONE]`; or
    named events (`event:` then `data:`, each JSON of that `type`), the last a final
    one. schemathesis hangs up after 20 events (the server then aborts the request):
    such a stream must hold no `[DONE]` or final event yet."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    assert blocks, "an empty event stream"
    if blocks[0].startswith("event: "):
        names = []
        if blocks[-1] == "data: [DONE]":  # the Responses API's end, after its final event
            blocks.pop()
        for block in blocks:
            head, data = block.split("\n", 1)
            names.append(head.removeprefix("event: "))
            assert json.loads(data.removeprefix("data: "))["type"] == names[-1], block[:200]
        assert not LAST_EVENTS & set(names[:-1]), names
        assert response.stream_cut_short or names[-1] in LAST_EVENTS, names[-1]
        return True
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks[:3]
    events = [b.removeprefix("data: ") for b in blocks]
    if not response.stream_cut_short:
        assert events.pop() == "[DONE]", f"the stream ends with {events[-1][:200]!r}"
    for event in events:
        json.loads(event)  # "[DONE]" before the end fails here
    return True


def fuzz(operation, mode: GenerationMode, base: str, sent: Counter) -> None:
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the report has a curl line
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=base, timeout=60)
        sent[(operation.path, mode.value, response.status_code)] += 1
        case.validate_response(response, checks=checks, additional_checks=[stream_ends_with_done])

    run()


# The request limits the document states only in part (a batch's size, the streamed
# logprob cap, a session name's shape, a salt's length), each sent as its own case: a
# refusal must be a 4xx the document describes.
LIMITS = {
    "/generate": [
        {"input_ids": [[1]] * 65, "rid": [f"r{i}" for i in range(65)]},
        {
            "input_ids": [1],
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 250},
        },
        {"input_ids": [1], "session_params": {"id": "x\n"}},
        {"input_ids": [1], "session_params": {"id": ".."}},
        {"input_ids": [1], "rid": "r" * 257},
        {"input_ids": [1], "cache_salt": ""},
    ],
    "/open_session": [{"session_id": "x\n"}, {"session_id": "."}, {"session_id": "a~" + "0" * 32}],
    "/v1/completions": [
        {"prompt": "a", "session_id": ".."},
        {"prompt": "a", "cache_salt": "s" * 257},
    ],
}
DEEP = b'{"text": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # past any decoder's depth


def limits_refused(schema, base: str, sent: Counter) -> None:
    by_path = {op.path: op for op in (r.ok() for r in schema.get_all_operations())}
    for path, bodies in LIMITS.items():
        for body in bodies:
            case = by_path[path].Case(body=body, media_type="application/json")
            response = case.call(base_url=base, timeout=60)
            sent[(path, "limits", response.status_code)] += 1
            assert 400 <= response.status_code < 500, (path, body, response.text[:300])
            case.validate_response(response, checks=CHECKS)
    for path in ("/generate", "/v1/completions", "/open_session"):
        deep = urllib.request.Request(f"{base}{path}", DEEP, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(deep, timeout=60)
            raise AssertionError(f"{path} took a body nested 5000 deep")
        except urllib.error.HTTPError as refused:
            assert refused.code == 400 and json.loads(refused.read())["error"], path


def test_the_api_holds_to_its_own_openapi_document(small_stack):
    port = small_stack.settings.port
    base = f"http://127.0.0.1:{port}"
    epoch = call(port, "/health")["executor"]
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11
    sent: Counter = Counter()
    started = time.monotonic()
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.body:  # a route without a body has no invalid input to send
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            assert time.monotonic() - started < BUDGET_SECONDS, dict(sent)
            fuzz(operation, mode, base, sent)
    limits_refused(schema, base, sent)
    print(f"schemathesis: {sum(sent.values())} requests in {time.monotonic() - started:.0f} s")
    assert sum(sent.values()) >= 250
    accepted = {path for (path, mode, status) in sent if mode == "positive" and status == 200}
    assert {"/generate", "/v1/completions", "/v1/chat/completions"} <= accepted
    assert call(port, "/health")["executor"] == epoch, "the executor restarted"
    assert all(child.poll() is None for child in small_stack.children.values())
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        assert 'custody_invariant_check_failures_total{replica="0"} 0.0' in resp.read().decode()
    view = ledger_when_idle(small_stack)
    assert view["violations"] == [] and view["leaked"] == {}
