"""The host tier: session state parked in host memory, laid out like the device pools.

Same shapes as `DevicePools` (model/pools.py) so a move is an index copy along axis 1:
KV `[attention layers, (pages + 1) * page_size, kv heads, head dim]`, conv and SSM state
`[mamba layers, slots + 1, ...]`, index 0 the sink. The tensors are allocated with
`torch.empty`: a slot is always written (by a hibernate or a load) before it is read, and
an untouched budget of gigabytes must not become resident when the executor starts.
On CUDA they are pinned, so copies to and from the device can be asynchronous.
"""

from __future__ import annotations

import torch

from services.executor.model.pools import ssm_dtype
from shared.model_config import ModelConfig
from shared.tiers import TierSizes


class HostTier:
    def __init__(
        self,
        model: ModelConfig,
        sizes: TierSizes,
        dtype: torch.dtype = torch.float32,
        pin: bool = False,
    ) -> None:
        self.sizes = sizes
        self.page_size = sizes.shapes.page_size
        self.kv_pages, self.mamba_slots = sizes.host_kv_pages, sizes.host_mamba_slots
        tokens = (self.kv_pages + 1) * self.page_size
        kv_shape = (len(model.attention_layers), tokens, model.num_key_value_heads, model.head_dim)
        empty = lambda shape, dt: torch.empty(shape, dtype=dt, pin_memory=pin)  # noqa: E731
        self.k = empty(kv_shape, dtype)
        self.v = empty(kv_shape, dtype)
        slots, mamba = self.mamba_slots + 1, len(model.mamba_layers)
        self.conv = empty((mamba, slots, model.conv_dim, model.conv_kernel - 1), dtype)
        # SSM state in the config's cache dtype whatever the model's, as on the device
        ssm_shape = (
            mamba,
            slots,
            model.mamba_num_heads,
            model.mamba_head_dim,
            model.ssm_state_size,
        )
        self.ssm = empty(ssm_shape, ssm_dtype(model))

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        """Indexed by KV token index on axis 1."""
        return [self.k, self.v]

    @property
    def state_tensors(self) -> list[torch.Tensor]:
        """Indexed by Mamba slot on axis 1."""
        return [self.conv, self.ssm]
