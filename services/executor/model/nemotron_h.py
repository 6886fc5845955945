"""NemotronH (transformers' `NemotronHForCausalLM`) over custody's pools: a per-layer
list of Mamba2, attention, MLP and mixture-of-experts mixers, each after an RMS norm and
with a residual. Parameter names are those of NemotronH checkpoints (`backbone.*`,
`lm_head.*`; weights named `model.*`, transformers' in-memory names, are accepted too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.executor.model.attention import Attention
from services.executor.model.batch import DecodeRows, ForwardBatch
from services.executor.model.layers import MLP, RMSNorm
from services.executor.model.mamba2 import Mamba2Mixer
from services.executor.model.moe import MoE
from services.executor.model.mtp import MtpHead
from services.executor.model.pools import DevicePools
from shared.model_config import ModelConfig, UnsupportedModel


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg)
        elif kind == "full_attention":
            self.mixer = Attention(cfg)
        elif kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.layers_block_type)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronH(nn.Module):
    def __init__(self, cfg: ModelConfig, mtp: bool = False) -> None:
        """`mtp`: with the checkpoint's multi-token-prediction head (mtp.py), which the
        config must describe as one custody runs."""
        super().__init__()
        cfg.validate()
        if mtp and cfg.mtp_problem:
            raise UnsupportedModel(f"no MTP head to load: {cfg.mtp_problem}")
        self.cfg = cfg
        self.backbone = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MtpHead(cfg) if mtp else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        """Final hidden states of every token of the batch, in row order."""
        mix = lambda mixer, h, layer: mixer(h, batch, pools, layer)  # noqa: E731
        return self._layers(batch.token_ids, pools, mix)

    def decode_logits(self, rows: DecodeRows, pools: DevicePools) -> torch.Tensor:
        """Logits [R, vocab] of a step of one-token rows: what compiled_decode.py compiles
        (plain tensor arithmetic over `rows` and the pools, no Python per row)."""
        mix = lambda mixer, h, layer: mixer.decode(h, rows, pools, layer)  # noqa: E731
        return self.lm_head(self._layers(rows.tokens, pools, mix))

    def _layers(self, token_ids: torch.Tensor, pools: DevicePools, mix: Callable) -> torch.Tensor:
        """Embed, then every block: norm, mixer (`mix` for the stateful ones, given the
        layer's index in its pool), residual; the final norm."""
        x = self.backbone.embeddings(token_ids)
        pools_layer = {"linear_attention": pools.mamba_layer, "full_attention": pools.kv_layer}
        for index, block in enumerate(self.backbone.layers):
            h = block.norm(x)
            if block.kind in pools_layer:
                h = mix(block.mixer, h, pools_layer[block.kind][index])
            else:
                h = block.mixer(h)
            x = x + h
        return self.backbone.norm_f(x)
