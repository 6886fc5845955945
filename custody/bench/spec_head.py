"""Training a test checkpoint's multi-token-prediction head for `custody bench spec`.

The head learns what the target would say next, from the target itself: the target's
greedy continuations of the training prompts (drawn by the caller with one seed; the
benchmark measures on prompts of another), its final hidden state at every position,
and at position p the head is taught the token at p + 2 from the hidden state at p and
the token at p + 1, as it drafts (services/executor/model/mtp.py). The target, its
embeddings and its `lm_head` stay frozen; only `mtp.*` trains. A fixed count of steps
on one thread from seeded weights: the same head bit for bit on every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from custody.bench import spec_targets
from custody.inprocess import InProcess
from services.executor.model.batch import ForwardBatch
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.weights import builtin_model, load_model
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings
from shared.messages.forward import StepRow
from shared.model_config import ModelConfig

HEAD_CONFIG = {  # a small head: one attention layer, then four experts of 64
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
}
STEPS, BATCH, LEARNING_RATE = 300, 16, 3e-3
TRAIN_PROMPTS, TRAIN_TOKENS, HEAD_SEED = 64, 48, 11  # the bench measures on another seed
# a target's name -> how the bench builds it and draws its prompts
TARGETS: dict[str, tuple[Callable[[], Path], Callable[[np.random.Generator], np.ndarray]]] = {
    "copy": (spec_targets.cached_copy_target, spec_targets.copy_prompt),
    "chain": (spec_targets.cached_chain_target, spec_targets.chain_prompt),
}


def continuations(target: Path, prompts: list[np.ndarray], new_tokens: int) -> list[np.ndarray]:
    """Each prompt followed by the target's greedy continuation of it."""
    local = InProcess(Settings(model=target, tokenizer="byte", compile=False, kv_pages=512))
    reqs = [
        local.engine.submit(Request(f"t{i}", p, SamplingParams(max_new_tokens=new_tokens)))
        for i, p in enumerate(prompts)
    ]
    local.run_until_idle()
    return [np.concatenate([r.prompt, np.asarray(r.output, dtype=np.int64)]) for r in reqs]


@torch.inference_mode()
def final_hidden(model: NemotronH, sequence: np.ndarray) -> torch.Tensor:
    """The target's final hidden state at every position of `sequence`."""
    n = len(sequence)
    pools = DevicePools(model.cfg, PoolSizes(n + 1, 1, 2), torch.device("cpu"))
    row = StepRow.of(sequence, 0, np.arange(1, n + 1), 1, sample=False)
    return model(ForwardBatch([row], torch.device("cpu")), pools).clone()


def train_head(target: Path, prompts: list[np.ndarray], new_tokens: int, out: Path) -> Path:
    """A checkpoint in `out`: the target's weights and config, and a head trained on its
    continuations of `prompts`."""
    torch.set_num_threads(1)
    sequences = continuations(target, prompts, new_tokens)
    frozen = load_model(target, torch.device("cpu"), "float32")
    hidden = [final_hidden(frozen, s) for s in sequences]
    cfg: ModelConfig = dataclasses.replace(frozen.cfg, **HEAD_CONFIG)
    head = builtin_model(cfg, mtp=True).mtp  # seeded initial weights
    embed, lm_head = frozen.backbone.embeddings, frozen.lm_head
    optimiser = torch.optim.AdamW(head.parameters(), lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(7)
    empty = torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim)
    for _ in range(STEPS):
        picks = torch.randint(len(sequences), (BATCH,), generator=generator).tolist()
        loss = torch.zeros(())
        for i in picks:
            tokens = torch.from_numpy(sequences[i])
            with torch.no_grad():
                embeds = embed(tokens[1:-1])
            guessed, _, _ = head.layers_over(embeds, hidden[i][:-2], empty, empty)
            logits = lm_head(guessed)
            loss = loss + torch.nn.functional.cross_entropy(logits, tokens[2:])
        optimiser.zero_grad()
        (loss / BATCH).backward()
        optimiser.step()
    return save(target, head, cfg, out)


def save(target: Path, head: torch.nn.Module, cfg: ModelConfig, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(target.glob("*.safetensors")):
        state |= load_file(str(f))
    state |= {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((target / "config.json").read_text()) | HEAD_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for extra in target.iterdir():  # a tokenizer, if the target has one
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


def training_prompts(target: str) -> list[np.ndarray]:
    rng = np.random.default_rng(HEAD_SEED)
    return [TARGETS[target][1](rng) for _ in range(TRAIN_PROMPTS)]


def build_head(target: str, out: Path) -> Path:
    """`target`'s checkpoint (built if not cached) with a head trained on it, in `out`."""
    return train_head(TARGETS[target][0](), training_prompts(target), TRAIN_TOKENS, out)


def cached_head(target: str) -> Path:
    """The checkpoint with `target`'s head, cached as <target>-head-<recipe> (the recipe:
    this file's and spec_targets.py's bytes)."""
    files = (Path(__file__), Path(spec_targets.__file__))
    recipe = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    return spec_targets.cached(f"{target}-head-{recipe}", lambda out: build_head(target, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("out_dir", nargs="?", type=Path, help="default: build the cache")
    args = parser.parse_args(argv)
    TARGETS[args.target][0]()  # the target first: its training is not the head's
    start = time.perf_counter()
    path = (
        cached_head(args.target) if args.out_dir is None else build_head(args.target, args.out_dir)
    )
    seconds = time.perf_counter() - start
    digest = spec_targets.weights_sha256(path)
    print(json.dumps({"checkpoint": str(path), "sha256": digest, "s": seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
