"""Sequential file writes with ``O_DIRECT``: from memory to the disk, around the page cache.

A buffered ``write`` copies every byte into the page cache before the disk sees it, and for a
checkpoint that copy is most of the persist (a kernel profile of a 1 GB persist on the
development VM: ``copy_folio_from_iter_atomic`` takes most of the writer's time, more where
fresh page-cache pages are slow to touch). With ``O_DIRECT`` the device reads the bytes from
the process's own memory; there is no copy and no page cache to fill or evict.

``O_DIRECT`` needs the file offset, the memory address and the length of each write to be
multiples of the device's logical block size; :data:`BLOCK` (4096) covers the devices in use.
:class:`DirectFile` takes sequential writes of any size and address:

* a write whose address is block-aligned, arriving when everything before it in the file ends
  on a block boundary, goes to the disk from where it is, in one ``writev`` with what is staged;
* anything else is copied (``memmove``, the GIL released) into a page-aligned staging buffer
  that is written whenever it is full;
* ``close`` pads the last block with zeros, writes it and truncates the file to its true size.

So a ``torch.save`` archive written with 4096-byte storage alignment (``io.statefile``) from
page-aligned buffers (the async snapshot's, :func:`aligned_empty`) sends each tensor's bytes
without a copy; only the zip headers and the last partial block of each tensor are staged.
Unaligned sources (a synchronous save of live tensors) are staged in full: one copy into a
buffer that stays in the CPU cache, as against one into fresh page-cache pages.

How fast the device reads a buffer depends on its physical layout: the block layer merges
physically adjacent pages into one segment, and scattered 4 KiB pages make many small
requests: an O_DIRECT write from pages with no physical neighbour runs at about half the speed
of one from transparent huge pages (``benchmarks/direct_sources.py``, which fragments free
memory first, measures it; docs/benchmarks.md has the figures). A process that has run a while
holds a mix. So :func:`aligned_empty` maps buffers from 2 MiB up on a 2 MiB boundary
and asks for huge pages (``MADV_HUGEPAGE``; honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``, a hint
elsewhere). Its mappings are private and wiped in a forked child (``MADV_WIPEONFORK``): a
DataLoader worker forked after the first snapshot would otherwise share them copy-on-write,
and every snapshot after it would copy each page it writes.

Not every filesystem takes ``O_DIRECT`` (``open`` fails with EINVAL on some FUSE filesystems,
and on tmpfs before Linux 6.6). :func:`open_direct` then returns None (and logs it once per
filesystem) or, when the setting requires direct I/O, raises an error naming the setting.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...errors import CheckpointError

__all__ = [
    "BLOCK",
    "STAGE_BYTES",
    "DirectFile",
    "address",
    "aligned_empty",
    "aligned_like",
    "open_direct",
    "open_direct_read",
    "read_buffer",
]

log = logging.getLogger(__name__)

BLOCK = 4096
ALIGN_MIN = 64 << 10  # buffers at least this large are allocated page-aligned (aligned_empty)
HUGE = 2 << 20  # ... and from this size up on a 2 MiB boundary, with huge-page advice
_MADV_WIPEONFORK = 18  # <linux/mman.h>; Python's mmap module does not name it
_STAGE = 16 << 20  # staging buffer: a multiple of BLOCK (16 MiB: the device's best write size here)
STAGE_BYTES = _STAGE
_POOL_MAX = 4  # staging buffers kept for reuse (two per writer, two concurrent writers; a read's 8 pieces)
_PIECE = 256 << 10  # a staged copy is checksummed in pieces this large, while they are in the CPU cache
_pool: list[tuple[mmap.mmap, int]] = []
_pool_lock = threading.Lock()
_refused: dict[int, str] = {}  # st_dev -> why that filesystem refused O_DIRECT


def address(view: memoryview) -> int | None:
    """Address of a contiguous buffer, or None when it cannot be told (numpy missing)."""
    try:
        import numpy as np
    except ImportError:
        return None
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _anonymous(nbytes: int) -> tuple[mmap.mmap, int]:
    """Private anonymous memory for ``nbytes``, and the offset in it where the buffer starts:
    a 2 MiB boundary with huge-page advice from :data:`HUGE` up, else offset 0 (a page).
    Pages the buffer does not use (the alignment slack) are never touched, so never resident."""
    huge = nbytes >= HUGE
    mapping = mmap.mmap(-1, nbytes + (HUGE if huge else 0) or 1,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = 0
    if huge:
        offset = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE
        whole = nbytes - nbytes % HUGE
        with contextlib.suppress(OSError, AttributeError):  # hints: 4 KiB pages without them
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, whole)
            # the last partial piece stays in small pages: with THP "always" a huge page there
            # would also make up to 2 MiB of the slack beyond the buffer resident
            mapping.madvise(mmap.MADV_NOHUGEPAGE, offset + whole, len(mapping) - offset - whole)
    for advice in (_MADV_WIPEONFORK, mmap.MADV_DONTFORK):  # Linux >= 4.14 wipes; older: left out
        with contextlib.suppress(OSError):
            mapping.madvise(advice)
            break
    return mapping, offset


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised CPU tensor whose storage starts on a page, from 2 MiB up on a huge page
    (see the module doc), so that :class:`DirectFile` writes it without a copy and in large
    segments. It owns its own private mapping, freed with it; a forked child sees zeros there."""
    import torch

    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    mapping, offset = _anonymous(nbytes)
    # frombuffer keeps `mapping` alive as long as the tensor's storage
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)


def aligned_like(t: Any) -> Any:
    """A page-aligned host buffer of ``t``'s shape and dtype (:func:`aligned_empty`) where
    O_DIRECT gains from one: ``t`` from :data:`ALIGN_MIN` up, strided, not quantized (a plain
    buffer cannot hold a quantized tensor). None otherwise: the caller allocates as it did."""
    import torch

    if t.layout != torch.strided or t.is_quantized or t.numel() * t.element_size() < ALIGN_MIN:
        return None
    return aligned_empty(tuple(t.shape), t.dtype)


def _take_stage() -> tuple[mmap.mmap, int]:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return _anonymous(_STAGE)


def _give_stage(stage: tuple[mmap.mmap, int]) -> None:
    with _pool_lock:
        if len(_pool) < _POOL_MAX:
            _pool.append(stage)


def open_direct(path: Path, *, required: bool, bounce: bool = False,
                crc: Callable[[Any, int], int] | None = None) -> DirectFile | None:
    """Create ``path`` (exclusively) for direct writes; None if its filesystem refuses O_DIRECT
    and ``required`` is false (logged once per filesystem), else :class:`CheckpointError`.

    ``bounce``: stage every byte instead of sending page-aligned sources to the disk from
    where they are (see :class:`DirectFile`). ``crc`` (``crc(data, value) -> value``, e.g.
    ``zlib.crc32``): a bouncing file checksums the bytes as it stages them
    (:attr:`DirectFile.crc`)."""
    flag = _direct_flag(path, required=required, doing="writing")
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o666)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # Linux creates the file before it checks O_DIRECT; O_EXCL made it ours
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _refusal(exc, path, required=required, done="written")
        return None
    return DirectFile(fd, path, bounce=bounce, crc=crc)


class _Stage:
    """One page-aligned staging buffer from the pool: its view and its address."""

    def __init__(self) -> None:
        self.buf = _take_stage()
        mapping, offset = self.buf
        self.view = memoryview(mapping)[offset : offset + _STAGE]
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + offset

    def release(self) -> None:
        self.view.release()
        _give_stage(self.buf)


class DirectFile:
    """A new file written sequentially with ``O_DIRECT`` (see the module doc). ``write`` takes any
    bytes-like object; ``close`` writes the staged tail, truncates to :attr:`size`, and fsyncs.

    Two staging buffers: a full one is written by a helper thread while the caller fills the
    other (one write in flight at a time, so the file offset stays sequential). A write from
    the caller's memory waits for it first. An error of the helper's write is raised by the
    next ``write`` or ``close``.

    ``bounce``: stage every byte, also page-aligned sources. For a writer whose sources lie in
    4 KiB pages that may be scattered in physical memory (the saver, writing from ``/dev/shm``
    segments without huge pages): copying them into the huge-page staging buffers while the
    other buffer is being written runs at the disk's speed for contiguous memory, at the cost
    of one copy of the bytes on the CPU. Then ``crc``, if given, checksums every
    byte right after it is copied, in pieces of :data:`_PIECE` that are still in the CPU
    cache, so the source is read once (for the copy) instead of twice (copy, then checksum);
    :attr:`crc` is the running value (None when the file does not checksum).
    """

    def __init__(self, fd: int, path: Path, *, bounce: bool = False,
                 crc: Callable[[Any, int], int] | None = None) -> None:
        self.path = path
        self._bounce = bounce
        self._crc = crc if bounce else None
        self.crc: int | None = None if self._crc is None else 0
        self.size = 0
        self.closed = False
        self._fd = fd
        self._stages = [_Stage()]
        self._cur = self._stages[0]
        self._n = 0  # bytes staged; the staging buffer always starts on a block boundary of the file
        self._io: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Nothing to do: staged bytes are written when a block fills, the tail on ``close``."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        addr = address(view) if total >= BLOCK else None
        direct = addr is not None and not self._bounce
        pos = 0
        while pos < total:
            left = total - pos
            if direct and left >= BLOCK and (addr + pos) % BLOCK == 0 and self._n % BLOCK == 0:  # type: ignore[operator]
                k = left - left % BLOCK
                self._wait()
                self._writev([self._cur.view[: self._n], view[pos : pos + k]])
                self._n = 0
                pos += k
                continue
            k = min(_STAGE - self._n, left)
            self._stage(view, addr, pos, k)
            self._n += k
            pos += k
            if self._n == _STAGE:
                self._hand_over()
        self.size += total
        return total

    def _stage(self, view: memoryview, addr: int | None, pos: int, k: int) -> None:
        """Copy ``k`` bytes of the source from ``pos`` to the staging buffer's end (and checksum them)."""
        step = k if self._crc is None else _PIECE
        for off in range(0, k, step):
            n, at = min(step, k - off), self._n + off
            if addr is not None:
                ctypes.memmove(self._cur.addr + at, addr + pos + off, n)  # releases the GIL
            else:
                self._cur.view[at : at + n] = view[pos + off : pos + off + n]
            if self._crc is not None:
                self.crc = self._crc(self._cur.view[at : at + n], self.crc)  # type: ignore[arg-type]

    def _hand_over(self) -> None:
        """Start writing the full staging buffer on the helper thread; go on in the other."""
        self._wait()
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="ftkit-direct-io")
            self._stages.append(_Stage())
        self._pending = self._io.submit(self._writev, [self._cur.view])
        self._cur = self._stages[1] if self._cur is self._stages[0] else self._stages[0]
        self._n = 0

    def _wait(self) -> None:
        """Wait for the helper's write; raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _writev(self, bufs: list[memoryview]) -> None:
        bufs = [b for b in bufs if b.nbytes]
        while bufs:
            want = sum(b.nbytes for b in bufs)
            try:
                done = os.writev(self._fd, bufs)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise OSError(
                        errno.EINVAL,
                        f"O_DIRECT write refused ({exc.strerror}; a device block larger than "
                        f"{BLOCK} bytes?): set checkpoint.direct_io=False",
                        str(self.path),
                    ) from exc
                raise
            if done == want:
                return
            if done == 0 or done % BLOCK:  # the next write could not be aligned
                raise OSError(errno.EIO, f"short O_DIRECT write ({done} of {want} bytes)", str(self.path))
            rest: list[memoryview] = []
            for b in bufs:  # drop what was written, keep the rest
                if done >= b.nbytes:
                    done -= b.nbytes
                else:
                    rest.append(b[done:])
                    done = 0
            bufs = rest

    def close(self, *, sync: bool = True) -> None:
        """Write the staged tail (zero-padded to a block), truncate to :attr:`size`, fsync if
        ``sync``, close. On an error the file is closed all the same, then the error raised."""
        if self.closed:
            return
        try:
            self._wait()
            if self._n:
                pad = -self._n % BLOCK
                ctypes.memset(self._cur.addr + self._n, 0, pad)
                self._writev([self._cur.view[: self._n + pad]])
                self._n = 0
                os.ftruncate(self._fd, self.size)
            if sync:
                os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing the staged tail (after a failure). A write in flight on the
        helper thread is waited for (its error dropped) before the descriptor is closed."""
        if self.closed:
            return
        self.closed = True
        if self._io is not None:
            self._io.shutdown(wait=True)
        self._pending = None
        for stage in self._stages:
            stage.release()
        os.close(self._fd)


# ---------------------------------------------------------------- reading


def open_direct_read(path: Path, *, required: bool = False) -> int | None:
    """A descriptor of ``path`` open for reading with ``O_DIRECT``, or None where its filesystem
    refuses it (logged once per filesystem, as for writes) and ``required`` is false, else
    :class:`CheckpointError` naming ``checkpoint.direct_io``. Errors other than a refusal
    (``ENOENT``, ``EACCES``, ...) are raised as they are."""
    flag = _direct_flag(path, required=required, doing="reading")
    if flag is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        _refusal(exc, path, required=required, done="read")
        return None


def _direct_flag(path: Path, *, required: bool, doing: str) -> int | None:
    """``O_DIRECT`` for opening ``path``, or None to go through the page cache: the platform
    has no ``O_DIRECT`` (an error where ``checkpoint.direct_io`` is True), or the filesystem
    of ``path`` already refused it (remembered by :func:`_refusal`)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        if required:
            raise CheckpointError(
                f"checkpoint.direct_io=True but this platform has no O_DIRECT ({doing} {path}); "
                "set checkpoint.direct_io to None (use it where available) or False"
            )
        return None
    if _refused and not required and os.stat(path.parent).st_dev in _refused:
        return None
    return flag


def _refusal(exc: OSError, path: Path, *, required: bool, done: str) -> None:
    """An open refused only because of O_DIRECT: an error where ``checkpoint.direct_io`` is True,
    else the filesystem is remembered (and logged once) so later opens go through the cache."""
    if required:
        raise CheckpointError(
            f"checkpoint.direct_io=True but the filesystem of {path} refuses O_DIRECT "
            f"({exc.strerror}); set checkpoint.direct_io to None (use it where available) or False"
        ) from exc
    dev = os.stat(path.parent).st_dev
    if dev not in _refused:
        log.info("the filesystem of %s refuses O_DIRECT (%s); checkpoints there are %s "
                 "through the page cache", path.parent, exc.strerror, done)
    _refused[dev] = exc.strerror or str(exc)


def read_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Fresh private memory to read a file of ``nbytes`` into with ``O_DIRECT``: page-aligned,
    its length rounded up to whole blocks (a direct read of a file's last partial block
    transfers the whole block). The mapping and a view of all of it.

    In 4 KiB pages, unlike the write path's buffers (:func:`aligned_empty`): a write buffer is
    filled once and written many times, a read buffer is faulted in once per load, and on a VM
    whose host backs guest memory lazily a fresh huge page costs more to fault than the 512
    small pages it replaces (``benchmarks/checkpoint_speed.py`` times the read into this
    buffer against the device's own read speed)."""
    length = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # a hint: THP "always" would fault 2 MiB
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return mapping, memoryview(mapping)


def take_stage() -> tuple[memoryview, Callable[[], None]]:
    """A page-aligned :data:`_STAGE`-byte buffer from the staging pool (reused across writes
    and reads, so not faulted in again), and the function that gives it back."""
    stage = _Stage()
    return stage.view, stage.release
