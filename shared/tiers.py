"""The sizes of the state tiers below the device: host memory and disk.

The scheduler (its ledger pools) and the executor (its host tensors and blob budget)
compute them with this one function from the same settings and model shapes, so slot
numbers the scheduler plans always exist on the executor. State is float32 (as the
executor's pools keep it), so bytes follow from the shapes alone, without torch.

- Host tier: KV pages and Mamba slots, like the device pools, in the device pools'
  proportion of pages to slots, as many as `host_state_bytes` pays for.
- Disk tier: one blob per session, each a slot of the disk pool; a slot is sized for the
  largest blob (a whole context of KV plus one state), so `disk_state_bytes` is a bound
  the blobs never pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_config import ModelConfig

FLOAT32 = 4
BLOB_OVERHEAD = 4096  # header and checksum of a blob, bounded


@dataclass(frozen=True)
class StateShapes:
    """Bytes of one KV page (every attention layer, K and V) and one Mamba slot (every
    Mamba layer, conv and SSM state)."""

    page_size: int
    kv_page_bytes: int
    mamba_slot_bytes: int

    @classmethod
    def of(cls, model: ModelConfig, page_size: int) -> StateShapes:
        kv_token = 2 * len(model.attention_layers) * model.num_key_value_heads * model.head_dim
        conv = model.conv_dim * (model.conv_kernel - 1)
        ssm = model.mamba_num_heads * model.mamba_head_dim * model.ssm_state_size
        return cls(
            page_size,
            kv_token * page_size * FLOAT32,
            len(model.mamba_layers) * (conv + ssm) * FLOAT32,
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
    ) -> TierSizes:
        """0 bytes: no such tier (its pools have no slots; nothing moves there)."""
        if host_state_bytes < 0 or disk_state_bytes < 0:
            raise ValueError("host_state_bytes and disk_state_bytes must be >= 0")
        shapes = StateShapes.of(model, page_size)
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
