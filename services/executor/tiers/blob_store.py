"""The disk tier: one file per disk slot, `<state_dir>/<slot>.blob`, holding one session's
state (its KV positions and its Mamba state) as the executor wrote it.

A blob is written to `<slot>.tmp` (mode 0600), fsynced, renamed over `<slot>.blob` and
the directory fsynced: a blob on disk is always whole, and a `.tmp` left by a write that
did not finish is never taken for one (they are deleted at start). After the rename the
file's pages are dropped from the page cache, so a later load really reads the disk.

Layout: a fixed prefix (magic, format version, header length), a JSON header (sid,
tokens, page size, each array's shape and dtype), the arrays' bytes (each padded to 64
bytes so it can be viewed in place), and a blake2b digest of everything before it. A
read checks all of it and raises a `BlobError` naming what was wrong; it never returns
bytes it did not check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

MAGIC = b"CUSTODYB"
VERSION = 1
PREFIX = struct.Struct("<8sHHI")  # magic, version, reserved, header length
DIGEST = 32
ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BlobError(Exception):
    """A blob that cannot be loaded: its move fails, the step runs on."""


class BlobMissing(BlobError):
    pass


class BlobUnreadable(BlobError):
    """The disk refused the read."""


class BlobBadMagic(BlobError):
    """Not a blob of this format (or of another format version)."""


class BlobTruncated(BlobError):
    pass


class BlobChecksumMismatch(BlobError):
    """The bytes are not the ones written (or the header does not parse)."""


class BlobMismatch(BlobError):
    """A whole blob, but of another session, length or shape than the move expects."""


class BlobSlotError(ValueError):
    """A disk slot outside 1..disk_slots."""


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class BlobStore:
    def __init__(self, state_dir: Path | None, disk_slots: int, page_size: int = 0) -> None:
        if disk_slots < 0 or (disk_slots and state_dir is None):
            raise ValueError(f"{disk_slots} disk slots need a state_dir")
        self.dir, self.disk_slots, self.page_size = state_dir, disk_slots, page_size
        if state_dir is None:
            return
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)  # an existing directory too: blobs are session data
        for leftover in state_dir.glob("*.tmp"):
            leftover.unlink(missing_ok=True)  # a write that never finished

    def path(self, slot: int) -> Path:
        self._check(slot)
        assert self.dir is not None
        return self.dir / f"{slot}.blob"

    def _check(self, slot: int) -> None:
        if not 0 < slot <= self.disk_slots:
            raise BlobSlotError(f"disk slot {slot} outside 1..{self.disk_slots}")

    def write(
        self,
        slot: int,
        sid: str,
        tokens: int,
        arrays: list[torch.Tensor],
        before_rename: Callable[[], None] | None = None,
    ) -> int:
        """Write the blob of `slot` whole, or raise OSError and leave no blob there (a
        failed spill's destination holds nothing). Returns the bytes written."""
        return self._write_file(
            slot, self._signed(self._encode(sid, tokens, arrays)), before_rename
        )

    def adopt(self, replica: str, src_slot: int, slot: int, sid: str, tokens: int) -> int:
        """Copy blob `src_slot` of `replica` (the directory beside this one) into `slot`,
        once it is checked whole and for `sid` and `tokens`: a `BlobError` otherwise, and
        nothing written. Returns the bytes written."""
        assert self.dir is not None
        source = self.dir.parent / f"replica-{replica}" / f"{src_slot}.blob"
        data = _read_whole(source)
        _decode(memoryview(data), source.name, sid, tokens)
        return self._write_file(slot, iter([memoryview(data)]), None)

    @staticmethod
    def _signed(chunks: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        digest = hashlib.blake2b(digest_size=DIGEST)
        for chunk in chunks:
            digest.update(chunk)
            yield chunk
        yield digest.digest()

    def _write_file(
        self,
        slot: int,
        chunks: Iterator[bytes | memoryview],
        before_rename: Callable[[], None] | None,
    ) -> int:
        blob = self.path(slot)
        tmp = blob.with_suffix(".tmp")
        written = 0
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                for chunk in chunks:
                    _write_all(fd, chunk)
                    written += len(chunk)
                os.fsync(fd)
                if before_rename is not None:
                    before_rename()
                os.replace(tmp, blob)
                self._fsync_dir()
                if hasattr(os, "posix_fadvise"):  # a later load reads the disk, not memory
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            for path in (tmp, blob):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            raise
        return written

    def _encode(
        self, sid: str, tokens: int, arrays: list[torch.Tensor]
    ) -> Iterator[bytes | memoryview]:
        flat = [a.detach().cpu().contiguous().reshape(-1) for a in arrays]
        specs = [
            {"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")} for a in arrays
        ]
        if any(s["dtype"] not in DTYPES for s in specs):
            raise ValueError(f"blob arrays must be one of {sorted(DTYPES)}")
        header = json.dumps(
            {"sid": sid, "tokens": tokens, "page_size": self.page_size, "arrays": specs}
        ).encode()
        header += b" " * (_padded(PREFIX.size + len(header)) - PREFIX.size - len(header))
        yield PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header
        for a in flat:
            data = memoryview(a.view(torch.uint8).numpy()) if a.numel() else memoryview(b"")
            yield data
            yield bytes(_padded(len(data)) - len(data))

    def _fsync_dir(self) -> None:
        assert self.dir is not None
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, slot: int, sid: str, tokens: int) -> list[torch.Tensor]:
        """The arrays of `slot`'s blob, checked whole and for `sid` and `tokens`; a
        `BlobError` otherwise."""
        path = self.path(slot)
        return _decode(memoryview(_read_whole(path)), path.name, sid, tokens)

    def discard(self, slot: int) -> None:
        """Delete `slot`'s blob; one already gone is fine."""
        path = self.path(slot)
        path.unlink(missing_ok=True)
        path.with_suffix(".tmp").unlink(missing_ok=True)


def _read_whole(path: Path) -> bytearray:
    try:
        with open(path, "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
    except FileNotFoundError as err:
        raise BlobMissing(f"{path.name}: no such blob") from err
    except OSError as err:
        raise BlobUnreadable(f"{path.name}: {err}") from err
    del data[got:]
    return data


def _decode(data: memoryview, name: str, sid: str, tokens: int) -> list[torch.Tensor]:
    if len(data) < PREFIX.size + DIGEST:
        raise BlobTruncated(f"{name}: {len(data)} bytes")
    magic, version, _, header_len = PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BlobBadMagic(f"{name}: magic {bytes(magic)!r}, format version {version}")
    start = PREFIX.size + header_len
    if start + DIGEST > len(data):
        raise BlobTruncated(f"{name}: {len(data)} bytes, header of {header_len}")
    try:
        header = json.loads(bytes(data[PREFIX.size : start]))
        specs = [(tuple(a["shape"]), DTYPES[a["dtype"]]) for a in header["arrays"]]
        sizes = [_nbytes(shape, dtype) for shape, dtype in specs]
    except (ValueError, KeyError, TypeError) as err:
        raise BlobChecksumMismatch(f"{name}: header does not parse ({err})") from err
    end = start + sum(_padded(n) for n in sizes)
    if end + DIGEST > len(data):
        raise BlobTruncated(f"{name}: {len(data)} bytes, {end + DIGEST} written")
    digest = hashlib.blake2b(data[:end], digest_size=DIGEST).digest()
    if len(data) != end + DIGEST or digest != bytes(data[end:]):
        raise BlobChecksumMismatch(f"{name}: checksum mismatch")
    if header.get("sid") != sid or header.get("tokens") != tokens:
        raise BlobMismatch(
            f"{name}: holds {header.get('sid')!r} at {header.get('tokens')} tokens,"
            f" not {sid!r} at {tokens}"
        )
    arrays, offset = [], start
    buffer = data.obj
    for (shape, dtype), n in zip(specs, sizes, strict=True):
        if n:
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=n, offset=offset)
            arrays.append(raw.view(dtype).reshape(shape))
        else:
            arrays.append(torch.empty(shape, dtype=dtype))
        offset += _padded(n)
    return arrays


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape {shape}")
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
