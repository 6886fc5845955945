"""`custody bench structured`: what constrained decoding costs. One stack (`custody up`'s
services, private Redis) serves a random NemotronH with NemotronH's vocabulary size,
131,072 tokens (a synthetic byte-level vocabulary: mask bytes and fill time scale with
it), and the same clients decode the same number of tokens from the same prompts,
unconstrained and under a grammar, at batch 1 and 16, runs interleaved, in one run.

The grammars never let a request end before its token limit, so both sides decode
exactly `OUTPUT` tokens per request (checked): a JSON object whose one string is at least
`MIN_CHARS` long, and the regex `[a-z ]{800,}`, both longer than `OUTPUT` tokens of at
most 8 characters can write. The unconstrained side ignores its EOS. Reported: tokens/s
per side (median of the runs), `ratio_constrained_b16` and `ratio_constrained_b1`
(constrained ÷ unconstrained, JSON), the regex's ratios, and `mask_share`: the
executor's time filling and unpacking masks (`custody_grammar_mask_seconds`) over its
step time (`custody_forward_seconds`) in the constrained runs. The model is small
(hidden 256), so its forward is short and the masks' share large: a larger model's
forward only shrinks it.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from custody.bench.e2e import _metric_sum
from custody.bench.harness import RESULTS_DIR, plot, progress
from custody.bench.sessions import _post
from custody.up import Stack
from shared.config import Settings

VOCAB, OUTPUT, PROMPT, MIN_CHARS = 131_072, 96, 16, 2000
BATCHES = (1, 16)
GRAMMARS = {
    "json": {
        "json_schema": json.dumps(
            {
                "type": "object",
                "properties": {"text": {"type": "string", "minLength": MIN_CHARS}},
                "required": ["text"],
                "additionalProperties": False,
            }
        )
    },
    "regex": {"regex": "[a-z ]{800,}"},  # more than OUTPUT tokens of 8 characters can write
}
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ.,:;!?-_()[]{}\"'"


def build_checkpoint(directory: Path, vocab: int = VOCAB) -> Path:
    """A random NemotronH of `vocab` tokens beside a byte-level tokenizer.json whose
    tokens past the 256 bytes are random strings of 2..8 characters (no merges: the
    bench sends token ids; only the vocabulary matters to the masks)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import NemotronHConfig, NemotronHForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    tokens = list(pre_tokenizers.ByteLevel.alphabet())
    seen = set(tokens)
    while len(tokens) < vocab - 1:
        piece = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
    model = models.BPE({t: i for i, t in enumerate(tokens)}, [])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=vocab,
        hidden_size=256,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        eos_token_id=vocab - 1,
    )
    NemotronHForCausalLM(config).float().eval().save_pretrained(directory)
    return directory


def _request(port: int, seed: int, grammar: dict | None, out: list[int]) -> None:
    rng = random.Random(seed)
    sampling = {"max_new_tokens": OUTPUT, "temperature": 1.0, "seed": seed}
    sampling |= {"ignore_eos": True} if grammar is None else grammar
    body = {"input_ids": [rng.randrange(256) for _ in range(PROMPT)], "sampling_params": sampling}
    out.append(_post(port, "/generate", body)["meta_info"]["completion_tokens"])


def _one_run(settings: Settings, batch: int, grammar: dict | None, run: int) -> dict:
    """`batch` requests at once; decode tokens/s and the executor's mask seconds."""
    mask0 = _metric_sum(settings.executor_metrics_port, "custody_grammar_mask_seconds")
    fwd0 = _metric_sum(settings.executor_metrics_port, "custody_forward_seconds")
    counts: list[int] = []
    threads = [
        threading.Thread(target=_request, args=(settings.port, run * 100 + i, grammar, counts))
        for i in range(batch)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert counts == [OUTPUT] * batch, counts  # the same work on both sides
    mask = _metric_sum(settings.executor_metrics_port, "custody_grammar_mask_seconds") - mask0
    fwd = _metric_sum(settings.executor_metrics_port, "custody_forward_seconds") - fwd0
    return {"tokens_per_s": sum(counts) / wall, "mask_s": mask, "step_s": fwd}


def measure(settings: Settings, repeats: int, batches: tuple[int, ...] = BATCHES) -> dict:
    """Every cell (batch x side), `repeats` times interleaved, on the running stack."""
    sides = {"plain": None} | GRAMMARS
    runs: dict[str, list[dict]] = {f"{s}_b{b}": [] for b in batches for s in sides}
    # one warm-up request per grammar: its compile is a check's, not a decode's
    for name, grammar in GRAMMARS.items():
        _request(settings.port, 0, grammar, [])
        progress(f"structured warm-up {name}", 1, 1)
    for i in range(repeats):
        for b in batches:
            for side, grammar in sides.items():
                runs[f"{side}_b{b}"].append(_one_run(settings, b, grammar, i))
        progress("structured", i + 1, repeats)
    tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    result: dict = {"tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}
    for b in batches:
        result[f"ratio_constrained_b{b}"] = round(tps[f"json_b{b}"] / tps[f"plain_b{b}"], 3)
        result[f"ratio_regex_b{b}"] = round(tps[f"regex_b{b}"] / tps[f"plain_b{b}"], 3)
        constrained = runs[f"json_b{b}"] + runs[f"regex_b{b}"]
        step = sum(r["step_s"] for r in constrained)
        result[f"mask_share_b{b}"] = round(sum(r["mask_s"] for r in constrained) / step, 4)
    return result


def run(repeats: int = 3) -> dict:
    with tempfile.TemporaryDirectory(prefix="custody-structured-") as tmp:
        checkpoint = build_checkpoint(Path(tmp))
        stack = Stack(Settings.ephemeral(model=checkpoint, compile=False))
        try:
            stack.start_all().wait_healthy()
            result = measure(stack.settings, repeats)
        finally:
            stack.stop()
    payload = {"vocab": VOCAB, "output_tokens": OUTPUT, "repeats": repeats, **result}
    lines = [
        "| figure | batch 1 | batch 16 |",
        "|---|---|---|",
        *(
            f"| {side} tokens/s | {result['tokens_per_s'][f'{side}_b1']} | "
            f"{result['tokens_per_s'][f'{side}_b16']} |"
            for side in ("plain", "json", "regex")
        ),
        f"| constrained ÷ unconstrained (JSON; target b16 >= 0.8) | "
        f"{result['ratio_constrained_b1']} | {result['ratio_constrained_b16']} |",
        f"| constrained ÷ unconstrained (regex) | {result['ratio_regex_b1']} | "
        f"{result['ratio_regex_b16']} |",
        f"| masks' share of the executor's step time | {result['mask_share_b1']} | "
        f"{result['mask_share_b16']} |",
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "structured.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS_DIR / "structured.md").write_text("\n".join(lines) + "\n")
    plot(
        "structured",
        f"decode tokens/s, vocabulary {VOCAB}",
        [f"batch {b}" for b in BATCHES],
        {
            s: [result["tokens_per_s"][f"{s}_b{b}"] for b in BATCHES]
            for s in ("plain", "json", "regex")
        },
        "tokens/s",
    )
    payload["table"] = "\n".join(lines)
    return payload
