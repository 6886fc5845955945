"""Items in the order of a recency stamp, so that eviction takes the oldest without a scan.

Most items are filed with the newest stamp (an access, a new node): they go to the tail of
an ordered dict, which therefore stays sorted. An item filed with an older stamp (a node
unlocked, or left a leaf, long after its last access) cannot go in the middle of it, so it
waits in a heap beside it. The oldest is the older of the two heads: O(1) from the dict,
O(log k) from the heap of k such late items. Equal stamps go in the order filed.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)
Entry = tuple[int, int]  # (stamp, serial of the filing)


class LruIndex(Generic[T]):
    def __init__(self, stamp: Callable[[T], int]) -> None:
        self._stamp = stamp
        self._entry: dict[T, Entry] = {}  # every member, with the entry it is filed under
        self._ordered: OrderedDict[T, None] = OrderedDict()  # members filed in order
        self._late: list[tuple[int, int, T]] = []  # the others; live while _entry agrees
        self._serial = itertools.count()

    def __len__(self) -> int:
        """Members, in O(1): a scrape reads how many states eviction could take."""
        return len(self._entry)

    def update(self, item: T, member: bool) -> None:
        """File `item` under its current stamp if it is to be a `member`, else drop it.
        The single entry point: callers state whether the item qualifies, after any change
        to it, and an unchanged member costs one lookup."""
        entry = self._entry.get(item)
        if not member:
            if entry is not None:
                self._drop(item)
            return
        stamp = self._stamp(item)
        if entry is not None:
            if entry[0] == stamp:
                return
            self._drop(item)
        entry = (stamp, next(self._serial))
        self._entry[item] = entry
        if not self._ordered or self._entry[next(reversed(self._ordered))] < entry:
            self._ordered[item] = None
            return
        heapq.heappush(self._late, (*entry, item))
        if len(self._late) > 2 * len(self._entry) + 64:  # dead entries: amortised O(1)
            self._late = [e for e in self._late if self._entry.get(e[2]) == e[:2]]
            heapq.heapify(self._late)

    def _drop(self, item: T) -> None:
        del self._entry[item]
        self._ordered.pop(item, None)  # a late entry stays in the heap, dead

    def oldest(self) -> T | None:
        """The member with the oldest entry, None when there is none. It stays a member
        until its owner drops it, so a removal that fails midway leaves the index exact."""
        late = self._late
        while late and self._entry.get(late[0][2]) != late[0][:2]:
            heapq.heappop(late)  # dropped or refiled since
        head = next(iter(self._ordered), None)
        if late and (head is None or late[0][:2] < self._entry[head]):
            return late[0][2]
        return head

    def problems(self, qualifying: Iterable[T]) -> list[str]:
        """The members against the items that qualify, found by a walk: exactly those,
        each filed under its current stamp, the ordered part in order."""
        wanted, members = set(qualifying), set(self._entry)
        out = [f"{i}: indexed but does not qualify" for i in members - wanted]
        out += [f"{i}: qualifies but is not indexed" for i in wanted - members]
        out += [
            f"{i}: filed at {e[0]}, stamped {self._stamp(i)}"
            for i, e in self._entry.items()
            if e[0] != self._stamp(i)
        ]
        ordered = [self._entry.get(i) for i in self._ordered]
        if None in ordered or ordered != sorted(ordered):
            out.append("the ordered part holds a non-member or is out of order")
        live_late = sum(self._entry.get(e[2]) == e[:2] for e in self._late)
        if live_late + len(ordered) != len(members):
            out.append(f"{len(members)} members, {len(ordered)} ordered, {live_late} late")
        return out
