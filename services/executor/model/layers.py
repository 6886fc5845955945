"""Norms and the MLP of NemotronH, with transformers' parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS norm per group of channels, applied after gating with silu(gate), in float32;
    the result in the gate's dtype (the model's), so a float32 scan output is gated
    before it is rounded."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float() * F.silu(gate.float())
        grouped = x32.view(*x32.shape[:-1], self.groups, -1)
        grouped = F.rms_norm(grouped, (grouped.shape[-1],), eps=self.eps)
        return (self.weight.float() * grouped.view_as(x32)).to(gate.dtype)


class MLP(nn.Module):
    """up -> relu^2 -> down."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())
