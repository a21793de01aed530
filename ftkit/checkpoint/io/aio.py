"""Linux native asynchronous reads (``io_setup``, ``io_submit``, ``io_getevents``) for ``O_DIRECT``.

With ``O_DIRECT`` on a local filesystem (ext4, xfs, btrfs) ``io_submit`` queues the reads on the
device and returns: one thread keeps a whole window of reads in flight, and collects them as
they complete, without a thread per read. A load used to start a reader thread per read in
flight and a pool for each round of small reads: on the development VM a thread costs 1-3 ms to
start (its stack is fresh memory), which made thread starts the largest fixed cost of loading a
small checkpoint. Here a context costs one system call.

The calls are made through ``syscall(2)`` (glibc has no wrappers; libaio is not needed): on
x86-64 and aarch64, little-endian, where the kernel's ``struct iocb`` layout below holds.
:func:`open_context` returns None elsewhere, or where the kernel refuses (``ENOSYS`` under a
seccomp filter or gVisor, ``EAGAIN`` when ``/proc/sys/fs/aio-max-nr`` is reached): the reader
then reads on threads (:mod:`ftkit.checkpoint.io.reader`). Native AIO is asynchronous only for
``O_DIRECT`` on filesystems that implement it; on others ``io_submit`` returns once the read is
done, which would read one request at a time, so :func:`asynchronous_fs` names the filesystems it
is used on.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["AioContext", "asynchronous_fs", "open_context"]

log = logging.getLogger(__name__)

# (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0
# statfs f_type of filesystems whose O_DIRECT reads are queued by io_submit, not done in it
_ASYNC_FS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs"}


class _Iocb(ctypes.Structure):
    """``struct iocb`` of ``<linux/aio_abi.h>`` (little-endian)."""

    _fields_ = [
        ("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
        ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    """``struct io_event``: the request's ``data``, its iocb, bytes read (or ``-errno``)."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def _libc() -> tuple[Any, Any]:
    """glibc's ``syscall`` and ``fstatfs``, or None where the calls below do not apply."""
    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        return None, None
    if os.uname().machine not in _SYSCALLS or ctypes.sizeof(_Iocb) != 64 or ctypes.sizeof(_Event) != 32:
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call, fstatfs = libc.syscall, libc.fstatfs
    except (OSError, AttributeError):
        return None, None
    call.restype = ctypes.c_long
    return call, fstatfs


_syscall, _fstatfs = _libc()
_ARCH = os.uname().machine if _syscall is not None else ""
_refused: list[str] = []  # why the kernel refused a context, once (then never asked again)


def asynchronous_fs(fd: int) -> str | None:
    """The name of ``fd``'s filesystem if its ``O_DIRECT`` reads are asynchronous under
    ``io_submit``, else None (network and FUSE filesystems: the reader uses threads there)."""
    if _syscall is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field (a long)
    if _fstatfs is None or _fstatfs(fd, buf) != 0:
        return None
    return _ASYNC_FS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class AioContext:
    """One kernel AIO context with room for ``depth`` reads in flight.

    ``submit(reads)`` queues ``(tag, fd, address, nbytes, offset)`` reads (the memory at
    ``address`` must stay valid until the read completes); ``wait(least)`` blocks until at
    least ``least`` reads completed and returns ``(tag, result)`` for each, ``result`` the bytes
    read or ``-errno``. :meth:`close` waits for the reads still in flight, so their memory may
    be reused after it. One thread uses a context at a time."""

    def __init__(self, ctx: int, depth: int) -> None:
        self._ctx = ctypes.c_ulong(ctx)
        self._pid = os.getpid()
        self.depth = depth
        self._inflight: dict[int, _Iocb] = {}  # tag -> its iocb, kept alive while the kernel holds it
        self._events = (_Event * depth)()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def submit(self, reads: Iterable[tuple[int, int, int, int, int]]) -> None:
        assert _syscall is not None
        batch: list[_Iocb] = []
        for tag, fd, address, nbytes, offset in reads:
            cb = _Iocb(data=tag, opcode=_IOCB_CMD_PREAD, fildes=fd, buf=address, nbytes=nbytes, offset=offset)
            batch.append(cb)
        while batch:
            if len(self._inflight) + len(batch) > self.depth:
                raise ValueError(f"{len(self._inflight) + len(batch)} reads in flight, room for {self.depth}")
            ptrs = (ctypes.POINTER(_Iocb) * len(batch))(*[ctypes.pointer(cb) for cb in batch])
            n = _syscall(ctypes.c_long(_SYSCALLS[_ARCH][3]), self._ctx, ctypes.c_long(len(batch)), ptrs)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"io_submit: {os.strerror(err)}")
            for cb in batch[:n]:
                self._inflight[int(cb.data)] = cb
            batch = batch[n:]

    def wait(self, least: int = 1) -> list[tuple[int, int]]:
        assert _syscall is not None
        least = max(0, min(least, len(self._inflight)))
        while True:
            n = _syscall(ctypes.c_long(_SYSCALLS[_ARCH][2]), self._ctx, ctypes.c_long(least),
                         ctypes.c_long(self.depth), self._events, None)
            if n >= 0:
                break
            if ctypes.get_errno() != errno.EINTR:  # a signal: its handler runs when this returns
                _check(n, "io_getevents")
        done: list[tuple[int, int]] = []
        for event in self._events[:n]:
            tag = int(event.data)
            self._inflight.pop(tag, None)
            done.append((tag, int(event.res)))
        return done

    def drain(self) -> None:
        """Wait for every read still in flight (their memory may be reused after it)."""
        while self._inflight:
            self.wait(len(self._inflight))

    def close(self) -> None:
        """Wait for the reads in flight, then keep the context for the next :func:`open_context`
        of this process (``io_destroy`` waits for an RCU grace period: ~30 ms on the development
        VM, a tenth of a small checkpoint's load)."""
        if self._ctx.value == 0:
            return
        try:
            self.drain()
        except BaseException:  # the reads' state is unknown: destroying the context waits for them
            self._destroy()
            raise
        with _lock:
            if self._pid == os.getpid() and len(_idle) < _IDLE_MAX:
                _idle.append(self)
                return
        self._destroy()

    def _destroy(self) -> None:
        ctx, self._ctx = self._ctx, ctypes.c_ulong(0)
        self._inflight.clear()
        if _syscall is None or ctx.value == 0 or self._pid != os.getpid():  # a fork's copy is not ours
            return
        while _syscall(ctypes.c_long(_SYSCALLS[_ARCH][1]), ctx) < 0 and ctypes.get_errno() == errno.EINTR:
            pass


_lock = threading.Lock()
_idle: list[AioContext] = []  # contexts with nothing in flight, for reuse
_IDLE_MAX = 4


def _forget_after_fork() -> None:
    """A forked child inherits the list, not the contexts (the kernel does not copy them)."""
    _idle.clear()
    _lock.release()


if hasattr(os, "register_at_fork"):  # the lock is taken across the fork: no thread holds it mid-change
    os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_forget_after_fork)


def open_context(depth: int) -> AioContext | None:
    """An :class:`AioContext` for ``depth`` reads (an idle one of this process when there is
    one large enough), or None where native AIO cannot be had (the reason is logged once at
    debug level)."""
    if _syscall is None or _refused:
        return None
    with _lock:
        for i, idle in enumerate(_idle):
            if idle.depth >= depth:
                return _idle.pop(i)
    ctx = ctypes.c_ulong(0)
    if _syscall(ctypes.c_long(_SYSCALLS[_ARCH][0]), ctypes.c_long(depth), ctypes.byref(ctx)) < 0:
        err = ctypes.get_errno()
        if err != errno.EAGAIN:  # EAGAIN (aio-max-nr reached) may pass; the rest will not
            _refused.append(os.strerror(err))
        log.debug("native AIO refused (%s): reading on threads", os.strerror(err))
        return None
    return AioContext(ctx.value, depth)
