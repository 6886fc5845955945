"""The scheduler's pools, built in one place: one ledger, three slot pools (KV pages,
Mamba slots, request rows), the row table and the paged KV allocator over them."""

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

    def __post_init__(self) -> None:
        for name in ("kv_pages", "page_size", "mamba_slots", "max_running_requests", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Pools:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.ledger = Ledger()
        self.kv_pages = self.ledger.add_pool("kv", config.kv_pages)
        self.mamba = self.ledger.add_pool("mamba", config.mamba_slots)
        self.req = self.ledger.add_pool("req", config.max_running_requests)
        self.rows = RowTable(self.req, config.page_size, config.max_context)
        self.kv = PagedKV(self.kv_pages, self.rows)
