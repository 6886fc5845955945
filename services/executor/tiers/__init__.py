"""The tiers below the device: session state parked in host memory (`host_tier.py`) and
on disk (`blob_store.py`), and the mover that runs a step's moves between them
(`mover.py`). Their sizes come from `shared.tiers.TierSizes`, computed the same way by
the scheduler, so every slot it plans exists here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.executor.model.pools import DevicePools
from services.executor.tiers.blob_store import BlobStore
from services.executor.tiers.host_tier import HostTier
from services.executor.tiers.mover import Mark, TierMover
from shared.dtypes import sizing_dtype
from shared.model_config import ModelConfig
from shared.tiers import StateShapes, TierSizes

if TYPE_CHECKING:
    from shared.config import Settings

log = logging.getLogger("custody.executor.tiers")


def build_tiers(
    settings: Settings, model: ModelConfig, device: DevicePools, mark: Mark | None = None
) -> TierMover:
    """The host tier, the blob store and their mover, sized from `settings` (the service
    and the in-process runtime build them the same way), in the device pools' dtype."""
    sizes = settings.tier_sizes(model)
    dtype = str(device.dtype).removeprefix("torch.")
    if dtype != sizing_dtype(settings.dtype):
        log.warning(
            "--dtype %s is %s here, but every service sizes the tiers for %s (it cannot see"
            " this device): they fill their byte budgets part way; pass --dtype %s to fill them",
            settings.dtype,
            dtype,
            sizing_dtype(settings.dtype),
            dtype,
        )
    host = HostTier(model, sizes, device.dtype, pin=device.device.type == "cuda")
    blobs = BlobStore(settings.blob_dir, sizes.disk_slots, settings.page_size)
    return TierMover(
        device,
        host,
        blobs,
        settings.page_size,
        context_len=settings.context_len,
        move_delay=settings.tier_move_delay_seconds,
        mark=mark,
    )


def no_tiers(device: DevicePools) -> TierMover:
    """A mover over empty tiers: every move is refused as out of range."""
    page_size = device.sizes.page_size
    dtype = str(device.dtype).removeprefix("torch.")
    sizes = TierSizes(0, 0, 0, StateShapes.of(device.model, page_size, dtype))
    host = HostTier(device.model, sizes, device.dtype)
    return TierMover(device, host, BlobStore(None, 0), page_size)
