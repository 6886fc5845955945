"""The scheduling core's own settings (the pools have theirs in PoolConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.allocators.pools import PoolConfig


@dataclass(frozen=True)
class EngineConfig:
    context_len: int
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()  # every id that ends a generation
    chunk_size: int = 256  # prefill tokens of one request per step (multiple of the page)
    max_step_tokens: int = 2048
    track_interval: int = 64  # decode snapshot interval (multiple of the page)
    checkpoint_interval: int = 0  # a prefill chunk ends every this many positions; 0: none
    junctions: bool = True  # a chunk ends where a prompt leaves the cached path
    max_sessions: int | None = None  # sessions open at once; None: no limit
    idle_timeout: float | None = None  # a session's timeout when its client gave none

    def check(self, pools: PoolConfig) -> None:
        """Refuse settings the pools cannot serve."""
        page_size = pools.page_size
        if self.context_len > pools.max_context:
            raise ValueError("context_len exceeds the row table's max_context")
        if pools.kv_pages * page_size < self.context_len:
            raise ValueError("the KV pool must hold at least one request of context_len")
        if pools.mamba_slots < pools.request_mamba_slots + 1:
            raise ValueError(f"mamba_slots must be >= {pools.request_mamba_slots + 1}")
        for name in ("chunk_size", "track_interval", "checkpoint_interval"):
            if getattr(self, name) % page_size:
                raise ValueError(f"{name} must be a multiple of the page size {page_size}")
        if self.max_step_tokens < 1 or self.chunk_size < 1:
            raise ValueError("max_step_tokens and chunk_size must be >= 1")
