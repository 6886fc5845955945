"""Grouped-query attention without positional encoding, over the paged KV pool: each row
writes the K and V of its new positions through its KV indices, then attends over its
whole context read back through the same indices. It computes in the model's dtype
whatever the pool keeps: writes and reads convert (a no-op when they agree, as
`--dtype` makes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.model.batch import DecodeRows, ForwardBatch, to_device
from services.executor.model.pools import DevicePools
from shared.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        q = self._project(h, batch.new_kv, pools, layer)
        out = torch.empty_like(q)
        if batch.decode_rows is not None:
            pos = batch.decode_positions
            out[pos] = self._attend_context(q[pos], batch.decode_rows, pools, layer)
        k_cache, v_cache = pools.k[layer], pools.v[layer]
        for i in batch.prefill:
            row, span = batch.rows[i], batch.span(i)
            idx = to_device(batch.kv[i], h.device)
            positions = torch.arange(row.start, row.end, device=h.device)
            mask = torch.arange(row.end, device=h.device)[None, :] <= positions[:, None]
            k, v = (cache[idx].to(q.dtype) for cache in (k_cache, v_cache))
            out[span] = self._attend(q[span][None], k[None], v[None], mask[None])[0]
        return self.o_proj(out.view(h.shape[0], -1))

    def decode(
        self, h: torch.Tensor, rows: DecodeRows, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        """A step of one-token rows only (`h` [R, hidden]): the compiled path."""
        q = self._project(h, rows.new_kv, pools, layer)
        return self.o_proj(self._attend_context(q, rows, pools, layer).view(h.shape[0], -1))

    def _project(
        self, h: torch.Tensor, new_kv: torch.Tensor, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        """Write K and V of the new positions to the pool; return Q [T, H, d]."""
        t = h.shape[0]
        for cache, proj in ((pools.k, self.k_proj), (pools.v, self.v_proj)):
            pools.write(cache, layer, new_kv, proj(h).view(t, self.kv_heads, self.head_dim))
        return self.q_proj(h).view(t, self.heads, self.head_dim)

    def _attend_context(
        self, q: torch.Tensor, rows: DecodeRows, pools: DevicePools, layer: int
    ) -> torch.Tensor:
        """Each one-token row attends over its context (padded with the sink, masked)."""
        k, v = (cache[layer][rows.context].to(q.dtype) for cache in (pools.k, pools.v))
        return self._attend(q[:, None], k, v, rows.mask[:, None])[:, 0]

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q [R, n, H, d], k/v [R, m, KH, d], mask [R, n, m] -> [R, n, H, d]."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2)
