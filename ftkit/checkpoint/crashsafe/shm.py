"""Snapshots in shared memory: one segment file per slot under ``/dev/shm``, readable by the saver.

Segment layout (``ftkit-snap-<token>-s<slot>-g<generation>``, mode 0600; see ``crashsafe.client``)::

    [0, 4096)                header: magic, version, state, seq, step, skeleton offset/length, data offset
    [4096, data_off)         skeleton: pickled {"skeleton", "tensors": [(offset, dtype, shape)], "nbytes"}
    [data_off, size)         tensor bytes, each at a 64-byte aligned offset, a 4096-byte
                             aligned one from 64 KiB up (written with O_DIRECT, ``io.direct``)

Commit rule (the crash guarantee): the trainer sets ``state = WRITING`` before it touches the
slot, copies the tensors, writes the skeleton and the header fields, and only then sets
``state = COMPLETE``. The saver only ever reads a slot whose state is COMPLETE, so a trainer
killed mid-copy leaves a slot that is ignored, never a half-copied snapshot. Two or more slots
(double buffering) keep the previous complete snapshot intact while the next one is written.

Lock rule (the saver reads while a trainer is alive): the trainer holds an exclusive ``flock`` on
the segment from ``begin`` to ``end``; the saver holds a shared one while it reads a slot
(``read_slot`` to ``SlotView.close``). A trainer never refills a slot it asked the saver to
persist, so the two only meet when the saver rescues a live rank's snapshot after another rank of
its node died: the rank's next refill of that slot then waits for the rescue's read. A lock held
by the file description of a dead trainer's forked child (a DataLoader worker) is not waited for:
``read_slot`` gives up waiting once the trainer is gone, and the header still says WRITING.

The space is reserved with ``posix_fallocate`` when the segment is created, so a full
``/dev/shm`` is an ENOSPC error then, not a SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._fs import mount_of
from ...errors import CheckpointError
from ..io.direct import ALIGN_MIN

__all__ = ["PREFIX", "Segment", "SlotMap", "SlotView", "huge_pages", "read_slot"]

log = logging.getLogger(__name__)

PREFIX = "ftkit-snap-"
MAGIC = b"FTKITSHM"
VERSION = 1
WRITING, COMPLETE = 0, 1
_HEADER = struct.Struct("<8sIIqqQQQ")  # magic, version, state, seq, step, skel_off, skel_len, data_off
_STATE_AT = 12  # byte offset of ``state`` in the header
_PAGE = 4096
_ALIGN = 64


def huge_pages(directory: str | os.PathLike[str]) -> bool:
    """Whether files created in ``directory`` get huge pages when their space is reserved: a
    tmpfs mounted with ``huge=always`` or ``huge=within_size``. ``/dev/shm`` is mounted without
    by default; then the saver bounces its writes (``bounce`` of :class:`ftkit.checkpoint.io.direct.DirectFile`):
    segment pages may be scattered in physical memory."""
    mount = mount_of(directory)
    return (mount is not None and mount.fstype == "tmpfs"
            and bool({"huge=always", "huge=within_size"} & set(mount.options)))


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"shared-memory snapshot names an unknown dtype {name!r}")
    return dtype


class Segment:
    """Trainer side of one slot: the mapped segment and a buffer (view) per tensor.

    ``layout`` is ``((where, shape, dtype), ...)``; ``fits`` says whether a new snapshot can
    reuse this segment, otherwise the caller creates a new one (next generation) and closes this.
    """

    def __init__(self, directory: Path, token: str, slot: int, generation: int,
                 layout: tuple, skeleton_capacity: int, *, pin: bool = False) -> None:
        self.layout = layout
        self.path = Path(directory) / f"{PREFIX}{token}-s{slot}-g{generation}"
        self.skeleton_capacity = _round(max(skeleton_capacity, 64 << 10), _PAGE)
        self.data_off = _PAGE + self.skeleton_capacity
        offsets, end = [], self.data_off
        for _, shape, dtype in layout:
            numel = 1
            for n in shape:
                numel *= n
            nbytes = numel * dtype.itemsize
            if nbytes >= ALIGN_MIN:  # on a page: an O_DIRECT write sends it without a copy
                end = _round(end, _PAGE)
            offsets.append(end)
            end = _round(end + nbytes, _ALIGN)
        self.size = _round(max(end, self.data_off + _ALIGN), _PAGE)
        self.table = [(off, str(dtype).removeprefix("torch."), list(shape)) for off, (_, shape, dtype) in zip(offsets, layout, strict=True)]
        self._registered = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self._head = mmap.mmap(fd, self.data_off)
        except OSError as exc:
            os.close(fd)
            self._unlink()
            try:
                st = os.statvfs(directory)
                free = f" ({st.f_bavail * st.f_frsize} bytes free there now)"
            except OSError:
                free = ""
            raise CheckpointError(
                f"cannot reserve {self.size} bytes of shared memory in {directory} for a snapshot: "
                f"{exc.strerror or exc}{free}. A crash-safe background save keeps max_in_flight + 1 "
                "snapshots of this size there (two by default, each slot made at its first use): free that "
                "much space there or set async_save.shm_dir"
            ) from exc
        self._fd = fd  # kept open for the write lock
        _HEADER.pack_into(self._head, 0, MAGIC, VERSION, WRITING, -1, -1, _PAGE, 0, self.data_off)
        base = torch.from_file(str(self.path), shared=True, size=self.size, dtype=torch.uint8)
        self.buffers = [
            base[off : off + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
            for off, (_, shape, dtype) in zip(offsets, layout, strict=True)
        ]
        if pin and torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.size, 0)
            self._registered = int(err) == 0
            if not self._registered:
                from ..io.device import forget_cuda_error

                forget_cuda_error()  # handled: torch's next kernel launch must not raise it
                log.warning("cudaHostRegister of %s failed (%s): device copies will be synchronous", self.path, err)
        self._base = base

    def fits(self, layout: tuple, skeleton_len: int) -> bool:
        return layout == self.layout and skeleton_len <= self.skeleton_capacity

    def begin(self) -> None:
        """Lock the slot and mark it as being written: until ``commit`` the saver ignores it.
        Always followed by ``end``, which unlocks."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # waits only for a rescue reading this slot
        struct.pack_into("<I", self._head, _STATE_AT, WRITING)

    def end(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def commit(self, seq: int, step: int, skeleton: Any, nbytes: int) -> None:
        """Write the skeleton and header, then flip the state to COMPLETE (last store)."""
        blob = encode_skeleton(skeleton, self.table, nbytes)
        if len(blob) > self.skeleton_capacity:
            raise CheckpointError(f"internal: skeleton of {len(blob)} bytes does not fit {self.path}")
        self._head[_PAGE : _PAGE + len(blob)] = blob
        _HEADER.pack_into(self._head, 0, MAGIC, VERSION, WRITING, seq, step, _PAGE, len(blob), self.data_off)
        struct.pack_into("<I", self._head, _STATE_AT, COMPLETE)

    def close(self, *, unlink: bool = True) -> None:
        """Unmap and (unless told not to: the saver unlinks it) unlink; idempotent."""
        if self._registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._registered = False
        self.buffers = []
        self._base = None  # type: ignore[assignment]  # closed: the mapping is gone
        if not self._head.closed:
            self._head.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            self._unlink()

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def encode_skeleton(skeleton: Any, table: list, nbytes: int) -> bytes:
    return pickle.dumps({"skeleton": skeleton, "tensors": table, "nbytes": nbytes}, protocol=5)


@dataclass(slots=True)
class SlotView:
    """Saver side: a COMPLETE slot, its tensors mapped straight from shared memory, read-locked
    until ``close``."""

    path: Path
    seq: int
    step: int
    skeleton: Any
    tensors: list[torch.Tensor]
    nbytes: int
    _owner: Any

    def close(self) -> None:
        self.tensors = []
        self.skeleton = None
        self._owner.release()


class SlotMap:
    """Saver side: one segment mapped once (``MAP_POPULATE``) and read at every persist of its slot.

    Mapping a segment anew for each persist would fault in (or populate) every page of it each
    time, a noticeable part of every persist. ``close`` unmaps and closes (idempotent).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(self._fd)
            if st.st_uid != os.geteuid():
                raise CheckpointError(f"{path} belongs to uid {st.st_uid}, not to this user; not reading it")
            self._mm: Any = mmap.mmap(self._fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(self._fd)
            raise
        self._one_shot = False

    def read(self, *, seq: int | None = None, writer_alive: Callable[[], bool] = lambda: False) -> SlotView | None:
        """The slot under a read lock if it is COMPLETE (with ``seq`` if given), else None.
        While ``writer_alive()``, waits for a write in progress to end."""
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not writer_alive():
                    break  # held by a dead trainer's child: the header tells whether it is complete
                time.sleep(0.01)
        mm = self._mm
        magic, version, state, got_seq, step, skel_off, skel_len, _ = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or state != COMPLETE or (seq is not None and got_seq != seq):
            self.release()
            return None
        meta = pickle.loads(mm[skel_off : skel_off + skel_len])
        tensors = []
        for off, dtype_name, shape in meta["tensors"]:
            dtype = _dtype(dtype_name)
            nbytes = _numel(shape) * dtype.itemsize
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
            else:
                tensors.append(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off).view(dtype).view(shape))
        return SlotView(self.path, got_seq, step, meta["skeleton"], tensors, meta["nbytes"], self)

    def release(self) -> None:
        """Drop the read lock (a one-shot mapping from ``read_slot`` is closed instead)."""
        if self._one_shot:
            self.close()
        elif self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a tensor still referenced: the GC unmaps it later
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)  # also releases the lock
            self._fd = -1


def read_header(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """``(state, seq, step)`` of a segment, or None if it is not one (or gone)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, version, state, seq, step, *_ = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return state, seq, step


def read_slot(
    path: str | os.PathLike[str], *, seq: int | None = None, writer_alive: Callable[[], bool] = lambda: False
) -> SlotView | None:
    """Map a COMPLETE slot once (see :class:`SlotMap`); None if it is absent, being written or
    another seq. ``SlotView.close`` unmaps it."""
    try:
        owner = SlotMap(path)
    except FileNotFoundError:
        return None
    owner._one_shot = True
    view = owner.read(seq=seq, writer_alive=writer_alive)
    if view is None:
        owner.close()
    return view
