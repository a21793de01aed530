"""Where a cold load's time goes: the same checkpoint loaded into live state on the GPU and in
host memory, in one process, alternating, each load's time split into its parts.

    python benchmarks/load_parts.py [--gb 1] [--rounds 3] [--settle 0.5] [--kinds gpu,cpu,...] [--dir DIR]

On an H200 whose disk read 2.5-3 GB/s, a one-rank load of a state on the GPU ran at 1.7-2.1
GB/s (0.66-0.76 of the raw read) whatever the request shape or staging, where the same reader
into host memory ran faster than the raw read (docs/benchmarks.md). This script saves two
checkpoints of ``checkpoint_speed.py``'s model and Adam state (``--gb``), keeps a second copy
of that state in host memory, and times, rotating, each after ``sync``, dropping the page
cache (root) and ``--settle`` seconds of pause, the raw ``O_DIRECT`` read of the newest
checkpoint's files (``raw1``, ``raw4``: one 16 MiB read at a time, four 4 MiB ones in flight)
and ``Checkpointer.load`` of it into:

* ``cpu``: the state in host memory (in a process that uses CUDA, staged in torch's pinned
  memory, as ftkit does there); ``cpu hugepages``: the same staged in huge pages, as in a
  process without CUDA; ``cpu 2x4``: 2 MiB reads, four in flight;
* ``cpu emulated``: the state in host memory, each piece's bytes given to a stand-in for a GPU
  load's copies (no CUDA needed): queued to one "copy engine" thread that takes as long as a
  50 GB/s DMA would and copies nothing (the live tensors from 1 MiB keep their values), with a
  fence per copy that the reader waits for before reusing a staging buffer (huge pages), as
  :mod:`ftkit.checkpoint.io.device` does; ``cpu emulated pinned`` (CUDA): the same staged in
  torch's pinned memory. Beside ``gpu`` (and ``gpu registered`` beside ``cpu emulated``: both
  stage in huge pages), it tells the cost of CUDA's calls and copies from that of the
  pipeline's structure and the staging's pages;
* ``gpu``: the state on the GPU (the default: pinned staging, four placing threads);
  ``gpu w1``, ``gpu w2``: one or two placing threads; ``gpu 2x4``: four reads in flight;
  ``gpu registered``: staging in huge pages registered with CUDA; ``gpu lean``: each copy
  queued without asking the CUDA runtime for the thread's current device first (one GPU);
  ``gpu switch``, ``cpu emulated switch``: ``gpu`` and ``cpu emulated`` with the GIL's switch
  interval at 0.2 ms instead of 5 ms (a thread back from a read's completion waits less for the
  GIL another holds).

Each load's parts are timed by wrapping ftkit's functions for the measurement: ``read`` (the
state file's read, from open to its CRC-32 checked and its copies done; the rest of the load
is finding, checking and restoring around it), ``take_any`` (the reading thread waiting for
reads to complete, and ``depth``: the reads in flight then, on average), ``submit``, ``crc``
(CRC-32, summed over the placing threads), ``write`` (queuing the host-to-device copies,
summed), ``fence`` (waiting for a staging buffer's copies before it is read into again, and for
the last pieces' copies at the end of the read) and ``finish`` (what is left then). Prints each
kind's median load, its ratio to the faster raw read and the medians of its parts. Without
CUDA, only the raw reads, ``cpu`` and ``cpu emulated``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoint_speed as cs  # the same model, raw read and preparation
from read_shape import parse_shape, set_shape

from ftkit.checkpoint import CheckpointConfig, make_manager
from ftkit.checkpoint.io import device as _device
from ftkit.checkpoint.io import reader as _reader
from ftkit.checkpoint.io import reads as _reads
from ftkit.checkpoint.io import statefile as _statefile
from ftkit.checkpoint.io.direct import aligned_empty

PARTS: collections.defaultdict[str, float] = collections.defaultdict(float)  # the load being timed
_PARTS_LOCK = threading.Lock()  # several placing threads add to the same part


def _add(key: str, value: float) -> None:
    with _PARTS_LOCK:
        PARTS[key] += value


def _timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(key, time.perf_counter() - t)

    return wrapped


def _instrument() -> dict[str, Any]:
    """Wrap the functions whose time is a load's part; returns the switches ``load`` sets."""
    take_any = _reads.Reads.take_any

    def timed_take_any(self: _reads.Reads, *, block: bool = True) -> list[tuple[int, int]]:
        if not block:
            return take_any(self, block=False)
        _add("waits", 1)
        _add("in flight", self.in_flight)
        t = time.perf_counter()
        try:
            return take_any(self, block=True)
        finally:
            _add("take_any", time.perf_counter() - t)

    _reads.Reads.take_any = timed_take_any
    _statefile.scatter_file = _timed("read", _statefile.scatter_file)  # the file's one read, start to end
    _reads.Reads.submit = _timed("submit", _reads.Reads.submit)
    _reader.crc32 = _timed("crc", _reader.crc32)
    for fence in (_device._RawEvent, _device._EventFence, _EmulatedFence):
        fence.wait = _timed("fence", fence.wait)
    _device.DeviceCopies.finish = _timed("finish", _device.DeviceCopies.finish)
    _Emulated.finish = _timed("finish", _Emulated.finish)
    _EmulatedTensor.write = _timed("write", _EmulatedTensor.write)
    write = _device.DeviceTensor.write
    switches = {"lean": False}

    def maybe_lean_write(self: _device.DeviceTensor, at: int, src: int, n: int) -> Any:
        if switches["lean"] and self._events is not None:
            return self._raw(self._events, at, src, n)  # the thread's current device taken to be this one
        return write(self, at, src, n)

    _device.DeviceTensor.write = _timed("write", maybe_lean_write)
    return switches


class _Emulated:
    """A stand-in for a load's :class:`ftkit.checkpoint.io.device.DeviceCopies`: staging in huge
    pages (``pinned``: from torch's pinned allocator, as a GPU load's), and each copy queued to
    one thread (a copy engine) that takes as long as a DMA at ``rate`` bytes/s would from when it
    was queued, copies nothing, then passes the copy's fence. Made once and reused by every load
    (as the reader's pool and torch's pinned blocks are), outside the timed loads."""

    def __init__(self, *, chunk: int, count: int, pinned: bool = False, rate: float = 50e9) -> None:
        self._chunk, self._count, self._rate = chunk, count, rate
        if pinned:
            block = torch.empty(chunk * count + 4096, dtype=torch.uint8, pin_memory=True)
            start = -block.data_ptr() % 4096
            self._keep, self._block = block, block[start : start + chunk * count]
        else:
            self._keep = self._block = aligned_empty((chunk * count,), torch.uint8)
            self._block.fill_(0)
        self._queue: queue.SimpleQueue[tuple[int, float, threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="emulated-copy-engine", daemon=True).start()

    def _run(self) -> None:
        busy_until = 0.0
        while True:
            n, queued, done = self._queue.get()
            busy_until = max(busy_until, queued) + n / self._rate  # as a DMA engine: in order, from when queued
            pause = busy_until - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            done.set()

    def stages(self) -> list[memoryview]:
        whole = self._block.numpy().data.cast("B")
        return [whole[i * self._chunk : (i + 1) * self._chunk] for i in range(self._count)]

    def target(self, tensor: torch.Tensor) -> _EmulatedTensor:
        return _EmulatedTensor(self)

    def finish(self) -> None:
        """Every copy queued so far done."""
        done = threading.Event()
        self._queue.put((0, time.perf_counter(), done))
        done.wait()


class _EmulatedTensor:
    def __init__(self, copies: _Emulated) -> None:
        self._copies = copies

    def write(self, at: int, src: int, n: int) -> _EmulatedFence:
        done = threading.Event()
        self._copies._queue.put((n, time.perf_counter(), done))
        return _EmulatedFence(done)


class _EmulatedFence:
    __slots__ = ("_done",)

    def __init__(self, done: threading.Event) -> None:
        self._done = done

    def wait(self) -> None:
        self._done.wait()


SWITCH = 0.0002  # the "switch" kinds' sys.setswitchinterval (default 0.005): a thread back from a
# blocking call (a read's completion) waits less for the GIL held by another


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB (model + Adam moments)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--kinds", default=None, help="comma-separated kinds (default: all this machine can run)")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    cs.DEVICE = "cuda" if cuda else "cpu"
    model, opt, _ = cs._build(args.gb)
    live = {"model": model, "optimizer": opt}
    work = Path(tempfile.mkdtemp(prefix="ftkit-parts-", dir=args.dir))
    cfg = CheckpointConfig(root=work / "ck", keep_last=None)
    manager = make_manager(cfg)
    manager.save(1, live)
    manager.save(2, live)
    host = live
    if cuda:  # the same state in host memory
        cs.DEVICE = "cpu"
        host_model, host_opt, _ = cs._build(args.gb)
        host = {"model": host_model, "optimizer": host_opt}
        cs.DEVICE = "cuda"  # cs._sync() waits for the GPU after every load
    files = cs._files_under(work / "ck" / "step-00000002")
    size = sum(f.stat().st_size for f in files)
    buf = cs._huge_copy(memoryview(bytes(cs._READ_CHUNK)))

    switches = _instrument()
    default = (_reader.CHUNK, _reader.DEPTH, _reader.STAGING)
    workers, wanted, staging0 = _reader.WORKERS, _device.wanted, _device.STAGING
    load_copies, destination = _statefile.load_copies, _statefile.destination
    emulators: dict[tuple[int, int, bool], _Emulated] = {}  # made before the timed loads, reused

    def emulated_copies(pinned: bool) -> Callable[..., Any]:
        @contextlib.contextmanager
        def copies(*, chunk: int, count: int) -> Iterator[_Emulated]:
            emulated = emulators[(chunk, count, pinned)]
            try:
                yield emulated
            finally:
                emulated.finish()

        return copies

    def emulated_destination(t: torch.Tensor, copies: Any) -> Any:
        if isinstance(copies, _Emulated) and t.numel() * t.element_size() >= 1 << 20:
            return copies.target(t)
        return destination(t, copies)  # small ones (an RNG state) get their bytes

    def load(state: dict[str, Any], shape: str | None = None, placers: int | None = None,
             staging: str = "pinned", lean: bool = False, huge: bool = False,
             emulated: str | None = None, switch: float | None = None) -> float:
        interval = sys.getswitchinterval()
        try:
            if switch is not None:
                sys.setswitchinterval(switch)
            switches["lean"] = lean
            if huge:  # staged as in a process without CUDA
                _device.wanted = lambda: False
            set_shape(*(parse_shape(shape) if shape else default))
            if emulated is not None:
                key = (_reader.CHUNK, _reader.STAGING // _reader.CHUNK, emulated == "pinned")
                if key not in emulators:
                    emulators[key] = _Emulated(chunk=key[0], count=key[1], pinned=key[2])
                _statefile.load_copies = emulated_copies(emulated == "pinned")
                _statefile.destination = emulated_destination
            _reader.WORKERS = placers or workers
            _device.STAGING = staging
            t = time.perf_counter()
            assert make_manager(cfg).load(state) == 2
            cs._sync()
            return time.perf_counter() - t
        finally:
            sys.setswitchinterval(interval)
            set_shape(*default)
            _reader.WORKERS, _device.STAGING, _device.wanted = workers, staging0, wanted
            _statefile.load_copies, _statefile.destination = load_copies, destination

    kinds: dict[str, Callable[[], float]] = {
        "raw1": lambda: cs._raw_read(files, buf), "raw4": lambda: cs._raw_read(files, buf, depth=4),
        "cpu": lambda: load(host), "cpu emulated": lambda: load(host, emulated="huge"),
        "cpu emulated switch": lambda: load(host, emulated="huge", switch=SWITCH)}
    if cuda:
        kinds |= {"cpu hugepages": lambda: load(host, huge=True), "cpu 2x4": lambda: load(host, "2x4"),
                  "cpu emulated pinned": lambda: load(host, emulated="pinned"),
                  "gpu": lambda: load(live), "gpu w1": lambda: load(live, placers=1),
                  "gpu w2": lambda: load(live, placers=2), "gpu 2x4": lambda: load(live, "2x4"),
                  "gpu registered": lambda: load(live, staging="registered"),
                  "gpu lean": lambda: load(live, lean=True),
                  "gpu switch": lambda: load(live, switch=SWITCH)}
    if args.kinds:
        wanted_kinds = ["raw1", "raw4", *(k for k in args.kinds.split(",") if k and k not in ("raw1", "raw4"))]
        unknown = [k for k in wanted_kinds if k not in kinds]
        if unknown:
            ap.error(f"--kinds: {', '.join(unknown)} not among {', '.join(kinds)}")
        kinds = {k: kinds[k] for k in wanted_kinds}
    for name, run in kinds.items():  # warm: code paths, staging, pinned pool, registered block
        if not name.startswith("raw"):
            run()

    times: dict[str, list[float]] = {k: [] for k in kinds}
    parts: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list) for k in kinds}
    names = list(kinds)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            cs._settle(args.settle)
            PARTS.clear()
            times[name].append(kinds[name]())
            if PARTS.get("waits"):
                PARTS["depth"] = PARTS.pop("in flight") / PARTS["waits"]
            for key, value in PARTS.items():
                parts[name][key].append(value)
    raw = min(statistics.median(times["raw1"]), statistics.median(times["raw4"]))
    dev = torch.cuda.get_device_name() if cuda else "no GPU"
    print(f"load_parts: {size / 1e9:.2f} GB of state files, {dev}, {args.rounds} cold rounds each, "
          f"{os.cpu_count()} CPUs, {workers} placing threads; raw read {size / raw / 1e6:.0f} MB/s")
    if cuda and _device._Runtime.get() is None:
        print("  the CUDA runtime library was not found: copies went through Tensor.copy_ ('gpu lean' is 'gpu')")
    if _device._Registered._refused:
        print(f"  registered staging was refused ({_device._Registered._refused}): those loads staged in pinned memory")
    for name in kinds:
        med = statistics.median(times[name])
        detail = "  ".join(f"{key} {statistics.median(v):.3f}" for key, v in sorted(parts[name].items())
                           if key not in ("waits", "in flight"))
        print(f"  {name:15s} {med:.3f}s ({' '.join(f'{t:.3f}' for t in times[name])})  "
              f"{size / med / 1e6:5.0f} MB/s  load / raw read {raw / med:.2f}  {detail}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
