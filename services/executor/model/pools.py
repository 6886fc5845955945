"""The executor's physical pools: KV for the attention layers, conv and SSM state for
the Mamba layers. Index 0 of every pool is the padding sink.

KV is stored flat by token index, `[attention layers, (pages + 1) * page_size, kv heads,
head dim]`: token index `page * page_size + offset` is a row, so the scheduler's indices
address it directly and page 0 (indices 0 .. page_size - 1) is the sink. Mamba state has
the layer first so one slot op covers every layer: `[mamba layers, slots + 1, ...]`. KV
and conv state take the model's dtype, SSM state the config's `mamba_ssm_cache_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model_config import ModelConfig


def ssm_dtype(model: ModelConfig) -> torch.dtype:
    """The SSM state's storage dtype, whatever the model's: the config's
    `mamba_ssm_cache_dtype` (float32 unless it names a 16-bit one). The scan computes in
    float32 whatever it is (mamba2.py)."""
    return getattr(torch, model.mamba_ssm_cache_dtype)


@dataclass(frozen=True)
class PoolSizes:
    kv_pages: int
    page_size: int
    mamba_slots: int


class DevicePools:
    def __init__(
        self,
        model: ModelConfig,
        sizes: PoolSizes,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        mtp: bool = False,
    ) -> None:
        """`mtp`: one more KV layer, the multi-token-prediction head's (mtp.py)."""
        self.model, self.sizes, self.device, self.dtype = model, sizes, device, dtype
        tokens = (sizes.kv_pages + 1) * sizes.page_size
        kv_layers = len(model.attention_layers) + mtp
        kv_shape = (kv_layers, tokens, model.num_key_value_heads, model.head_dim)
        self.mtp_kv_layer = len(model.attention_layers)  # when there is one
        self.k = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v = torch.zeros(kv_shape, dtype=dtype, device=device)
        slots = sizes.mamba_slots + 1
        mamba = len(model.mamba_layers)
        self.conv = torch.zeros(
            (mamba, slots, model.conv_dim, model.conv_kernel - 1), dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            (mamba, slots, model.mamba_num_heads, model.mamba_head_dim, model.ssm_state_size),
            dtype=ssm_dtype(model),
            device=device,
        )
        self.kv_layer = {layer: i for i, layer in enumerate(model.attention_layers)}
        self.mamba_layer = {layer: i for i, layer in enumerate(model.mamba_layers)}
        layers = max(kv_layers, mamba)
        self._layer_ids = [torch.tensor(i, device=device) for i in range(layers)]

    def write(self, pool: torch.Tensor, layer: int, index: torch.Tensor, values: torch.Tensor):
        """`pool[layer, index] = values` (converted to the pool's dtype), as one in-place
        index_put on the whole pool tensor. Compiled (compiled_decode.py), a write through
        the view `pool[layer]` would copy the layer to keep the view's semantics; on the
        pool itself it stays a write of just these rows."""
        pool.index_put_((self._layer_ids[layer], index), values.to(pool.dtype))

    @property
    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors indexed by Mamba slot on axis 1: what deferred ops act on."""
        return [self.conv, self.ssm]

    def bytes_per_kv_token(self) -> int:
        per_layer = self.k.shape[2] * self.k.shape[3] * self.k.element_size()
        return 2 * per_layer * self.k.shape[0]

    def bytes_per_mamba_slot(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.state_tensors)

    def reset(self) -> None:
        """A restarted executor: every slot's contents are gone."""
        for t in (self.k, self.v, *self.state_tensors):
            t.zero_()
