"""What a session holds in the tiers below the device between turns.

A hibernated session holds host KV pages (its KV of positions 0..tokens-1, every page
its own: a copy of borrowed cache pages too) and one host Mamba slot; a spilled session
holds one disk slot, its blob. Like `SessionSlots` on the device, each is a set of leases
on slots the session owns in the ledger, so a move to another tier is a transfer and a
stale handle fails loudly. `ready`: the step that writes this state has run; until then
no move may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.allocators.paged_kv import pages_for
from services.scheduler.ownership.invariants import Claim
from services.scheduler.ownership.lease import Lease, new_lease
from services.scheduler.ownership.owners import Owner

if TYPE_CHECKING:
    from services.scheduler.allocators.pools import Pools


@dataclass(slots=True, eq=False)
class HostState:
    owner: Owner
    pages: Lease  # host_kv
    state: Lease  # host_mamba
    tokens: int
    ready: bool = False

    def claims(self, pools: Pools | None = None) -> list[Claim]:
        return [
            (self.owner, "host_kv", np.atleast_1d(self.pages.held)),
            (self.owner, "host_mamba", [self.state.held]),
        ]

    def hold(self, transit: Owner, reason: str) -> list[Lease]:
        """Hand every slot to `transit` (a move still reads them); the leases it holds."""
        return [self.pages.move_to(transit, reason), self.state.move_to(transit, reason)]

    def release(self, reason: str) -> None:
        self.pages.release(reason)
        self.state.release(reason)


@dataclass(slots=True, eq=False)
class DiskState:
    owner: Owner
    blob: Lease  # disk
    tokens: int
    ready: bool = False  # the spill that writes the blob has run: the blob is valid

    def claims(self, pools: Pools | None = None) -> list[Claim]:
        return [(self.owner, "disk", [self.blob.held])]


def host_fits(pools: Pools, tokens: int) -> bool:
    return pools.host_kv.can_alloc(pages_for(tokens, pools.config.page_size)) and (
        pools.host_mamba.can_alloc(1)
    )


def host_state(pools: Pools, owner: Owner, tokens: int, reason: str) -> HostState:
    """Host pages and a host Mamba slot for a state of `tokens` positions; the caller
    checked `host_fits`."""
    pages = pools.host_kv.alloc(pages_for(tokens, pools.config.page_size), owner, reason)
    slot = pools.host_mamba.alloc_one(owner, reason)
    host_kv, host_mamba = pools.host_kv, pools.host_mamba
    return HostState(
        owner, new_lease(host_kv, owner, pages), new_lease(host_mamba, owner, slot), tokens
    )
