"""Building the scheduling core from the settings, the one way every process does it."""

from __future__ import annotations

from services.scheduler.allocators.pools import PoolConfig, Pools
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.core import EngineCore
from services.scheduler.engine.drafts import Drafter, HeadDrafts, PromptNgram
from shared.config import Settings
from shared.model_config import ModelConfig
from shared.tokenizer import Tokenizer


def build_engine(
    settings: Settings, model: ModelConfig, tokenizer: Tokenizer, strict: bool
) -> EngineCore:
    """The pools and the core for `settings`. `strict` makes an invariant violation
    raise (tests, the in-process demo) instead of being logged and counted (services)."""
    settings.check_speculation(model)
    tiers = settings.tier_sizes(model)
    pools = Pools(
        PoolConfig(
            settings.kv_pages,
            settings.page_size,
            settings.mamba_slots,
            settings.max_running_requests,
            settings.context_len,
            tiers.host_kv_pages,
            tiers.host_mamba_slots,
            tiers.disk_slots,
            working_slots=settings.working_slots,
            spec_slots=settings.spec_drafts,
        )
    )
    config = EngineConfig(
        context_len=settings.context_len,
        vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids,
        chunk_size=settings.chunk_size,
        max_step_tokens=settings.max_step_tokens,
        track_interval=settings.track_interval,
        checkpoint_interval=settings.state_checkpoint_interval,
        junctions=settings.junction_checkpoints,
        max_sessions=settings.session_limit(tiers),
        idle_timeout=settings.session_idle_timeout or None,
    )
    drafter: Drafter | None = None
    if settings.spec_drafts:
        drafter = HeadDrafts() if settings.drafts_by_head else PromptNgram()
    return EngineCore(pools, config, strict=strict, tokenizer=tokenizer, drafter=drafter)
