"""Reading checkpoint files once, at the device's sequential speed, checksummed as they arrive.

A resume reads every byte of its files from a cold page cache. Read through the page cache, a
file costs the kernel a fresh page for every 4 KiB plus a copy out of it, and a separate CRC
pass before ``torch.load`` reads the file a second time (from memory if it stayed cached).
Here a file is read with ``O_DIRECT`` (:func:`ftkit.checkpoint.io.direct.open_direct_read`;
through the page cache with sequential read-ahead advice where the filesystem refuses it) in
:data:`CHUNK`-byte pieces, :data:`DEPTH` of them in flight, so that the device always has the
next requests queued. The reads are submitted and collected by the one thread that streams the
file, through Linux native AIO where the kernel and the filesystem give it
(:mod:`ftkit.checkpoint.io.aio`), else made by a few threads (:mod:`ftkit.checkpoint.io.reads`):
a load starts no thread per read. As pieces arrive, that thread and up to :data:`WORKERS` ``- 1`` helpers take
the CRC-32 of each and copy it to where its bytes are wanted (``ctypes.memmove``, the GIL
released) while it is in the CPU cache; the pieces' CRC-32s are combined in file order
(``crc32_combine``), so no piece waits for the one before it. One pass over the bytes, no
verification pass of its own.

Three destinations:

* :func:`read_file` reads the whole file into fresh page-aligned memory
  (:func:`ftkit.checkpoint.io.direct.read_buffer`) and returns it only once size and CRC-32
  matched the manifest: the caller parses it in place
  (:func:`ftkit.checkpoint.io.statefile.read_state_file`) and nothing from a corrupt file ever
  reaches a live object;
* :func:`check_file` only checksums, through reused staging buffers
  (:func:`ftkit.checkpoint.io.direct.take_stage`, :data:`STAGING` bytes): validating a file
  another process reads, or one a library reads by itself (DCP's), without holding it in
  memory. ``cache=True`` reads it through the page cache instead, so that the library's read
  that follows on this node finds it there;
* :func:`scatter_file` reads through the same reused staging buffers and copies each piece,
  once its CRC-32 is taken, to where its bytes are wanted: ranges of the file into memory of
  the caller's (the live tensors of a resume, which are already faulted in), the rest into
  fresh page-aligned memory as :func:`read_file` does. Fresh memory costs the kernel a zeroed
  page per 4 KiB the first time it is written, about as long as the disk takes to read it
  here; memory that is already in use costs only the copy. Where the bytes go is planned
  from the file's headers and index, read first by :class:`Fetch` in a few rounds of small
  reads that go out together before the bulk read starts (queued behind it, each would wait
  for the pieces ahead of it); the plan's parsing runs while the first pieces are read. The
  bytes reach the caller's memory before the CRC-32 of the whole file is known: a caller
  that cannot afford a corrupt file's bytes there must not use it
  (:mod:`ftkit.checkpoint.manager` uses it only when an older checkpoint is there to fall back
  on, which overwrites them). Its ``place`` may copy asynchronously (to a GPU): it returns a
  :class:`Fence`, and the staging buffer is reused only once that fence is passed.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from .direct import BLOCK, STAGE_BYTES, read_buffer, take_stage
from .files import CHECKSUM, crc32, crc32_combine
from .reads import FileProblem, Reads, address, opened

__all__ = ["CHUNK", "DEPTH", "FRESH_WORKERS", "SUB", "Destination", "Fence", "Fetch", "FileProblem", "Target", "check_file", "read_file",
           "read_spans", "scatter_file"]

CHUNK = 2 << 20  # one request: whole blocks. Small enough that the reads in flight, which a device
# tends to complete together, are placed soon after the last of them arrives; large enough for
# the device to stream (the block layer splits requests at a few MiB anyway)
DEPTH = 8  # requests in flight (16 MiB): a queue deep enough for an NVMe or virtio disk to stream
STAGING = 32 << 20  # staging memory of a read (two of the pool's buffers): half in flight, half placed.
# Less staging read faster on the 2-CPU VM (why is not established: caches that a smaller
# footprint stays in, or the VM host's handling of guest memory): cold loads of 3 GB alternating
# in one process took 1.45 s with 32 MiB (8 in flight) against 1.74 s with 64 MiB (16), the raw
# read 1.53 s; 1 GB 0.52 s against 0.59 s (medians of 10 and 8 rounds; docs/benchmarks.md has
# 16 MiB with 4 in flight too, faster still there, not taken: too few reads in flight for a
# high-latency filesystem, and not yet measured on other machines)


def _usable_cpus() -> int:
    """CPUs this process may run on (a SLURM job's cpuset, ``taskset``), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


WORKERS = max(1, min(4, _usable_cpus() - 1))  # threads that checksum and place pieces (the caller's
# one of them): a piece takes ~0.3 ms of CPU here and a read ~1-2 ms, but the reads in flight
# complete together, and a fast array delivers more than one thread can place. One CPU is left
# to the kernel's completions of the reads and the process's other threads: on a 2-CPU VM a
# second placing thread made a cold 0.25 GB read slower, not faster (check_file 157 vs 146 ms,
# a load 172 vs 159 ms, medians of 18-24 rounds)
FRESH_WORKERS = max(1, min(4, _usable_cpus()))  # the same, where most of the bytes go to fresh
# memory (a requeued job's optimizer moments): each first write of a page faults it in, which
# is CPU work that more threads share (a requeue's load of 3 GB into a fresh Adam on a 2-CPU
# VM, alternating: two threads 4.6 s against one's 9.8 s in one run, 2.2 s against 2.7 s in
# another, the VM's page faults being that variable)
SUB = CHUNK  # a piece is checksummed and placed in parts this large (each still in the L2/L3 cache)
FETCH = 8 << 10  # scatter_file's small reads (headers, an index) read at least this much at once
SMALL_BATCH = 32  # small reads submitted at once
ROOM = 64 + SMALL_BATCH  # reads one file may have in flight: every staging piece (CHUNK from 1 MiB), and a batch of small reads
FRESH_THREADS = 64 << 20  # read_file reads a file from this size on into fresh memory on threads:
# each read there faults in its pages first (the kernel pins them), so several threads fault in
# parallel; a single submitting thread would fault them one after the other


class Fence(Protocol):
    """What ``place`` returns when its copies out of a staging buffer are still running (a CUDA
    event after asynchronous host-to-device copies): the buffer is read into again only after
    ``wait()`` returned."""

    def wait(self) -> None: ...


def _expected(name: str, meta: Mapping[str, Any]) -> tuple[int, str | None]:
    size = meta.get("size")
    if not isinstance(size, int) or size < 0:
        raise FileProblem(f"{name}: the manifest gives no size")
    crc = meta.get(CHECKSUM)
    return size, crc if isinstance(crc, str) else None


def _stream(
    reads: Reads,
    size: int,
    *,
    piece: Callable[[int], memoryview] | None = None,
    stages: list[memoryview] | None = None,
    place: Callable[[int, int, int], Fence | None] | None = None,
    during: Callable[[Callable[[], None]], None] | None = None,
    placers: Callable[[], int] | None = None,
) -> int:
    """Read the file's ``size`` bytes in :data:`CHUNK` pieces and return their CRC-32.

    The caller's thread keeps :data:`DEPTH` reads in flight (each into ``piece(i)``, the
    piece's own place in memory, or one of the reused ``stages``) and collects them as they
    complete; it and up to :data:`WORKERS` ``- 1`` helper threads take each arrived piece's
    CRC-32 and give it to ``place(offset, address, n)`` (the file's bytes ``[offset, offset +
    n)`` lie at ``address``) in :data:`SUB`-byte parts, each placed right after its CRC-32 read
    it, while it is in the CPU cache (both release the GIL); then the buffer is free again, and
    the free buffer placed longest ago reads the next piece. The device always has the next
    reads queued while pieces are checksummed and copied; a device that completes the reads in
    flight together gets them placed in parallel.
    ``place`` may return a :class:`Fence` for copies still running from the buffer: it is
    waited for before the buffer is read into again, and before this returns. The pieces'
    CRC-32s are combined in file order (``crc32_combine``).

    ``during(go)`` runs first: a plan of where the bytes go, whose small reads come first; it
    calls ``go()`` once they are done, and the bulk reads start then (or when it returns), so
    the plan's parsing overlaps them. ``place`` is called only once it returned, and then
    ``placers()`` says how many threads checksum and place (default :data:`WORKERS`). A file that
    ends early or runs on (changed since it was sized) is a problem, raised at once; the
    caller's :meth:`Reads.close` then waits for the reads still in flight."""
    pieces = -(-size // CHUNK)
    crcs = [0] * pieces
    free = collections.deque(stages or ())  # buffers to read into (any thread gives one back)
    fences: dict[int, Fence] = {}  # id of a staging view -> copies still reading it
    inflight: dict[int, tuple[int, memoryview]] = {}  # tag -> (piece, buffer); the caller's alone
    arrived: collections.deque[tuple[int, memoryview, int]] = collections.deque()  # read, not yet placed
    turn = threading.Condition()  # guards free, fences, arrived, done, failed
    done = [0]  # pieces placed
    failed: list[BaseException] = []  # a helper's error, raised by the caller
    stopping = [False]  # the caller's error: the helpers stop
    helpers: list[threading.Thread] = []
    claimed = 0
    started = False

    def fill(limit: int = DEPTH) -> None:
        nonlocal claimed
        batch: list[tuple[int, memoryview]] = []
        while claimed < pieces and len(inflight) + len(batch) < limit:
            if piece is not None:
                view = piece(claimed)
            else:
                with turn:
                    if not free:
                        break
                    # the buffer placed longest ago: a GPU's copies out of it (its fence) are
                    # done by now, where the one placed last has its copy just queued
                    view = free.popleft()
                    fence = fences.pop(id(view), None)
                if fence is not None:
                    fence.wait()
            batch.append((claimed, view))
            claimed += 1
        tags = reads.submit([(view, i * CHUNK) for i, view in batch], "bulk")
        inflight.update(zip(tags, batch, strict=True))

    def settle(i: int, view: memoryview, n: int) -> None:
        """Checksum and place one piece (any thread)."""
        base = address(view) if place is not None else 0
        crc, fence = 0, None
        for lo in range(0, n, SUB):
            part = min(SUB, n - lo)
            crc = crc32(view[lo : lo + part], crc)
            if place is not None:
                fence = place(i * CHUNK + lo, base + lo, part) or fence
        with turn:
            crcs[i] = crc
            if fence is not None:
                fences[id(view)] = fence
            if piece is None:
                free.append(view)
            done[0] += 1
            turn.notify_all()

    def helper() -> None:
        while True:
            with turn:
                while not arrived and not failed and not stopping[0] and done[0] < pieces:
                    turn.wait()
                if failed or stopping[0] or not arrived:
                    return
                got = arrived.popleft()
            try:
                settle(*got)
            except BaseException as exc:
                with turn:
                    failed.append(exc)
                    turn.notify_all()
                return

    def go() -> None:
        nonlocal started
        if started:
            return
        started = True
        fill(max(DEPTH, len(free)))  # every staging buffer: the plan may take a while yet

    try:
        if during is not None:
            during(go)
        go()
        # no piece is taken from the reads before this: the helpers start while the first are in flight
        for _ in range(min(placers() if placers is not None else WORKERS, pieces) - 1):
            thread = threading.Thread(target=helper, name="ftkit-read-place", daemon=True)
            thread.start()
            helpers.append(thread)
        while True:
            with turn:
                if failed:
                    raise failed[0]
                if done[0] == pieces:
                    break
                waiting = bool(arrived)
            got = reads.take_any(block=not waiting) if inflight else []
            for tag, n in got:
                i, view = inflight.pop(tag)
                want = min(CHUNK, size - i * CHUNK)
                if n != want:
                    raise FileProblem(
                        f"{reads.source.path.name}: {i * CHUNK + n} bytes where the read expected "
                        f"{i * CHUNK + want} (the manifest says {size}): the file changed while it was read"
                    )
                with turn:
                    arrived.append((i, view, n))
                    turn.notify()
            fill()  # the device gets the next reads (into the spare buffers) before these are placed
            with turn:
                mine = arrived.popleft() if arrived else None
                if mine is None and not inflight and done[0] < pieces and not failed:
                    turn.wait()  # the helpers have the last pieces
            if mine is not None:
                settle(*mine)
                fill()  # a free buffer reads the next piece while the others are placed
    except BaseException:
        with turn:  # the helpers stop at their next piece
            stopping[0] = True
            turn.notify_all()
        raise
    finally:
        for thread in helpers:
            thread.join()
        for fence in fences.values():  # the copies out of the staging buffers are done
            fence.wait()
    crc = 0
    for i, part_crc in enumerate(crcs):
        crc = crc32_combine(crc, part_crc, min(CHUNK, size - i * CHUNK))
    return crc


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
    with opened(path, name, size, direct=direct, cache=False, fresh=size >= FRESH_THREADS, room=ROOM) as reads:
        crc = _stream(reads, size, piece=lambda i: _piece(whole, i))
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]


Prepare = Callable[[Reads], tuple[Callable[[Callable[[], None]], None], Callable[[int, int, int], Fence | None]]]
"""``prepare(reads)``: ``_stream``'s ``during`` and ``place`` for a file once it is open."""


def _staged(path: Path, name: str, size: int, *, direct: bool | None, cache: bool,
            prepare: Prepare | None = None, stages: list[memoryview] | None = None,
            placers: Callable[[], int] | None = None) -> int:
    """The CRC-32 of ``path``'s ``size`` bytes read through :data:`STAGING` bytes of reused
    staging buffers (the pool's, or ``stages``). ``prepare(reads)``, called once the file is
    open, returns ``_stream``'s ``during`` and ``place``."""
    count = min(max(2, STAGING // CHUNK), max(1, -(-size // CHUNK)))
    per = max(1, STAGE_BYTES // CHUNK)  # pieces per staging buffer
    pool = [] if stages is not None else [take_stage() for _ in range(-(-count // per))]
    try:
        with opened(path, name, size, direct=direct, cache=cache, room=ROOM) as reads:
            views = stages[:count] if stages is not None else [
                view[k * CHUNK : (k + 1) * CHUNK] for view, _ in pool for k in range(per)][:count]
            during, place = prepare(reads) if prepare is not None else (None, None)
            return _stream(reads, size, stages=views, place=place, during=during, placers=placers)
    finally:
        for _, release in pool:  # after the reads in flight were waited for
            release()


def check_file(
    path: Path, meta: Mapping[str, Any], *, name: str | None = None, direct: bool | None = None,
    cache: bool = False,
) -> None:
    """Check ``path``'s size and CRC-32 against its manifest entry; :class:`FileProblem` if not.

    Reads through :data:`STAGING` bytes of reused staging buffers, with ``O_DIRECT`` unless ``cache``
    (then through the page cache, which keeps the file for a read on this node that follows)."""
    name = name or path.name
    size, want = _expected(name, meta)
    crc = _staged(path, name, size, direct=direct, cache=cache)
    _check_crc(name, crc, want)


class Fetch:
    """Small reads of a file (headers, an index) into the read buffer, at their offsets.

    ``fetch(start, end)`` reads bytes ``[start, end)`` unless an earlier fetch read them;
    ``fetch.many(ranges)`` reads several ranges at once (submitted together, so that they wait
    for the device together instead of one after the other). Each read covers whole blocks
    and at least :data:`FETCH` bytes, with ``O_DIRECT`` where the file was opened with it:
    nothing goes through the page cache."""

    def __init__(self, reads: Reads, whole: memoryview, size: int) -> None:
        self._reads, self._whole, self._size = reads, whole, size
        self.finished: Callable[[], None] = lambda: None
        self._starts: list[int] = []  # what was read: sorted, disjoint [start, end) spans
        self._ends: list[int] = []

    def __call__(self, start: int, end: int) -> None:
        self.many([(start, end)])

    def done(self) -> None:
        """No more small reads: the bulk read may start (it waits for this, or for the plan
        to return, so that the small reads do not queue behind it)."""
        self.finished()

    def covered(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` were read."""
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and end <= self._ends[i]

    def _add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self._starts, a)
        if i and self._ends[i - 1] >= a:  # joins the one before
            i -= 1
            a = self._starts[i]
        j = i
        while j < len(self._starts) and self._starts[j] <= b:  # and those it reaches
            b = max(b, self._ends[j])
            j += 1
        self._starts[i:j], self._ends[i:j] = [a], [b]

    def many(self, ranges: Iterable[tuple[int, int]]) -> None:
        spans: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            start, end = max(0, start), min(self._size, end)
            if end <= start or self.covered(start, end):
                continue
            a = start - start % BLOCK
            b = min(-(-max(end, start + FETCH) // BLOCK) * BLOCK, self._whole.nbytes)
            if spans and a <= spans[-1][1]:  # touching or overlapping the one before: one read
                spans[-1] = (spans[-1][0], max(b, spans[-1][1]))
            else:
                spans.append((a, b))
        # all at once where they fit beside the reads in flight (before a bulk read: the
        # headers of a file's items go out together), else SMALL_BATCH at a time
        step = max(SMALL_BATCH, self._reads.room - self._reads.in_flight)
        for k in range(0, len(spans), step):
            batch = spans[k : k + step]
            tags = self._reads.submit([(self._whole[a:b], a) for a, b in batch], "small")
            for (a, b), n in zip(batch, self._reads.take(tags), strict=True):
                want = min(b, self._size) - a
                if n < want:
                    raise FileProblem(f"{self._reads.source.path.name}: ends before byte {a + want} (the "
                                      f"manifest says {self._size})")
                self._add(a, min(b, self._size))


def read_spans(path: Path, size: int, spans: list[tuple[int, int]], *, direct: bool | None = None
               ) -> dict[tuple[int, int], bytes]:
    """The bytes of each ``[start, end)`` of ``path`` (``size`` bytes, as its manifest says),
    read together in small reads (:class:`Fetch`): a few items of a file, without its bulk.
    Raises :class:`FileProblem` when the file is missing or of another size."""
    _, whole = read_buffer(size)
    with opened(path, path.name, size, direct=direct, cache=False, room=ROOM) as reads:
        Fetch(reads, whole, size).many(spans)
    return {(a, b): bytes(whole[a:b]) for a, b in spans}


class Destination(Protocol):
    """Memory a :func:`scatter_file` target's bytes go to that is not host memory to
    ``memmove`` into (a GPU tensor): ``write(at, src, n)`` copies the ``n`` bytes at host
    address ``src`` (a staging buffer's) to its bytes ``[at, at + n)``, and returns a
    :class:`Fence` when the copy is still running (the buffer is not read into before it)."""

    def write(self, at: int, src: int, n: int) -> Fence | None: ...


Target = tuple[int, int, "memoryview | Destination"]
"""``(start, end, memory)``: the file's bytes ``[start, end)`` go to ``memory`` (``end - start``
bytes), host memory or a :class:`Destination`."""


def scatter_file(
    path: Path,
    meta: Mapping[str, Any],
    plan: Callable[[Any, memoryview, Fetch], list[Target] | None],
    *,
    verify: bool = True,
    direct: bool | None = None,
    stages: list[memoryview] | None = None,
    placers: Callable[[], int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Any, memoryview]:
    """Read ``path`` once, each piece to where ``plan`` wants it; ``(mapping, view)`` as
    :func:`read_file`, with the bytes ``plan`` sent elsewhere left unread (zero) in it.

    ``plan(mapping, view, fetch)`` runs before any byte is placed: ``fetch(start, end)`` and
    ``fetch.many(ranges)`` (a :class:`Fetch`) read small parts of the file into ``view`` at
    their offsets (a header, an index), and ``plan`` returns the ranges of the file that go to
    the caller's memory instead of ``view`` (sorted, not overlapping), or None when nothing of
    the file is wanted (it is only checked, nothing kept). The bulk read starts when ``plan``
    calls ``fetch.done()`` (its small reads are over) or returns. Then the whole file streams
    through reused staging buffers (the pool's, or ``stages``: :data:`CHUNK`-byte page-aligned
    buffers of the caller's, such as pinned memory a GPU copies from asynchronously), every
    piece checksummed and copied to its targets and the rest into ``view``. Raises
    :class:`FileProblem` as :func:`read_file`; by then the targets hold the file's (wrong)
    bytes. ``placers()``, asked once ``plan`` returned: how many threads checksum and place
    (:data:`WORKERS`; :data:`FRESH_WORKERS` suits targets mostly in fresh memory).
    ``progress(n)``, on a placing thread whenever it grows: the file's first ``n`` bytes are
    placed (those for ``view`` are in it), so the caller may look at them before the read ends."""
    name = path.name
    size, want = _expected(name, meta)
    mapping, whole = read_buffer(size)

    whole_at = address(whole) if size else 0
    plan_of: dict[str, Any] = {}

    def prepare(reads: Reads) -> tuple[Callable[[Callable[[], None]], None], Callable[[int, int, int], Fence | None]]:
        fetch = Fetch(reads, whole, size)

        def during(go: Callable[[], None]) -> None:
            fetch.finished = go  # the plan's small reads first, then the bulk
            targets = plan(mapping, whole[:size], fetch)
            if targets is None:  # nothing wanted: the file is only checked
                plan_of["discard"] = True
                targets = []
            plan_of["keep"] = targets  # the target memory stays alive while it is written
            plan_of["starts"] = [t[0] for t in targets]
            plan_of["ends"] = [t[1] for t in targets]
            plan_of["at"] = [address(t[2]) if isinstance(t[2], memoryview) else t[2] for t in targets]

        def place(lo: int, src: int, n: int) -> Fence | None:
            """File bytes ``[lo, lo + n)``, at ``src`` (on a reader thread): to their targets,
            the rest into the buffer at its offset. The fence of the last asynchronous copy."""
            if "discard" in plan_of:
                return None
            starts, ends, at = plan_of["starts"], plan_of["ends"], plan_of["at"]
            hi, pos = lo + n, lo
            fence = None
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
                    if isinstance(at[j], int):
                        ctypes.memmove(at[j] + pos - start, src + pos - lo, stop - pos)
                    else:
                        fence = at[j].write(pos - start, src + pos - lo, stop - pos) or fence
                    pos = stop
                else:
                    ctypes.memmove(whole_at + pos, src + pos - lo, hi - pos)
                    pos = hi
            return fence

        if progress is None:
            return during, place
        placed: dict[int, int] = {}  # start -> end of the parts placed beyond the first gap
        upto = [0]
        lock = threading.Lock()

        def place_and_tell(lo: int, src: int, n: int) -> Fence | None:
            fence = place(lo, src, n)
            with lock:
                placed[lo] = lo + n
                if upto[0] in placed:
                    while upto[0] in placed:
                        upto[0] = placed.pop(upto[0])
                    progress(upto[0])
            return fence

        return during, place_and_tell

    crc = _staged(path, name, size, direct=direct, cache=False, prepare=prepare, stages=stages, placers=placers)
    if verify:
        _check_crc(name, crc, want)
    return mapping, whole[:size]
