"""Building the model: the built-in tiny model with seeded random weights, or a
NemotronH checkpoint directory (`config.json` + `*.safetensors`, transformers' names),
in the dtype `--dtype` resolves to on its device (shared/dtypes.py). The pools take the
model's dtype from its weights, so one setting decides both. `--load-format dummy` gives
a checkpoint's config the built-in model's seeded random weights, drawn on the device: a
published shape (8B and up) is benchmarked without its weights, and without drawing
billions of numbers on the host."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.executor.model.mamba2 import Mamba2Mixer
from services.executor.model.nemotron_h import NemotronH
from shared.dtypes import resolve_dtype
from shared.model_config import ModelConfig, builtin_config

BUILTIN_SEED = 20261122
CPU = torch.device("cpu")
log = logging.getLogger("custody.executor")


def load_model(
    path: Path | None,
    device: torch.device,
    dtype: str = "auto",
    load_format: str = "auto",
    mtp: bool = False,
) -> NemotronH:
    """`dtype`: a `--dtype` value; `auto` reads the checkpoint's and the device.
    `load_format`: `auto` reads the checkpoint's weights, `dummy` draws them. `mtp`:
    with the checkpoint's multi-token-prediction head (speculative decoding's draft)."""
    cfg = builtin_config() if path is None else ModelConfig.from_dir(Path(path))
    resolved = getattr(torch, resolve_dtype(dtype, cfg, gpu=device.type == "cuda"))
    if path is None or load_format == "dummy":
        return builtin_model(cfg, device, mtp).to(dtype=resolved).eval()
    return load_checkpoint(Path(path), cfg, device, resolved, mtp).eval()


def load_checkpoint(
    path: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, mtp: bool = False
) -> NemotronH:
    """The model built without memory (meta device) and its parameters taken from the
    files, each converted once to `dtype` on `device`: a 16-bit checkpoint never exists
    as a float32 copy. Either layout of MoE experts loads: a released checkpoint's
    tensors per expert are fused as read into transformers' two tensors per layer.
    Multi-token-prediction weights (`mtp.*`) are loaded with `mtp` (the head drafts for
    speculative decoding), else skipped, by name in the log."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors")
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    skipped: list[str] = []
    for f in files:
        for name, tensor in load_file(str(f), device=str(device)).items():
            if name.startswith("mtp.") and not mtp:
                skipped.append(name)
                continue
            name = _checkpoint_name(name)
            kept = tensor if name.endswith(FLOAT32_BUFFERS) else tensor.to(dtype)
            expert = PER_EXPERT.fullmatch(name)
            if expert is None:
                state[name] = kept
            else:
                layer, index, proj = expert.groups()
                experts.setdefault(f"{layer}.experts.{proj}", {})[int(index)] = kept
    for name, pieces in experts.items():
        state[name] = _fused(name, pieces)
    if skipped:
        log.info(
            "skipped %d multi-token-prediction tensors (%s, ...): no speculation with them",
            len(skipped),
            skipped[0],
        )
    with torch.device("meta"):
        model = NemotronH(cfg, mtp)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if mtp and any(name.startswith("mtp.") for name in missing):
        raise ValueError(f"{path} holds no multi-token-prediction weights (mtp.*) to draft with")
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model


# a released checkpoint's expert tensors: backbone.layers.{i}.mixer.experts.{j}.{up,down}_proj
PER_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(up_proj|down_proj)\.weight")
# kept in float32 whatever the dtype, as transformers keeps them
FLOAT32_BUFFERS = ("e_score_correction_bias",)


def _fused(name: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """One layer's per-expert tensors stacked in expert order, as transformers fuses them."""
    if sorted(pieces) != list(range(len(pieces))):
        raise ValueError(f"checkpoint does not match: {name} lacks experts of 0..{max(pieces)}")
    fused = torch.stack([pieces[i] for i in range(len(pieces))])
    pieces.clear()  # each expert's tensor is freed once it is in the fused one
    return fused


def model_dtype(model: NemotronH) -> torch.dtype:
    """The dtype the model's pools must hold: its weights'."""
    return model.lm_head.weight.dtype


def _checkpoint_name(name: str) -> str:
    return "backbone." + name[len("model.") :] if name.startswith("model.") else name


def builtin_model(
    cfg: ModelConfig | None = None, device: torch.device = CPU, mtp: bool = False
) -> NemotronH:
    """Seeded random weights, initialised the way transformers initialises NemotronH: of
    the built-in config, or of `cfg` (a benchmark's variant of it, or a checkpoint's
    config under `--load-format dummy`), in float32 on `device`, drawn there by a
    generator of that device (so a CUDA model's numbers differ from a CPU one's)."""
    cfg = cfg or builtin_config()
    generator = torch.Generator(device=device).manual_seed(BUILTIN_SEED)
    with torch.device(device):
        model = NemotronH(cfg, mtp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.dim() >= 2 or name.endswith("embeddings.weight"):
                p.normal_(0.0, cfg.initializer_range, generator=generator)
        for mixer in model.modules():
            if isinstance(mixer, Mamba2Mixer):
                heads = cfg.mamba_num_heads
                mixer.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
                mixer.D.fill_(1.0)
                lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
                drawn = torch.rand(heads, generator=generator, device=device)
                dt = torch.exp(drawn * (hi - lo) + lo)
                dt = dt.clamp(min=cfg.time_step_floor)
                mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
    return model
