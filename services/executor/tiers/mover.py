"""Runs a step's tier moves (shared/messages/tiers.py): the discards first, then every
adopt, spill, hibernate, load and restore, in that order (`MOVE_ORDER`).

A move carries one session's state as one unit: the KV of its positions `0..tokens-1`
(page p of a side holds positions p*page_size ..; the tail of the last page beyond
`tokens` is not carried: nothing reads it, and a session's next write starts there) in
every attention layer, K and V, and the conv and SSM state of its slot in every Mamba
layer. A load or an adopt whose blob fails its checks, or a spill or an adopt the disk
refuses, fails that move
alone: its index is returned (and logged and counted), its destination holds nothing,
and the step runs on. Anything else raises, and the runner fails the step.

For fault drills, `move_delay` makes each move sleep half-way (between a hibernate's or
restore's KV and its state, between a spill's fsync and its rename, after a load's
read), and `mark` is told what a step's moves are before they run and `{}` after.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence

import numpy as np
import torch
from prometheus_client import Counter, Histogram

from services.executor.model.pools import DevicePools
from services.executor.tiers.blob_store import BlobError, BlobMismatch, BlobStore
from services.executor.tiers.checks import FOREIGN, Capacity, check_moves
from services.executor.tiers.copier import Copier
from services.executor.tiers.host_tier import HostTier
from shared.messages.tiers import MOVE_ORDER, TierMove

log = logging.getLogger("custody.executor.tiers")
MOVES = Counter("custody_tier_moves_total", "tier moves completed, by kind", ["kind"])
MOVE_BYTES = Counter(
    "custody_tier_move_bytes_total", "bytes carried by completed tier moves", ["kind"]
)
MOVE_SECONDS = Histogram(
    "custody_tier_move_seconds",
    "time of one completed tier move (on a GPU, a restore's time to queue its copies)",
    ["kind"],
)
FAILED = Counter(
    "custody_tier_failed_moves_total",
    "tier moves that failed while the step ran on (a load: a blob that failed its check;"
    " a spill: a write the disk refused)",
    ["kind"],
)
DISCARDS = Counter("custody_tier_discards_total", "disk blobs deleted as steps asked")
FAILS: dict[str, tuple[type[Exception], ...]] = {
    "load": (BlobError,),
    "spill": (OSError,),
    "adopt": (BlobError, OSError),
}
for _kind in MOVE_ORDER:  # every kind's series exists from the start, at 0
    for _metric in (MOVES, MOVE_BYTES, MOVE_SECONDS, FAILED):
        _metric.labels(_kind)
Mark = Callable[[dict[str, int]], None]


class TierMover:
    def __init__(
        self,
        device: DevicePools,
        host: HostTier,
        blobs: BlobStore,
        page_size: int,
        *,
        context_len: int | None = None,
        move_delay: float = 0.0,
        mark: Mark | None = None,
    ) -> None:
        if page_size != device.sizes.page_size or page_size != host.page_size:
            raise ValueError(f"page size {page_size}: the device and host tiers differ")
        self.device, self.host, self.blobs, self.page_size = device, host, blobs, page_size
        self.context_len = context_len or device.sizes.kv_pages * page_size
        self.move_delay, self.mark = move_delay, mark
        self.copier = Copier(device.device)
        self.capacity = {
            "device": Capacity(device.sizes.kv_pages, device.sizes.mamba_slots),
            "host": Capacity(host.kv_pages, host.mamba_slots),
            "disk": Capacity(0, blobs.disk_slots),
            "foreign": FOREIGN,
        }
        self._run: dict[str, Callable[[TierMove], int]] = {
            "hibernate": self._hibernate,
            "spill": self._spill,
            "load": self._load,
            "restore": self._restore,
            "adopt": self._adopt,
        }

    def validate(self, moves: Sequence[TierMove], discards: Sequence[int]) -> None:
        """TierMoveRefused (a ValueError) for anything out of range; touches nothing."""
        check_moves(moves, discards, self.capacity, self.page_size, self.context_len)

    def apply(self, moves: Sequence[TierMove], discards: Sequence[int]) -> list[int]:
        """Run validated moves; the indices (in `moves`) of those that failed."""
        if not moves and not discards:
            return []
        marked = self.mark is not None and bool(moves)
        if marked:
            tally = Tally(m.kind for m in moves)
            self.mark({kind: tally[kind] for kind in MOVE_ORDER})
        try:
            for slot in discards:
                self.blobs.discard(slot)
                DISCARDS.inc()
            failed: list[int] = []
            self.copier.begin()
            try:
                for kind in MOVE_ORDER:
                    failed += [
                        i for i, m in enumerate(moves) if m.kind == kind and not self._one(i, m)
                    ]
            finally:
                self.copier.end()
            return sorted(failed)
        finally:
            if marked:
                self.mark({})

    def _one(self, index: int, move: TierMove) -> bool:
        """Run one move; False when it failed in a way that leaves the step running."""
        start = time.perf_counter()
        try:
            moved = self._run[move.kind](move)
        except FAILS.get(move.kind, ()) as err:
            FAILED.labels(move.kind).inc()
            log.warning("tier move %d (%s of %s) failed: %s", index, move.kind, move.sid, err)
            return False
        MOVES.labels(move.kind).inc()
        MOVE_BYTES.labels(move.kind).inc(moved)
        MOVE_SECONDS.labels(move.kind).observe(time.perf_counter() - start)
        return True

    def _pause(self) -> None:
        if self.move_delay > 0:
            time.sleep(self.move_delay)

    def _positions(self, pages: np.ndarray, tokens: int) -> torch.Tensor:
        """The KV token indices of positions 0..tokens-1 held in `pages`, in order."""
        first = torch.from_numpy(pages.astype(np.int64))[:, None] * self.page_size
        return (first + torch.arange(self.page_size)).reshape(-1)[:tokens]

    def _between(
        self, move: TierMove, src: tuple[list[torch.Tensor], list[torch.Tensor]], dst: tuple
    ) -> int:
        """A hibernate or restore: KV, then (half-way) the state."""
        (src_kv, src_state), (dst_kv, dst_state) = src, dst
        moved = self.copier.copy(
            src_kv,
            self._positions(move.src_pages, move.tokens),
            dst_kv,
            self._positions(move.dst_pages, move.tokens),
        )
        self._pause()
        slot = lambda s: torch.tensor([s], dtype=torch.long)  # noqa: E731
        return moved + self.copier.copy(
            src_state, slot(move.src_slot), dst_state, slot(move.dst_slot)
        )

    def _hibernate(self, move: TierMove) -> int:
        device, host = self.device, self.host
        return self._between(
            move,
            ([device.k, device.v], device.state_tensors),
            (host.kv_tensors, host.state_tensors),
        )

    def _restore(self, move: TierMove) -> int:
        device, host = self.device, self.host
        return self._between(
            move,
            (host.kv_tensors, host.state_tensors),
            ([device.k, device.v], device.state_tensors),
        )

    def _spill(self, move: TierMove) -> int:
        self.copier.host_ready()
        positions = self._positions(move.src_pages, move.tokens)
        arrays = [t.index_select(1, positions) for t in self.host.kv_tensors]
        arrays += [t[:, move.src_slot] for t in self.host.state_tensors]
        return self.blobs.write(move.dst_slot, move.sid, move.tokens, arrays, self._pause)

    def _adopt(self, move: TierMove) -> int:
        return self.blobs.adopt(
            move.src_replica, move.src_slot, move.dst_slot, move.sid, move.tokens
        )

    def _load(self, move: TierMove) -> int:
        arrays = self.blobs.read(move.src_slot, move.sid, move.tokens)
        expected = self._blob_layout(move.tokens)
        got = [(tuple(a.shape), a.dtype) for a in arrays]
        if got != expected:
            raise BlobMismatch(f"blob {move.src_slot}: arrays {got}, expected {expected}")
        self._pause()
        self.copier.host_ready()
        k, v, conv, ssm = arrays
        positions = self._positions(move.dst_pages, move.tokens)
        for tensor, values in zip(self.host.kv_tensors, (k, v), strict=True):
            tensor.index_copy_(1, positions, values)
        for tensor, values in zip(self.host.state_tensors, (conv, ssm), strict=True):
            tensor[:, move.dst_slot] = values
        return sum(a.numel() * a.element_size() for a in arrays)

    def _blob_layout(self, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The arrays a spill of `tokens` positions writes: K, V, conv, SSM."""
        kv = [(t.shape[0], tokens, *t.shape[2:]) for t in self.host.kv_tensors]
        state = [tuple(t[:, 0].shape) for t in self.host.state_tensors]
        tensors = self.host.kv_tensors + self.host.state_tensors
        return [(tuple(s), t.dtype) for s, t in zip(kv + state, tensors, strict=True)]
