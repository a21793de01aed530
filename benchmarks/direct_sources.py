"""O_DIRECT write speed of the same bytes from four kinds of memory, side by side.

    python benchmarks/direct_sources.py [--mb 256] [--rounds 9] [--dir DIR] [--settle S] [--churn-gb G]

With ``O_DIRECT`` the device reads a buffer where it is, and the block layer merges physically
adjacent pages into one segment; pages scattered in physical memory make many small requests.
This benchmark writes the same ``--mb`` of random bytes (16 MiB buffers, the size of a
2048x2048 float32 tensor) with O_DIRECT + fsync to a new file, from:

* ``huge``    ftkit's host buffers (``ftkit.checkpoint._direct.aligned_empty``): private, on a
  2 MiB boundary, advised into transparent huge pages;
* ``private`` private anonymous mappings in 4 KiB pages (``MADV_NOHUGEPAGE``);
* ``shared``  shared anonymous mappings (shmem pages: what ftkit's buffers were before);
* ``devshm``  a file in ``/dev/shm`` mapped shared, as the crash-safe saver's segment
  (``AsyncConfig(crash_safe=True)``) is.

How scattered fresh pages are depends on what the process did before: ``--churn-gb`` (default
0.25) first builds the state ``checkpoint_speed.py`` builds (model + Adam state of that size;
the temporaries freed by its Adam step leave the free pages scattered), as its workers do
before their first snapshot; ``--churn-gb 0`` allocates from a quiet process.

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
from checkpoint_speed import _build, _raw_write, _settle  # the same raw writer and state

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


def _sources(kind: str, count: int, data: bytes, shm_dir: Path) -> list[memoryview]:
    import torch

    from ftkit.checkpoint._direct import aligned_empty

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
            os.ftruncate(fd, CHUNK)
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
    ap.add_argument("--churn-gb", type=float, default=0.25,
                    help="build checkpoint_speed's model + Adam state of this size first (0: none)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    churn = _build(args.churn_gb) if args.churn_gb > 0 else None
    count = max(1, args.mb // 16)
    data = os.urandom(count * CHUNK)
    kinds = ["huge", "private", "shared", "devshm"]
    sources = {k: _sources(k, count, data, Path("/dev/shm")) for k in kinds}
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
          f"after a {args.churn_gb} GB state was built, medians (runs):")
    for kind in kinds:
        med = statistics.median(times[kind])
        phys = runs[kind]
        where = (f"{statistics.median(phys):.0f} physical runs per 16 MiB"
                 if all(r is not None for r in phys) else "physical layout not readable (not root)")
        print(f"  {kind:<8} {nbytes / med / 1e6:6.0f} MB/s  time / huge's {med / best:4.2f}  {where}  "
              f"({', '.join(f'{t:.3f}' for t in times[kind])})")
    del churn


if __name__ == "__main__":
    main()
