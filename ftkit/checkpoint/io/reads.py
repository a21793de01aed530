"""One open file's reads, kept in flight and collected: by one thread through native AIO, or by threads.

:func:`opened` opens a checkpoint file for reading (an ``O_DIRECT`` descriptor where the
filesystem takes it, a buffered one always) and checks its size against the manifest's; its
:class:`Reads` queue reads of ``(buffer, offset)`` and hand back what they read, whichever way
they are made:

* through Linux native AIO (:mod:`ftkit.checkpoint.io.aio`) where the kernel and the filesystem
  give it: the one thread that streams the file submits and collects every read, and a load
  starts no thread to keep the device busy;
* by up to :data:`THREADS` threads (``os.preadv``) elsewhere: a filesystem that refuses
  ``O_DIRECT`` or whose ``io_submit`` would not be asynchronous (network, FUSE), and reads into
  fresh memory, whose page faults several threads take in parallel.

A direct read cut short before the end of the file is completed through the page cache.
What the reads are for, and where their bytes go, is :mod:`ftkit.checkpoint.io.reader`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import queue
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .aio import AioContext, asynchronous_fs, open_context
from .direct import BLOCK, open_direct_read

__all__ = ["FileProblem", "Reads", "Source", "address", "opened"]

THREADS = 8  # reads in flight where they are made by threads (each thread costs a start)


class FileProblem(Exception):
    """A file does not match its manifest entry (or cannot be read); ``str`` says how."""


class Source:
    """The open file: an O_DIRECT descriptor where possible, always a buffered one too (for
    the tail of a short direct read, and where O_DIRECT is refused)."""

    def __init__(self, path: Path, *, direct: bool | None, cache: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.direct_fd: int | None = None
        try:
            if direct is not False and not cache:
                self.direct_fd = open_direct_read(path, required=direct is True)
            if self.direct_fd is None and hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):  # read-ahead advice only
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``; fewer bytes only at the end of the file. (``view``
        lies on a block boundary where ``offset`` does: a direct read needs both.)"""
        got = 0
        while got < view.nbytes:
            aligned = (offset + got) % BLOCK == 0
            fd = self.direct_fd if self.direct_fd is not None and aligned else self.fd
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.direct_fd = None


def address(view: memoryview) -> int:
    """Address of a writable contiguous buffer (no export of it is kept)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Aio:
    """Reads queued on the device by native AIO (:mod:`ftkit.checkpoint.io.aio`): ``O_DIRECT``,
    submitted and collected by the one thread that streams the file."""

    def __init__(self, ctx: AioContext, fd: int) -> None:
        self._ctx, self._fd = ctx, fd

    def submit(self, reads: list[tuple[int, memoryview, int]]) -> None:
        self._ctx.submit([(tag, self._fd, address(view), view.nbytes, offset) for tag, view, offset in reads])

    def wait(self, least: int) -> list[tuple[int, int]]:
        return self._ctx.wait(least)

    def close(self) -> None:
        self._ctx.close()


class _Threads:
    """Reads made by up to :data:`THREADS` threads (``os.preadv``), started as reads are
    submitted: where native AIO cannot be had, or would not be asynchronous (a buffered
    descriptor, a network filesystem), and for reads into fresh memory
    (:data:`ftkit.checkpoint.io.reader.FRESH_THREADS`)."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ftkit-read")
        self._done: queue.SimpleQueue[tuple[int, Future[int]]] = queue.SimpleQueue()
        self._inflight = 0

    def submit(self, reads: list[tuple[int, memoryview, int]]) -> None:
        for tag, view, offset in reads:
            future = self._pool.submit(self._source.read, view, offset)
            self._inflight += 1
            future.add_done_callback(functools.partial(self._finished, tag))

    def _finished(self, tag: int, future: Future[int]) -> None:
        self._done.put((tag, future))

    def wait(self, least: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while self._inflight and (len(out) < least or not self._done.empty()):
            tag, future = self._done.get()
            self._inflight -= 1
            exc = future.exception()
            if exc is None:
                out.append((tag, future.result()))
            elif isinstance(exc, OSError) and exc.errno:
                out.append((tag, -exc.errno))
            else:
                raise exc
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Reads:
    """The reads of one open file, whichever way they are made (:class:`_Aio`, :class:`_Threads`;
    ``fresh``: into fresh memory, by threads; ``room``: how many may be in flight at once):
    ``submit`` queues reads of ``(view, offset)`` and returns their tags, :meth:`take` waits
    for given ones, :meth:`take_any` for any; both give the bytes read, a short read already
    completed where it can be (a direct read that stopped before the end of the file), so
    fewer bytes than asked only at the end of the file. :meth:`close` waits for the reads in
    flight: their memory may be reused after it."""

    def __init__(self, source: Source, *, fresh: bool = False, room: int = 96) -> None:
        self.source = source
        self.room = room
        self._size = source.size
        self._tags = itertools.count()
        self._asked: dict[int, tuple[memoryview, int, str]] = {}  # tag -> (view, offset, kind)
        self._done: dict[int, int] = {}  # completed, not yet taken
        self._engine: _Aio | _Threads = self._choose(fresh, room)

    def _choose(self, fresh: bool, room: int) -> _Aio | _Threads:
        fd = self.source.direct_fd
        if fd is not None and not fresh and asynchronous_fs(fd):
            ctx = open_context(room)
            if ctx is not None:
                return _Aio(ctx, fd)
        return _Threads(self.source)

    @property
    def in_flight(self) -> int:
        """Reads submitted and not yet collected."""
        return len(self._asked)

    @property
    def engine(self) -> str:
        return "aio" if isinstance(self._engine, _Aio) else "threads"

    def submit(self, reads: Iterable[tuple[memoryview, int]], kind: str) -> list[int]:
        batch = [(next(self._tags), view, offset) for view, offset in reads]
        for tag, view, offset in batch:
            self._asked[tag] = (view, offset, kind)
        self._engine.submit(batch)
        return [tag for tag, _, _ in batch]

    def _collect(self, least: int) -> None:
        for tag, n in self._engine.wait(least):
            view, offset, kind = self._asked.pop(tag)
            if n < 0:
                raise OSError(-n, os.strerror(-n), str(self.source.path))
            if n < view.nbytes and offset + n < self._size:  # a direct read cut short
                n += self.source.read(view[n:], offset + n)
            self._completed(tag, view, offset, n, kind)

    def _completed(self, tag: int, view: memoryview, offset: int, n: int, kind: str) -> None:
        """Every read ends here (``kind``: "bulk" or "small")."""
        self._done[tag] = n

    def take(self, tags: list[int]) -> list[int]:
        while any(t not in self._done for t in tags):
            self._collect(1)
        return [self._done.pop(t) for t in tags]

    def take_any(self, *, block: bool = True) -> list[tuple[int, int]]:
        """Reads completed: at least one when ``block``, else those that already have."""
        if not self._done or not block:
            self._collect(1 if block and not self._done else 0)
        done, self._done = self._done, {}
        return list(done.items())

    def close(self) -> None:
        self._engine.close()


@contextlib.contextmanager
def opened(path: Path, name: str, size: int, *, direct: bool | None, cache: bool,
           fresh: bool = False, room: int = 96) -> Iterator[Reads]:
    """``path`` open for reading (its size checked against the manifest's), and its reads;
    on leaving, the reads in flight are waited for and the file closed."""
    try:
        source = Source(path, direct=direct, cache=cache)
    except FileNotFoundError:
        raise FileProblem(f"{name} is missing") from None
    except OSError as exc:
        raise FileProblem(f"cannot read {name}: {exc.strerror or exc}") from exc
    try:
        actual = source.size
        if actual != size:
            raise FileProblem(f"{name}: size {actual} bytes, manifest says {size}")
        reads = Reads(source, fresh=fresh, room=room)
        try:
            yield reads
        finally:
            reads.close()
    except OSError as exc:
        raise FileProblem(f"cannot read {name}: {exc.strerror or exc}") from exc
    finally:
        source.close()
