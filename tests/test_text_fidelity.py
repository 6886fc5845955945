"""Text as a real checkpoint's users see it, over real HTTP against the services on the
test checkpoint (tests/checkpoints.py: a trained byte-level BPE full of multi-byte
characters whose post-processor adds a BOS): streamed text equals non-streamed text in
both APIs, stop strings are trimmed in streams too, raw text gets the BOS transformers
adds (and a later session turn does not), and a checkpoint without tokenizer.json runs
ids-only; OpenAI's `n` and SGLang's batch /generate fan out into requests, each counted
against the queue limit (3 here). One stack per module: starting one costs seconds."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from custody.up import Stack
from shared.config import Settings
from shared.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer
from tests.services_harness import call, stack_settings, start_stack
from tests.test_api import raw_call, sse_events

PROMPT = "Grüße aus Köln! 日本語のテキスト"
SAMPLED = {"max_new_tokens": 48, "temperature": 1.0, "seed": 7, "ignore_eos": True}


def clean_database(redis_url: str, db: int) -> str:
    """The URL of database `db` of the test Redis, emptied: a stack of its own beside
    this module's (two schedulers on one database would fence each other)."""
    url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


@pytest.fixture(scope="module")
def bpe_stack(redis_url: str, chat_checkpoint: Path) -> Iterator[Stack]:
    url = clean_database(redis_url, 3)
    running = start_stack(stack_settings(url, model=chat_checkpoint, max_queued_requests=3))
    yield running
    running.stop()
    clean_database(redis_url, 3)


def generate(stack: Stack, **body: object) -> dict:
    return call(stack.settings.port, "/generate", body)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")


def test_streamed_text_equals_the_text_of_the_same_generation(bpe_stack, chat_checkpoint):
    """Via the official client; the old per-token stream decode tore the multi-byte
    characters this vocabulary splits across tokens."""
    tok = FileTokenizer(chat_checkpoint / "tokenizer.json")
    plain = generate(bpe_stack, text=PROMPT, sampling_params=SAMPLED)
    naive = "".join(tok.decode([i]) for i in plain["output_ids"])
    assert naive != plain["text"] and any(ord(ch) > 127 for ch in plain["text"])
    oai, model = client(bpe_stack), bpe_stack.settings.model_name
    args = {"model": model, "prompt": PROMPT, "max_tokens": 48, "temperature": 1.0, "seed": 7}
    done = oai.completions.create(**args)
    stream = oai.completions.create(**args, stream=True)
    deltas = [c.choices[0].text for c in stream if c.choices]
    assert done.choices[0].text == plain["text"] == "".join(deltas)  # ignore_eos: no eos met
    events = sse_events(
        bpe_stack.settings.port,
        "/generate",
        {"text": PROMPT, "sampling_params": SAMPLED, "stream": True},
    )
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == plain["text"] and events[-1]["output_ids"] == plain["output_ids"]


def test_stop_strings_are_trimmed_in_streams_as_in_replies(bpe_stack):
    free = generate(bpe_stack, text=PROMPT, sampling_params=SAMPLED)["text"]
    stop = next(free[i : i + 2] for i in range(6, len(free)) if ord(free[i]) > 127)
    cut = free[: free.index(stop)]
    stopped = SAMPLED | {"stop": stop}
    assert generate(bpe_stack, text=PROMPT, sampling_params=stopped)["text"] == cut
    port = bpe_stack.settings.port
    body = {"text": PROMPT, "sampling_params": stopped, "stream": True}
    texts = [e["text"] for e in sse_events(port, "/generate", body)]
    assert texts[-1] == cut and all(stop not in t for t in texts)
    oai, model = client(bpe_stack), bpe_stack.settings.model_name
    args = {"model": model, "prompt": PROMPT, "max_tokens": 48, "temperature": 1.0, "seed": 7}
    deltas = [c.choices[0].text for c in oai.completions.create(**args, stop=stop, stream=True)]
    assert "".join(deltas) == cut == oai.completions.create(**args, stop=stop).choices[0].text
    kept = generate(bpe_stack, text=PROMPT, sampling_params=stopped | {"no_stop_trim": True})
    body["sampling_params"] = stopped | {"no_stop_trim": True}
    texts = [e["text"] for e in sse_events(port, "/generate", body)]
    assert texts[-1] == kept["text"] and kept["text"].startswith(cut + stop)


def test_raw_text_gets_the_bos_transformers_adds_once_per_sequence(bpe_stack, chat_checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_checkpoint)
    ids = hf(PROMPT).input_ids
    assert ids[0] == hf.bos_token_id
    greedy = {"max_new_tokens": 6, "ignore_eos": True}
    by_text = generate(bpe_stack, text=PROMPT, sampling_params=greedy)
    by_ids = generate(bpe_stack, input_ids=ids, sampling_params=greedy)
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]
    sid = call(bpe_stack.settings.port, "/open_session", {"session_id": "bos"})
    session = {"id": sid}
    first = generate(bpe_stack, text=PROMPT, sampling_params=greedy, session_params=session)
    assert first["meta_info"]["prompt_tokens"] == len(ids)
    second = generate(bpe_stack, text=" Ça va?", sampling_params=greedy, session_params=session)
    more = hf(" Ça va?", add_special_tokens=False).input_ids
    assert second["meta_info"]["prompt_tokens"] == len(ids) + 6 + len(more)
    done = client(bpe_stack).completions.create(
        model=bpe_stack.settings.model_name, prompt=PROMPT, max_tokens=2
    )
    assert done.usage.prompt_tokens == len(ids)
    call(bpe_stack.settings.port, "/close_session", {"session_id": sid})


def test_a_checkpoint_without_tokenizer_json_runs_ids_only(redis_url, chat_checkpoint, tmp_path):
    bare = tmp_path / "ids-only"
    shutil.copytree(chat_checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    assert isinstance(load_tokenizer(bare, "byte"), ByteTokenizer)
    stack = start_stack(stack_settings(clean_database(redis_url, 4), model=bare))
    try:
        port = stack.settings.port
        reply = generate(stack, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
        assert len(reply["output_ids"]) == 3 and reply["text"] == ""
        named = str(bare / "tokenizer.json")
        for path, body in [
            ("/generate", {"text": "hello"}),
            ("/generate", {"input_ids": [5], "sampling_params": {"stop": "x"}}),
            ("/v1/completions", {"prompt": "hello"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            status, raw = raw_call(port, path, json.dumps(body).encode())
            assert status == 400 and named in json.loads(raw)["error"]["message"], (path, raw)
    finally:
        stack.stop()


def test_tokenizer_byte_opts_in_to_bytes(chat_checkpoint):
    """`--tokenizer byte` (or CUSTODY_TOKENIZER=byte) serves the checkpoint on the byte
    tokenizer; any other value is refused at start."""
    settings = Settings.resolve(None, {"CUSTODY_TOKENIZER": "byte"})
    assert isinstance(load_tokenizer(chat_checkpoint, settings.tokenizer), ByteTokenizer)
    assert isinstance(load_tokenizer(chat_checkpoint), FileTokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        Settings.resolve(None, {"CUSTODY_TOKENIZER": "words"})


def refusal(port: int, path: str, body: dict) -> tuple[int, str]:
    status, raw = raw_call(port, path, json.dumps(body).encode())
    return status, json.loads(raw)["error"]["message"]


def test_n_choices_are_requests_with_derived_seeds(bpe_stack):
    """Choice i samples with seed + i: it is the request with that seed alone."""
    oai, port = client(bpe_stack), bpe_stack.settings.port
    args = {"model": bpe_stack.settings.model_name, "prompt": PROMPT, "max_tokens": 12}
    args |= {"temperature": 1.0, "seed": 11}
    many = oai.completions.create(**args, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    alone = [oai.completions.create(**(args | {"seed": 11 + i})) for i in range(3)]
    assert texts == [a.choices[0].text for a in alone] and len(set(texts)) == 3
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    joined = ["", "", ""]
    for chunk in oai.completions.create(**args, n=3, stream=True):
        for choice in chunk.choices:
            joined[choice.index] += choice.text
    assert joined == texts
    sid = call(port, "/open_session", {"session_id": "one-reply"})
    status, message = refusal(port, "/v1/completions", {"prompt": "x", "n": 2, "session_id": sid})
    assert status == 400 and "session" in message
    call(port, "/close_session", {"session_id": sid})
    assert refusal(port, "/v1/completions", {"prompt": "x", "n": 17})[0] == 400
    status, message = refusal(port, "/v1/completions", {"prompt": "x", "n": 4})
    assert status == 503 and "4 requests" in message  # 4 choices, 3 queue places


def test_a_batch_generate_answers_a_list(bpe_stack):
    port, texts = bpe_stack.settings.port, [PROMPT, " Ça va?", "🙂🚀"]
    greedy = {"max_new_tokens": 5, "ignore_eos": True}
    alone = [generate(bpe_stack, text=t, sampling_params=greedy) for t in texts]
    many = generate(bpe_stack, text=texts, sampling_params=greedy)
    assert [m["text"] for m in many] == [a["text"] for a in alone]
    assert [m["output_ids"] for m in many] == [a["output_ids"] for a in alone]
    ids = generate(bpe_stack, input_ids=[[5, 6, 7], [8, 9]], rid=["a", "b"])
    assert [r["meta_info"]["id"] for r in ids] == ["a", "b"]
    body = {"text": texts, "sampling_params": greedy, "stream": True}
    events = sse_events(port, "/generate", body)
    last = {e["index"]: e["text"] for e in events}  # cumulative: the last one per item
    assert last == {i: a["text"] for i, a in enumerate(alone)}
    session = {"input_ids": [[1], [2]], "session_params": {"id": "any"}}
    assert "session" in refusal(port, "/generate", session)[1]
    assert refusal(port, "/generate", {"text": ["a"] * 65})[0] == 400
    status, message = refusal(port, "/generate", {"text": ["a"] * 4})
    assert status == 503 and "4 requests" in message
