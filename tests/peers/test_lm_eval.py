"""lm-evaluation-harness 0.4.13, unchanged (its `lm_eval` command, `local-completions`
with the remote tokenizer it finds at /tokenizer_info and /tokenize), against a stack
serving the checkpoint of tests/checkpoints.py, over two tasks written here
(tests/data/lm_eval/: a multiple-choice task scored by loglikelihood and a
generate_until task; no hub access).

What it can catch: a loglikelihood that is not transformers' log-softmax on the same
tokens (echo, prompt logprobs, the batched prompt form, the remote tokenizer's split of
context and continuation), a generation that is not transformers' greedy one. What it
cannot: lm-eval's echo requests recompute every position (no prefix-cache reuse), so
the cache half is checked separately, through /generate's logprob_start_len: a
continuation scored after its context was cached equals the cold score.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from custody.up import Stack
from tests.services_harness import call

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "lm_eval"
LOGLIKELIHOOD_TOL, CACHE_TOL = 1e-4, 1e-5


def lm_eval(stack: Stack, out: Path) -> dict[str, list[dict]]:
    """Run the `lm_eval` command over both tasks; the logged samples, per task."""
    base = f"http://127.0.0.1:{stack.settings.port}/v1/completions"
    args = f"base_url={base},model={stack.settings.model_name},max_retries=1"
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions"]
    command += ["--model_args", args, "--tasks", "custody_choice,custody_generate"]
    command += ["--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    ran = subprocess.run(
        command, cwd=REPO, env=os.environ | offline, timeout=600, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "remote tokenizer backend" in ran.stderr  # it found /tokenizer_info, /tokenize
    samples = {}
    for task in ("custody_choice", "custody_generate"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (trailing
    spaces move to the continuation; the continuation is what the whole adds)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head) :]


def loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([context + continuation])).logits[0].float()
    lsm = torch.log_softmax(logits, -1)
    return sum(float(lsm[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def greedy_text(tokenizer, model, prompt: str, n: int, until: str) -> str:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return tokenizer.decode(out).split(until)[0]


def test_lm_eval_scores_are_transformers_loglikelihoods_and_greedy_text(
    checkpoint_stack, checkpoint_reference, tmp_path
):
    tokenizer, model = checkpoint_reference
    samples = lm_eval(checkpoint_stack, tmp_path)
    choice = samples["custody_choice"]
    assert len(choice) == 6
    for sample in choice:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            got = float(resp[0][0])
            expected = loglikelihood(model, *encode_pair(tokenizer, context, continuation))
            assert abs(got - expected) < LOGLIKELIHOOD_TOL, (context, continuation, got, expected)
    generate = samples["custody_generate"]
    assert len(generate) == 4
    for sample in generate:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        assert sample["resps"][0][0] == greedy_text(tokenizer, model, prompt, 8, "\n")


def docs() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "choice.jsonl").read_text().splitlines()]


def test_a_continuation_scored_after_its_context_was_cached_equals_the_cold_score(
    checkpoint_stack, checkpoint_reference
):
    """Each continuation after a few-shot context (every other question with its answer,
    then the question: pages long), scored through /generate from the context's last
    position: cold (cache flushed), then warm (the context alone prefilled first, so the
    cache holds it): equal within 1e-5, the warm one reusing all but at most a page of
    the context, and both transformers' loglikelihood."""
    tokenizer, model = checkpoint_reference
    port, page = checkpoint_stack.settings.port, checkpoint_stack.settings.page_size
    all_docs = docs()
    for i, doc in enumerate(all_docs):
        shots = [d for j, d in enumerate(all_docs) if j != i]
        context = "".join(f"{d['question']} {d['choices'][d['answer']]}\n" for d in shots)
        context += doc["question"]
        for choice in doc["choices"]:
            ctx, cont = encode_pair(tokenizer, context, " " + choice)
            assert len(ctx) > 4 * page
            body = {"input_ids": ctx + cont, "return_logprob": True}
            body |= {"logprob_start_len": len(ctx) - 1, "sampling_params": {"max_new_tokens": 0}}
            call(port, "/flush_cache", {})
            cold = call(port, "/generate", body)["meta_info"]
            call(port, "/flush_cache", {})
            call(port, "/generate", {"input_ids": ctx, "sampling_params": {"max_new_tokens": 0}})
            warm = call(port, "/generate", body)["meta_info"]
            assert cold["cached_tokens"] == 0
            assert warm["cached_tokens"] >= len(ctx) - page
            scores = [[lp for lp, _, _ in m["input_token_logprobs"][1:]] for m in (cold, warm)]
            assert len(scores[0]) == len(cont)
            assert all(abs(a - b) < CACHE_TOL for a, b in zip(*scores, strict=True))
            expected = loglikelihood(model, ctx, cont)
            assert abs(sum(scores[0]) - expected) < LOGLIKELIHOOD_TOL
