"""The model's shape, read from a NemotronH `config.json` (transformers' key names) or
the built-in tiny model. Pure data: no torch here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_VOCAB

MIXERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MTP_PATTERN = "*E"  # the MTP head custody runs: attention (with the input projections), MoE
SSM_CACHE_DTYPES = ("float32", "bfloat16", "float16")


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
    # the SSM state pool's dtype, whatever `--dtype` (vLLM serves recent releases with a
    # 16-bit one; transformers keeps float32 whatever this says)
    mamba_ssm_cache_dtype: str = "float32"
    # mixture-of-experts layers ("moe", pattern "E"); transformers' defaults
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    # 0: no shared experts; n: one MLP n times moe_shared_expert_intermediate_size wide
    # (as vLLM reads it; transformers always builds one of that width)
    n_shared_experts: int = 1
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None  # the experts' width, if not hidden_size
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # a multi-token-prediction head (docs/speculative.md): its layers' pattern, as
    # hybrid_override_pattern spells the backbone's; custody runs "*E" (attention, MoE)
    num_nextn_predict_layers: int = 0
    mtp_hybrid_override_pattern: str = ""

    # ---- derived ----
    @property
    def mtp_problem(self) -> str | None:
        """Why custody cannot run this checkpoint's MTP head (None: it can)."""
        layers, pattern = self.num_nextn_predict_layers, self.mtp_hybrid_override_pattern
        if not layers:
            return "the checkpoint has no multi-token-prediction head (num_nextn_predict_layers)"
        if layers != 1 or pattern != MTP_PATTERN:
            return (
                f"its MTP head ({layers} x {pattern!r}) is not one attention layer then one "
                f"mixture-of-experts layer ({MTP_PATTERN!r}), the one custody runs"
            )
        return None

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
        if "moe" in self.layers_block_type or self.mtp_problem is None:
            self._validate_moe()
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPES:
            raise UnsupportedModel(
                f"mamba_ssm_cache_dtype must be one of {', '.join(SSM_CACHE_DTYPES)}, "
                f"not {self.mamba_ssm_cache_dtype!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModel("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mamba_num_heads % self.n_groups or self.mamba_intermediate % self.n_groups:
            raise UnsupportedModel("mamba heads must split evenly into n_groups")

    def _validate_moe(self) -> None:
        """The routing transformers computes needs these (its group score sums each
        group's two best experts)."""
        experts, groups = self.n_routed_experts, self.n_group
        if experts < 1 or groups < 1 or experts % groups or experts // groups < 2:
            raise UnsupportedModel(
                f"n_routed_experts ({experts}) must split into n_group ({groups}) groups "
                "of at least two experts"
            )
        if not 1 <= self.topk_group <= groups:
            raise UnsupportedModel(f"topk_group ({self.topk_group}) must lie in 1..n_group")
        reachable = self.topk_group * experts // groups
        if not 1 <= self.num_experts_per_tok <= reachable:
            raise UnsupportedModel(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in 1..{reachable} "
                "(the experts of topk_group groups)"
            )
        widths = {
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            "moe_latent_size": 1 if self.moe_latent_size is None else self.moe_latent_size,
        }
        bad = {k: v for k, v in widths.items() if v < 1} | (
            {"n_shared_experts": self.n_shared_experts} if self.n_shared_experts < 0 else {}
        )
        if bad:
            raise UnsupportedModel(f"MoE sizes must be positive (n_shared_experts >= 0): {bad}")

    # ---- loading ----
    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        raw = dict(raw)
        refused = {k: raw[k] for k, ok in IMPLEMENTED_ONLY.items() if raw.get(k, ok[0]) not in ok}
        if refused:
            raise UnsupportedModel(f"custody's executor does not implement {refused}")
        if raw.get("quantization_config"):
            raise UnsupportedModel(
                "custody's executor serves unquantized weights only, not quantization_config "
                + quantization_name(raw["quantization_config"])
            )
        if "layers_block_type" not in raw:
            if "hybrid_override_pattern" not in raw:
                raise UnsupportedModel(
                    "config has neither layers_block_type nor hybrid_override_pattern"
                )
            pattern = str(raw["hybrid_override_pattern"])
            unknown = sorted(set(pattern) - set(MIXERS))
            if unknown:
                raise UnsupportedModel(
                    f"hybrid_override_pattern {pattern!r} holds {unknown}: custody knows "
                    f"{', '.join(f'{c} ({m})' for c, m in MIXERS.items())}"
                )
            raw["layers_block_type"] = [MIXERS[c] for c in pattern]
        for old, new in (
            ("mamba_n_groups", "n_groups"),
            ("mamba_d_conv", "conv_kernel"),
            ("mamba_chunk_size", "chunk_size"),
            ("mamba_conv_bias", "use_conv_bias"),
            ("mamba_dt_min", "time_step_min"),
            ("dtype", "torch_dtype"),  # transformers >= 4.56 writes `dtype`
            ("num_local_experts", "n_routed_experts"),  # transformers' alias
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


def quantization_name(quantization: object) -> str:
    """A checkpoint's quantization as its config names it (FP8: quant_method `fp8`;
    NVFP4: quant_method `modelopt`, quant_algo `NVFP4`)."""
    if not isinstance(quantization, dict):
        return repr(quantization)
    named = {k: quantization[k] for k in ("quant_method", "quant_algo") if k in quantization}
    return ", ".join(f"{k} = {v!r}" for k, v in named.items()) or repr(quantization)


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
