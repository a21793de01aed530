"""Durable file primitives: fsync, atomic replace, a file wrapper that checksums as it writes.

The checksum is CRC-32 (``zlib.crc32``, stored as 8 lowercase hex digits). It catches
truncation, torn writes and flipped bits at several GB/s; it is not a defence against
deliberate tampering.
"""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "CHECKSUM",
    "HashingWriter",
    "atomic_write_bytes",
    "crc32_file",
    "fsync_dir",
    "fsync_file",
]

CHECKSUM = "crc32"
_CHUNK = 4 << 20


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, crc32 hex)`` of a file, read sequentially in 4 MiB chunks."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


class HashingWriter:
    """A write-only binary file that counts bytes and updates a CRC-32 as they are written.

    Pass it to ``torch.save``: torch writes its zip archive sequentially through ``write``,
    so the checksum covers exactly the bytes on disk without reading them back.
    ``close`` flushes and fsyncs.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._f: BinaryIO = open(self.path, "xb")  # noqa: SIM115 - closed in close()
        self._crc = 0
        self.size = 0
        self.error: OSError | None = None  # torch.save turns write errors into RuntimeError

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            n = self._f.write(view)
        except OSError as exc:
            self.error = exc
            raise
        self._crc = zlib.crc32(view, self._crc)
        self.size += len(view)
        return n

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def checksum(self) -> str:
        return f"{self._crc:08x}"

    def close(self, *, sync: bool = True) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            if sync:
                os.fsync(self._f.fileno())
        except OSError as exc:
            self.error = exc
            raise
        finally:
            self._f.close()

    def abort(self) -> None:
        """Close without fsync after a failure; the caller leaves the file marked incomplete."""
        with contextlib.suppress(OSError):
            self._f.close()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to a temporary sibling, fsync, then ``os.replace`` it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)
