"""Reading checkpoint files once, at the device's sequential speed, checksummed as they arrive.

A resume reads every byte of its files from a cold page cache. Read through the page cache, a
file costs the kernel a fresh page for every 4 KiB plus a copy out of it, and a separate CRC
pass before ``torch.load`` reads the file a second time (from memory if it stayed cached).
Here a file is read with ``O_DIRECT`` (:func:`ftkit.checkpoint.io.direct.open_direct_read`;
through the page cache with sequential read-ahead advice where the filesystem refuses it) in
:data:`CHUNK`-byte pieces by :data:`DEPTH` reader threads that do nothing else, so that the
device always has the next requests queued. :data:`WORKERS` other threads take the CRC-32 of
each piece as it arrives and copy it to where its bytes are wanted (``ctypes.memmove``, the GIL
released), while the piece is still in the CPU cache; the pieces' CRC-32s are combined in file
order (``crc32_combine``), so no piece waits for the one before it. One pass over the bytes, no
verification pass of its own.

Three destinations:

* :func:`read_file` reads the whole file into fresh page-aligned memory
  (:func:`ftkit.checkpoint.io.direct.read_buffer`) and returns it only once size and CRC-32
  matched the manifest: the caller parses it in place
  (:func:`ftkit.checkpoint.io.statefile.read_state_file`) and nothing from a corrupt file ever
  reaches a live object;
* :func:`check_file` only checksums, through a few reused staging buffers
  (:func:`ftkit.checkpoint.io.direct.take_stage`): validating a file another process reads, or
  one a library reads by itself (DCP's), without holding it in memory. ``cache=True`` reads it
  through the page cache instead, so that the library's read that follows on this node finds
  it there;
* :func:`scatter_file` reads through the same reused staging buffers and copies each piece,
  once its CRC-32 is taken, to where its bytes are wanted: ranges of the file into memory of
  the caller's (the live tensors of a resume, which are already faulted in), the rest into
  fresh page-aligned memory as :func:`read_file` does. Fresh memory costs the kernel a zeroed
  page per 4 KiB the first time it is written, about as long as the disk takes to read it
  here; memory that is already in use costs only the copy. Where the bytes go is planned
  from the file's headers and index, read first by :class:`Fetch` in a few rounds of small
  reads that go out together before the bulk read starts (queued behind it, each would wait
  for a whole piece); the plan's parsing runs while the first pieces are read. The bytes
  reach the caller's memory before the CRC-32 of the whole file is known: a caller that
  cannot afford a corrupt file's bytes there must not use it (:mod:`ftkit.checkpoint.manager`
  uses it only when an older checkpoint is there to fall back on, which overwrites them).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .direct import BLOCK, STAGE_BYTES, open_direct_read, read_buffer, take_stage
from .files import CHECKSUM, crc32, crc32_combine

__all__ = ["CHUNK", "DEPTH", "SUB", "Fetch", "FileProblem", "check_file", "read_file", "scatter_file"]

CHUNK = 8 << 20  # one request: whole blocks, at most a staging buffer
DEPTH = 6  # requests in flight: a queue deep enough for an NVMe or virtio disk to stream
WORKERS = 2  # threads that checksum and place the pieces read (~1 ms a piece here, a read ~3)
STAGES = DEPTH + WORKERS  # staging buffers: one per read in flight, one per piece being placed
SUB = 8 << 20  # a piece is checksummed and placed in parts this large (each still in the L3 cache; one
# GIL hand-over per part: smaller parts were slower here)
FETCH = 8 << 10  # scatter_file's small reads (headers, an index) read at least this much at once


class FileProblem(Exception):
    """A file does not match its manifest entry (or cannot be read); ``str`` says how."""


def _expected(name: str, meta: Mapping[str, Any]) -> tuple[int, str | None]:
    size = meta.get("size")
    if not isinstance(size, int) or size < 0:
        raise FileProblem(f"{name}: the manifest gives no size")
    crc = meta.get(CHECKSUM)
    return size, crc if isinstance(crc, str) else None


class _Source:
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
        """Fill ``view`` from ``offset``; fewer bytes only at the end of the file."""
        got = 0
        while got < view.nbytes:
            aligned = got % BLOCK == 0
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


def _address(view: memoryview) -> int:
    """Address of a writable contiguous buffer (no export of it is kept)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _stream(
    source: _Source,
    size: int,
    *,
    piece: Callable[[int], memoryview] | None = None,
    stages: list[memoryview] | None = None,
    place: Callable[[int, int, int], None] | None = None,
    during: Callable[[Callable[[], None]], None] | None = None,
) -> int:
    """Read the file's ``size`` bytes in :data:`CHUNK` pieces and return their CRC-32.

    :data:`DEPTH` reader threads only read: each takes the next piece of the file and a free
    buffer (``piece(i)``, the piece's own place in memory, or one of the reused ``stages``),
    reads it and hands it on. :data:`WORKERS` other threads take the CRC-32 of each piece that
    arrived and give it to ``place(offset, address, n)`` (the file's bytes ``[offset, offset +
    n)`` lie at ``address``), both in :data:`SUB`-byte parts, each placed right after its
    CRC-32 read it, while it is in the CPU cache; then its staging buffer is free again. The
    pieces' CRC-32s are combined in file order (``crc32_combine``), so nothing waits for
    another piece: the device always has the next reads queued while the pieces before them
    are checksummed and copied.

    ``during(go)`` runs on the calling thread: a plan of where the bytes go, whose small reads
    come first; it calls ``go()`` once they are done, and the bulk reads start then (or when
    it returns). ``place`` is called only once it returned. A file that ends early or runs on
    (changed since it was sized) is a problem; the first problem, or ``during``'s exception,
    stops every thread at its next piece and is raised."""
    pieces = -(-size // CHUNK)
    crcs = [0] * pieces
    claim = itertools.count()  # next() is atomic: each piece to one reader
    go, planned, stop = threading.Event(), threading.Event(), threading.Event()
    problems: list[BaseException] = []
    free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for view in stages or ():
        free.put(view)
    arrived: queue.SimpleQueue[tuple[int, memoryview, int] | None] = queue.SimpleQueue()

    def fail(exc: BaseException) -> None:
        problems.append(exc)
        stop.set()

    def read() -> None:
        try:
            go.wait()
            while not stop.is_set():
                view = free.get() if stages else None
                i = next(claim)
                if i >= pieces or stop.is_set():
                    if view is not None:
                        free.put(view)
                    return
                if view is None:
                    view = piece(i)  # type: ignore[misc]
                want = min(CHUNK, size - i * CHUNK)
                n = source.read(view, i * CHUNK)
                if n != want:
                    raise FileProblem(
                        f"{source.path.name}: {i * CHUNK + n} bytes where the read expected "
                        f"{i * CHUNK + want} (the manifest says {size}): the file changed while "
                        "it was read"
                    )
                arrived.put((i, view, n))
        except BaseException as exc:
            fail(exc)

    def work() -> None:
        while (got := arrived.get()) is not None:
            i, view, n = got
            try:
                if not stop.is_set():
                    base = _address(view) if place is not None else 0
                    crc = 0
                    for lo in range(0, n, SUB):
                        part = min(SUB, n - lo)
                        crc = crc32(view[lo : lo + part], crc)
                        if place is not None:
                            planned.wait()
                            if stop.is_set():
                                break
                            place(i * CHUNK + lo, base + lo, part)
                    crcs[i] = crc
            except BaseException as exc:
                fail(exc)
            finally:
                if stages:
                    free.put(view)

    readers = min(DEPTH, max(1, pieces))
    workers = min(WORKERS, max(1, pieces))
    with ThreadPoolExecutor(readers + workers, thread_name_prefix="ftkit-read") as pool:
        reading = [pool.submit(read) for _ in range(readers)]
        working = [pool.submit(work) for _ in range(workers)]
        try:
            if during is not None:
                during(go.set)
        except BaseException:
            stop.set()
            raise
        finally:
            go.set()
            planned.set()
            try:
                for fut in reading:
                    fut.result()
            except BaseException:  # an interrupt while waiting: the threads stop at their next piece
                stop.set()
                raise
            finally:
                for _ in working:
                    arrived.put(None)
            for fut in working:
                fut.result()
    if problems:
        raise problems[0]
    crc = 0
    for i, part_crc in enumerate(crcs):
        crc = crc32_combine(crc, part_crc, min(CHUNK, size - i * CHUNK))
    return crc


def _open(path: Path, name: str, size: int, *, direct: bool | None, cache: bool) -> _Source:
    try:
        source = _Source(path, direct=direct, cache=cache)
    except FileNotFoundError:
        raise FileProblem(f"{name} is missing") from None
    actual = source.size
    if actual != size:
        source.close()
        raise FileProblem(f"{name}: size {actual} bytes, manifest says {size}")
    return source


def _check_crc(name: str, crc: int, want: str | None) -> None:
    if want is not None and f"{crc:08x}" != want:
        raise FileProblem(f"{name}: checksum {CHECKSUM} {crc:08x} does not match manifest {want}")


def _piece(view: memoryview, i: int) -> memoryview:
    return view[i * CHUNK : (i + 1) * CHUNK]


def read_file(
    path: Path, meta: Mapping[str, Any], *, verify: bool = True, direct: bool | None = None
) -> tuple[Any, memoryview]:
    """The whole of ``path`` in fresh page-aligned memory: ``(mapping, view of its bytes)``.

    Raises :class:`FileProblem` unless the file has the manifest entry's size and, with
    ``verify``, its CRC-32 (checked as the pieces arrive, so no byte is read twice). ``direct``
    as ``checkpoint.direct_io``: None uses ``O_DIRECT`` where the filesystem accepts it."""
    name = path.name
    size, want = _expected(name, meta)
    mapping, whole = read_buffer(size)  # freed with the last view of it, also on an error
    try:
        source = _open(path, name, size, direct=direct, cache=False)
        try:
            crc = _stream(source, size, piece=lambda i: _piece(whole, i))
        finally:
            source.close()
    except OSError as exc:
        raise FileProblem(f"cannot read {name}: {exc.strerror or exc}") from exc
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]


def _staged(
    path: Path, name: str, size: int, *, direct: bool | None, cache: bool,
    prepare: Callable[[_Source], tuple[Callable[[Callable[[], None]], None], Callable[[int, int, int], None]]]
    | None = None,
) -> int:
    """The CRC-32 of ``path``'s ``size`` bytes read through :data:`STAGES` reused staging
    buffers. ``prepare(source)``, called once the file is open, returns ``_stream``'s
    ``during`` and ``place``."""
    count = min(STAGES, max(1, -(-size // CHUNK)))
    per = max(1, STAGE_BYTES // CHUNK)  # pieces per staging buffer
    stages = [take_stage() for _ in range(-(-count // per))]
    try:
        source = _open(path, name, size, direct=direct, cache=cache)
        try:
            views = [view[k * CHUNK : (k + 1) * CHUNK] for view, _ in stages for k in range(per)][:count]
            during, place = prepare(source) if prepare is not None else (None, None)
            return _stream(source, size, stages=views, place=place, during=during)
        finally:
            source.close()
    except OSError as exc:
        raise FileProblem(f"cannot read {name}: {exc.strerror or exc}") from exc
    finally:
        for _, release in stages:
            release()


def check_file(
    path: Path, meta: Mapping[str, Any], *, name: str | None = None, direct: bool | None = None,
    cache: bool = False,
) -> None:
    """Check ``path``'s size and CRC-32 against its manifest entry; :class:`FileProblem` if not.

    Reads through :data:`DEPTH` reused staging buffers, with ``O_DIRECT`` unless ``cache``
    (then through the page cache, which keeps the file for a read on this node that follows)."""
    name = name or path.name
    size, want = _expected(name, meta)
    crc = _staged(path, name, size, direct=direct, cache=cache)
    _check_crc(name, crc, want)


class Fetch:
    """Small reads of a file (headers, an index) into the read buffer, at their offsets.

    ``fetch(start, end)`` reads bytes ``[start, end)`` unless an earlier fetch read them;
    ``fetch.many(ranges)`` reads several ranges at once, on helper threads, so that they wait
    for the device together (the bulk of the file is being read beside them) instead of one
    after the other. Each read covers whole blocks and at least :data:`FETCH` bytes, with
    ``O_DIRECT`` where the file was opened with it: nothing goes through the page cache."""

    def __init__(self, source: _Source, whole: memoryview, size: int) -> None:
        self._source, self._whole, self._size = source, whole, size
        self.finished: Callable[[], None] = lambda: None
        self._done: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, start: int, end: int) -> None:
        self.many([(start, end)])

    def done(self) -> None:
        """No more small reads: the bulk read may start (it waits for this, or for the plan
        to return, so that the small reads do not queue behind it)."""
        self.finished()

    def _covered(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in reversed(self._done))

    def many(self, ranges: Iterable[tuple[int, int]]) -> None:
        spans: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            start, end = max(0, start), min(self._size, end)
            if end <= start or self._covered(start, end):
                continue
            a = start - start % BLOCK
            b = min(-(-max(end, start + FETCH) // BLOCK) * BLOCK, self._whole.nbytes)
            if spans and a <= spans[-1][1]:  # touching or overlapping the one before: one read
                spans[-1] = (spans[-1][0], max(b, spans[-1][1]))
            else:
                spans.append((a, b))
        if not spans:
            return

        def read(span: tuple[int, int]) -> None:
            a, b = span
            want = min(b, self._size) - a
            if self._source.read(self._whole[a:b], a) < want:
                raise FileProblem(f"{self._source.path.name}: ends before byte {a + want} (the manifest "
                                  f"says {self._size})")

        if len(spans) == 1:
            read(spans[0])
        else:
            with ThreadPoolExecutor(min(16, len(spans)), thread_name_prefix="ftkit-fetch") as pool:
                list(pool.map(read, spans))
        with self._lock:
            self._done += [(a, min(b, self._size)) for a, b in spans]


Target = tuple[int, int, memoryview]
"""``(start, end, memory)``: the file's bytes ``[start, end)`` go to ``memory`` (``end - start`` bytes)."""


def scatter_file(
    path: Path,
    meta: Mapping[str, Any],
    plan: Callable[[Any, memoryview, Fetch], list[Target] | None],
    *,
    verify: bool = True,
    direct: bool | None = None,
) -> tuple[Any, memoryview]:
    """Read ``path`` once, each piece to where ``plan`` wants it; ``(mapping, view)`` as
    :func:`read_file`, with the bytes ``plan`` sent elsewhere left unread (zero) in it.

    ``plan(mapping, view, fetch)`` runs before any byte is placed: ``fetch(start, end)`` and
    ``fetch.many(ranges)`` (a :class:`Fetch`) read small parts of the file into ``view`` at
    their offsets (a header, an index), and ``plan`` returns the ranges of the file that go to
    the caller's memory instead of ``view`` (sorted, not overlapping), or None when nothing of
    the file is wanted (it is only checked, nothing kept). The bulk read starts when ``plan``
    calls ``fetch.done()`` (its small reads are over) or returns. Then the whole file streams
    through reused staging buffers, every piece checksummed and copied to its targets and the
    rest into ``view``. Raises :class:`FileProblem` as :func:`read_file`; by then the targets
    hold the file's (wrong) bytes."""
    name = path.name
    size, want = _expected(name, meta)
    mapping, whole = read_buffer(size)

    whole_at = _address(whole) if size else 0
    plan_of: dict[str, Any] = {}

    def prepare(source: _Source) -> tuple[Callable[[], None], Callable[[int, int, int], None]]:
        fetch = Fetch(source, whole, size)

        def during(go: Callable[[], None]) -> None:
            fetch.finished = go  # the plan's small reads first, then the bulk
            targets = plan(mapping, whole[:size], fetch)
            if targets is None:  # nothing wanted: the file is only checked
                plan_of["discard"] = True
                targets = []
            plan_of["keep"] = targets  # the target memory stays alive while it is written
            plan_of["starts"] = [t[0] for t in targets]
            plan_of["ends"] = [t[1] for t in targets]
            plan_of["at"] = [_address(t[2]) for t in targets]

        def place(lo: int, src: int, n: int) -> None:
            """File bytes ``[lo, lo + n)``, at ``src`` (on a reader thread): to their targets,
            the rest into the buffer at its offset."""
            if "discard" in plan_of:
                return
            starts, ends, at = plan_of["starts"], plan_of["ends"], plan_of["at"]
            hi, pos = lo + n, lo
            j = max(0, bisect.bisect_right(starts, lo) - 1)  # the target holding lo, if any
            while pos < hi:
                while j < len(starts) and ends[j] <= pos:
                    j += 1
                if j < len(starts) and starts[j] < hi:
                    start = starts[j]
                    if pos < start:  # the bytes before this target: into the buffer
                        ctypes.memmove(whole_at + pos, src + pos - lo, start - pos)
                        pos = start
                    stop = min(ends[j], hi)
                    ctypes.memmove(at[j] + pos - start, src + pos - lo, stop - pos)
                    pos = stop
                else:
                    ctypes.memmove(whole_at + pos, src + pos - lo, hi - pos)
                    pos = hi

        return during, place

    crc = _staged(path, name, size, direct=direct, cache=False, prepare=prepare)
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]
