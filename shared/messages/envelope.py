"""What every message between the services shares: the format version, its kind (the
tag msgspec dispatches on), the producer's `(epoch, seq)` so a consumer applies it once
(a duplicate has a seq it has seen; a gap, one past the next it expects), and integer
arrays packed as little-endian bytes.

An array field is declared once, by its type (`U1`, `I4`, `I8`, `U8`, `F4`, `F8`): it holds a numpy
array, travels as the bytes of its items (msgpack bin, as `pack` writes them), and is
decoded back by `decode_hook`, which checks its length.

Each message kind is a msgspec Struct (forward.py: the step and its result; ownership.py:
what the scheduler tells the session store). Decoding checks every field's type and every
packed array's length; a message that fails is a `WireError` naming why, which the
consumer counts and acknowledges: it is never half-applied and never crashes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

FORMAT_VERSION = 2
M = TypeVar("M")
U1 = npt.NDArray[np.uint8]
I4 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint64]
F4 = npt.NDArray[np.float32]
F8 = npt.NDArray[np.float64]
WIRE_DTYPES = {U1: "<u1", I4: "<i4", I8: "<i8", U8: "<u8", F4: "<f4", F8: "<f8"}
# each kind's dtype made once: a step decodes a few arrays per row, hundreds of rows
_DTYPES = {kind: np.dtype(name) for kind, name in WIRE_DTYPES.items()}


class WireError(ValueError):
    """A message that is not of this format: refused, never half-applied."""


class Arrays(msgspec.Struct, kw_only=True):
    """A Struct with array fields: equal when every field is, arrays by their items'
    bytes (numpy's own `==` has no single truth value)."""

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(_same(getattr(self, f), getattr(other, f)) for f in self.__struct_fields__)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b


class Message(msgspec.Struct, kw_only=True, tag_field="kind"):
    v: Literal[2] = FORMAT_VERSION  # a message of another format fails to decode
    epoch: str  # the producer's life
    seq: int  # the producer's number of this message within its epoch


def pack(values: np.ndarray | list[int] | list[float], dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def unpack(raw: bytes, dtype: str) -> np.ndarray:
    """`raw` as an array of `dtype`; a WireError if its length is not a whole number of
    items (a truncated or foreign field)."""
    return _frombuffer(raw, np.dtype(dtype))


def _frombuffer(raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"a packed {dtype.str} array of {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def array(values: np.ndarray | Sequence[int] | Sequence[float], kind: type) -> np.ndarray:
    """`values` as a new array for a field of type `kind` (U1, I4, I8, U8, F4, F8): a
    copy, so the message does not change with the caller's array."""
    out = np.asarray(values, dtype=WIRE_DTYPES[kind])
    # a conversion already made a new array: copy only what may still be the caller's
    return out.copy() if out is values or not out.flags.owndata else out


def empty(kind: type) -> Callable[[], np.ndarray]:
    """The default factory of an array field that may be left out: no items."""
    return lambda: array((), kind)


def encode_hook(value: object) -> bytes:
    """An array field's items as msgpack bin (their dtype is the field's: `array`)."""
    if isinstance(value, np.ndarray):
        return value.tobytes()
    raise NotImplementedError(type(value))


def decode_hook(kind: type, raw: object) -> np.ndarray:
    """An array field from its bytes; a WireError if it is cut."""
    dtype = _DTYPES.get(kind)
    if dtype is None:
        raise NotImplementedError(kind)
    if type(raw) is not bytes:
        raise WireError(f"expected a packed {dtype.str} array, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:  # as `unpack`, inline: called per array field per row
        raise WireError(f"a packed {dtype.str} array of {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(message, enc_hook=encode_hook)


class Decoder:
    """Decodes raw messages as one type (a Struct or a union of tagged Structs)."""

    def __init__(self, kind: type[M]) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=decode_hook)

    def decode(self, raw: bytes) -> M:
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            raise WireError(f"malformed message: {err}") from None
