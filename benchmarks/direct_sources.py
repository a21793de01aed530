"""O_DIRECT write speed of the same bytes from four kinds of memory, side by side.

    python benchmarks/direct_sources.py [--mb 256] [--rounds 9] [--dir DIR] [--settle S] [--fragment-gb G] [--shm-dir DIR]

With ``O_DIRECT`` the device reads a buffer where it is, and the block layer merges physically
adjacent pages into one segment; pages scattered in physical memory make many small requests.
This benchmark writes the same ``--mb`` of random bytes (16 MiB buffers, the size of a
2048x2048 float32 tensor) with O_DIRECT + fsync to a new file, from:

* ``huge``    ftkit's host buffers (``ftkit.checkpoint.io.direct.aligned_empty``): private, on a
  2 MiB boundary, advised into transparent huge pages;
* ``private`` private anonymous mappings in 4 KiB pages (``MADV_NOHUGEPAGE``);
* ``shared``  shared anonymous mappings (shmem pages: what ftkit's buffers were before);
* ``devshm``  a file in ``/dev/shm`` (``--shm-dir``) mapped shared, as the crash-safe saver's
  segment (``AsyncConfig(crash_safe=True)``, ``shm_dir``) is, its space reserved with
  ``posix_fallocate`` as the segment's is. On a tmpfs mounted with ``huge=always`` or
  ``huge=within_size`` that reservation takes huge pages.

How scattered fresh pages are depends on the free memory the kernel has: after a process has
run a while, freed pages whose neighbours are still in use are handed out first, one here, one
there. ``--fragment-gb G`` (default 2) makes that state on purpose: it maps G GB in 4 KiB
pages, then frees every other page and keeps the rest until the end, so the small-page kinds
get pages with no physical neighbour (the worst case; a huge page comes from an intact 2 MiB
block all the same). ``--fragment-gb 0`` allocates from the machine's free memory as it is.

Rounds rotate the order; each write follows the same preparation (``sync``, dropped page cache
when root, a pause). Prints the median MB/s of each, its ratio to ``huge``, and where
``/proc/self/pagemap`` shows physical addresses (root) how many physically contiguous runs make
up each 16 MiB buffer (4096 = every page on its own; 8 = eight 2 MiB pieces).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import os
import statistics
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_speed import _raw_write, _settle  # the same raw writer

CHUNK = 16 << 20


def _runs(view: memoryview) -> int | None:
    """Physically contiguous runs under a page-aligned buffer, or None without PFNs (not root)."""
    import numpy as np

    addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    n = view.nbytes // mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // mmap.PAGESIZE * 8)
            entries = struct.unpack(f"{n}Q", f.read(n * 8))
    except OSError:
        return None
    pfns = [e & ((1 << 55) - 1) for e in entries]
    if not any(pfns):
        return None
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(pfns))


def _fragment(nbytes: int) -> mmap.mmap | None:
    """Map ``nbytes`` in 4 KiB pages, touch them, free every other one; keep the mapping."""
    if nbytes <= 0:
        return None
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    page = mmap.PAGESIZE
    for off in range(0, nbytes, page):
        m[off] = 1
    for off in range(0, nbytes, 2 * page):
        m.madvise(mmap.MADV_DONTNEED, off, page)
    return m


def _sources(kind: str, count: int, data: bytes, shm_dir: Path) -> list[memoryview]:
    import torch

    from ftkit.checkpoint.io.direct import aligned_empty

    out = []
    for i in range(count):
        if kind == "huge":
            t = aligned_empty((CHUNK,), torch.uint8)
            view = memoryview(t.numpy()).cast("B")
        elif kind == "private":
            m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError, AttributeError):
                m.madvise(mmap.MADV_NOHUGEPAGE)
            view = memoryview(m)
        elif kind == "shared":
            view = memoryview(mmap.mmap(-1, CHUNK))
        else:
            fd, name = tempfile.mkstemp(dir=shm_dir, prefix="ftkit-direct-sources-")
            os.unlink(name)  # the mapping keeps the pages
            os.posix_fallocate(fd, 0, CHUNK)
            view = memoryview(mmap.mmap(fd, CHUNK))
            os.close(fd)
        view[:] = data[i * CHUNK : (i + 1) * CHUNK]
        out.append(view)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="bytes per write, in MiB (a multiple of 16)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir here)")
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for the devshm kind")
    ap.add_argument("--fragment-gb", type=float, default=2.0,
                    help="map this much in 4 KiB pages and free every other page first (0: no)")
    args = ap.parse_args()
    holes = _fragment(int(args.fragment_gb * (1 << 30)))
    count = max(1, args.mb // 16)
    data = os.urandom(count * CHUNK)
    kinds = ["huge", "private", "shared", "devshm"]
    sources = {k: _sources(k, count, data, args.shm_dir) for k in kinds}
    runs = {k: [_runs(v) for v in vs] for k, vs in sources.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(dir=args.dir or Path.cwd(), prefix=".direct-sources-") as tmp:
        for i in range(args.rounds):
            for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                _settle(args.settle)
                path = Path(tmp) / f"{kind}-{i}.bin"
                times[kind].append(_raw_write(path, count * CHUNK, sources[kind], direct=True))
                path.unlink()
    nbytes = count * CHUNK
    best = statistics.median(times["huge"])
    print(f"O_DIRECT write + fsync of {nbytes / 1e6:.0f} MB in 16 MiB writes, {args.rounds} rounds, "
          f"{args.fragment_gb} GB fragmented first, devshm in {args.shm_dir}, medians (runs):")
    for kind in kinds:
        med = statistics.median(times[kind])
        phys = runs[kind]
        where = (f"{statistics.median(phys):.0f} physical runs per 16 MiB"
                 if all(r is not None for r in phys) else "physical layout not readable (not root)")
        print(f"  {kind:<8} {nbytes / med / 1e6:6.0f} MB/s  time / huge's {med / best:4.2f}  {where}  "
              f"({', '.join(f'{t:.3f}' for t in times[kind])})")
    del holes


if __name__ == "__main__":
    main()
