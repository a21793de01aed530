"""Does a GPU's DMA slow the disk's reads? The raw ``O_DIRECT`` read of one file, side by side
with the same read while host-to-device copies run.

    python benchmarks/read_beside_copies.py [--gb 2] [--rounds 3] [--dir /tmp]

A cold load onto a GPU reads pieces into pinned staging while earlier pieces cross to the
device (:mod:`ftkit.checkpoint.io.device`); on an H200 it ran at ~0.7 of the raw read where the
same load into host memory ran at ~1.0. This tells one suspected cause apart: the disk's reads
completing slower while the GPU reads host memory. In one process, rotating, each read after
``sync`` and dropping the page cache (root), it times the raw read (``checkpoint_speed.py``'s
one 16 MiB request at a time) of a ``--gb`` file into:

* ``huge pages``: page-aligned memory in transparent huge pages (the raw read's reference);
* ``pinned``: a buffer from torch's pinned allocator (without CUDA, ``4 KiB pages``: the same
  allocation, not pinned);
* ``pinned, copies flat out`` (CUDA): the same while another thread copies 64 MiB from other
  pinned memory to the GPU again and again (its rate is printed first);
* ``pinned, copies 3 GB/s`` (CUDA): the same with ``--copy-mb`` (2) MiB copies paced to 3 GB/s,
  about what a load at the disk's speed queues (each row prints the copies' rate during the read);
* ``pinned, copies 3 GB/s, other process`` (CUDA): the same copies made by another process, which
  shares no GIL with the reading thread: the copies' thread above takes the GIL some 1500 times a
  second, which the read's thread waits for on its way back from each read. Reads as fast here
  as alone, but slower beside the same copies in one process, put the slowdown on the process's
  threads, not on the GPU's DMA;
* ``pinned, read then copy`` (CUDA): each 16 MiB read copied to the GPU before the next read
  (the simplest loader, no overlap).

Prints each one's median throughput and its ratio to ``huge pages``. Without CUDA, only the
first two.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoint_speed as cs  # the same raw read, cache dropping, huge-page buffer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the file read")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.2, help="seconds of pause after dropping the cache")
    ap.add_argument("--dir", default=None, help="where the file is written (default: the temp dir)")
    ap.add_argument("--copy-mb", type=int, default=2, help="MiB per paced copy (a load's: 2)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    chunk = cs._READ_CHUNK
    work = Path(tempfile.mkdtemp(prefix="ftkit-beside-", dir=args.dir))
    path = work / "data.bin"
    block = os.urandom(chunk)
    pieces = max(1, round(args.gb * 1e9 / chunk))
    with open(path, "wb") as f:
        for _ in range(pieces):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    size = pieces * chunk

    huge = cs._huge_copy(memoryview(bytes(chunk)))
    pinned_block = torch.empty(chunk + 4096, dtype=torch.uint8, pin_memory=cuda)  # page-aligned view of it
    start = -pinned_block.data_ptr() % 4096
    staging = pinned_block[start : start + chunk]
    staging.fill_(0)  # faulted in before the timed reads (pinned memory already is)
    pinned = staging.numpy().data.cast("B")

    kinds = {"huge pages": lambda: cs._raw_read([path], huge),
             "pinned" if cuda else "4 KiB pages": lambda: cs._raw_read([path], pinned)}
    rates: dict[str, list[float]] = collections.defaultdict(list)  # the copies' GB/s during each read
    if cuda:
        gpu = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        source = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        side = torch.cuda.Stream()
        stop = threading.Event()

        def copies(rate: float | None, done: list[Any]) -> None:
            """Copies to the GPU until ``stop``: 64 MiB at a time flat out, or 2 MiB at a time
            paced to ``rate`` bytes/s; ``done``: bytes copied, seconds, and an error if any."""
            t, n = time.perf_counter(), 0
            try:
                with torch.cuda.stream(side):
                    while not stop.is_set():
                        part = gpu if rate is None else gpu[: args.copy_mb << 20]
                        part.copy_(source[: part.numel()], non_blocking=True)
                        side.synchronize()
                        n += part.numel()
                        if rate is not None:
                            time.sleep(max(0.0, t + n / rate - time.perf_counter()))
            except BaseException as exc:
                done.append(exc)
            done[:0] = [n, time.perf_counter() - t]

        def beside(name: str, rate: float | None) -> float:
            stop.clear()
            done: list[Any] = []
            thread = threading.Thread(target=copies, args=(rate, done), daemon=True)
            thread.start()
            time.sleep(0.05)  # the copies are running before the read starts
            try:
                return cs._raw_read([path], pinned)
            finally:
                stop.set()
                thread.join()
                if len(done) > 2:
                    raise RuntimeError(f"{name}: the copies failed") from done[2]
                rates[name].append(done[0] / done[1] / 1e9)

        def read_then_copy() -> float:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            t = time.perf_counter()
            try:
                with torch.cuda.stream(side):
                    for off in range(0, size, chunk):
                        os.preadv(fd, [pinned], off)
                        gpu[:chunk].copy_(staging, non_blocking=True)
                        side.synchronize()
            finally:
                os.close(fd)
            return time.perf_counter() - t

        other = _CopyProcess(args.copy_mb << 20, 3e9)

        def beside_other() -> float:
            other.go()
            try:
                return cs._raw_read([path], pinned)
            finally:
                rates["pinned, copies 3 GB/s, other process"].append(other.stop())

        kinds |= {"pinned, copies flat out": lambda: beside("pinned, copies flat out", None),
                  "pinned, copies 3 GB/s": lambda: beside("pinned, copies 3 GB/s", 3e9),
                  "pinned, copies 3 GB/s, other process": beside_other,
                  "pinned, read then copy": read_then_copy}
        t, n = time.perf_counter(), 0
        with torch.cuda.stream(side):
            while time.perf_counter() - t < 0.5:
                gpu.copy_(source, non_blocking=True)
                side.synchronize()
                n += 1
        print(f"host-to-device copies flat out: {n * gpu.numel() / (time.perf_counter() - t) / 1e9:.1f} GB/s")

    times: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            cs._settle(args.settle)
            times[name].append(kinds[name]())
    base = statistics.median(times["huge pages"])
    dev = torch.cuda.get_device_name() if cuda else "no GPU"
    print(f"read_beside_copies: {size / 1e9:.2f} GB file in {work.parent}, {dev}, {args.rounds} rounds, "
          f"one 16 MiB O_DIRECT read at a time")
    for name, ts in times.items():
        med = statistics.median(ts)
        copied = f", copies at {statistics.median(rates[name]):.1f} GB/s" if rates.get(name) else ""
        print(f"  {name:24s} {size / med / 1e6:6.0f} MB/s  ({' '.join(f'{t:.3f}' for t in ts)})  "
              f"{base / med:.2f} of huge pages{copied}")
    shutil.rmtree(work, ignore_errors=True)
    if cuda:
        other.close()
    return 0


_CHILD = """
import sys, threading, time, torch
nbytes, rate, device = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
target = torch.empty(nbytes, dtype=torch.uint8, device=device)
side = torch.cuda.Stream() if device == "cuda" else None
running = threading.Event()
quit = threading.Event()

def commands():
    for line in sys.stdin:
        (running.set if line.strip() == "go" else running.clear)()
    quit.set()
    running.set()

threading.Thread(target=commands, daemon=True).start()
print("ready", flush=True)
while not quit.is_set():
    running.wait()
    if quit.is_set():
        break
    t, n = time.perf_counter(), 0
    while running.is_set() and not quit.is_set():
        if side is not None:
            with torch.cuda.stream(side):
                target.copy_(source, non_blocking=True)
            side.synchronize()
        else:
            target.copy_(source)
        n += nbytes
        time.sleep(max(0.0, t + n / rate - time.perf_counter()))
    print(f"{n / (time.perf_counter() - t) / 1e9:.3f}", flush=True)
"""


class _CopyProcess:
    """Another process that copies ``nbytes`` from pinned memory to the GPU again and again,
    paced to ``rate`` bytes/s, between :meth:`go` and :meth:`stop` (which returns its GB/s);
    on a machine without CUDA, host to host (to try the plumbing)."""

    def __init__(self, nbytes: int, rate: float) -> None:
        import subprocess

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(nbytes), str(rate), device],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready"

    def go(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()
        time.sleep(0.05)  # the copies are running before the read starts

    def stop(self) -> float:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("stop\n")
        self._proc.stdin.flush()
        return float(self._proc.stdout.readline())

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
