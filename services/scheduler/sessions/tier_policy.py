"""Which session's state goes where, under pressure and on demand.

- Device pressure: the least recently used idle session hibernates to the host tier
  instead of dropping its state.
- Host pressure: the least recently used ready host states spill to disk; a full disk
  first drops its least recently used blob. Only when a tier cannot make room is state
  dropped back to history (counted in `TierMoves.dropped`).
- A queued turn whose session is on disk starts loading it at once (prefetch), so its
  admission finds the state on the host, one copy away from the device.
- An operator may place an idle session in a tier (`place`); each planned step moves it
  one tier closer.
- A retention hint (`retain`: a turn's `cache_control`, docs/tiers.md "Retention hints")
  orders the victims: while its TTL has not passed since the session was last used, the
  session leaves a tier only after every unhinted one, and among hinted ones the lower
  priority first. A hint orders; it never refuses a move, so pressure that has no
  unhinted victim left still moves hinted sessions, and no hint can hold a tier full.

Victims are found by a scan of the open sessions: O(sessions) per move, paid only when
something must move.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from services.scheduler.allocators.tier_slots import host_fits
from services.scheduler.sessions.tier_moves import TierMoves
from shared.http_limits import MAX_RETENTION_PRIORITY

if TYPE_CHECKING:
    from services.scheduler.records.request import Request
    from services.scheduler.records.session import Session

TIERS = ("device", "host", "disk")
MakeRoom = Callable[[int, int, int], bool]  # pages, Mamba slots, rows


class TierPolicy:
    def __init__(
        self, moves: TierMoves, sessions: dict[str, Session], clock: Callable[[], float]
    ) -> None:
        self.moves, self.sessions, self.clock = moves, sessions, clock
        self.pools = moves.pools
        self.placing: dict[str, str] = {}  # session id -> the tier an operator asked for

    def retain(self, s: Session, ttl: float, priority: int) -> None:
        """Hint that `s`'s state be kept in the faster tiers for `ttl` seconds after its
        last use, with `priority` (0..MAX_RETENTION_PRIORITY) among hinted sessions."""
        if not 0 <= priority <= MAX_RETENTION_PRIORITY:
            raise ValueError(f"a retention priority is 0..{MAX_RETENTION_PRIORITY}")
        s.retain_ttl, s.retain_priority = ttl, priority

    def hinted(self, s: Session, now: float) -> bool:
        """Whether `s`'s retention hint still counts at `now`."""
        return now < s.last_used + s.retain_ttl

    def idle_on_device(self, keep: Session | None = None) -> Session | None:
        """The least recently used session holding device state no turn uses (a waiting
        turn's is recently used, so idle sessions' go first), other than `keep`: the one
        to leave the device under pressure. Not one whose restore has yet to run: a
        hibernate of the same step would copy what the restore has not written."""
        return self._lru(
            lambda s: s.slots is not None and s.slots.ready and not s.state_in_use and s is not keep
        )

    def host_room(
        self, tokens: int, keep: Session | None = None, ahead: Collection[Session] = ()
    ) -> bool:
        """Free host room for a state of `tokens` positions (`keep`'s) by spilling (or,
        with the disk full, dropping) the least recently used ready host states but those
        of `ahead`, sessions whose queued turns need their state before `keep`'s; False
        if it cannot."""
        while not host_fits(self.pools, tokens):
            victim = self._lru(
                lambda s: s.host is not None and s.host.ready and s is not keep and s not in ahead
            )
            if victim is None:
                return False
            if self.disk_room(keep, ahead):
                self.moves.spill(victim)
            else:
                self.moves.drop_host(victim, "host_full")
                victim.cached_len = 0
                self.moves.dropped["host"] += 1
        return True

    def disk_room(self, keep: Session | None = None, ahead: Collection[Session] = ()) -> bool:
        """A free disk slot, dropping the least recently used valid blob (not `keep`'s or
        one of `ahead`'s) if the disk is full; False if the disk tier has no slot to give."""
        disk = self.pools.disk
        if disk.can_alloc(1):
            return True
        victim = self._lru(
            lambda s: s.disk is not None and s.disk.ready and s is not keep and s not in ahead
        )
        if victim is None:
            return False
        self.moves.drop_disk(victim, "disk_full")
        victim.cached_len = 0
        self.moves.dropped["disk"] += 1
        return disk.can_alloc(1)

    def prefetch(self, waiting: Iterable[Request]) -> None:
        """Start loading the blobs of queued turns' sessions, in queue order. A load makes
        its host room only from states no turn ahead of it needs: were the room taken from
        a turn ahead, each load would spill what an earlier one loaded, and with more
        queued turns on disk than the host holds the head of the queue would never find
        its state ready (admission takes the queue in order), for ever. A load that does
        not fit beside the host states of the turns ahead waits for them to go up to the
        device; one that does not fit without them is dropped: that turn re-prefills
        rather than wait."""
        if self.pools.disk.free_count == self.pools.disk.capacity:
            return  # no session holds a blob: nothing to look for in the queue
        ahead: set[Session] = set()  # the sessions of the turns before this one
        held_ahead = False  # whether one of them holds a host state
        for req in waiting:
            s = req.session
            if s is None:
                continue
            if s.disk is not None and s.disk.ready:
                if self.host_room(s.disk.tokens, keep=s, ahead=ahead):
                    self.moves.load(s)
                elif held_ahead:
                    return  # the turns ahead leave the host first
                else:
                    self.moves.drop_disk(s, "no_host_room")
                    s.cached_len = 0
                    self.moves.dropped["disk"] += 1
            ahead.add(s)
            held_ahead = held_ahead or s.host is not None

    def bring_to_device(self, s: Session, make_room: MakeRoom, pages: int, mamba: int) -> bool:
        """A hibernated session's state back on the device, with room for `pages` more
        pages and `mamba` more slots; False (nothing moved) if it is not on the host and
        ready, or there is no room."""
        host = s.host
        if host is None or not host.ready:
            return False
        own = -(-host.tokens // self.pools.config.page_size)
        if not make_room(own + pages, 1 + mamba, 1) or s.host is not host:
            return False
        self.moves.to_device(s)
        return True

    def place(self, s: Session, tier: str) -> None:
        """Move `s` to `tier` over the next steps (a step moves it one tier)."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        self.placing[s.sid] = tier

    def advance_placements(self, make_room: MakeRoom) -> None:
        """One move closer to its asked tier for each idle session being placed."""
        for sid, want in list(self.placing.items()):
            s = self.sessions.get(sid)
            if s is not None and s.turn is not None:
                continue
            at = None if s is None else s.state_tier
            if at == want or at is None:
                del self.placing[sid]  # reached, or nothing to place (the route reports which)
            elif at == "device" and s.slots.ready:
                if self.host_room(s.cached_len, keep=s):
                    self.moves.hibernate(s)
            elif at == "host" and s.host.ready:
                if want == "device":
                    self.bring_to_device(s, make_room, 0, 0)
                elif self.disk_room(keep=s):
                    self.moves.spill(s)
            elif at == "disk" and s.disk.ready and self.host_room(s.disk.tokens, keep=s):
                self.moves.load(s)

    def _lru(self, eligible: Callable[[Session], bool]) -> Session | None:
        """The eligible session to move first: unhinted ones before hinted ones (the
        lower priority first), then the least recently used."""
        found = [s for s in self.sessions.values() if eligible(s)]
        if not found:
            return None
        now = self.clock()

        def order(s: Session) -> tuple[bool, int, float]:
            hinted = self.hinted(s, now)
            return hinted, s.retain_priority if hinted else 0, s.last_used

        return min(found, key=order)
