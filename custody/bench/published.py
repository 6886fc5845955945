"""Published NemotronH shapes, for the benchmarks that run custody at the size it is for
(with `--load-format dummy`'s seeded random weights: the numbers of a forward depend on
the shape, not on what the weights say).

Nemotron-H 8B (NVIDIA's Nemotron-H-8B-Base-8K): 52 layers in the pattern below (24
Mamba-2, 4 attention, 24 squared-ReLU MLP), hidden size 4096, Mamba-2 with 128 heads of
64 channels, 8 groups and a state of 128, attention with 32 query and 8 KV heads of 128,
an MLP of 21504, a vocabulary of 131072 and untied embeddings: about 8.1e9 parameters,
16.2 GB in bfloat16.
"""

from __future__ import annotations

from shared.model_config import MIXERS, ModelConfig

NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

NEMOTRON_H_8B = ModelConfig(
    vocab_size=131072,
    hidden_size=4096,
    layers_block_type=[MIXERS[c] for c in NEMOTRON_H_8B_PATTERN],
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=21504,
    ssm_state_size=128,
    mamba_num_heads=128,
    mamba_head_dim=64,
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    max_position_embeddings=8192,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=2,
)
