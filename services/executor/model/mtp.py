"""NemotronH's multi-token-prediction head (`mtp.layers.*`), the draft of NEXTN/EAGLE.

The head sees, at position p, the target's final hidden state there and the embedding
of the token after p, and predicts the token after that: `eh_proj` joins the two (each
RMS-normed, `enorm` and `hnorm`), an attention layer and a mixture-of-experts layer
follow (each after its norm, with a residual), then `final_layernorm` and the target's
own `lm_head`. Its next guesses chain on its own output hidden state.

Its attention layer keeps K and V for every position the target has committed, in one
more layer of the KV pool at the same token indices, so they live on the target's pages
and are owned in the ledger with them (docs/speculative.md). A chained guess's K and V
are never written: they belong to positions nobody has accepted. Where the head has no
K and V for a position (the last position of a prompt chunk that samples nothing: the
token after it is the next chunk's), it attends to what the pool holds there, finite
and stale; that can only cost acceptance, never a wrong token, since every draft is
verified by the target.

One function computes the layers for serving and for training a head
(`MtpHead.layers_over`): the new positions attend over given past K and V (the pool's,
or nothing) and causally over each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.model.attention import Attention
from services.executor.model.layers import RMSNorm
from services.executor.model.moe import MoE
from services.executor.model.pools import DevicePools
from shared.model_config import ModelConfig


class MtpAttentionLayer(nn.Module):
    """`mtp.layers.0`: the input projections, then attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.enorm = RMSNorm(cfg.hidden_size, eps)
        self.hnorm = RMSNorm(cfg.hidden_size, eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, eps)
        self.mixer = Attention(cfg)


class MtpMoELayer(nn.Module):
    """`mtp.layers.1`: mixture of experts, then the head's final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = MoE(cfg)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class MtpHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MtpAttentionLayer(cfg), MtpMoELayer(cfg)])
        self.passes = 0  # forwards run (`custody bench spec` counts a draft's cost)

    def layers_over(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`embeds` and `hidden` [T, H]: T new positions, after the past ones whose K and
        V are `past_k`, `past_v` [P, kv heads, d]. Returns the head's output [T, H] and
        the new positions' K and V."""
        self.passes += 1
        first, second = self.layers
        attention: Attention = first.mixer
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        a = first.norm(x)
        t = a.shape[0]
        q = attention.q_proj(a).view(t, attention.heads, attention.head_dim)
        k = attention.k_proj(a).view(t, attention.kv_heads, attention.head_dim)
        v = attention.v_proj(a).view(t, attention.kv_heads, attention.head_dim)
        keys, values = torch.cat([past_k.to(k.dtype), k]), torch.cat([past_v.to(v.dtype), v])
        past = past_k.shape[0]
        mask = (
            torch.arange(past + t, device=a.device)[None, :]
            <= past + torch.arange(t, device=a.device)[:, None]
        )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            enable_gqa=True,
        )[0].transpose(0, 1)
        x = x + attention.o_proj(out.reshape(t, -1))
        x = x + second.mixer(second.norm(x))
        return second.final_layernorm(x), k, v

    def propose(
        self,
        model: nn.Module,
        pools: DevicePools,
        context: torch.Tensor,
        new_kv: torch.Tensor,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        n: int,
    ) -> list[int]:
        """A row's drafts: the head over the positions the target just committed
        (`hidden` [m, H] there, `next_tokens` [m] the token after each, `new_kv` their KV
        indices, whose K and V are written), after the row's earlier positions (KV
        indices `context`); then `n` guesses (0: only the K and V are written), each
        chained on the head's output before it."""
        layer = pools.mtp_kv_layer
        past_k, past_v = pools.k[layer][context], pools.v[layer][context]
        embed, lm_head = model.backbone.embeddings, model.lm_head
        out, k, v = self.layers_over(embed(next_tokens), hidden, past_k, past_v)
        pools.write(pools.k, layer, new_kv, k)
        pools.write(pools.v, layer, new_kv, v)
        drafts: list[int] = []
        keys, values = torch.cat([past_k.to(k.dtype), k]), torch.cat([past_v.to(v.dtype), v])
        for _ in range(n):
            token = torch.argmax(lm_head(out[-1]), dim=-1)
            drafts.append(int(token))
            if len(drafts) == n:
                break
            out, k, v = self.layers_over(embed(token[None]), out[-1:], keys, values)
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
        return drafts
