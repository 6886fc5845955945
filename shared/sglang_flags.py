"""SGLang's launch flags, so a command line written for `sglang serve` (the one its test
kits' `popen_launch_server` builds, a deployment's args) starts `custody up` unchanged.

Each SGLang flag is one of three things here:
- an alias of the custody setting that means the same (`ALIASES`: `--context-length` is
  `--context-len`), shown beside custody's name in `custody up --help`, its values in
  SGLang's spelling too (`VALUES`: `--reasoning-parser nemotron_3`, `--dtype half`);
- behaviour custody always has, so accepted with nothing to set (`ALWAYS`);
- refused by name, saying why (`REFUSED`; `ONE` for the parallel sizes, whose only value
  here is 1; `--tokenizer-path` unless it is the model's own directory).
SGLang's boolean flags are bare (`--enable-streaming-session`); custody's take a value
(`--compile false`) or stand bare for true, so both spellings start it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# custody setting -> SGLang's flag for the same thing
ALIASES = {
    "model": "--model-path",
    "context_len": "--context-length",
    "chunk_size": "--chunked-prefill-size",
    "api_keys": "--api-key",
    "mamba_slots": "--max-mamba-cache-size",
    "max_step_tokens": "--max-prefill-tokens",
    "admin_api_keys": "--admin-api-key",
}
# custody setting -> SGLang's spelling of a value -> custody's
VALUES = {
    "reasoning_parser": {"deepseek-r1": "deepseek_r1", "nemotron_3": "nemotron_v3"},
    "dtype": {"half": "float16", "float": "float32"},
}
# SGLang's flag -> why custody needs no setting for it
ALWAYS = {
    "--enable-streaming-session": "every custody session streams: its state stays between turns",
    "--skip-server-warmup": "custody sends itself no warm-up request (the executor warms up "
    "before its first heartbeat)",
    "--trust-remote-code": "custody runs no code of a checkpoint's (NemotronH is built in)",
    "--enable-metrics": "every custody service always exports Prometheus metrics",
}
# SGLang's flag -> why custody cannot do what it asks
REFUSED = {
    "--mem-fraction-static": "custody sizes its pools by count (KV pages, Mamba slots)",
    "--max-total-tokens": "custody sizes its KV pool in pages (KV pages times the page size)",
    "--quantization": "custody serves unquantized weights (docs/checkpoints.md)",
    "--enable-lora": "custody serves no adapters",
    "--lora-paths": "custody serves no adapters",
    "--attention-backend": "custody runs its own attention and Mamba kernels",
    "--disable-radix-cache": "custody's prefix cache is where sessions' shared prefixes live",
    "--random-seed": "custody seeds sampling per request (its seed field)",
}
ONE = ("--tp-size", "--tensor-parallel-size", "--dp-size", "--data-parallel-size", "--pp-size")


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's flags that are not aliases of a setting (those `Settings.add_arguments`
    adds under both names)."""
    group = parser.add_argument_group("SGLang's launch flags", "accepted or refused by name")
    for flag, why in ALWAYS.items():
        group.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for flag, why in REFUSED.items():
        group.add_argument(flag, nargs="?", const="", default=None, help=f"refused: {why}")
    for flag in ONE:
        group.add_argument(flag, type=int, default=None, help="accepted as 1 (one device)")
    group.add_argument(
        "--disable-cuda-graph", action="store_true", help="the same as --compile false"
    )
    group.add_argument(
        "--tokenizer-path",
        type=Path,
        default=None,
        help="accepted when it is --model-path (custody reads the checkpoint's tokenizer)",
    )


def apply_sglang_flags(args: argparse.Namespace) -> None:
    """What SGLang's flags set in custody's terms (`--disable-cuda-graph`: an eager
    decode step); a ValueError naming the first one custody cannot honour."""
    if args.disable_cuda_graph:
        args.compile = False
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag)) is not None:
            raise ValueError(f"{flag} is not supported: {why}")
    for flag in ONE:
        size = getattr(args, _dest(flag))
        if size is not None and size != 1:
            raise ValueError(f"{flag} {size}: custody runs one model copy on one device")
    tokenizer = args.tokenizer_path
    if tokenizer is not None and (
        args.model is None or tokenizer.resolve() != Path(args.model).resolve()
    ):
        raise ValueError(
            f"--tokenizer-path {tokenizer}: custody reads the tokenizer from the checkpoint "
            "directory (--model-path); give no other"
        )


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
