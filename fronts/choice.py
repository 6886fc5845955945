"""Which ready replica takes a request that no placement binds (a plain request, a new
session): the one whose prefix cache holds the longest prefix of its prompt, so it
recomputes the least, unless that replica is already loaded past its share.

Bounded load, as in consistent hashing with bounded loads: a replica is eligible only
while its load (`Replica.load`: running, queued and this router's requests in flight) is
at most ceil((1 + EPSILON) x the average load) + 1, so a popular prefix cannot pile
every request onto one replica; the least loaded replica is always eligible. Among the
eligible, the longest match wins, ties going to the least loaded (then fewest sessions,
then one at random). The decision is `prefix` when a match picked the replica (it holds
more of the prompt than some other eligible one), else `load`.

A prompt that no eligible replica holds any of (a prefix on its first request, or one
evicted everywhere) goes to the eligible replica whose indexed cache is the smallest
(`PrefixIndex.cached_tokens`), and only among equals to the least loaded. That first
request decides where every later one of its prefix goes, so spreading first requests by
load alone deals prefixes out by chance: one replica can get more than its cache holds
and evict them in turn while the other has room. Filling the emptier cache splits them
evenly; once the caches are equally full it is the load rule again. (SGLang's
cache-aware router does the same below its match threshold.) Requests whose prompt the
router cannot read, and session opens, go by load alone: the cache does not tell where
they belong. A request sent away from the replica holding the most of its prompt because
that one is past the bound is counted in `custody_<front>_prefix_diverted`.

The prompt's tokens are read as the replicas read them: `/generate`'s `input_ids` or its
`text` through the same tokenizer (the first of a batch), `/v1/completions`' `prompt`;
anything else (chat, an ids-only deployment given text, a body that is not one) has no
prefix and goes by load alone.

With `router_policy` random, every such request goes to a placeable replica chosen
uniformly (decision `random`): the baseline prefix-aware routing is measured against
(`custody bench scaleout`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from fronts.prefix_index import PrefixIndex
from fronts.replicas import Replica, ReplicaTable
from shared.messages.cache import cache_namespace
from shared.tokenizer import Tokenizer, TokenizerMissing

EPSILON = 0.25
CHARS_PER_TOKEN = 16  # text read past context_len x this could only be refused


@dataclass(frozen=True)
class Choice:
    replica: Replica
    decision: str  # "prefix", "load" or "random"
    matched: int  # prompt tokens the replica's cache holds


@dataclass(frozen=True)
class PrefixCounters:
    """What prefix-aware choice counts, in the registry of the front that chooses."""

    tokens: Counter  # prompt tokens sent where the chosen replica's cache held them
    diverted: Counter  # requests the load bound sent away from the best holder

    @classmethod
    def of(cls, registry: CollectorRegistry, front: str) -> PrefixCounters:
        """The two counters, named for `front` (`router`, `epp`)."""
        tokens = Counter(
            f"custody_{front}_prefix_tokens",
            "prompt tokens of the requests routed that the chosen replica's prefix cache "
            "held, as the index saw it",
            ["replica"],
            registry=registry,
        )
        diverted = Counter(
            f"custody_{front}_prefix_diverted",
            "requests the load bound sent away from the replica whose cache held the most "
            "of their prompt (labelled with that replica)",
            ["replica"],
            registry=registry,
        )
        return cls(tokens, diverted)


def eligible(ready: list[Replica]) -> list[Replica]:
    """The replicas under the bound: at most ceil((1 + EPSILON) x average) + 1."""
    cap = math.ceil((1 + EPSILON) * sum(r.load for r in ready) / len(ready)) + 1
    return [r for r in ready if r.load <= cap]


def choose(
    ready: list[Replica], matched: dict[str, int], sizes: dict[str, int] | None = None
) -> Choice:
    """Among the eligible of `ready` (not empty): the longest match; when nothing matches
    and `sizes` (cached tokens per replica) is given, the smallest cache; then the least
    load."""
    candidates = eligible(ready)
    longest = max(matched.get(r.id, 0) for r in candidates)
    best = [r for r in candidates if matched.get(r.id, 0) == longest]
    if longest == 0 and sizes is not None:
        smallest = min(sizes.get(r.id, 0) for r in best)
        best = [r for r in best if sizes.get(r.id, 0) == smallest]
    least = min((r.load, r.sessions) for r in best)
    replica = random.choice([r for r in best if (r.load, r.sessions) == least])
    decided = longest > 0 and len(best) < len(candidates)
    return Choice(replica, "prefix" if decided else "load", longest)


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


class Chooser:
    def __init__(
        self,
        table: ReplicaTable,
        index: PrefixIndex,
        tokenizer: Tokenizer,
        context_len: int,
        counters: PrefixCounters,
        policy: str = "prefix",
    ) -> None:
        self.table, self.index, self.tokenizer = table, index, tokenizer
        self.context_len, self.counters, self.policy = context_len, counters, policy

    def pick(
        self,
        path: str,
        body: dict | None,
        tenant: str | None,
        only: Collection[str] | None = None,
    ) -> Choice | None:
        """The replica for a request of `tenant` to `path` with JSON `body`, among the
        ids in `only` if given; None if none is ready. A prompt matches only the prefixes
        its replica would let it reuse (its key's, or its `cache_salt`'s:
        shared/messages/cache.py)."""
        ready = self.table.placeable(only=only)
        if not ready:
            return None
        if self.policy == "random":
            return Choice(random.choice(ready), "random", 0)
        tokens = self.prompt(path, body)
        if not tokens:
            return choose(ready, {})
        salt = body.get("cache_salt") if body is not None else None
        namespace = cache_namespace(tenant, salt if isinstance(salt, str) else None)
        matched = self.index.match(tokens, [r.id for r in ready], namespace)
        sizes = {r.id: self.index.cached_tokens(r.id) for r in ready}
        choice = choose(ready, matched, sizes)
        if choice.matched:
            self.counters.tokens.labels(choice.replica.id).inc(choice.matched)
        holder = max(matched, key=matched.__getitem__, default=None)
        if holder is not None and matched[holder] > choice.matched:
            self.counters.diverted.labels(holder).inc()
        return choice

    def prompt(self, path: str, body: dict | None) -> list[int] | None:
        """The request's prompt tokens as its replica will see them, or None."""
        if body is None:
            return None
        if path == "/generate":
            ids, text = body.get("input_ids"), body.get("text")
        elif path == "/v1/completions":
            ids = text = body.get("prompt")
        else:
            return None
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]  # a batch: its first prompt
        if isinstance(text, list) and text:
            text = text[0]
        if _ids(ids) is not None:
            return ids[: self.context_len]
        if not isinstance(text, str) or not text:
            return None
        try:  # a raw text starts its sequence: the tokenizer's special tokens are added
            return self.tokenizer.encode(text[: self.context_len * CHARS_PER_TOKEN], True)
        except TokenizerMissing:
            return None
