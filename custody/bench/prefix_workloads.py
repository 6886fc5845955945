"""The request series of `custody bench prefix`: prompts that share part of a document
with the requests before them, each with a suffix of its own, in the shapes of the public
reports of hybrid prefix caches losing that reuse (SGLang #22935 and #37198, vLLM #45238).

Every series is one document and, per request, how much of it the request starts with
and how many tokens of its own follow. What an earlier request shares with request k is
then the document up to the shorter of the two (the suffixes are random bytes, so they
share nothing to speak of), which gives each request's *shared* length: what a perfect
cache could reuse. A series also names the headline figure it counts towards, if any.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SGLANG_22935 = "SGLang #22935: shared prefix + own suffix, 8 requests"
VLLM_45238 = "vLLM #45238: the shared/unique split of ~2,200-token prompts moved by 100"
SGLANG_37198 = "SGLang #37198: a ~1,024-token prefix wobbling by a few tokens"
FORK = "32 sessions whose first turns fork from one system prompt"
JUNCTION_HEADLINE = "junction_reuse_share"
FORK_HEADLINE = "fork_sessions_reuse_share"
# vLLM #45238's shift, as a walk over one 2,000-token document: each request's shared
# part is 100 tokens longer or shorter than the one before, its prompt ~2,200 tokens
WALK = (1500, 1600, 1700, 1600, 1500, 1600, 1700, 1800, 1900, 1800, 1900, 2000)
# around the page boundary at 1,024 (page 16)
WOBBLE = (1024, 1021, 1027, 1022, 1026, 1023, 1025, 1021, 1027, 1024, 1022, 1026)
MESSAGES = tuple(32 + 37 * k % 224 for k in range(32))  # each session's own first message


@dataclass(frozen=True)
class Series:
    """Requests sent one at a time, each answered before the next: request k is the first
    `prefixes[k]` tokens of the series' document, then `suffixes[k]` tokens of its own; a
    session's first turn each (one session per request) when `sessions`."""

    name: str
    source: str
    prefixes: tuple[int, ...]
    suffixes: tuple[int, ...]
    sessions: bool = False
    headline: str | None = None  # the headline figure these requests count towards

    def __post_init__(self) -> None:
        if len(self.prefixes) != len(self.suffixes) or len(self.prefixes) < 3:
            raise ValueError(f"{self.name}: as many suffixes as prefixes, at least 3")

    def shared(self) -> list[int]:
        """Per request, the tokens of its prompt that an earlier request sent too."""
        return [min(p, max(self.prefixes[:k], default=0)) for k, p in enumerate(self.prefixes)]

    def prompts(self, seed: int) -> tuple[list[list[int]], list[int]]:
        """Every request's prompt, and the check's: the last request's share of the
        document with a suffix of its own (byte ids; the same for the same seed)."""
        rng = random.Random(seed)
        document = _tokens(rng, max(self.prefixes))
        own = [_tokens(rng, s) for s in self.suffixes]
        prompts = [document[:p] + mine for p, mine in zip(self.prefixes, own, strict=True)]
        check = document[: self.prefixes[-1]] + _tokens(rng, self.suffixes[-1])
        return prompts, check


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _same(n: int, prefix: int, suffix: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (prefix,) * n, (suffix,) * n


WORKLOADS = (
    *(
        Series(f"shared_{p}_suffix_{s}", SGLANG_22935, *_same(8, p, s), headline=JUNCTION_HEADLINE)
        for p, s in ((2048, 64), (2048, 376), (2048, 1296), (1500, 600), (2999, 900))
    ),
    Series("vllm_1600_600", VLLM_45238, *_same(8, 1600, 600)),
    Series("vllm_1500_700", VLLM_45238, *_same(8, 1500, 700)),
    Series("shift_100", VLLM_45238, WALK, tuple(2200 - p for p in WALK)),
    Series("wobble_1024", SGLANG_37198, WOBBLE, (256,) * len(WOBBLE)),
    Series(
        "fork_sessions",
        FORK,
        (2048,) * len(MESSAGES),
        MESSAGES,
        sessions=True,
        headline=FORK_HEADLINE,
    ),
    Series("fork_sessions_2000", FORK, (2000,) * len(MESSAGES), MESSAGES, sessions=True),
)


def reuse_share(shared: list[int], cached: list[int], start: int = 2) -> float:
    """Of the shared tokens of requests `start`.. (the third on: the second may find no
    state where its prompt leaves the first's), the share reused: sum of min(cached,
    shared) over sum of shared."""
    total = sum(shared[start:])
    return sum(min(c, s) for c, s in zip(cached[start:], shared[start:], strict=True)) / total
