"""The HTTP API over real HTTP against the real services on the test Redis: every
endpoint, server-sent events, the official `openai` client, 200+ bad inputs, API keys,
and the metrics against the independent ledger."""

from __future__ import annotations

import itertools
import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from services.scheduler.http.openai_replies import Reply
from services.scheduler.http.routes import KEPT_BECAUSE
from services.scheduler.records.finish import FinishReason
from shared.config import SECRET_SETTINGS, Settings
from tests.services_harness import (
    POOLS,
    assert_clean,
    call,
    ledger_when_idle,
    one_shot,
    stack_settings,
    start_stack,
)


def raw_call(
    port: int, path: str, data: bytes | None, headers: dict | None = None, method: str = "POST"
) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def sse_events(port: int, path: str, body: dict) -> list:
    status, raw = raw_call(port, path, json.dumps(body).encode())
    assert status == 200
    events = [
        line[len("data: ") :] for line in raw.decode().split("\n") if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_every_endpoint(stack):
    port = stack.settings.port
    assert call(port, "/health")["status"] == "ok"
    info = call(port, "/get_model_info")
    assert (
        info["context_length"] == POOLS["context_len"] and info["page_size"] == POOLS["page_size"]
    )
    server = call(port, "/get_server_info")
    assert server == call(port, "/server_info")
    assert server["context_len"] == POOLS["context_len"] and server["version"]
    state = server["internal_states"][0]
    assert (state["requests"], state["queued_requests"]) == (0, 0)
    assert state["memory_usage"]["token_capacity"] == POOLS["kv_pages"] * POOLS["page_size"]
    assert not SECRET_SETTINGS & set(server)
    assert call(port, "/v1/models")["data"][0]["root"] == "custody"
    assert call(port, "/reset_prefix_cache", {})["flushed"] is True
    sid = call(port, "/open_session", {"session_id": "api"})
    first = call(
        port,
        "/generate",
        {
            "text": "Hi there.",
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            "session_params": {"id": sid},
        },
    )
    assert first["meta_info"]["cached_tokens"] == 0 and len(first["output_ids"]) == 5
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    events = sse_events(
        port,
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "stream": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "session_params": {"id": sid},
        },
    )
    assert (
        len(events) >= 2
        and events[-1]["output_ids"][: len(events[0]["output_ids"])] == events[0]["output_ids"]
    )
    assert events[-1]["meta_info"]["cached_tokens"] == len("Hi there.") + 5 - 1
    plain = call(
        port,
        "/generate",
        {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert plain["output_ids"] == one_shot([9, 8, 7], 3)
    assert call(port, "/abort_request", {"rid": "nothing-running"}) is True
    assert call(port, "/abort_request", {"abort_all": True}) is True
    assert call(port, "/flush_cache", {})["flushed"] is True
    assert call(port, "/close_session", {"session_id": sid}) is True
    status, metrics = raw_call(port, "/metrics", None, method="GET")
    assert status == 200 and b"custody_pool_capacity" in metrics
    view = ledger_when_idle(stack)
    assert view["violations"] == [] and view["leaked"] == {}


def test_a_prefill_only_request_caches_its_prompt_and_a_turn_appends_its_input(stack):
    """max_new_tokens 0 (SGLang's prefill-only request, which its frontend sends to warm
    a prefix): the prompt is computed and cached, nothing is generated; on a session it
    is a turn that appends its input, and the next turn resumes from there."""
    port = stack.settings.port
    assert call(port, "/flush_cache", {})["flushed"] is True
    prompt = list(range(3, 83))
    warm = call(port, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert warm["output_ids"] == [] and warm["text"] == ""
    assert warm["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert warm["meta_info"]["completion_tokens"] == 0
    body = {
        "input_ids": [*prompt, 9, 9],
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
    }
    again = call(port, "/generate", body)
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - POOLS["page_size"]
    assert again["output_ids"] == one_shot([*prompt, 9, 9], 4)
    streamed = sse_events(
        port,
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 0}, "stream": True},
    )
    assert (
        streamed[-1]["output_ids"] == []
        and streamed[-1]["meta_info"]["finish_reason"]["length"] == 0
    )
    sid = call(port, "/open_session", {})
    turn = {
        "input_ids": [7] * 30,
        "sampling_params": {"max_new_tokens": 0},
        "session_params": {"id": sid},
    }
    assert call(port, "/generate", turn)["output_ids"] == []
    turn |= {"input_ids": [8] * 5, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    second = call(port, "/generate", turn)
    assert second["meta_info"]["prompt_tokens"] == 35 and second["meta_info"]["cached_tokens"] == 30
    assert second["output_ids"] == one_shot([7] * 30 + [8] * 5, 4)
    call(port, "/close_session", {"session_id": sid})
    assert_clean(stack)


def test_the_tokenizer_routes_tokenize_as_the_server_does(stack):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-eval's remote tokenizer
    uses them: it learns the EOS id by encoding the EOS string, and renders chats with the
    template it is given."""
    port = stack.settings.port
    info = call(port, "/tokenizer_info")
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"
    assert (
        info["model_max_length"] == POOLS["context_len"]
        and "<|assistant|>" in info["chat_template"]
    )
    eos = call(port, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos == {
        "count": 1,
        "max_model_len": POOLS["context_len"],
        "tokens": [257],
        "token_strs": None,
    }
    text = "héllo <|eos|>!"
    tokens = call(port, "/tokenize", {"prompt": text})["tokens"]
    assert tokens == [*"héllo ".encode(), 257, ord("!")]
    assert call(port, "/detokenize", {"tokens": tokens}) == {"prompt": "héllo !"}
    chat = call(port, "/tokenize", {"messages": [{"role": "user", "content": "hi <|eos|>"}]})
    assert (
        bytes(chat["tokens"]).decode() == "<|user|>\nhi <|eos|>\n<|assistant|>\n"
    )  # content: text
    for bad in (
        {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        {"prompt": "x", "return_token_strs": True},
        {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            call(port, "/tokenize", bad)
        assert refused.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as refused:
        call(port, "/detokenize", {"tokens": [258]})
    assert refused.value.code == 400
    files = call(port, "/get_model_info")["tokenizer_path"]
    assert (Path(files) / "tokenizer.json").exists()


def test_the_cache_is_not_flushed_while_requests_run(stack):
    """As SGLang: a 400, and nothing flushed; GET works as POST does."""
    port = stack.settings.port
    long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: call(port, "/generate", long | {"rid": "long"}))
    worker.start()
    deadline = time.monotonic() + 30
    while 'custody_requests_running{replica="0"} 1.0' not in scrape(port):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, raw = raw_call(port, "/flush_cache", b"{}")
    assert code == 400 and json.loads(raw)["error"]["type"] == "cache_busy"
    assert call(port, "/abort_request", {"rid": "long"}) is True
    worker.join(timeout=60)
    code, raw = raw_call(port, "/flush_cache", None, method="GET")
    assert code == 200 and json.loads(raw) == {
        "flushed": True,
        "kv_pages_kept": 0,
        "mamba_slots_kept": 0,
        "kept_because": KEPT_BECAUSE,
    }


def test_the_served_model_is_named_listed_and_checked(stack):
    port = stack.settings.port
    (card,) = call(port, "/v1/models")["data"]
    assert card["id"] == "custody" and card["max_model_len"] == stack.settings.context_len
    body = {"prompt": "Once", "max_tokens": 2}
    assert call(port, "/v1/completions", body)["model"] == "custody"  # absent: the served one
    code, raw = raw_call(port, "/v1/completions", json.dumps(body | {"model": "gpt-4o"}).encode())
    assert code == 404 and json.loads(raw)["error"]["type"] == "model_not_found"
    chat = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    code, raw = raw_call(port, "/v1/chat/completions", json.dumps(chat).encode())
    assert code == 404 and json.loads(raw)["error"]["type"] == "model_not_found"
    assert Settings(model=Path("/ckpt/nemotron-h-8b")).model_name == "nemotron-h-8b"
    assert Settings(served_model_name="mine").model_name == "mine"


def test_openai_client_completions_and_chat(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["custody"]
    done = client.completions.create(
        model="custody", prompt="Once upon", max_tokens=4, temperature=0
    )
    assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(
        model="custody", prompt="Once upon", max_tokens=4, temperature=0, stream=True
    )
    assert sum(1 for _ in streamed) >= 1
    call(stack.settings.port, "/open_session", {"session_id": "agent"})
    messages = [{"role": "user", "content": "Plan a trip."}]
    reply = client.chat.completions.create(
        model="custody",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"session_id": "agent"},
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Shorter."},
    ]
    again = client.chat.completions.create(
        model="custody",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"session_id": "agent"},
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the agent loop kept its cache
    chunks = list(
        client.chat.completions.create(
            model="custody",
            messages=[{"role": "user", "content": "Stream?"}],
            max_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    call(stack.settings.port, "/close_session", {"session_id": "agent"})
    view = ledger_when_idle(stack)
    assert view["violations"] == [] and view["leaked"] == {}


def bad_inputs() -> list[tuple[str, bytes]]:
    """Hand-picked and generated: malformed bodies, wrong types, unknown values, absurd
    limits, over-long prompts, unknown sessions, forbidden session parameters."""
    hand = [
        ("/generate", b""),
        ("/generate", b"{"),
        ("/generate", b"[]"),
        ("/generate", b"null"),
        ("/generate", b"\xff\xfe"),
        ("/generate", json.dumps({}).encode()),
        ("/generate", json.dumps({"text": 5}).encode()),
        ("/generate", json.dumps({"input_ids": "abc"}).encode()),
        ("/generate", json.dumps({"input_ids": [1, "2"]}).encode()),
        ("/generate", json.dumps({"input_ids": [1, True]}).encode()),
        ("/generate", json.dumps({"input_ids": []}).encode()),
        ("/generate", json.dumps({"input_ids": [-1]}).encode()),
        ("/generate", json.dumps({"input_ids": [10**9]}).encode()),
        ("/generate", json.dumps({"input_ids": [1] * 5000}).encode()),
        ("/generate", json.dumps({"text": "x" * 5000}).encode()),
        ("/generate", json.dumps({"text": "x", "sampling_params": []}).encode()),
        ("/generate", json.dumps({"text": "x", "sampling_params": {"top_k": "k"}}).encode()),
        ("/generate", json.dumps({"text": "x", "session_params": {"id": "nope"}}).encode()),
        ("/generate", json.dumps({"text": "x", "session_params": 3}).encode()),
        ("/open_session", b"{}x"),
        ("/open_session", json.dumps({"session_id": ""}).encode()),
        ("/open_session", json.dumps({"session_id": "a b"}).encode()),
        ("/open_session", json.dumps({"session_id": 7}).encode()),
        ("/open_session", json.dumps({"timeout": -1}).encode()),
        ("/open_session", json.dumps({"timeout": "soon"}).encode()),
        ("/close_session", json.dumps({"session_id": "never-opened"}).encode()),
        ("/close_session", json.dumps({"session_id": None}).encode()),
        ("/close_session", b"not json"),
        ("/abort_request", b"[1]"),
        ("/v1/completions", json.dumps({"prompt": 3}).encode()),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -5}).encode()),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 17}).encode()),
        ("/v1/completions", json.dumps({"prompt": "x", "stop": 5}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
        ),
        ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode()),
        ("/generate", b"x" * (9 * 1024 * 1024)),  # over the body limit: 413
    ]
    rng = random.Random(7)
    fields = {
        "max_new_tokens": [-1, 10**9, 1.5, "5", True, [], {}],
        "temperature": [-1, 101, "hot", None, [], float("nan")],
        "top_p": [0, -0.5, 1.5, "all", []],
        "top_k": [0, -2, 10**6, 2.5, "k"],
        "seed": ["s", 1.5, [], {}],
        "stop_token_ids": [[-1], [2**31], "x", [1.5], 5],
        "ignore_eos": ["yes", 1, [], None],
    }
    generated = []
    for key, values in itertools.cycle(fields.items()):
        if len(generated) >= 180:
            break
        value = rng.choice(values)
        body = {
            "input_ids": [rng.randrange(256) for _ in range(rng.randint(1, 6))],
            "sampling_params": {"max_new_tokens": 2, key: value},
        }
        if rng.random() < 0.3:
            body["session_params"] = rng.choice(
                [
                    {"id": "bad-session"},
                    {"id": 5},
                    {"id": "s-ok", "offset": 1},
                    {"id": "s-ok", "replace": True},
                    {"id": "s-ok", "drop_previous_output": True},
                ]
            )
        data = json.dumps(body, allow_nan=True).encode()
        if (key == "max_new_tokens" and value == 10**9) or (key == "ignore_eos" and value is None):
            continue
        generated.append(("/generate", data))
    return hand + generated


def test_200_bad_inputs_get_4xx_and_change_nothing(stack):
    port = stack.settings.port
    call(port, "/open_session", {"session_id": "s-ok", "streaming": True})  # never branches
    cases = bad_inputs()
    assert len(cases) >= 200
    for path, data in cases:
        status, body = raw_call(port, path, data, {"Content-Type": "application/json"})
        assert 400 <= status < 500, (path, data[:120], status, body[:200])
        assert "error" in json.loads(body) and "message" in json.loads(body)["error"]
    assert call(port, "/health")["executor"]
    call(port, "/close_session", {"session_id": "s-ok"})
    assert_clean(stack)  # the prefix cache emptied first


def scrape(port: int) -> str:
    return raw_call(port, "/metrics", None, method="GET")[1].decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of `name` with exactly these labels and the stack's replica, "0"."""
    want = labels | {"replica": "0"}
    for found, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', found)) == want:
            return float(value)
    raise AssertionError(f"no sample {name} {want}")


def caught_up(stack) -> tuple[dict, str]:
    """The store's ledger and the scheduler's metrics once the store has applied what the
    scheduler shipped: the store replays the stream behind the scheduler, so a view read
    too early is an earlier state (after 10 s, whatever they say, for the asserts)."""
    deadline = time.monotonic() + 10
    while True:
        view, text = call(stack.settings.store_port, "/ledger"), scrape(stack.settings.port)
        free = {pool: sample(text, "custody_pool_free", pool=pool) for pool in view["counts"]}
        if all(free[p] == c["free"] for p, c in view["counts"].items()):
            return view, text
        if time.monotonic() > deadline:
            return view, text
        time.sleep(0.2)


def test_metrics_match_the_ledger(stack):
    port = stack.settings.port
    call(port, "/open_session", {"session_id": "m"})
    call(
        port,
        "/generate",
        {
            "input_ids": [4, 5, 6],
            # more tokens than steps in flight: some step is published as one completes
            "sampling_params": {"max_new_tokens": 8},
            "session_params": {"id": "m"},
        },
    )
    for phase in ("open", "closed"):
        if phase == "closed":
            call(port, "/close_session", {"session_id": "m"})
        view, text = caught_up(stack)
        for pool, counts in view["counts"].items():
            assert sample(text, "custody_pool_free", pool=pool) == counts["free"], (phase, pool)
            assert sample(text, "custody_pool_capacity", pool=pool) == sum(counts.values())
            for kind in ("request", "session", "cache", "track"):
                held = sample(text, "custody_pool_held", owner_kind=kind, pool=pool)
                assert held == counts[kind], (phase, pool, kind)
        assert sample(text, "custody_sessions_open") == (1 if phase == "open" else 0)
        assert sample(text, "custody_invariant_check_failures_total") == 0
        assert sample(text, "custody_step_turnaround_seconds_count") > 0  # steps pipelined
        store = scrape(stack.settings.store_port)
        for pool in view["counts"]:
            assert sample(store, "custody_ledger_leaked_slots", pool=pool) == 0
        for kind in ("double_free", "not_owner", "leak", "count_mismatch", "gap"):
            assert sample(store, "custody_ledger_violations", kind=kind) == 0
        executor = scrape(stack.settings.executor_metrics_port)
        assert sample(executor, "custody_executor_steps_total", outcome="ok") > 0
        assert sample(executor, "custody_forward_seconds_count") > 0


def scrape_until(port: int, ready: Callable[[str], bool]) -> str:
    """The first scrape `ready` accepts: the loop publishes steps as others complete, so
    what a request held goes a step or two after its reply."""
    deadline = time.monotonic() + 30
    while not ready(text := scrape(port)):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return text


def test_kv_utilization_counts_what_requests_hold_not_what_the_cache_could_free(stack):
    """The MSP gauge a stock endpoint picker balances on: 0 on an idle replica, above 0
    while a request holds pages and slots, 0 again once requests end though their
    prefixes stay cached, since the cache gives them up for the next request."""
    port = stack.settings.port
    assert sample(scrape(port), "custody_kv_utilization") == 0
    prompt = list(range(4, 40))
    call(port, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
    params = {"max_new_tokens": 900, "ignore_eos": True}  # within the context
    long = {"input_ids": [*prompt, 41, 42], "sampling_params": params, "rid": "long"}
    worker = threading.Thread(target=lambda: call(port, "/generate", long))
    worker.start()
    busy = scrape_until(port, lambda text: sample(text, "custody_requests_running") == 1)
    assert 0 < sample(busy, "custody_kv_utilization") <= 1
    assert call(port, "/abort_request", {"rid": "long"}) is True
    worker.join(timeout=60)
    idle = scrape_until(port, lambda text: sample(text, "custody_kv_utilization") == 0)
    assert sample(idle, "custody_requests_running") == 0
    assert sample(idle, "custody_pool_held", pool="kv", owner_kind="cache") > 0


@pytest.fixture
def keyed_stack(redis_url, redis_client):
    running = start_stack(stack_settings(redis_url, api_keys="alpha,beta", admin_api_keys="op"))
    yield running
    running.stop()


def test_api_keys_guard_everything_but_health_and_metrics(keyed_stack):
    port = keyed_stack.settings.port
    assert raw_call(port, "/health", None, method="GET")[0] == 200
    assert raw_call(port, "/metrics", None, method="GET")[0] == 200
    body = json.dumps({"session_id": "mine"}).encode()
    assert raw_call(port, "/open_session", body)[0] == 401
    assert raw_call(port, "/open_session", body, {"Authorization": "Bearer wrong"})[0] == 401
    assert raw_call(port, "/open_session", body, {"Authorization": "Bearer alpha"})[0] == 200
    turn = json.dumps(
        {
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 2},
            "session_params": {"id": "mine"},
        }
    ).encode()
    assert raw_call(port, "/generate", turn, {"Authorization": "Bearer beta"})[0] == 404
    assert raw_call(port, "/generate", turn, {"Authorization": "Bearer alpha"})[0] == 200
    close = json.dumps({"session_id": "mine"}).encode()
    assert raw_call(port, "/close_session", close, {"Authorization": "Bearer beta"})[0] == 404
    assert raw_call(port, "/close_session", close, {"Authorization": "Bearer alpha"})[0] == 200


def test_stop_strings_end_a_request_and_are_trimmed(stack):
    port = stack.settings.port
    free = call(
        port,
        "/generate",
        {
            "input_ids": [3, 1, 4, 1, 5],
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True},
        },
    )
    text = free["text"]
    stop = next(ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd")
    cut = call(
        port,
        "/generate",
        {
            "input_ids": [3, 1, 4, 1, 5],
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "stop": stop},
        },
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and text.startswith(cut["text"])


def test_an_aborted_request_finishes_with_abort_in_the_openai_api():
    """As vLLM reports it; it used to say "length"."""
    for chat in (False, True):
        reply = Reply("r", chat, False, "m")
        for reason in ("abort", "stop", "length"):
            choice = reply.choice("", None, FinishReason(reason))
            assert choice["finish_reason"] == reason and choice["matched_stop"] is None
