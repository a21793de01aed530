"""Reading checkpoint files once, at the device's sequential speed, checksummed as they arrive.

A resume reads every byte of its files from a cold page cache. Read through the page cache, a
file costs the kernel a fresh page for every 4 KiB plus a copy out of it, and a separate CRC
pass before ``torch.load`` reads the file a second time (from memory if it stayed cached).
Here a file is read with ``O_DIRECT`` (:func:`ftkit.checkpoint.io.direct.open_direct_read`; through the page
cache with sequential read-ahead advice where the filesystem refuses it) in
:data:`CHUNK`-byte pieces, :data:`DEPTH` of them in flight on helper threads so that the device
always has the next request queued, and the CRC-32 of each piece is taken in file order as soon
as it has arrived, while the next ones are still being read: one pass over the bytes, no
verification pass of its own.

Two destinations:

* :func:`read_file` reads the whole file into fresh page-aligned memory
  (:func:`ftkit.checkpoint.io.direct.read_buffer`) and returns it only once size and CRC-32 matched the manifest:
  the caller parses it in place (:func:`ftkit.checkpoint.io.statefile.read_state_file`) and nothing from a corrupt
  file ever reaches a live object;
* :func:`check_file` only checksums, through a few reused staging buffers
  (:func:`ftkit.checkpoint.io.direct.take_stage`): validating a file another process reads, or one a library
  reads by itself (DCP's), without holding it in memory. ``cache=True`` reads it through the
  page cache instead, so that the library's read that follows on this node finds it there;
* :func:`scatter_file` reads through the same reused staging buffers and copies each piece,
  once its CRC-32 is taken, to where its bytes are wanted: ranges of the file into memory of
  the caller's (the live tensors of a resume, which are already faulted in), the rest into
  fresh page-aligned memory as :func:`read_file` does. Fresh memory costs the kernel a
  zeroed page per 4 KiB the first time it is written, about as long as the disk takes to
  read it here; memory that is already in use costs only the copy. The bytes reach the
  caller's memory before the CRC-32 of the whole file is known: a caller that cannot afford
  a corrupt file's bytes there must not use it (:mod:`ftkit.checkpoint.manager` uses it only when an
  older checkpoint is there to fall back on, which overwrites them).
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .direct import BLOCK, open_direct_read, read_buffer, take_stage
from .files import CHECKSUM, crc32

__all__ = ["CHUNK", "DEPTH", "FileProblem", "check_file", "read_file", "scatter_file"]

CHUNK = 16 << 20  # one request: whole blocks, at most a staging buffer (the device's best size here)
DEPTH = 4  # requests in flight: a queue deep enough for an NVMe or virtio disk to stream
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


def _stream(
    source: _Source,
    size: int,
    dest: Callable[[int], memoryview],
    done: Callable[[int], None] = lambda i: None,
    *,
    window: int,
    arrived: Callable[[int, int], None] | None = None,
) -> int:
    """Read the file's ``size`` bytes in :data:`CHUNK` pieces, piece ``i`` into ``dest(i)``
    (a page-aligned buffer of up to :data:`CHUNK` bytes, whole blocks), with up to ``window``
    pieces in flight; CRC-32 each piece in file order as soon as it arrived, then ``done(i)``
    (after which ``dest(i)``'s memory may be reused for piece ``i + window``). Returns the
    CRC-32. A file that ends early or runs on (changed since it was sized) is a problem.
    ``arrived(i, n)`` runs on the helper thread right after piece ``i``'s read (``n`` bytes),
    in parallel with the CRC-32 of the pieces before it."""
    pieces = -(-size // CHUNK)
    crc = 0
    with ThreadPoolExecutor(min(DEPTH, max(1, pieces)), thread_name_prefix="ftkit-read") as pool:
        pending: dict[int, Future[int]] = {}

        def fill(i: int) -> int:
            n = source.read(dest(i), i * CHUNK)
            if arrived is not None and n == min(CHUNK, size - i * CHUNK):
                arrived(i, n)
            return n

        def submit(i: int) -> None:
            if i < pieces:
                pending[i] = pool.submit(fill, i)

        try:
            for i in range(min(window, pieces)):
                submit(i)
            for i in range(pieces):
                n = pending.pop(i).result()
                want = min(CHUNK, size - i * CHUNK)
                if n != want:
                    raise FileProblem(
                        f"{source.path.name}: {i * CHUNK + n} bytes where the read expected "
                        f"{i * CHUNK + want} (the manifest says {size}): the file changed while "
                        "it was read"
                    )
                crc = crc32(dest(i)[:n], crc)
                done(i)
                submit(i + window)
        finally:
            for fut in pending.values():
                fut.cancel()
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
            crc = _stream(source, size, lambda i: _piece(whole, i), window=2 * DEPTH)
        finally:
            source.close()
    except OSError as exc:
        raise FileProblem(f"cannot read {name}: {exc.strerror or exc}") from exc
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]


def _staged(
    path: Path, name: str, size: int, *, direct: bool | None, cache: bool,
    prepare: Callable[[_Source, list[memoryview]], Callable[[int, int], None]] | None = None,
) -> int:
    """The CRC-32 of ``path``'s ``size`` bytes read through :data:`DEPTH` reused staging
    buffers. ``prepare(source, stages)``, called once the file is open, returns what to do
    with each piece as it arrives (``_stream``'s ``arrived``; piece ``i`` is in
    ``stages[i % len(stages)]``)."""
    stages = [take_stage() for _ in range(min(DEPTH, max(1, -(-size // CHUNK))))]
    try:
        source = _open(path, name, size, direct=direct, cache=cache)
        try:
            views = [view for view, _ in stages]
            arrived = prepare(source, views) if prepare is not None else None
            return _stream(source, size, lambda i: views[i % len(views)][:CHUNK], window=len(views), arrived=arrived)
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


Target = tuple[int, int, memoryview]
"""``(start, end, memory)``: the file's bytes ``[start, end)`` go to ``memory`` (``end - start`` bytes)."""


def scatter_file(
    path: Path,
    meta: Mapping[str, Any],
    plan: Callable[[Any, memoryview, Callable[[int, int], None]], list[Target]],
    *,
    verify: bool = True,
    direct: bool | None = None,
) -> tuple[Any, memoryview]:
    """Read ``path`` once, each piece to where ``plan`` wants it; ``(mapping, view)`` as
    :func:`read_file`, with the bytes ``plan`` sent elsewhere left unread (zero) in it.

    ``plan(mapping, view, fetch)`` runs before the bulk of the file is read: ``fetch(start,
    end)`` reads a small part of the file into ``view`` at its offset (a header, an index), and
    ``plan`` returns the ranges of the file that go to the caller's memory instead of
    ``view`` (sorted, not overlapping). Then the whole file streams through reused staging
    buffers, CRC-32 in file order as in :func:`read_file`, every piece copied to its
    targets and the rest into ``view``. Raises :class:`FileProblem` as :func:`read_file`; by
    then the targets hold the file's (wrong) bytes."""
    name = path.name
    size, want = _expected(name, meta)
    mapping, whole = read_buffer(size)

    def prepare(source: _Source, stages: list[memoryview]) -> Callable[[int, int], None]:
        fetched: list[tuple[int, int]] = []  # what fetch read already: a header's pieces come in a row

        def fetch(start: int, end: int) -> None:
            start, end = max(0, start), min(size, end)
            if end <= start or any(a <= start and end <= b for a, b in reversed(fetched)):
                return
            end = max(end, min(size, start + FETCH))  # one cold read for the small reads that follow
            if os.preadv(source.fd, [whole[start:end]], start) != end - start:
                raise FileProblem(f"{name}: ends before byte {end} (the manifest says {size})")
            fetched.append((start, end))

        targets = plan(mapping, whole[:size], fetch)
        starts = [t[0] for t in targets]

        def place(i: int, n: int) -> None:
            """Piece ``i`` (on its reader thread): to its targets, the rest into the buffer."""
            lo, hi = i * CHUNK, i * CHUNK + n
            piece = stages[i % len(stages)]
            pos = lo
            j = max(0, bisect.bisect_right(starts, lo) - 1)  # the target holding lo, if any
            while pos < hi:
                while j < len(targets) and targets[j][1] <= pos:
                    j += 1
                if j < len(targets) and targets[j][0] < hi:
                    start, end, memory = targets[j]
                    if pos < start:  # the bytes before this target: into the buffer
                        whole[pos:start] = piece[pos - lo : start - lo]
                        pos = start
                    stop = min(end, hi)
                    memory[pos - start : stop - start] = piece[pos - lo : stop - lo]
                    pos = stop
                else:
                    whole[pos:hi] = piece[pos - lo : hi - lo]
                    pos = hi

        return place

    crc = _staged(path, name, size, direct=direct, cache=False, prepare=prepare)
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]
