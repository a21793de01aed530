"""Durable file primitives: fsync, atomic replace, a file wrapper that checksums as it writes.

``fsync_dir`` and the atomic replace are :mod:`ftkit._fs`'s (one implementation for the
checkpoints and the job-dir writers), re-exported here for the checkpoint modules.

The checksum is CRC-32 (zlib's polynomial, stored as 8 lowercase hex digits). It catches
truncation, torn writes and flipped bits; it is not a defence against deliberate tampering.
It is computed with ``zlib_ng.crc32`` (the ``zlib-ng`` package, a dependency: carry-less
multiplication, several times the standard library's speed) when that imports, else with
``zlib.crc32``. Both give the same value, so a checkpoint written with one
verifies with the other; :data:`CRC_IMPL` says which one this process uses.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..._fs import atomic_write, fsync_dir
from .direct import address, open_direct

try:  # the same CRC-32 as zlib's, faster; releases the GIL like zlib.crc32
    from zlib_ng.zlib_ng import crc32 as crc32
    from zlib_ng.zlib_ng import crc32_combine as crc32_combine

    CRC_IMPL = "zlib-ng"
except ImportError:  # pragma: no cover - zlib-ng is a dependency; identical values, slower
    from zlib import crc32 as crc32

    CRC_IMPL = "zlib"

    def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
        """zlib's ``crc32_combine`` (the standard library does not export it)."""
        return _combine(crc1, crc2, len2)


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix (32 columns) that appends ``nbytes`` zero bytes to a CRC-32 register:
    zlib's ``crc32_combine`` operator, built once per length (a stream's pieces share theirs)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(2):  # two zero bits, then four
        op = [_gf2_times(op, op[n]) for n in range(32)]
    total = [1 << n for n in range(32)]  # the identity
    while True:
        op = [_gf2_times(op, op[n]) for n in range(32)]  # one zero byte, then 2, 4, ...
        if nbytes & 1:
            total = [_gf2_times(op, total[n]) for n in range(32)]
        nbytes >>= 1
        if not nbytes:
            return tuple(total)


def _combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``len2 = len(B)``:
    zlib's ``crc32_combine``, in Python (the fallback where zlib-ng is missing)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2

__all__ = [
    "CHECKSUM",
    "CRC_IMPL",
    "HashingWriter",
    "atomic_write_bytes",
    "crc32",
    "crc32_combine",
    "crc32_file",
    "fsync_dir",
    "fsync_file",
]

CHECKSUM = "crc32"
_CHUNK = 4 << 20
_COPY_MAX = 256 << 10  # HashingWriter copies buffers up to this size for its CRC thread
_WRITEBACK_EVERY = 64 << 20  # HashingWriter starts the kernel's writeback this often
_WRITEBACK_DROP = 2 * _WRITEBACK_EVERY  # ...and evicts written-back pages this far behind


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, crc32 hex)`` of a file, read sequentially in 4 MiB chunks into one buffer."""
    crc = 0
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


class HashingWriter:
    """A write-only binary file that counts bytes and updates a CRC-32 as they are written.

    Pass it to ``torch.save``: torch writes its zip archive sequentially through ``write``,
    so the checksum covers exactly the bytes on disk without reading them back.

    The CRC runs in a helper thread over the very buffers handed to ``write``, in write order,
    so it overlaps the write calls and the final fsync instead of adding to them
    (:func:`crc32` releases the GIL). A buffer may be checksummed after ``write`` returned
    only if it stays valid and unchanged until ``close``: buffers inside one of the ``stable``
    memory ranges (``(address, nbytes)``, e.g. the storages of the tensors being saved) are
    queued by reference; other buffers are copied when small, else ``write`` waits until
    their CRC is done. ``close`` flushes and fsyncs while the CRC catches up, then joins the
    thread; ``abort`` stops it without waiting.
    A direct file that stages every byte (``bounce``, the saver's) computes the CRC itself
    instead, each piece right after copying it, while it is in the CPU cache.

    ``direct``: write with ``O_DIRECT`` (:mod:`ftkit.checkpoint.io.direct`), True requires it, None uses it where
    the filesystem accepts it; :attr:`direct` says whether it is in use. Otherwise the file is
    written through the page cache, with ``writeback`` bounding how much of it a save occupies.
    ``bounce``: a direct file stages every byte (:class:`ftkit.checkpoint.io.direct.DirectFile`), for sources in
    4 KiB pages that may be scattered in physical memory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        stable: Iterable[tuple[int, int]] = (),
        writeback: bool = True,
        direct: bool | None = False,
        bounce: bool = False,
    ) -> None:
        self.path = Path(path)
        self._f: Any = None
        if direct is not False:
            self._f = open_direct(self.path, required=direct is True, bounce=bounce, crc=crc32)
        self.direct = self._f is not None
        self._staged_crc = self.direct and self._f.crc is not None  # the direct file checksums
        if self._f is None:
            self._f = open(self.path, "xb")  # noqa: SIM115 - closed in close()
        self.size = 0
        self._writeback = writeback and not self.direct and hasattr(os, "posix_fadvise")
        self._written_back = 0
        self.error: OSError | None = None  # torch.save turns write errors into RuntimeError
        self._crc = _CrcThread()
        self._aborted = False
        ranges = sorted({(int(a), int(a) + int(n)) for a, n in stable if n > 0})
        self._starts = [a for a, _ in ranges]
        self._ends = [b for _, b in ranges]

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        if self._aborted:  # the file is given up: torch's zip writer may still write its end
            return view.nbytes  # records as it is freed, in a C++ destructor, where raising aborts the process
        done = None if self._staged_crc else self._queue_crc(view)
        try:
            n = self._f.write(view)
        except OSError as exc:
            self.error = exc
            raise
        finally:
            if done is not None:  # the caller may free the buffer once write returns (or raises)
                try:
                    done.wait()
                except BaseException:  # Ctrl-C twice: the CRC thread may still be reading it
                    done.wait()
                    raise
        self.size += view.nbytes
        if self._writeback and self.size - self._written_back >= _WRITEBACK_EVERY:
            self._start_writeback()
        return n

    def _queue_crc(self, view: memoryview) -> threading.Event | None:
        """Hand ``view`` to the CRC thread; an event to wait for before ``write`` returns, if any."""
        if view.nbytes <= _COPY_MAX:
            self._crc.put(bytes(view))
        elif self._is_stable(view):
            self._crc.put(view)
        else:
            done = threading.Event()
            self._crc.put(view, done)
            return done
        return None

    def _start_writeback(self) -> None:
        """Start the writeback of what was written since the last call; evict what is on disk.

        ``POSIX_FADV_DONTNEED`` starts the asynchronous writeback of the dirty pages in its
        range and evicts the clean ones (Linux; PostgreSQL's fallback for ``sync_file_range``).
        Pages just written are still dirty, so the range reaches back ``_WRITEBACK_DROP``
        bytes: the pages whose writeback an earlier call started, done by now, are evicted and
        the next writes recycle them. A save thus cycles through a few intervals' worth of page
        cache instead of taking its whole size in fresh pages, which costs more than the write
        itself where first touching memory is slow (VMs with free page reporting or ballooning), and it does not
        evict other files' cache. Durability still comes from fsync.
        """
        end = self.size
        start = max(0, self._written_back - _WRITEBACK_DROP)
        try:
            os.posix_fadvise(self._f.fileno(), start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._writeback = False  # only an optimisation
        self._written_back = end

    def _is_stable(self, view: memoryview) -> bool:
        start = address(view)
        if start is None:
            return False
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + view.nbytes <= self._ends[i]

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
        """The CRC-32 of everything written; final only after ``close``."""
        return f"{self._f.crc if self._staged_crc else self._crc.value:08x}"

    def close(self, *, sync: bool = True) -> None:
        if self._f.closed:
            return
        try:
            try:
                if self.direct:
                    self._f.close(sync=sync)  # the staged tail, truncate, fsync
                else:
                    self._f.flush()
                    if sync:
                        os.fsync(self._f.fileno())  # the CRC thread catches up meanwhile
            except OSError as exc:
                self.error = exc
                raise
            finally:
                self._f.close()
        except BaseException:
            self._crc.stop(wait=False)
            raise
        self._crc.stop(wait=True)

    def abort(self) -> None:
        """Close without fsync after a failure; the caller leaves the file marked incomplete.
        Later writes are taken and dropped (:meth:`write`)."""
        if self._aborted:
            return
        self._aborted = True
        self._crc.stop(wait=False)
        with contextlib.suppress(OSError):
            if self.direct:
                self._f.abort()
            else:
                self._f.close()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _CrcThread:
    """CRC-32 of a sequence of buffers, in order, in a helper thread."""

    def __init__(self) -> None:
        self.value = 0
        self._queue: queue.SimpleQueue[tuple[Any, threading.Event | None] | None] = (
            queue.SimpleQueue()
        )
        self._abort = False
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def put(self, buf: Any, done: threading.Event | None = None) -> None:
        if self._stopped:
            raise ValueError("write to a closed HashingWriter")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftkit-crc32", daemon=True)
            self._thread.start()  # stop() ends it even if Ctrl-C twice interrupts this
        self._queue.put((buf, done))

    def _run(self) -> None:
        crc = 0
        while (item := self._queue.get()) is not None:
            buf, done = item
            try:
                if not self._abort and self.error is None:
                    crc = crc32(buf, crc)
                    self.value = crc
            except BaseException as exc:  # re-raised by stop()
                self.error = exc
            finally:
                if done is not None:
                    done.set()

    def stop(self, *, wait: bool) -> None:
        """End the thread; ``wait=False`` skips the CRC of what is still queued."""
        self._stopped = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._abort = self._abort or not wait
        self._queue.put(None)  # also ends a thread whose start() was interrupted, once it runs
        try:
            thread.join()
        except RuntimeError:  # not started: KeyboardInterrupt (Ctrl-C twice) in start(), before
            if wait:  # it had checksummed anything
                raise RuntimeError("CRC-32 thread never started: the checksum is unknown") from None
            return
        if wait and self.error is not None:
            raise RuntimeError(f"CRC-32 thread failed: {self.error}") from self.error


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, sync: bool = True, sync_dir: bool = True
) -> None:
    """:func:`ftkit._fs.atomic_write` for a checkpoint's own files (manifest, ``latest``, a
    rank's part): created with the mode every other checkpoint file gets (``0o666`` before the
    umask, as ``torch.save`` creates the state files)."""
    atomic_write(path, data, sync=sync, sync_dir=sync_dir, mode=0o666)
