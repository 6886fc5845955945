"""The scheduler's pools, built in one place: one ledger; the device's slot pools (KV
pages, Mamba slots, request rows) with the row table and the paged KV allocator over
them; and the state tiers below the device (shared/tiers.py): host KV pages and Mamba
slots, and disk blobs, one per session."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.allocators.paged_kv import PagedKV
from services.scheduler.allocators.request_rows import RowTable
from services.scheduler.ownership.ledger import Ledger


@dataclass(frozen=True, slots=True)
class PoolConfig:
    kv_pages: int = 4096
    page_size: int = 1
    mamba_slots: int = 192
    max_running_requests: int = 32
    max_context: int = 8192
    host_kv_pages: int = 0
    host_mamba_slots: int = 0
    disk_slots: int = 0
    # a running request's Mamba working slots, and its track slots: pipeline depth + 1
    working_slots: int = 2
    # a running request's speculative slots: the drafts a verify step checks (0: none)
    spec_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_pages", "page_size", "mamba_slots", "max_running_requests", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_kv_pages", "host_mamba_slots", "disk_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.spec_slots < 0:
            raise ValueError(f"spec_slots must be >= 0, got {self.spec_slots}")
        if self.working_slots < 2:
            raise ValueError(f"working_slots must be >= 2, got {self.working_slots}")

    @property
    def track_slots(self) -> int:
        """A running request's track slots: the latest snapshot, and one per step in
        flight (track_buffer.py)."""
        return self.working_slots

    @property
    def request_mamba_slots(self) -> int:
        """What a running request holds of the Mamba pool: its working slots, as many
        track slots and its speculative slots (request_slots.py)."""
        return self.working_slots + self.track_slots + self.spec_slots


class Pools:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.ledger = Ledger()
        # KV pages move in batches; the others mostly one slot at a time (slot_pool.py)
        self.kv_pages = self.ledger.add_pool("kv", config.kv_pages)
        self.mamba = self.ledger.add_pool("mamba", config.mamba_slots, scalar=True)
        self.req = self.ledger.add_pool("req", config.max_running_requests, scalar=True)
        self.rows = RowTable(self.req, config.page_size, config.max_context)
        self.kv = PagedKV(self.kv_pages, self.rows)
        self.host_kv = self.ledger.add_pool("host_kv", config.host_kv_pages)
        self.host_mamba = self.ledger.add_pool("host_mamba", config.host_mamba_slots, scalar=True)
        self.disk = self.ledger.add_pool("disk", config.disk_slots, scalar=True)
