"""NemotronH's mixture-of-experts layer, computed as transformers' `NemotronHMoE` does:
a sigmoid router that picks each token's experts within its best groups, non-gated
relu² experts over the step's tokens grouped by expert, optional shared experts, and an
optional latent projection around the routed experts. Parameter names are
transformers' (the experts as two fused tensors; weights.py fuses a released
checkpoint's per-expert tensors into them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.model.layers import MLP
from shared.model_config import ModelConfig


class TopkRouter(nn.Module):
    """Each token's experts and their weights, in float32 whatever the model's dtype.
    Groups are ranked by the sum of their two best corrected scores; experts are chosen
    among the `topk_group` best groups by corrected score (`e_score_correction_bias`,
    which steers the choice only) and weighted by their raw sigmoid score."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert indices [T, k])."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        corrected = scores + self.e_score_correction_bias.float()
        grouped = corrected.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible = corrected.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1), -torch.inf)
        indices = eligible.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, indices


class Experts(nn.Module):
    """The routed experts: `up_proj` [experts, intermediate, width] and `down_proj`
    [experts, width, intermediate], width the hidden size or the latent size."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.moe_latent_size or cfg.hidden_size
        experts, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.up_proj = nn.Parameter(torch.empty(experts, inner, width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, inner))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.custody.routed_experts(x, weights, indices, self.up_proj, self.down_proj)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        shared = cfg.n_shared_experts * cfg.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, shared, cfg.mlp_bias) if shared else None
        latent = cfg.moe_latent_size
        self.fc1_latent_proj = (
            nn.Linear(cfg.hidden_size, latent, bias=cfg.mlp_bias) if latent else None
        )
        self.fc2_latent_proj = (
            nn.Linear(latent, cfg.hidden_size, bias=cfg.mlp_bias) if latent else None
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """`h` [tokens, hidden], normed: the routed experts' weighted sum (in the latent
        space, if any), plus the shared experts' output."""
        weights, indices = self.gate(h)
        x = h if self.fc1_latent_proj is None else self.fc1_latent_proj(h)
        routed = self.experts(x, weights, indices)
        out = routed if self.fc2_latent_proj is None else self.fc2_latent_proj(routed)
        return out if self.shared_experts is None else out + self.shared_experts(h)


@torch.library.custom_op("custody::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Σ_j weights[t, j] · down_e(relu²(up_e(x[t]))) over each token's experts e =
    indices[t, j]: the (token, expert) pairs sorted by expert, and each expert's
    contiguous run multiplied at once (`torch._grouped_mm`: no loop over tokens or
    experts, no host sync, so the op also runs inside a captured CUDA graph). Summed in
    float32, then the input's dtype, as transformers accumulates. An opaque op for
    torch.compile: the compiled decode step calls it as it is."""
    tokens, per_token = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // per_token
    counts = torch.zeros(up.shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # (bincount syncs)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    inner = torch._grouped_mm(x[token], up.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(torch.relu(inner).square(), down.transpose(1, 2), offs=offsets)
    weighted = y.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, weighted).to(x.dtype)


@routed_experts.register_fake
def _routed_experts_shape(x, weights, indices, up, down) -> torch.Tensor:
    return torch.empty_like(x)


def _routed_experts_plainly(x, weights, indices, up, down) -> torch.Tensor:
    """What routed_experts computes, by gathering each token's experts' weights: memory
    per token and expert, so only for the small models a head is trained on."""
    inner = torch.einsum("tw,tkiw->tki", x, up[indices])
    y = torch.einsum("tki,tkwi->tkw", torch.relu(inner).square(), down[indices])
    return (y.float() * weights[..., None]).sum(1).to(x.dtype)


def _remember_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _routed_experts_backward(ctx, grad: torch.Tensor):
    """The gradients, by computing the op again with plain tensor operations: training
    an MTP head (custody/bench/spec_head.py) goes through its MoE layer."""
    x, weights, indices, up, down = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (x, weights, up, down)]
        out = _routed_experts_plainly(leaves[0], leaves[1], indices, leaves[2], leaves[3])
        dx, dw, dup, ddown = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return dx, dw, None, dup, ddown


routed_experts.register_autograd(_routed_experts_backward, setup_context=_remember_inputs)
