"""What every message between the services shares: the format version, its kind (the
tag msgspec dispatches on), the producer's `(epoch, seq)` so a consumer applies it once
(a duplicate has a seq it has seen; a gap, one past the next it expects), and integer
arrays packed as little-endian bytes.

Each message kind is a msgspec Struct (forward.py: the step and its result; ownership.py:
what the scheduler tells the session store). Decoding checks every field's type and every
packed array's length; a message that fails is a `WireError` naming why, which the
consumer counts and acknowledges: it is never half-applied and never crashes it.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec
import numpy as np

FORMAT_VERSION = 2
M = TypeVar("M")


class WireError(ValueError):
    """A message that is not of this format: refused, never half-applied."""


class Message(msgspec.Struct, kw_only=True, tag_field="kind"):
    v: Literal[2] = FORMAT_VERSION  # a message of another format fails to decode
    epoch: str  # the producer's life
    seq: int  # the producer's number of this message within its epoch


def pack(values: np.ndarray | list[int] | list[float], dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def unpack(raw: bytes, dtype: str) -> np.ndarray:
    """`raw` as an array of `dtype`; a WireError if its length is not a whole number of
    items (a truncated or foreign field)."""
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise WireError(f"a packed {dtype} array of {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def encode(message: Message) -> bytes:
    return msgspec.msgpack.encode(message)


class Decoder:
    """Decodes raw messages as one type (a Struct or a union of tagged Structs)."""

    def __init__(self, kind: type[M]) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)

    def decode(self, raw: bytes) -> M:
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            raise WireError(f"malformed message: {err}") from None
