"""Log probabilities as each API returns them, against transformers' own log-softmax on
the same checkpoint (tests/checkpoints.py), over real HTTP against the services: SGLang's
/generate (plain and streamed, cumulative), OpenAI's completions and chat completions
via the official client (plain and streamed, each chunk carrying its own tokens'). The
numbers are the raw logits' whatever the sampling parameters. One stack per module."""

from __future__ import annotations

import json
import math
import urllib.error

import numpy as np
import openai
import pytest
import torch

from custody.inprocess import InProcess
from custody.up import Stack
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from tests.services_harness import POOLS, call
from tests.test_api import sse_events

PROMPT_IDS = [5, 77, 140, 23, 301, 9, 64, 210, 18, 33]
N, K, TOL = 12, 5, 1e-4


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


def test_generate_logprobs_match_transformers(checkpoint_stack, checkpoint_reference):
    tokenizer, model = checkpoint_reference
    sampling = {"max_new_tokens": N, "ignore_eos": True}
    body = {"input_ids": PROMPT_IDS, "sampling_params": sampling, "return_logprob": True}
    out = call(checkpoint_stack.settings.port, "/generate", body | {"top_logprobs_num": K})
    ids, meta = out["output_ids"], out["meta_info"]
    assert ids == greedy(model, PROMPT_IDS, N)
    expected = log_softmax(model, PROMPT_IDS, ids)
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == ids
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - float(expected[i, tok])) < TOL
        check_top(expected[i], [(t, lp) for lp, t, _ in meta["output_top_logprobs"][i]])
        assert len(meta["output_top_logprobs"][i]) == K
    assert all(text is None for _, _, text in meta["output_token_logprobs"])  # SGLang's
    named = call(
        checkpoint_stack.settings.port, "/generate", body | {"return_text_in_logprobs": True}
    )
    texts = [text for _, _, text in named["meta_info"]["output_token_logprobs"]]
    assert texts == [tokenizer.decode([t]) for t in ids]
    plain = call(checkpoint_stack.settings.port, "/generate", body)
    assert "output_top_logprobs" not in plain["meta_info"]  # not asked for
    stream = body | {"top_logprobs_num": K, "stream": True}
    events = [
        e for e in sse_events(checkpoint_stack.settings.port, "/generate", stream) if e != "[DONE]"
    ]
    for event in events:  # cumulative, as SGLang's chunks are
        n = len(event["output_ids"])
        assert len(event["meta_info"]["output_token_logprobs"]) == n
        assert len(event["meta_info"]["output_top_logprobs"]) == n
    last = events[-1]["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in last] == ids
    assert all(
        abs(a[0] - b[0]) < TOL for a, b in zip(last, meta["output_token_logprobs"], strict=True)
    )


def test_logprobs_are_the_raw_model_s_whatever_the_sampling(checkpoint_stack, checkpoint_reference):
    _, model = checkpoint_reference
    sampling = {"max_new_tokens": N, "ignore_eos": True, "temperature": 0.7, "seed": 3}
    sampling |= {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.4, "frequency_penalty": 1}
    body = {"input_ids": PROMPT_IDS, "sampling_params": sampling, "return_logprob": True}
    out = call(checkpoint_stack.settings.port, "/generate", body | {"top_logprobs_num": 3})
    expected = log_softmax(model, PROMPT_IDS, out["output_ids"])
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(expected[i, tok])) < TOL
        check_top(expected[i], [(t, lp) for lp, t, _ in out["meta_info"]["output_top_logprobs"][i]])


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.settings.port}/v1", api_key="none")


def test_completion_logprobs_match_transformers_streamed_and_not(
    checkpoint_stack, checkpoint_reference
):
    tokenizer, model = checkpoint_reference
    oai = client(checkpoint_stack)
    args = {"model": checkpoint_stack.settings.model_name, "prompt": PROMPT_IDS, "max_tokens": N}
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
        assert len(done.top_logprobs[i]) == len(set(candidates))  # none lost to a collision
        for text, lp in done.top_logprobs[i].items():  # a colliding text: keyed by id
            if text.startswith("token_id:"):
                same = [int(text.removeprefix("token_id:"))]
            else:
                same = [t for t in candidates if tokenizer.decode([t]) == text]
            assert any(abs(lp - float(expected[i, t])) < TOL for t in same), (i, text)
    chunks = [c.choices[0].logprobs for c in oai.completions.create(**args, stream=True)]
    joined = [x for c in chunks if c is not None for x in c.tokens]
    assert joined == done.tokens
    lps = [x for c in chunks if c is not None for x in c.token_logprobs]
    assert all(
        math.isclose(a, b, abs_tol=TOL) for a, b in zip(lps, done.token_logprobs, strict=True)
    )


def test_chat_logprobs_match_transformers_streamed_and_not(checkpoint_stack, checkpoint_reference):
    tokenizer, model = checkpoint_reference
    messages = [{"role": "user", "content": "Grüße aus Köln! Ça va?"}]
    prompt = list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    ids = greedy(model, prompt, N)
    expected = log_softmax(model, prompt, ids)
    oai = client(checkpoint_stack)
    args = {"model": checkpoint_stack.settings.model_name, "messages": messages, "max_tokens": N}
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


# ---- input (prompt) logprobs: SGLang's logprob_start_len, OpenAI's echo ----

LONG = [(7 * i + 3) % 400 for i in range(40)]  # spans pages, so a prefix can be cached


def prompt_log_softmax(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position (row p scores prompt[p + 1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def check_inputs(expected: torch.Tensor, prompt: list[int], start: int, meta: dict, k: int):
    """SGLang's input fields from `start`: the first logprob null, each later position's
    transformers' (and its top `k`, when asked)."""
    entries = meta["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == prompt[start:]
    assert entries[0][0] is None
    for p, (lp, tok, _) in enumerate(entries[1:], start + 1):
        assert abs(lp - float(expected[p - 1, tok])) < TOL, p
    if k:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for p, top in enumerate(tops[1:], start + 1):
            check_top(expected[p - 1], [(t, lp) for lp, t, _ in top])


def test_generate_input_logprobs_match_transformers_cold_and_warm(
    checkpoint_stack, checkpoint_reference
):
    """Input logprobs from 0 and from a later position, then again with the prompt's
    prefix cached: the cache is reused only up to the start (its logits are computed
    again), and the numbers do not change."""
    _, model = checkpoint_reference
    port, expected = checkpoint_stack.settings.port, prompt_log_softmax(model, LONG)
    body = {"input_ids": LONG, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    for start in (0, 23, 39, 40):
        asked = body | {"logprob_start_len": start, "top_logprobs_num": K}
        cold = call(port, "/generate", asked | {"rid": f"cold-{start}"})["meta_info"]
        if start == len(LONG):  # at the end: nothing listed
            assert cold["input_token_logprobs"] == [] == cold["input_top_logprobs"]
            continue
        check_inputs(expected, LONG, start, cold, K)
        warm = call(port, "/generate", asked)["meta_info"]
        assert warm["cached_tokens"] <= start
        check_inputs(expected, LONG, start, warm, K)
    plain = call(port, "/generate", body)["meta_info"]
    assert plain["input_token_logprobs"] == [] and plain["cached_tokens"] > 0
    assert "input_top_logprobs" not in plain


def test_generate_input_logprobs_streamed_prefill_only_and_batched(
    checkpoint_stack, checkpoint_reference
):
    _, model = checkpoint_reference
    port, expected = checkpoint_stack.settings.port, prompt_log_softmax(model, LONG)
    body = {"input_ids": LONG, "return_logprob": True, "logprob_start_len": 5}
    only = call(port, "/generate", body | {"sampling_params": {"max_new_tokens": 0}})
    assert only["output_ids"] == [] and only["meta_info"]["finish_reason"]["type"] == "length"
    check_inputs(expected, LONG, 5, only["meta_info"], 0)
    stream = body | {"stream": True, "sampling_params": {"max_new_tokens": 3}}
    events = [e for e in sse_events(port, "/generate", stream) if e != "[DONE]"]
    for event in events:  # cumulative: every chunk carries the input's
        check_inputs(expected, LONG, 5, event["meta_info"], 0)
    batch = {"input_ids": [LONG, LONG[:20]], "return_logprob": True}
    replies = call(port, "/generate", batch | {"logprob_start_len": [0, 7]})
    check_inputs(expected, LONG, 0, replies[0]["meta_info"], 0)
    check_inputs(expected, LONG[:20], 7, replies[1]["meta_info"], 0)


def test_a_session_turn_s_input_logprobs_start_after_the_state_it_resumes(
    checkpoint_stack, checkpoint_reference
):
    """A turn resumes its session's state: its input logprobs start no earlier than its
    new input (the history is not computed again), and are those of the whole
    conversation."""
    _, model = checkpoint_reference
    port = checkpoint_stack.settings.port
    sid = call(port, "/open_session", {"capacity_of_str_len": 1000})
    first = {"input_ids": LONG[:20], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    out = call(port, "/generate", first | {"session_params": {"id": sid}})
    history = LONG[:20] + out["output_ids"]
    turn = {"input_ids": LONG[20:], "return_logprob": True, "logprob_start_len": 0}
    turn |= {"sampling_params": {"max_new_tokens": 2}, "session_params": {"id": sid}}
    meta = call(port, "/generate", turn)["meta_info"]
    whole = history + LONG[20:]
    check_inputs(prompt_log_softmax(model, whole), whole, len(history), meta, 0)
    assert meta["cached_tokens"] >= len(LONG[:20])
    call(port, "/close_session", {"session_id": sid})


def test_logprob_start_len_past_the_input_is_a_400(checkpoint_stack):
    body = {"input_ids": LONG[:5], "return_logprob": True, "logprob_start_len": 6}
    with pytest.raises(urllib.error.HTTPError) as err:
        call(checkpoint_stack.settings.port, "/generate", body)
    assert err.value.code == 400 and "logprob_start_len 6" in err.value.read().decode()


def test_completion_echo_gives_the_prompt_s_logprobs_then_the_output_s(
    checkpoint_stack, checkpoint_reference
):
    """OpenAI's echo: the prompt's tokens first (the first logprob null), then the
    generated ones; max_tokens 0 with echo scores the prompt alone (lm-eval's
    loglikelihood request), streamed or not."""
    tokenizer, model = checkpoint_reference
    oai, expected = client(checkpoint_stack), prompt_log_softmax(model, LONG)
    args = {"model": checkpoint_stack.settings.model_name, "prompt": LONG, "echo": True}
    args |= {"temperature": 0, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    prompt_text = tokenizer.decode(LONG)
    scored = oai.completions.create(**args, max_tokens=0).choices[0]
    assert scored.text == prompt_text
    lps = scored.logprobs
    assert lps.tokens == [tokenizer.decode([t]) for t in LONG]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    for p in range(1, len(LONG)):
        assert abs(lps.token_logprobs[p] - float(expected[p - 1, LONG[p]])) < TOL
        assert len(lps.top_logprobs[p]) <= 3
    ids = greedy(model, LONG, 3)
    whole = oai.completions.create(**args, max_tokens=3).choices[0]
    assert whole.text == prompt_text + tokenizer.decode(ids)
    assert whole.logprobs.tokens == lps.tokens + [tokenizer.decode([t]) for t in ids]
    assert whole.logprobs.token_logprobs[: len(LONG)] == lps.token_logprobs
    assert whole.logprobs.text_offset[len(LONG)] == len(prompt_text)
    chunks = [c.choices[0] for c in oai.completions.create(**args, max_tokens=3, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert len(streamed) == len(whole.logprobs.token_logprobs)


def test_max_tokens_0_without_echo_is_a_400(checkpoint_stack):
    oai = client(checkpoint_stack)
    with pytest.raises(openai.BadRequestError, match="max_tokens 0"):
        oai.completions.create(
            model=checkpoint_stack.settings.model_name, prompt=LONG, max_tokens=0
        )


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order(
    checkpoint_stack, checkpoint_reference
):
    """OpenAI's batched prompt forms (token id lists, texts): each prompt's `n` choices,
    indexed in prompt order; usage counts each prompt once. lm-evaluation-harness sends
    its loglikelihood requests as `prompt: [[ids]]` with echo."""
    tokenizer, model = checkpoint_reference
    oai, name = client(checkpoint_stack), checkpoint_stack.settings.model_name
    prompts = [LONG[:12], LONG[12:30]]
    args = {"model": name, "max_tokens": 2, "temperature": 0, "n": 2}
    out = oai.completions.create(prompt=prompts, **args)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text == tokenizer.decode(greedy(model, prompts[c.index // 2], 2))
    assert out.usage.prompt_tokens == 12 + 18 and out.usage.completion_tokens == 8
    texts = oai.completions.create(prompt=["Grüße", "Köln"], **args | {"n": 1})
    assert [c.index for c in texts.choices] == [0, 1]
    scored = oai.completions.create(
        prompt=prompts, model=name, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    for c in scored.choices:
        prompt = prompts[c.index]
        expected = prompt_log_softmax(model, prompt)
        got = c.logprobs.token_logprobs
        assert len(got) == len(prompt) + 1 and got[0] is None
        assert all(
            abs(got[p] - float(expected[p - 1, prompt[p]])) < TOL for p in range(1, len(prompt))
        )


def scored_in_process(retract_when: str | None) -> Request:
    """`LONG` (in the built-in model's bytes) with its input logprobs (and top 2) in one
    process, retracted once
    mid-prefill (`"prefill"`: its first chunk computed, not its last) or after its first
    output token (`"output"`); a re-admitted request computes them all again."""
    local = InProcess(Settings(**POOLS))  # 32-token chunks: LONG takes two
    params = SamplingParams(max_new_tokens=3, logprobs=True, top_logprobs=2, logprob_start=0)
    req = local.engine.submit(Request("x", np.asarray([t % 256 for t in LONG]), params))
    done = {"prefill": lambda: req.computed > 0, "output": lambda: len(req.output) > 0}
    if retract_when is not None:
        while not done[retract_when]():
            local.step()
        assert req.computed < len(LONG) or retract_when == "output"
        local.engine.retract(req)
    local.run_until_idle()
    assert req.input_logprobs[0] is None and None not in req.input_logprobs[1:]
    return req


def test_input_logprobs_are_the_same_after_a_retract_mid_prefill_or_after_it():
    whole = scored_in_process(None)
    assert len(whole.input_logprobs) == len(LONG) and len(whole.input_top) == len(LONG)
    for when in ("prefill", "output"):
        again = scored_in_process(when)
        assert np.allclose(again.input_logprobs[1:], whole.input_logprobs[1:], atol=1e-5)
        assert [t[0] for t in again.input_top[1:]] == [t[0] for t in whole.input_top[1:]]
        assert again.output == whole.output


def test_a_stream_s_cap_counts_the_input_positions_every_chunk_repeats(checkpoint_stack):
    """SGLang's cumulative chunks repeat the input's logprobs each time, so a streamed
    request's cap counts them: the same request is refused from position 0, served from
    position 39 (one entry listed)."""
    port = checkpoint_stack.settings.port
    body = {"input_ids": LONG, "return_logprob": True, "top_logprobs_num": 20, "stream": True}
    body |= {"sampling_params": {"max_new_tokens": 160, "ignore_eos": True}}
    with pytest.raises(urllib.error.HTTPError) as err:
        call(port, "/generate", body | {"logprob_start_len": 0})
    assert err.value.code == 400 and "logprob_start_len" in err.value.read().decode()
    streamed = sse_events(port, "/generate", body | {"logprob_start_len": 39})
    events = [e for e in streamed if e != "[DONE]"]
    assert len(events[-1]["meta_info"]["input_token_logprobs"]) == 1
