"""The targets of `custody bench spec`: small NemotronH models trained to be guessable.

A drafter is worth measuring only on a target whose continuations it can guess; the
built-in model's random weights continue a prompt with noise, so no draft is ever right
for long. This target, given `BOS + A + SEP + A[:k]` (A: 8 to 32 random bytes), goes on
copying A, then SEP, then A again: text that repeats, where an n-gram draft should win.

- **Shape.** The built-in config (`builtin_config()`) narrowed to hidden 64 (attention
  as the built-in's: 4 heads of 32, 2 KV heads) and cut to its first three layers,
  Mamba, attention, MLP: the Mamba layer's short convolution can carry each position's
  previous token, and the attention layer then finds where the current token was seen
  before and reads what followed it (an induction head). With all seven layers the loss
  had not left ln 256 after 45 s; heads of 16 copied less exactly.
- **Data.** SEP is BOS (256): no byte is one, and `BOS + A` repeated is exactly periodic,
  so even the first token after the first SEP is found as every later one is. The loss
  counts every token after the first SEP. The first 350 steps see A of 8 to 16 bytes in
  48 tokens (the copy forms sooner on short ones), the last 400 A of 8 to 32 in 100 (the
  bench's longest sequence is 98).
- **Why it trains in time.** `lm_head` starts as the embeddings times 8 (two tensors
  still: custody refuses tied ones), so a token read from the context is already that
  token's logit, and a confident one; from a random `lm_head` the loss stayed at ln 256
  for 700 steps.
- **Bit for bit.** Seeded weights and data (`TRAIN_SEED`; the bench draws its prompts with
  another seed), a fixed count of steps, one thread: two builds write the same bytes.

The *chain target* (same shape and start) is the easiest target there is for an MTP
head: after BOS and a first byte, each token is followed by SUCCESSOR[token], a fixed
random permutation of the bytes, which it learns in 200 steps (a few seconds). Its
greedy continuation is a walk the head can learn from the embedding of the token it is
given alone, and that an n-gram rarely guesses (a walk repeats only when it closes its
cycle: this permutation's cycles are 224, 26, 2, 2, 1 and 1 bytes long) and repeating
the last token almost never does (two bytes are their own successor). What it shows is
the machinery of an MTP head's drafts and their cost, not a head's worth on real text.

Both train through transformers' NemotronH (custody's own forward is inference-only) and
save transformers' names, `config.json` and the byte tokenizer's files: checkpoints
`custody up --model` and `InProcess` load. `scripts/build-spec-targets.sh` builds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shared.model_config import builtin_config
from shared.tokenizer import BYTE_BOS

SEPARATOR = BYTE_BOS
SHORTEST, LONGEST = 8, 32  # bytes of A
TRAIN_SEED = 1  # weights and training sequences; the bench's prompts use another seed
COPY_CONFIG = dataclasses.replace(
    builtin_config(),
    hidden_size=64,
    layers_block_type=["linear_attention", "full_attention", "mlp"],
    torch_dtype="float32",
)
# the chain target: each token followed by SUCCESSOR[token], a fixed random permutation
SUCCESSOR = np.random.default_rng(3).permutation(256)
CHAIN_LENGTH, CHAIN_STEPS, CHAIN_LEARNING_RATE = 32, 200, 3e-3
# (steps, sequences per step, tokens per sequence, longest A): short copies first
PHASES = ((350, 16, 48, 16), (400, 16, 100, LONGEST))
LEARNING_RATE, WARMUP, FINAL_LR_SHARE = 1e-3, 30, 0.1
LM_HEAD_SCALE = 8.0


def copy_prompt(rng: np.random.Generator) -> np.ndarray:
    """`BOS + A + SEP + A[:k]`, A of SHORTEST..LONGEST random bytes, 1 <= k <= len(A) // 2
    (so 48 more tokens stay within the 100 the target trained on)."""
    a = rng.integers(0, 256, rng.integers(SHORTEST, LONGEST + 1)).tolist()
    k = int(rng.integers(1, len(a) // 2 + 1))
    return np.asarray([BYTE_BOS, *a, SEPARATOR, *a[:k]], dtype=np.int64)


def _batch(
    rng: np.random.Generator, size: int, length: int, longest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` sequences of `length` tokens, each `BOS + A` repeated; labels mask the first
    period and the SEP after it (nothing tells where A ends the first time)."""
    inputs = np.empty((size, length), dtype=np.int64)
    labels = np.empty_like(inputs)
    for row in range(size):
        a = rng.integers(0, 256, rng.integers(SHORTEST, longest + 1))
        period = np.concatenate([[SEPARATOR], a])
        inputs[row] = np.resize(period, length)
        labels[row] = inputs[row]
        labels[row, : len(period) + 1] = -100
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def _twin():
    """transformers' NemotronH of COPY_CONFIG with seeded weights, `lm_head` = embeddings."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TRAIN_SEED)
        model = NemotronHForCausalLM(NemotronHConfig(**COPY_CONFIG.to_dict())).float()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embeddings.weight * LM_HEAD_SCALE)
    return model.train()


def _learning_rate(step: int) -> float:
    """Linear warm-up, flat through the short copies, then a linear decay to a tenth."""
    first, total = PHASES[0][0], sum(p[0] for p in PHASES)
    decay = max(0, step - first) / (total - first)
    return LEARNING_RATE * min((step + 1) / WARMUP, 1.0 - (1.0 - FINAL_LR_SHARE) * decay)


Batches = Callable[[np.random.Generator, int], tuple[torch.Tensor, torch.Tensor]]


def train(batches: Batches, steps: int, learning_rate: Callable[[int], float]) -> torch.nn.Module:
    """The twin trained for `steps` steps on `batches(rng, step)`, on one thread (the
    caller's count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _twin()
        optimiser = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
        rng = np.random.default_rng(TRAIN_SEED)
        for step in range(steps):
            inputs, labels = batches(rng, step)
            for group in optimiser.param_groups:
                group["lr"] = learning_rate(step)
            out = model(input_ids=inputs, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            optimiser.zero_grad()
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def _copy_batches(rng: np.random.Generator, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy recipe's batch of `step`: its phase's shape."""
    first = PHASES[0][0]
    _, size, length, longest = PHASES[0] if step < first else PHASES[1]
    return _batch(rng, size, length, longest)


def chain_prompt(rng: np.random.Generator) -> np.ndarray:
    """`BOS` and 4 to 12 tokens of the chain target's successor walk from a random byte."""
    walk = [int(rng.integers(0, 256))]
    for _ in range(int(rng.integers(3, 12))):
        walk.append(int(SUCCESSOR[walk[-1]]))
    return np.asarray([BYTE_BOS, *walk], dtype=np.int64)


def _chain_batches(rng: np.random.Generator, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Successor walks of CHAIN_LENGTH tokens after BOS; the first token is a guess."""
    inputs = np.empty((16, CHAIN_LENGTH), dtype=np.int64)
    inputs[:, 0] = BYTE_BOS
    inputs[:, 1] = rng.integers(0, 256, 16)
    for i in range(2, CHAIN_LENGTH):
        inputs[:, i] = SUCCESSOR[inputs[:, i - 1]]
    labels = inputs.copy()
    labels[:, :2] = -100
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def build_copy_target(out_dir: Path) -> Path:
    """Train the copy target and write it as a checkpoint into `out_dir`; returns it."""
    return _save(train(_copy_batches, sum(p[0] for p in PHASES), _learning_rate), out_dir)


def build_chain_target(out_dir: Path) -> Path:
    """Train the chain target and write it as a checkpoint into `out_dir`; returns it."""
    return _save(train(_chain_batches, CHAIN_STEPS, lambda _: CHAIN_LEARNING_RATE), out_dir)


def _save(model: torch.nn.Module, out_dir: Path) -> Path:
    """`model` as a checkpoint in `out_dir`, with the byte tokenizer's files."""
    from safetensors.torch import save_file

    from services.scheduler.text.tokenizer_files import export_byte_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.dumps(COPY_CONFIG.to_dict(), indent=1, sort_keys=True)
    (out_dir / "config.json").write_text(config + "\n")
    export_byte_tokenizer(out_dir, COPY_CONFIG.max_position_embeddings)
    return out_dir


def recipe_id() -> str:
    """Names a build by this file's bytes: a changed recipe is a different target."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def cache_dir(name: str) -> Path:
    """Where the bench keeps what it built: ~/.cache/custody/spec/<name>."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "custody" / "spec" / name


def cached_copy_target() -> Path:
    return cached(f"copy-{recipe_id()}", build_copy_target)


def cached_chain_target() -> Path:
    return cached(f"chain-{recipe_id()}", build_chain_target)


def cached(name: str, build: Callable[[Path], Path]) -> Path:
    """The checkpoint cached as `name`, built first if missing (into a temporary
    directory beside it, renamed into place once complete, so a half-written one is
    never read)."""
    final = cache_dir(name)
    if (final / "model.safetensors").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        build(building)
        os.replace(building, final)
    except OSError:
        if not (final / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)  # another build won the rename
    return final


def weights_sha256(checkpoint: Path) -> str:
    return hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", action="store_true", help="the chain target, not the copy")
    parser.add_argument(
        "out_dir", nargs="?", type=Path, help="where to write it (default: build the cache)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out_dir is None:
        path = cached_chain_target() if args.chain else cached_copy_target()
    else:
        path = (build_chain_target if args.chain else build_copy_target)(args.out_dir)
    seconds = time.perf_counter() - start
    print(json.dumps({"checkpoint": str(path), "sha256": weights_sha256(path), "s": seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
