"""`custody bench spec`: how many target forwards speculative decoding saves, per drafter,
against speculation off in the same run.

The scheduler core and the executor run in one process (`InProcess`, real tensors, eager
forward, torch on its default threads). Every side decodes the same prompts greedily:
16 held-out copy prompts (`BOS + A + SEP + A[:k]`, drawn with `PROMPT_SEED`; the copy
target trained on `spec_targets.TRAIN_SEED`'s), 48 new tokens each, at most 3 drafts a
verify step. Two batchings: `b1`, one request at a time (all submitted, at most one
running), and `b4`, at most four running (the next admitted as one ends). Two targets:

- `copy_target`: spec_targets' small NemotronH trained to keep copying A (built and
  cached under ~/.cache/custody/spec/ when missing): text that repeats, where a draft
  can be right;
- `random_target`: the built-in model, untrained: its continuations are noise, so
  drafts from the prompt are rarely right. It shows why the copy target is used.

Each run starts from a fresh `InProcess` (empty prefix cache, fresh counters); a repeat
runs every batching and side of a target in turn, so machine noise hits all alike. Counts
come from the first repeat; `cpu_wall_s` is the median over repeats of the seconds from
the first submit to idle. Greedy outputs must be the same with every drafter as with
speculation off: `outputs_identical_to_off` says whether they were, over every repeat.

A side is an entry of `DRAFTERS`. An MTP head's row goes there too: `Drafting("NEXTN")`
builds the engine's own head drafter, which needs that side to serve the target's
checkpoint with `mtp.*` weights (`spec_head.py` trains them); its `forwards` counts the
head's forwards.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from custody.bench.harness import RESULTS_DIR, progress
from custody.bench.spec_head import HEAD_SEED, cached_head
from custody.bench.spec_targets import (
    SEPARATOR,
    SUCCESSOR,
    chain_prompt,
    copy_prompt,
    recipe_id,
    weights_sha256,
)
from custody.inprocess import InProcess
from services.scheduler.engine.drafts import Drafter, RepeatLast
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings

PROMPTS, NEW_TOKENS, DRAFTS, BATCHES = 16, 48, 3, (1, 4)
PROMPT_SEED = 2  # held out: the copy target trained on spec_targets.TRAIN_SEED (1)


def _no_forwards(_: InProcess) -> int:
    """A model-free drafter's: it runs no forward."""
    return 0


@dataclass(frozen=True)
class Drafting:
    """How one side speculates: the `speculative_algorithm` its engine is built with, and
    the drafter put in place of the one that builds (None: keep it). `forwards`: the
    model forwards its drafts cost (none for a model-free drafter)."""

    algorithm: str
    drafter: Callable[[], Drafter] | None = None
    forwards: Callable[[InProcess], int] = _no_forwards


DRAFTERS: dict[str, Drafting] = {
    "ngram": Drafting("NGRAM"),  # PromptNgram, the engine's own NGRAM drafter
    "repeat_last": Drafting("NGRAM", RepeatLast),
}
# on a checkpoint with an MTP head: its drafts, and its forwards (each pass of its layers)
WITH_HEAD = DRAFTERS | {
    "mtp_head": Drafting("NEXTN", forwards=lambda local: local.model.mtp.passes)
}


@dataclass
class Run:
    outputs: list[list[int]]
    forwards: int  # engine steps run: one target forward each
    wall_s: float
    draft_forwards: int
    verify_steps: int  # verify rows, as `Acceptance` counts them
    drafted: int
    accepted: int
    accepted_at: list[float]  # the share of drafts accepted at each draft position

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def held_out_prompts(
    count: int = PROMPTS,
    seed: int = PROMPT_SEED,
    draw: Callable[[np.random.Generator], np.ndarray] = copy_prompt,
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [draw(rng) for _ in range(count)]


def _settings(model: Path | None, batch: int, algorithm: str) -> Settings:
    return Settings(
        model=model,
        compile=False,
        max_running_requests=batch,
        kv_pages=256,
        mamba_slots=64,
        context_len=256,  # a prompt and its output: at most 50 + 48 tokens
        host_state_bytes=0,  # no sessions: no host tier
        speculative_algorithm=algorithm,
        speculative_num_steps=DRAFTS,
    )


def run_once(
    model: Path | None,
    batch: int,
    drafting: Drafting | None,
    prompts: list[np.ndarray],
    new_tokens: int,
) -> Run:
    """Decode every prompt greedily on a fresh `InProcess`; `drafting` None: speculation
    off. Timed from the first submit to idle."""
    local = InProcess(_settings(model, batch, drafting.algorithm if drafting else ""))
    if drafting is not None and drafting.drafter is not None:
        local.engine.drafter = drafting.drafter()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    reqs = [local.engine.submit(Request(f"p{i}", p, params)) for i, p in enumerate(prompts)]
    # InProcess completes a step before it plans the next, so while a request remains
    # every step has rows: one target forward each
    forwards = 0
    while not local.engine.idle:
        if forwards > 2 * len(prompts) * (new_tokens + 1):
            raise RuntimeError("the engine did not become idle")
        local.step()
        forwards += 1
    wall = time.perf_counter() - start
    accepted = local.engine.completion.accepted
    return Run(
        [list(r.output) for r in reqs],
        forwards,
        wall,
        drafting.forwards(local) if drafting else 0,
        accepted.steps,
        accepted.drafted,
        accepted.accepted,
        [a / o for a, o in zip(accepted.at_position, accepted.offered_at, strict=True)],
    )


def _off_figures(runs: list[Run]) -> dict:
    first = runs[0]
    return {
        "target_forwards": first.forwards,
        "tokens": first.tokens,
        "target_forwards_per_token": round(first.forwards / first.tokens, 4),
        "draft_forwards": 0,
        "cpu_wall_s": round(statistics.median(r.wall_s for r in runs), 4),
    }


def _drafter_figures(runs: list[Run], off: list[Run]) -> dict:
    """One drafter's figures, its ratios (on ÷ off) from unrounded values."""
    first, wall = runs[0], statistics.median(r.wall_s for r in runs)
    per_token = first.forwards / first.tokens
    off_per_token = off[0].forwards / off[0].tokens
    steps = max(first.verify_steps, 1)
    return {
        "verify_steps": first.verify_steps,
        "mean_accepted_tokens": round(first.accepted / steps, 4),
        "tokens_per_verify_step": round((first.accepted + first.verify_steps) / steps, 4),
        "acceptance_rate": round(first.accepted / max(first.drafted, 1), 4),
        "accepted_at_position": [round(a, 4) for a in first.accepted_at],
        "target_forwards": first.forwards,
        "tokens": first.tokens,
        "target_forwards_per_token": round(per_token, 4),
        "target_forwards_per_token_ratio": round(per_token / off_per_token, 4),
        "draft_forwards": first.draft_forwards,
        "cpu_wall_s": round(wall, 4),
        "wall_ratio": round(wall / statistics.median(r.wall_s for r in off), 4),
        "outputs_identical_to_off": all(r.outputs == off[0].outputs for r in runs + off),
    }


def measure(
    model: Path | None,
    prompts: list[np.ndarray],
    new_tokens: int = NEW_TOKENS,
    batches: tuple[int, ...] = BATCHES,
    repeats: int = 3,
    label: str = "spec",
    drafters: dict[str, Drafting] = DRAFTERS,
    accuracy: Callable[[list[np.ndarray], list[list[int]]], float] | None = None,
) -> dict:
    """Every batching x side (`drafters`, and off) on `model` (None: the built-in model),
    `repeats` times interleaved: {"b<batch>": {"off": ..., <drafter>: ...}}, and how
    much of off's output is what the target was trained to say (`target_accuracy`; by
    default the exact copy)."""
    sides: dict[str, Drafting | None] = {"off": None, **drafters}
    runs: dict[tuple[int, str], list[Run]] = {(b, s): [] for b in batches for s in sides}
    for i in range(repeats):
        for b in batches:
            for name, drafting in sides.items():
                runs[b, name].append(run_once(model, b, drafting, prompts, new_tokens))
        progress(label, i + 1, repeats)
    judge = accuracy or copy_accuracy
    result: dict = {"target_accuracy": judge(prompts, runs[batches[0], "off"][0].outputs)}
    for b in batches:
        off = runs[b, "off"]
        cell = {"off": _off_figures(off)}
        cell |= {name: _drafter_figures(runs[b, name], off) for name in drafters}
        result[f"b{b}"] = cell
    return result


def copy_accuracy(prompts: list[np.ndarray], outputs: list[list[int]]) -> float:
    """The share of output tokens that continue the prompt's period (`SEP + A`) exactly."""
    right = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        period = prompt[: 1 + int(np.flatnonzero(prompt[1:] == SEPARATOR)[0])]  # BOS + A
        expected = np.resize(period, len(prompt) + len(out))[len(prompt) :]
        right += int((np.asarray(out) == expected).sum())
        total += len(out)
    return round(right / max(total, 1), 4)


def chain_accuracy(prompts: list[np.ndarray], outputs: list[list[int]]) -> float:
    """The share of output tokens that are the successor of the token before them."""
    right = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        before = np.asarray([prompt[-1], *out[:-1]])
        right += int((SUCCESSOR[before] == np.asarray(out)).sum())
        total += len(out)
    return round(right / max(total, 1), 4)


def table(result: dict) -> str:
    lines = [
        "| target | batch | side | tokens/verify step | forwards/token | ÷ off | wall s "
        "| ÷ off | same outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for target in ("copy_target", "chain_target", "random_target"):
        for b in BATCHES:
            for side, f in result[target][f"b{b}"].items():
                lines.append(
                    f"| {target.split('_')[0]} | {b} | {side} "
                    f"| {f.get('tokens_per_verify_step', '-')} "
                    f"| {f['target_forwards_per_token']} "
                    f"| {f.get('target_forwards_per_token_ratio', '-')} | {f['cpu_wall_s']} "
                    f"| {f.get('wall_ratio', '-')} | {f.get('outputs_identical_to_off', '-')} |"
                )
    return "\n".join(lines)


def run(repeats: int = 3) -> dict:
    copy, chain = cached_head("copy"), cached_head("chain")
    held_out = held_out_prompts()
    walks = held_out_prompts(draw=chain_prompt)
    payload: dict = {
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "drafts_per_verify_step": DRAFTS,
        "prompt_seed": PROMPT_SEED,
        "head_training_seed": HEAD_SEED,
        "repeats": repeats,
        "copy_target": {
            **_identity(copy),
            **measure(copy, held_out, repeats=repeats, label="copy", drafters=WITH_HEAD),
        },
        "chain_target": {
            **_identity(chain),
            **measure(
                chain,
                walks,
                repeats=repeats,
                label="chain",
                drafters=WITH_HEAD,
                accuracy=chain_accuracy,
            ),
        },
        "random_target": {
            "checkpoint": "built-in",
            **measure(None, held_out, repeats=repeats, label="random"),
        },
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "spec.json").write_text(json.dumps(payload, indent=2) + "\n")
    payload["table"] = table(payload)
    return payload


def _identity(checkpoint: Path) -> dict:
    """Which checkpoint (the target's weights and its trained head) a target's runs used."""
    return {
        "checkpoint": checkpoint.name,
        "recipe": recipe_id(),
        "sha256": weights_sha256(checkpoint),
    }
