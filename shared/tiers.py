"""The sizes of the state tiers below the device: host memory and disk.

The scheduler (its ledger pools) and the executor (its host tensors and blob budget)
compute them with this one function from the same settings and model shapes, so slot
numbers the scheduler plans always exist on the executor. KV and conv state take the
`--dtype`'s bytes (shared/dtypes.py; `auto` is sized as float32), SSM state those of the
model's `mamba_ssm_cache_dtype`, so bytes follow from the config and the setting alone,
without torch or a device.

- Host tier: KV pages and Mamba slots, like the device pools, in the device pools'
  proportion of pages to slots, as many as `host_state_bytes` pays for.
- Disk tier: one blob per session, each a slot of the disk pool; a slot is sized for the
  largest blob (a whole context of KV plus one state), so `disk_state_bytes` is a bound
  the blobs never pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.dtypes import ITEMSIZE
from shared.model_config import ModelConfig

BLOB_OVERHEAD = 4096  # header and checksum of a blob, bounded


@dataclass(frozen=True)
class StateShapes:
    """Bytes of one KV page (every attention layer, K and V) and one Mamba slot (every
    Mamba layer, conv and SSM state): KV and conv in `dtype` (a concrete name of
    shared/dtypes.py), SSM state in the model's `mamba_ssm_cache_dtype`."""

    page_size: int
    kv_page_bytes: int
    mamba_slot_bytes: int

    @classmethod
    def of(cls, model: ModelConfig, page_size: int, dtype: str = "float32") -> StateShapes:
        kv_token = 2 * len(model.attention_layers) * model.num_key_value_heads * model.head_dim
        conv = model.conv_dim * (model.conv_kernel - 1) * ITEMSIZE[dtype]
        ssm = model.mamba_num_heads * model.mamba_head_dim * model.ssm_state_size
        return cls(
            page_size,
            kv_token * page_size * ITEMSIZE[dtype],
            len(model.mamba_layers) * (conv + ssm * ITEMSIZE[model.mamba_ssm_cache_dtype]),
        )

    def session_bytes(self, tokens: int) -> int:
        """What one session's state of `tokens` positions takes in a tier."""
        return -(-tokens // self.page_size) * self.kv_page_bytes + self.mamba_slot_bytes


@dataclass(frozen=True)
class TierSizes:
    host_kv_pages: int
    host_mamba_slots: int
    disk_slots: int
    shapes: StateShapes

    @classmethod
    def of(
        cls,
        model: ModelConfig,
        page_size: int,
        device_kv_pages: int,
        device_mamba_slots: int,
        host_state_bytes: int,
        disk_state_bytes: int,
        context_len: int,
        dtype: str = "float32",
    ) -> TierSizes:
        """0 bytes: no such tier (its pools have no slots; nothing moves there)."""
        if host_state_bytes < 0 or disk_state_bytes < 0:
            raise ValueError("host_state_bytes and disk_state_bytes must be >= 0")
        shapes = StateShapes.of(model, page_size, dtype)
        device = (
            device_kv_pages * shapes.kv_page_bytes + device_mamba_slots * shapes.mamba_slot_bytes
        )
        scale = host_state_bytes / device
        blob = shapes.session_bytes(context_len) + BLOB_OVERHEAD
        return cls(
            int(device_kv_pages * scale),
            int(device_mamba_slots * scale),
            disk_state_bytes // blob,
            shapes,
        )
