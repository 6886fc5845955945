"""A tiny NemotronH in transformers and the same weights in custody's executor."""

from __future__ import annotations

from pathlib import Path

import torch

from services.executor.model.batch import ForwardBatch
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.weights import load_model
from shared.messages.forward import StepRow

LAYERS = [
    "linear_attention",
    "full_attention",
    "mlp",
    "linear_attention",
    "full_attention",
    "mlp",
    "linear_attention",
]


def tiny_config(vocab_size: int, layers: list[str], **extra: object):
    """A transformers NemotronHConfig small enough for CPU tests, with n_groups > 1."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        layers_block_type=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=64,
        ssm_state_size=8,
        mamba_num_heads=6,
        mamba_head_dim=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        initializer_range=0.15,
        use_conv_bias=True,
        **extra,
    )


def build_reference(directory: Path):
    """transformers' NemotronHForCausalLM, saved to `directory`."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    ref = NemotronHForCausalLM(tiny_config(96, LAYERS, eos_token_id=None)).float().eval()
    ref.save_pretrained(directory, safe_serialization=True)
    return ref


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


CPU = torch.device("cpu")


def ours(directory: Path, device: torch.device = CPU) -> NemotronH:
    return load_model(directory, device)


TOKENS = 512  # KV capacity of the test pools, whatever the page size


def pools_for(
    model: NemotronH, page_size: int, slots: int = 8, device: torch.device = CPU
) -> DevicePools:
    return DevicePools(model.cfg, PoolSizes(TOKENS // page_size, page_size, slots), device)


def all_logits(
    model: NemotronH, pools: DevicePools, rows: list[StepRow], device: torch.device = CPU
) -> list[torch.Tensor]:
    """Logits at every position of every row (the runner returns only the last), on
    `device` (the model's and the pools')."""
    batch = ForwardBatch(rows, device)
    hidden = model(batch, pools)
    with torch.no_grad():
        logits = model.lm_head(hidden).float()
    return [logits[batch.span(i)] for i in range(len(rows))]


def row(tokens: list[int], start: int, kv: torch.Tensor, slot: int, **kw) -> StepRow:
    return StepRow.of(tokens, start, kv[: start + len(tokens)], slot, **kw)


def scattered_kv(lengths: list[int], page_size: int, seed: int) -> list[torch.Tensor]:
    """Token indices for rows of these lengths, each on its own randomly chosen pages
    (never the sink page), as a paged allocator would hand them out."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(TOKENS // page_size, generator=g) + 1
    out, used = [], 0
    for length in lengths:
        n = -(-length // page_size)
        chosen, used = pages[used : used + n], used + n
        pos = torch.arange(length)
        out.append(chosen[pos // page_size] * page_size + pos % page_size)
    return out
