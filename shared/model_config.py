"""The model's shape, read from a NemotronH `config.json` (transformers' key names) or
the built-in tiny model. Pure data: no torch here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_VOCAB

MIXERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


class UnsupportedModel(ValueError):
    pass


# Config keys whose other values change the model's arithmetic in ways custody's executor
# does not implement: such a checkpoint is refused by name rather than served wrong.
# (time_step_limit and residual_in_fp32 are absent: transformers' NemotronH reads neither.)
IMPLEMENTED_ONLY = {
    "mlp_hidden_act": ("relu2",),
    "mamba_hidden_act": ("silu",),
    "attention_bias": (False,),
    "mamba_proj_bias": (False,),
    "sliding_window": (None,),
    "tie_word_embeddings": (False,),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    layers_block_type: list[str] = field(default_factory=list)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    mlp_bias: bool = False
    ssm_state_size: int = 16
    mamba_num_heads: int = 8
    mamba_head_dim: int = 16
    n_groups: int = 2
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    chunk_size: int = 64  # SSD chunk of the prefill scan
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    eos_token_id: int | list[int] | None = None  # as the checkpoint gives it: one id or several
    bos_token_id: int | None = None
    max_position_embeddings: int = 8192
    torch_dtype: str | None = None  # the weights' dtype as saved (`--dtype auto` on a GPU)

    # ---- derived ----
    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layers_block_type) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layers_block_type) if t == "full_attention"]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation (a checkpoint may list several)."""
        eos = self.eos_token_id
        return frozenset(eos if isinstance(eos, list) else () if eos is None else (eos,))

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    def validate(self) -> None:
        unknown = set(self.layers_block_type) - set(MIXERS.values())
        if unknown or not self.layers_block_type:
            raise UnsupportedModel(
                f"layers_block_type must list known mixers, got {unknown or 'none'}"
            )
        if "moe" in self.layers_block_type:
            raise UnsupportedModel("moe layers are not supported by custody's executor")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModel("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mamba_num_heads % self.n_groups or self.mamba_intermediate % self.n_groups:
            raise UnsupportedModel("mamba heads must split evenly into n_groups")

    # ---- loading ----
    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        raw = dict(raw)
        refused = {k: raw[k] for k, ok in IMPLEMENTED_ONLY.items() if raw.get(k, ok[0]) not in ok}
        if refused:
            raise UnsupportedModel(f"custody's executor does not implement {refused}")
        if "layers_block_type" not in raw:
            if "hybrid_override_pattern" not in raw:
                raise UnsupportedModel(
                    "config has neither layers_block_type nor hybrid_override_pattern"
                )
            raw["layers_block_type"] = [MIXERS[c] for c in raw["hybrid_override_pattern"]]
        for old, new in (
            ("mamba_n_groups", "n_groups"),
            ("mamba_d_conv", "conv_kernel"),
            ("mamba_chunk_size", "chunk_size"),
            ("mamba_conv_bias", "use_conv_bias"),
            ("mamba_dt_min", "time_step_min"),
            ("dtype", "torch_dtype"),  # transformers >= 4.56 writes `dtype`
        ):
            if old in raw:
                raw[new] = raw.pop(old)
        known = {f for f in cls.__dataclass_fields__}
        config = cls(**{k: v for k, v in raw.items() if k in known})
        config.validate()
        return config

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def to_dict(self) -> dict:
        """transformers-compatible keys (a NemotronHConfig accepts this dict)."""
        out = asdict(self)
        out["model_type"] = "nemotron_h"
        out["mamba_hidden_act"], out["mlp_hidden_act"] = "silu", "relu2"
        return out


def builtin_config() -> ModelConfig:
    """The built-in tiny model: NoPE attention makes any context length valid; 8,192 is
    the advertised one."""
    return ModelConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        layers_block_type=[
            "linear_attention",
            "mlp",
            "linear_attention",
            "full_attention",
            "mlp",
            "linear_attention",
            "mlp",
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        chunk_size=64,
        bos_token_id=BYTE_BOS,
        eos_token_id=BYTE_EOS,
        max_position_embeddings=8192,
    )
