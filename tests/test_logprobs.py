"""Log probabilities as each API returns them, against transformers' own log-softmax on
the same checkpoint (tests/checkpoints.py), over real HTTP against the services: SGLang's
/generate (plain and streamed, cumulative), OpenAI's completions and chat completions
via the official client (plain and streamed, each chunk carrying its own tokens'). The
numbers are the raw logits' whatever the sampling parameters. One stack per module."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from custody.up import Stack
from tests.checkpoints import reference
from tests.services_harness import call, stack_settings, start_stack
from tests.test_api import sse_events

PROMPT_IDS = [5, 77, 140, 23, 301, 9, 64, 210, 18, 33]
N, K, TOL = 12, 5, 1e-4


@pytest.fixture(scope="module")
def bpe_stack(redis_url: str, chat_checkpoint: Path) -> Iterator[Stack]:
    running = start_stack(stack_settings(redis_url, model=chat_checkpoint))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def ref(chat_checkpoint: Path):
    return reference(chat_checkpoint)


def log_softmax(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position that sampled an output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], -1)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def check_top(expected: torch.Tensor, got: list[tuple[int, float]]) -> None:
    """The top ids are transformers' (where not tied) and their logprobs within TOL."""
    values, ids = torch.topk(expected, len(got))
    for rank, (tok, lp) in enumerate(got):
        assert abs(lp - float(values[rank])) < TOL
        assert abs(lp - float(expected[tok])) < TOL
        tied = (values - values[rank]).abs() < TOL
        assert tok == int(ids[rank]) or int(tied.sum()) > 1


def test_generate_logprobs_match_transformers(bpe_stack, ref):
    _, model = ref
    sampling = {"max_new_tokens": N, "ignore_eos": True}
    body = {"input_ids": PROMPT_IDS, "sampling_params": sampling, "return_logprob": True}
    out = call(bpe_stack.settings.port, "/generate", body | {"top_logprobs_num": K})
    ids, meta = out["output_ids"], out["meta_info"]
    assert ids == greedy(model, PROMPT_IDS, N)
    expected = log_softmax(model, PROMPT_IDS, ids)
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == ids
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - float(expected[i, tok])) < TOL
        check_top(expected[i], [(t, lp) for lp, t, _ in meta["output_top_logprobs"][i]])
        assert len(meta["output_top_logprobs"][i]) == K
    plain = call(bpe_stack.settings.port, "/generate", body)
    assert "output_top_logprobs" not in plain["meta_info"]  # not asked for
    stream = body | {"top_logprobs_num": K, "stream": True}
    events = [e for e in sse_events(bpe_stack.settings.port, "/generate", stream) if e != "[DONE]"]
    for event in events:  # cumulative, as SGLang's chunks are
        n = len(event["output_ids"])
        assert len(event["meta_info"]["output_token_logprobs"]) == n
        assert len(event["meta_info"]["output_top_logprobs"]) == n
    last = events[-1]["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in last] == ids
    assert all(
        abs(a[0] - b[0]) < TOL for a, b in zip(last, meta["output_token_logprobs"], strict=True)
    )


def test_logprobs_are_the_raw_model_s_whatever_the_sampling(bpe_stack, ref):
    _, model = ref
    sampling = {"max_new_tokens": N, "ignore_eos": True, "temperature": 0.7, "seed": 3}
    sampling |= {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.4, "frequency_penalty": 1}
    body = {"input_ids": PROMPT_IDS, "sampling_params": sampling, "return_logprob": True}
    out = call(bpe_stack.settings.port, "/generate", body | {"top_logprobs_num": 3})
    expected = log_softmax(model, PROMPT_IDS, out["output_ids"])
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(expected[i, tok])) < TOL
        check_top(expected[i], [(t, lp) for lp, t, _ in out["meta_info"]["output_top_logprobs"][i]])


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")


def test_completion_logprobs_match_transformers_streamed_and_not(bpe_stack, ref):
    tokenizer, model = ref
    oai = client(bpe_stack)
    args = {"model": bpe_stack.settings.model_name, "prompt": PROMPT_IDS, "max_tokens": N}
    args |= {"temperature": 0, "logprobs": 3, "extra_body": {"ignore_eos": True}}
    done = oai.completions.create(**args).choices[0].logprobs
    ids = greedy(model, PROMPT_IDS, N)
    expected = log_softmax(model, PROMPT_IDS, ids)
    texts = [tokenizer.decode([t]) for t in ids]
    assert done.tokens == texts
    assert done.text_offset == [sum(map(len, texts[:i])) for i in range(N)]
    for i, tok in enumerate(ids):
        assert abs(done.token_logprobs[i] - float(expected[i, tok])) < TOL
        candidates = [*torch.topk(expected[i], 3).indices.tolist(), tok]
        assert texts[i] in done.top_logprobs[i] and len(done.top_logprobs[i]) <= 4
        for text, lp in done.top_logprobs[i].items():  # texts may collide (U+FFFD)
            same = [t for t in candidates if tokenizer.decode([t]) == text]
            assert any(abs(lp - float(expected[i, t])) < TOL for t in same), (i, text)
    chunks = [c.choices[0].logprobs for c in oai.completions.create(**args, stream=True)]
    joined = [x for c in chunks if c is not None for x in c.tokens]
    assert joined == done.tokens
    lps = [x for c in chunks if c is not None for x in c.token_logprobs]
    assert all(
        math.isclose(a, b, abs_tol=TOL) for a, b in zip(lps, done.token_logprobs, strict=True)
    )


def test_chat_logprobs_match_transformers_streamed_and_not(bpe_stack, ref):
    tokenizer, model = ref
    messages = [{"role": "user", "content": "Grüße aus Köln! Ça va?"}]
    prompt = list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    ids = greedy(model, prompt, N)
    expected = log_softmax(model, prompt, ids)
    oai = client(bpe_stack)
    args = {"model": bpe_stack.settings.model_name, "messages": messages, "max_tokens": N}
    args |= {"temperature": 0, "logprobs": True, "top_logprobs": K}
    args |= {"extra_body": {"ignore_eos": True}}
    content = oai.chat.completions.create(**args).choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    for i, (entry, tok) in enumerate(zip(content, ids, strict=True)):
        assert abs(entry.logprob - float(expected[i, tok])) < TOL
        assert entry.bytes == list(entry.token.encode())
        values = torch.topk(expected[i], K).values.tolist()
        assert len(entry.top_logprobs) == K
        for top, value in zip(entry.top_logprobs, values, strict=True):
            assert abs(top.logprob - value) < TOL
    chunks = [c.choices[0] for c in oai.chat.completions.create(**args, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content, strict=True))
    plain = oai.chat.completions.create(**(args | {"logprobs": None, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None
    raw = json.loads(plain.model_dump_json())
    assert raw["choices"][0]["logprobs"] is None
