"""What a scheduler tells routers about its prefix cache, on its ownership stream (each
entry with the stream field `k` = `CACHE_KIND`, so the session store skips it undecoded).

Only what can serve a match is told: a match ends where a node holds a Mamba state, so the
router's view is the *servable tree*, the cache's nodes that hold a state, each under its
nearest servable ancestor (0: the root). A `Stored` op is such a node: its id, that
parent, and the hashes of the token blocks from the parent's end to its own. A `Removed`
op is a node that no longer serves (its state evicted, or the node gone).

Tokens are hashed in blocks of `block` (the page size) tokens, each block's hash chained
with the one before it (`chain`), the first with its namespace's root (`namespace_root`):
a hash stands for the whole prefix up to its block in one namespace, so equal prefixes
give equal chains on every replica, and a router matches a request by hashing it the
same way.

- `CacheEvents`: ops since the last message, with their own `seq`, consecutive within the
  scheduler's epoch (a reader that sees a gap asks for a snapshot).
- `CacheSnapshot`: the whole servable tree, parents before children; ops up to it are
  folded in. Shipped at the start of an epoch and whenever `Keys.cache_snapshot_wanted`
  is set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from hashlib import blake2b

import msgspec
import numpy as np

from shared.messages.envelope import Decoder, Message, WireError

CACHE_KIND = b"cache"  # the stream field `k` of a cache entry
HASH_BYTES = 8
ROOT_HASH = bytes(HASH_BYTES)  # what the first block is chained with
ROOT_NODE = 0


def cache_namespace(tenant: str | None, salt: str | None) -> str:
    """Whose cached prefixes a request may reuse (vLLM's `cache_salt` rule): those of
    requests sending the same salt, else those of its own API key (`tenant`, the key's
    hash); with keys off and no salt, everyone's (""). Cache hits and their latency are
    thus never a side channel between keys that share nothing."""
    if salt:
        return "salt:" + salt
    return "" if tenant is None else "key:" + tenant


def namespace_root(namespace: str) -> bytes:
    """What the first block of a `namespace` prefix is chained with: equal token blocks
    of two namespaces hash apart, so a router matches a request only where its replica
    would."""
    if not namespace:
        return ROOT_HASH
    return blake2b(namespace.encode(), digest_size=HASH_BYTES, person=b"custody-ns").digest()


def block_hashes(tokens: Sequence[int] | np.ndarray, block: int, parent: bytes) -> Iterator[bytes]:
    """The chained hash of each whole block of `tokens`, the first chained with `parent`
    (the hash of the block before them, `ROOT_HASH` at the start): blake2b of the previous
    hash and the block's int64 bytes. A generator, so a reader stops hashing where its
    match ends."""
    raw = np.asarray(tokens, dtype="<i8").tobytes()
    step = block * 8
    previous = parent
    for at in range(0, len(raw) - len(raw) % step, step):
        previous = blake2b(previous + raw[at : at + step], digest_size=HASH_BYTES).digest()
        yield previous


def chain(tokens: Sequence[int] | np.ndarray, block: int, parent: bytes = ROOT_HASH) -> bytes:
    """Every block's hash of `tokens`, packed (`HASH_BYTES` each)."""
    return b"".join(block_hashes(tokens, block, parent))


class Stored(msgspec.Struct, array_like=True, tag="stored", tag_field="op"):
    """A node that now serves a match: its blocks after its servable parent's end."""

    node: int
    parent: int  # its nearest ancestor that serves; ROOT_NODE for none
    hashes: bytes  # packed, HASH_BYTES each; the last one is the node's end

    def __post_init__(self) -> None:
        if not self.hashes or len(self.hashes) % HASH_BYTES:
            raise WireError(f"cache node {self.node}: hashes of {len(self.hashes)} bytes")

    def hash_list(self) -> list[bytes]:
        raw = self.hashes
        return [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


class Removed(msgspec.Struct, array_like=True, tag="removed", tag_field="op"):
    """A node that no longer serves a match."""

    node: int


class CacheEvents(Message, tag="cache_events"):
    ops: list[Stored | Removed]


class CacheSnapshot(Message, tag="cache_snapshot"):
    block: int  # tokens per hashed block
    ops: list[Stored]  # parents before their children

    def __post_init__(self) -> None:
        if self.block < 1:
            raise WireError(f"cache snapshot with blocks of {self.block} tokens")


CacheMessage = CacheEvents | CacheSnapshot
CACHE_MESSAGES = Decoder(CacheMessage)
