"""The session store's decision on a gap in a replica's records (docs/protocol.md,
"Actors"): records lost from a stream before the store applied them leave every
session's record of that replica in doubt. Only the life that wrote them can make them
whole again, by the full set its next snapshot ships; once a later life has begun (its
snapshot arrived, or its fence is in Redis), none ever will, and the store decides: what
that replica recorded is lost, and its sessions answer `session_lost` instead of a 503
for ever. The store (services/session_store/consumer.py) and the model checker's store
(tests/protocol/world.py) both decide by this function."""

from __future__ import annotations

from collections.abc import Hashable


def gap_decided(gap_life: Hashable | None, life_now: Hashable | None) -> bool:
    """Whether the gap left in the records of life `gap_life` (None: no gap waits) can
    no longer be mended: `life_now`, the latest life known to have begun (None: none
    known), is another one."""
    return gap_life is not None and life_now not in (None, gap_life)
