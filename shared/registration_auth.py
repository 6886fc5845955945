"""A replica's registration, signed: an HMAC-SHA256 under the cluster secret every
service shares (`--cluster-secret`) over the replica's id, the URL it gives and its
scheduler's epoch. The router sends a client's API key, and an operator's, to the URL a
registration names; without the signature, anything that can write Redis could name its
own address and collect them. With no secret set nothing is signed or checked (a stack on
one machine; `custody up` makes one up for its children)."""

from __future__ import annotations

import hashlib
import hmac


def signature(secret: str, replica: str, url: str, epoch: str) -> str:
    message = "\n".join((replica, url, epoch)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def verified(secret: str, replica: str, entry: dict) -> bool:
    """Whether `entry` (a registration read from Redis) was signed for `replica` under
    `secret`; always, with no secret."""
    if not secret:
        return True
    url, epoch, sig = entry.get("url"), entry.get("epoch"), entry.get("sig")
    if not all(isinstance(v, str) for v in (url, epoch, sig)):
        return False
    return hmac.compare_digest(signature(secret, replica, url, epoch), sig)
