"""How much a checkpoint costs the training loop: ftkit async/crash-safe vs copy, torch.save, DCP.

    python benchmarks/checkpoint_speed.py --sizes 0.25,1,3 [--dir DIR] [--json FILE] [--rounds N] [--settle S]
                                          [--device cuda]

(``--rounds`` defaults to 15 below 1 GB and 7 from 1 GB up.)

For each state size (GB of model + Adam state: Linear(2048, 2048) layers, parameters, exp_avg,
exp_avg_sq, all float32; on ``--device`` ``cpu`` or ``cuda``) every variant runs in a fresh subprocess, so its peak extra host
memory is ``VmHWM - VmRSS`` measured around the operation (the high-water mark is reset
through /proc/self/clear_refs after the state is built). Variants, side by side in one run:

* ``copy``        the limit: ``copy_`` of every tensor into preallocated host buffers (with
                  ``--device cuda``: pinned buffers, ``non_blocking`` copies, then a synchronize)
* ``torch.save``  torch.save + fsync of the state dicts (the loop waits for all of it)
* ``dcp``         torch.distributed.checkpoint.save (single process)
* ``dcp-async``   torch.distributed.checkpoint.async_save (stall = until it returns)
* ``ftkit-async`` AsyncCheckpointer.save (thread worker); stall of a steady-state save
* ``ftkit-shm``   AsyncCheckpointer(crash_safe=True): copy into /dev/shm, saver process persists
* ``raw-write``   os.write of the same number of bytes + fsync: the disk's sequential bandwidth

The persist-throughput goal compares ftkit's background persist with raw write+fsync measured
side by side in the same worker process: ``--rounds`` rounds, each one ftkit save and four raw
writes of the same number of bytes to new files (order rotating), each preceded by the same
preparation (``sync``, drop the page cache when root, ``--settle`` seconds of pause); the
persist median is compared with the best of the three raw medians that write from the state's
memory (plain, evict, direct). The
stall is compared with an in-memory copy of the same tensors in ``--rounds`` more rounds,
alternating save and copy, warm (dropping the page cache right before a save evicts the code
pages it runs through). The raw writes:

* ``plain``: os.write of the state's tensors (the same memory a checkpoint writer reads) + fsync;
* ``evict``: the same with the early writeback + eviction of written-back pages that ftkit's
  buffered writer does, its fallback where a filesystem refuses O_DIRECT
  (``posix_fadvise(DONTNEED)`` every 64 MiB, reaching back 128 MiB). Without the eviction a
  write takes its whole size in fresh page-cache pages, which on a VM whose first touch of
  memory is slow (free page reporting: ~2 s/GiB measured) bounds it far below the disk;
* ``direct``: os.write with ``O_DIRECT`` (no page cache; the device reads the memory) from
  copies of the same tensors in transparent huge pages (2 MiB-aligned private mappings with
  ``MADV_HUGEPAGE``), as ftkit's writer does where the filesystem accepts it. Huge pages are
  the fastest source found: a device reads physically contiguous memory in large segments,
  and the same write from scattered 4 KiB pages ran up to 1.8x slower here
  (``benchmarks/direct_sources.py``). Whether the copies got huge pages is printed;
* ``cached``: as ``evict``, but from one 16 MiB buffer written over and over, as ``dd`` does.
  It stays in the CPU cache, so on a disk as fast as memory (this VM's, ~2.5 GB/s) it can beat
  a buffered writer of a state that lives in memory; its ratio is printed for reference, not as
  the goal.

A raw write measured elsewhere (another process, reusing the pages of a file it just deleted)
can be 5x faster or slower than one measured beside the persist.

plus resume times (torch.load, DCP load, ftkit load with CRC check), each from a cold page
cache (the same preparation: a resumed job, often on another node, reads from the disk); DCP
and ftkit load into the existing model and optimizer tensors, torch.load allocates. A requeued
job loads once, in a new process whose optimizer has no state yet: ``ftkit-async`` also times
that (``requeue_load``, a fresh process per load, beside the raw read), printed for reference,
not as the goal; and a steady training loop
(Adam steps) checkpointing every N steps with ftkit-async vs torch.save vs none. Goals, as ratios:
stall <= 1.25x copy; stall >= 5x smaller than torch.save+fsync at 1 GB; persist throughput
>= 0.8x raw write bandwidth; peak extra host memory <= 2x state size.

With ``--device cuda`` the state lives on the GPU. A stall is then timed until the GPU may go
on: ``save`` returns once the copies are queued on a side stream that the compute stream waits
for, so every stall (ftkit's and the copy's) ends with ``torch.cuda.synchronize()``. The raw
writes write from host copies of the tensors (the persist writes from host buffers too), made
after the peak memory was read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYER = 2048
DEVICE = "cpu"  # --device: where the state lives (the worker's)
BYTES_PER_LAYER = (LAYER * LAYER + LAYER) * 4 * 3  # weight + bias, times (param, exp_avg, exp_avg_sq)


# ---------------------------------------------------------------- worker side (one subprocess per variant)
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _huge_bytes() -> int:
    """Bytes of this process's memory in transparent huge pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _status("VmRSS")


def _sync() -> None:
    """Wait for the GPU's queued work (a stall ends when the GPU may go on)."""
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def _host_buffers(tensors) -> list:
    """Preallocated host buffers for ``tensors``: pinned for CUDA tensors (asynchronous copies)."""
    import torch

    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]


def _model(gb: float):
    """The benchmark's model of ``gb`` GB (with its Adam moments) and its optimizer, no step taken."""
    import torch

    torch.manual_seed(0)
    layers = max(1, round(gb * 1e9 / BYTES_PER_LAYER))
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)]).to(DEVICE)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _build(gb: float):
    import torch

    model, opt = _model(gb)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    _sync()
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, opt, nbytes


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _settle(settle_s: float) -> bool:
    """The same start for every timed write: dirty data flushed, page cache dropped (root
    only), then a pause so the kernel (and a VM's host) is done with the memory just freed.
    Returns whether the page cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        dropped = True
    except OSError:
        dropped = False
    time.sleep(settle_s)
    return dropped


_RAW_CHUNK = 16 << 20  # torch's _save writes one storage per call: 16 MiB for a 2048x2048 float32


_EVICT_EVERY = 64 << 20  # the raw "evict" write mirrors ftkit's HashingWriter writeback policy


def _raw_write(path: Path, nbytes: int, sources: list[memoryview], *, evict: bool = False,
               direct: bool = False) -> float:
    """Seconds to os.write ``nbytes`` to a new file in calls of at most 16 MiB and fsync it.

    The bytes come from ``sources`` in turn (cycled): one 16 MiB buffer, which stays in the CPU
    cache (``dd``-like), or the state's own tensors, read from memory as a checkpoint writer
    reads them. ``evict``: every 64 MiB, posix_fadvise(DONTNEED) from 128 MiB before the last
    such call to here. ``direct``: O_DIRECT (the sources must be page-aligned, with sizes in
    whole pages); the last block is written whole, then the file truncated to ``nbytes``."""
    t = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        done = advised = i = 0
        while done < nbytes:
            src = sources[i % len(sources)]
            i += 1
            off = 0
            while off < len(src) and done < nbytes:
                want = min(_RAW_CHUNK, len(src) - off, nbytes - done)
                if direct:
                    want = min(-(-want // 4096) * 4096, len(src) - off)
                n = os.write(fd, src[off : off + want])  # views: no copy
                off += n
                done += n
                if evict and done - advised >= _EVICT_EVERY:
                    start = max(0, advised - 2 * _EVICT_EVERY)
                    os.posix_fadvise(fd, start, done - start, os.POSIX_FADV_DONTNEED)
                    advised = done
        if done > nbytes:
            os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _huge_copy(src: memoryview) -> memoryview:
    """A copy of ``src`` in private memory on a 2 MiB boundary, advised into transparent huge
    pages (physically contiguous 2 MiB pieces where the kernel grants them)."""
    huge = 2 << 20
    m = mmap.mmap(-1, src.nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = memoryview(m)
    import numpy as np

    offset = -int(np.frombuffer(whole, dtype=np.uint8).ctypes.data) % huge
    with contextlib.suppress(OSError):
        m.madvise(mmap.MADV_HUGEPAGE, offset, src.nbytes - src.nbytes % huge)
    view = whole[offset : offset + src.nbytes]
    view[:] = src
    return view


def _direct_written(path: Path) -> bool:
    """Whether ftkit wrote ``path`` with O_DIRECT: its tensor records start on 4096-byte
    boundaries (torch's own alignment is 64)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        offsets = []
        for info in z.infolist():
            if "/data/" not in info.filename or info.file_size < 4096:
                continue
            f.seek(info.header_offset)
            head = f.read(30)
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            offsets.append(info.header_offset + 30 + name_len + extra_len)
    return bool(offsets) and all(o % 4096 == 0 for o in offsets)


_READ_CHUNK = 16 << 20  # the raw read's buffer: one 16 MiB request at a time, or four 4 MiB ones in
# flight (ftkit's reader keeps eight 2 MiB requests in flight: io/reader.py's CHUNK and DEPTH)


def _raw_read(files: list[Path], buf: memoryview, *, depth: int = 1) -> float:
    """Seconds to read ``files`` with O_DIRECT into one reused page-aligned 16 MiB buffer, as
    ``dd iflag=direct bs=16M`` does (``depth=1``), or with ``depth`` reads in flight on threads
    (``depth`` pieces of the buffer): the device's sequential read bandwidth, nothing kept."""
    from concurrent.futures import ThreadPoolExecutor

    piece = len(buf) // depth

    def read(fd: int, slot: int, off: int) -> int:
        return os.preadv(fd, [buf[slot * piece : (slot + 1) * piece]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        for path in files:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                offsets = range(0, os.fstat(fd).st_size, piece)
                if depth == 1:
                    for off in offsets:
                        read(fd, 0, off)
                else:
                    list(pool.map(read, [fd] * len(offsets), [i % depth for i in range(len(offsets))], offsets))
            finally:
                os.close(fd)
    return time.perf_counter() - t


def _load_rounds(load, files: list[Path], rounds: int, settle_s: float, *, comm: bool = False,
                 timed: bool = False) -> dict:
    """``rounds`` rounds of a cold load and of the raw cold reads of the same ``files`` (one
    sequential, one with 4 reads in flight), rotating order, each after ``_settle`` (sync, drop
    the page cache, pause): the same bytes from the same cold cache, side by side.

    ``comm`` (several ranks, ``torch.distributed`` initialised): rank 0 drops the cache, every rank loads,
    or reads its own ``files``, at the same time; a round's time is from a barrier before to a
    barrier after.

    ``timed``: ``load()`` times itself (a load in another process) and returns its seconds."""
    import torch.distributed as dist

    buf = _huge_copy(memoryview(bytes(_READ_CHUNK)))  # page-aligned, touched before timing
    times: dict[str, list[float]] = {"load": [], "read1": [], "read4": []}
    kinds = list(times)
    dropped = True  # before every timed read (rank 0 drops the host's page cache for all ranks)
    for i in range(rounds):
        for what in kinds[i % 3:] + kinds[: i % 3]:
            if not comm or dist.get_rank() == 0:
                dropped = _settle(settle_s) and dropped
            if comm:
                dist.barrier()
            t = time.perf_counter()
            took = None
            if what == "load":
                got = load()
                _sync()  # on a GPU: until the state is there, not until its copies are queued
                took = got if timed else None
            else:
                _raw_read(files, buf, depth=int(what[-1]))
            if comm:
                dist.barrier()
            times[what].append(took if took is not None else time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(f.stat().st_size for f in files)
    if comm:  # the bytes all ranks read
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, nbytes)
        nbytes = sum(parts)
    return {"load_s": med["load"], "load_runs": times["load"], "read_s": min(med["read1"], med["read4"]),
            "read1_runs": times["read1"], "read4_runs": times["read4"], "read_bytes": nbytes,
            "load_dropped_caches": dropped}


def requeue_load(gb: float, root: Path) -> dict:
    """A requeued job's resume, once, in this fresh process: the model built as ``_build`` builds
    it, its Adam optimizer without state (a new run's has none before its first step), then the
    newest checkpoint under ``root`` loaded. Its load time, and this process's age when the load
    began (interpreter, imports, building the model)."""
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager

    torch.set_num_threads(2)
    model, opt = _model(gb)
    _sync()
    age = time.time() - _process_start()
    t = time.perf_counter()
    step = make_manager(CheckpointConfig(root=root)).load({"model": model, "optimizer": opt})
    _sync()
    return {"load_s": time.perf_counter() - t, "age_s": age, "step": step}


def _process_start() -> float:
    """When this process started (epoch seconds), from /proc."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _fresh_loads(gb: float, root: Path, files: list[Path], rounds: int, settle_s: float) -> dict:
    """``rounds`` requeues (:func:`requeue_load`, each a new process), rotating with the raw cold
    reads of the same ``files`` (``_load_rounds``): the first load of a process, which the
    rounds of one process do not show (its staging buffers faulted in, code run for the first
    time), and a fresh optimizer's moments read into memory of their own."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, __file__, "--worker", "requeue-load", "--size", str(gb), "--dir", str(root),
            "--device", DEVICE]
    ages: list[float] = []

    def load() -> float:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        ages.append(got["age_s"])
        return got["load_s"]

    r = _load_rounds(load, files, rounds, settle_s, timed=True)
    return {"fresh_load_s": r["load_s"], "fresh_load_runs": r["load_runs"], "fresh_age_s": statistics.median(ages),
            "fresh_read_s": r["read_s"]}


def _files_under(path: Path) -> list[Path]:
    return sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())


def worker(variant: str, gb: float, work: Path, rounds: int = 5, settle_s: float = 3.0, load_rounds: int = 9) -> dict:
    import torch

    torch.set_num_threads(2)
    out: dict = {"variant": variant}
    chunk = memoryview(os.urandom(_RAW_CHUNK))  # incompressible, like the state
    if variant == "raw-write":
        nbytes = max(1, round(gb * 1e9 / BYTES_PER_LAYER)) * BYTES_PER_LAYER  # the state's size
        times = []
        for i in range(rounds):  # new files, kept like ftkit's checkpoints (keep_last=None)
            out["dropped_caches"] = _settle(settle_s)
            times.append(_raw_write(work / f"raw-{i}.bin", nbytes, [chunk]))
        out["persist_s"] = statistics.median(times)
        out["persist_runs"] = times
        out["bytes"] = nbytes
        return out
    model, opt, nbytes = _build(gb)
    out["bytes"] = nbytes
    state_dicts = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    base = _reset_peak()
    if variant == "copy":
        tensors = [t for t in _tensors(state_dicts())]
        bufs = _host_buffers(tensors)
        out["stall_s"] = statistics.median(_copy_times(bufs, tensors, 5))
    elif variant == "torch.save":
        path = work / "state.pt"
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        out["stall_s"] = out["persist_s"] = time.perf_counter() - t
        out["peak_extra"] = _status("VmHWM") - base
        out.update(_load_rounds(lambda: torch.load(path, weights_only=True), [path],
                                load_rounds, settle_s))
    elif variant in ("dcp", "dcp-async"):
        import torch.distributed.checkpoint as dcp

        path = work / "dcp"
        t = time.perf_counter()
        if variant == "dcp":
            dcp.save(state_dicts(), checkpoint_id=path, no_dist=True)
            _sync()
            out["stall_s"] = time.perf_counter() - t
        else:
            fut = dcp.async_save(state_dicts(), checkpoint_id=path, no_dist=True)
            _sync()
            out["stall_s"] = time.perf_counter() - t
            fut.result()
        _fsync_tree(path)  # FileSystemWriter fsyncs its files; the tree fsync makes it comparable
        out["persist_s"] = time.perf_counter() - t
        out["peak_extra"] = _status("VmHWM") - base
        target = state_dicts()
        out.update(_load_rounds(lambda: dcp.load(target, checkpoint_id=path, no_dist=True),
                                _files_under(path), load_rounds, settle_s))
    elif variant in ("ftkit-async", "ftkit-shm"):
        from ftkit.checkpoint import CheckpointConfig, make_manager
        from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
        from ftkit.checkpoint.io.files import CRC_IMPL

        out["crc"] = CRC_IMPL  # which CRC-32 implementation the persist ran with
        # keep_last=None: deleting the previous checkpoint is retention, not the persist
        cfg = CheckpointConfig(root=work / "ck", keep_last=None)
        state = {"model": model, "optimizer": opt}
        mgr = AsyncCheckpointer(cfg, async_config=AsyncConfig(crash_safe=variant == "ftkit-shm"))
        try:
            stalls, persists, copies = [], [], []
            raws: dict[str, list[float]] = {"plain": [], "evict": [], "direct": [], "cached": []}
            raw_bytes = 0
            step = 1  # allocates the buffers: not timed
            t = time.perf_counter()
            mgr.save(step, state)
            _sync()
            out["first_stall_s"] = time.perf_counter() - t
            mgr.wait()
            out["peak_extra"] = _status("VmHWM") - base
            # the raw writes' source: the state's tensors (as large as the snapshot ftkit writes);
            # on a GPU, host copies of them (made after the peak was read: they are the benchmark's)
            memory = [memoryview(x.cpu().numpy()).cast("B") for x in _tensors(state_dicts())
                      if x.numel() * x.element_size() >= 1 << 20]
            out["direct_io"] = _direct_written(work / "ck" / f"step-{step:08d}" / "rank-00000.pt")
            # the O_DIRECT raw write's source: copies of the same tensors in huge pages (allocated
            # after the peak was read: they are the benchmark's, not ftkit's)
            huge_before = _huge_bytes()
            aligned = [_huge_copy(m) for m in memory]
            out["raw_direct_huge"] = (_huge_bytes() - huge_before) / sum(m.nbytes for m in memory)
            # Persist rounds: (persist, plain raw, evict raw, direct raw, cached raw) in rotating
            # order, each after the same preparation (sync, dropped page cache, pause).
            kinds = ["persist", "plain", "evict", "direct", "cached"]
            for i in range(rounds):
                for what in kinds[i % 5:] + kinds[: i % 5]:
                    out["dropped_caches"] = _settle(settle_s)
                    if what != "persist":
                        path = work / f"raw-{what}-{i}.bin"
                        source = {"cached": [chunk], "direct": aligned}.get(what, memory)
                        raws[what].append(_raw_write(path, raw_bytes, source, evict=what == "evict" or what == "cached",
                                                     direct=what == "direct"))
                        path.unlink()  # not timed; 3 GB x 4 writes x rounds would fill the disk
                        continue
                    step += 1
                    mgr.save(step, state)
                    mgr.wait()
                    # the background worker's own time from snapshot handed over to durable
                    persists.append(mgr.last_persist_seconds)
                    # the raw writes write exactly the bytes ftkit wrote (state file, manifest, ...)
                    raw_bytes = sum(p.stat().st_size for p in (work / "ck" / f"step-{step:08d}").rglob("*")
                                    if p.is_file())
                    _prune(work / "ck", step)
            # Stall rounds: a save (then wait until durable) and a plain copy of the same
            # tensors into preallocated buffers, alternating, warm: no dropped caches, which
            # would evict the code pages a save runs through and time the disk, not the stall.
            tensors = list(_tensors(state_dicts()))
            bufs = _host_buffers(tensors)
            _copy_times(bufs, tensors, 1)  # first touch of the buffers: not timed
            for i in range(rounds):
                for what in ("copy", "save") if i % 2 else ("save", "copy"):
                    if what == "copy":
                        copies += _copy_times(bufs, tensors, 1)
                        continue
                    step += 1
                    t = time.perf_counter()
                    mgr.save(step, state)
                    _sync()
                    stalls.append(time.perf_counter() - t)
                    mgr.wait()
                    _prune(work / "ck", step)
            del bufs, tensors, memory, aligned
            out["stall_s"] = statistics.median(stalls)
            out["copy_here_s"] = statistics.median(copies)
            out["persist_s"] = statistics.median(persists)
            out["persist_runs"] = persists
            for what, times in raws.items():
                out[f"raw_{what}_s"] = statistics.median(times)
                out[f"raw_{what}_runs"] = times
            out["raw_bytes"] = raw_bytes
            # the load reads the newest of two, as a job's resume does once it has saved twice
            # (keep_last=3 by default): with an older one to fall back on, it reads straight
            # into the live tensors; the only checkpoint is timed too (read into them as well,
            # what it overwrites set aside for an undo should it turn out corrupt)
            step += 1
            mgr.save(step, state)
            mgr.wait()
        finally:
            mgr.close()
        last = 2 + 2 * rounds
        _prune(work / "ck", last, keep=2)

        def load() -> None:
            assert make_manager(cfg).load(state) == last

        files = _files_under(work / "ck" / f"step-{last:08d}")
        out.update(_load_rounds(load, files, load_rounds, settle_s))
        if variant == "ftkit-async":
            out.update(_fresh_loads(gb, work / "ck", files, min(rounds, 3), settle_s))
        _prune(work / "ck", last)
        only = _load_rounds(load, files, load_rounds, settle_s)
        out["load_only_s"], out["load_only_runs"], out["read_only_s"] = only["load_s"], only["load_runs"], only["read_s"]
    elif variant == "loop":
        out.update(_loop(model, opt, work))
    if variant == "copy":
        out["peak_extra"] = _status("VmHWM") - base
    return out


def worker_2ranks(variant: str, gb: float, work: Path, rounds: int, settle_s: float) -> dict:
    """One of two ranks (gloo on 127.0.0.1) holding half of the state each, as shards: each
    rank's layers have names of their own, so DCP writes each rank's tensors to that rank's
    file and each rank reads back only its own (a sharded checkpoint, without FSDP on a CPU).
    ``ftkit-dcp2``: ftkit's Checkpointer with world_size=2 (state files + DCP + manifest);
    ``dcp2``: plain ``dcp.save``/``dcp.load``. The raw read: each rank its own files at once
    (``rank-R.pt`` and ``dcp/__R_*.distcp``; rank 0 also the rest), as the load needs them.
    ``ftkit-ddp2`` and ``ddp2``: the same, but each rank holds the whole state, the same on both
    (a DDP job's): DCP stores each tensor once, about half in each rank's file, and each rank
    loads both; its raw read is then every ``.distcp`` file too."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    replicated = variant in ("ftkit-ddp2", "ddp2")
    torch.manual_seed(0 if replicated else rank)
    layers = max(1, round(gb * 1e9 / BYTES_PER_LAYER / (1 if replicated else 2)))
    model = torch.nn.ModuleDict({f"l{i}" if replicated else f"r{rank}_{i}": torch.nn.Linear(LAYER, LAYER)
                                 for i in range(layers)})
    model.to(DEVICE)  # --device cuda: both ranks' state on the one GPU
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = {"model": model, "optimizer": opt}
    out: dict = {"variant": variant, "bytes": (1 if replicated else 2) * sum(p.numel() * 4 * 3 for p in model.parameters())}

    def mine(step_dir: Path) -> list[Path]:
        every = _files_under(step_dir)
        own = [p for p in every if p.name == f"rank-{rank:05d}.pt" or p.name.startswith("__" if replicated else f"__{rank}_")]
        if rank == 0:  # the rest (.metadata, manifest.json)
            own += [p for p in every if not p.name.startswith(("rank-", "__"))]
        return own

    if variant in ("ftkit-dcp2", "ftkit-ddp2"):
        from ftkit.checkpoint import CheckpointConfig, make_manager

        cfg = CheckpointConfig(root=work / "ck", keep_last=None)
        saver = make_manager(cfg, rank=rank, world_size=2)
        saver.save(1, state)  # the older one to fall back on, as a job has once it saved twice
        saver.save(2, state)

        def load() -> None:
            assert make_manager(cfg, rank=rank, world_size=2).load(state) == 2

        files = mine(work / "ck" / "step-00000002")
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = work / "dcp"
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        dist.barrier()

        def load() -> None:
            target_m, target_o = get_state_dict(model, opt)
            dcp.load({"model": target_m, "optim": target_o}, checkpoint_id=path)

        files = mine(path)
    out.update(_load_rounds(load, files, rounds, settle_s, comm=True))
    if variant == "ftkit-dcp2":  # the job's only checkpoint: nothing older to fall back on
        dist.barrier()
        if rank == 0:
            _prune(work / "ck", 2)
        dist.barrier()
        only = _load_rounds(load, files, rounds, settle_s, comm=True)
        out["load_only_s"], out["load_only_runs"], out["read_only_s"] = only["load_s"], only["load_runs"], only["read_s"]
    dist.barrier()
    return out


def _prune(root: Path, newest: int, keep: int = 1) -> None:
    """Delete every checkpoint but ``newest`` and the ``keep - 1`` steps before it (outside the
    timings: retention is not the persist, and the saver runs with keep_last=None so that no
    deletion overlaps a timed persist)."""
    kept = {f"step-{newest - i:08d}" for i in range(keep)}
    for d in root.glob("step-*"):
        if d.name not in kept:
            shutil.rmtree(d)


def _copy_times(bufs, tensors, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for b, s in zip(bufs, tensors, strict=True):
            b.copy_(s, non_blocking=True)  # asynchronous only from a GPU into pinned memory
        _sync()
        times.append(time.perf_counter() - t)
    return times


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _loop(model, opt, work: Path, rounds: int = 3) -> dict:
    """A steady loop of Adam steps checkpointing every N steps: ftkit-async vs torch.save vs none.

    N is chosen so that the steps between two checkpoints take about twice as long as one
    persist (a real run checkpoints every few minutes, not faster than its disk can write);
    with a shorter interval every loop is bound by the disk, async or not. A loop is two
    intervals, with the saves in their middle (steady state: a persist overlaps the steps after
    it; a loop ending on a save would time one persist whole). ``rounds`` rounds of
    the three loops in rotating order; medians. The worker runs with glibc's malloc kept from
    returning freed memory to the kernel (``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_``;
    see ``run_variant``): Adam's full-size temporaries are then reused from step to step, as
    CUDA's caching allocator reuses them on a GPU, instead of being first touched again every
    step, which on this VM costs ~2 s/GiB and swamps what is measured. The steps use all cores
    but one: on a GPU node the step runs on the GPU and the host's cores are mostly idle, while
    here a step on every core would leave the background persist nothing but the step's own
    CPU time, and only measure how a CPU is shared.
    """
    import torch

    from ftkit.checkpoint import CheckpointConfig
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig

    state = {"model": model, "optimizer": opt}
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core for the background

    def run(save, steps: int, every: int, first: int = 1) -> float:
        t = time.perf_counter()
        for step in range(first, first + steps):
            opt.step()
            if save is not None and step % every == every // 2:
                save(step)
        _sync()
        return time.perf_counter() - t

    step_s = run(None, 3, 1) / 3  # warm-up and step time
    mgr = AsyncCheckpointer(CheckpointConfig(root=work / "loop", keep_last=1), async_config=AsyncConfig())

    def sync_save(step: int) -> None:
        with open(work / "loop.pt", "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    times: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    try:
        t = time.perf_counter()
        mgr.save(0, state)  # allocates the buffers outside the timed loops (a run does it once)
        mgr.wait()
        persist_s = time.perf_counter() - t
        every = max(2, int(2 * persist_s / step_s) + 1)
        steps = 2 * every
        kinds = list(times)
        for i in range(rounds):
            for what in kinds[i % 3:] + kinds[: i % 3]:
                first = 1 + i * steps  # new step numbers every round: each save is a new checkpoint
                if what == "none":
                    times[what].append(run(None, steps, every, first))
                elif what == "sync":
                    times[what].append(run(sync_save, steps, every, first))
                else:
                    t = time.perf_counter()
                    run(lambda s: mgr.save(s, state), steps, every, first)
                    mgr.wait()  # the last checkpoint is durable before the loop counts as done
                    times[what].append(time.perf_counter() - t)
    finally:
        mgr.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"loop_base_s": med["none"], "loop_async_s": med["async"], "loop_sync_s": med["sync"],
            "loop_runs": times, "loop_steps": steps, "loop_every": every, "loop_step_s": step_s}


# ---------------------------------------------------------------- driver
VARIANTS = ["raw-write", "copy", "torch.save", "dcp", "dcp-async", "ftkit-async", "ftkit-shm", "ftkit-dcp2", "dcp2",
            "ftkit-ddp2", "ddp2", "loop"]
TWO_RANKS = ("ftkit-dcp2", "dcp2", "ftkit-ddp2", "ddp2")


def run_variant(variant: str, gb: float, base_dir: Path, rounds: int, settle_s: float, device: str = "cpu",
                load_rounds: int = 9) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ckspeed-{variant}-", dir=base_dir))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if variant == "loop":  # freed memory stays in the heap for the next step (see _loop)
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    argv = [sys.executable, __file__, "--worker", variant, "--size", str(gb), "--dir", str(work),
            "--rounds", str(rounds), "--load-rounds", str(load_rounds), "--settle", str(settle_s), "--device", device]
    ranks = 2 if variant in TWO_RANKS else 1
    if ranks > 1:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        env.update(WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, RANK=str(r))) for r in range(ranks)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
        for p, (stdout, stderr) in zip(procs, outs, strict=True):
            if p.returncode != 0:
                return {"variant": variant, "error": (stderr or stdout).strip().splitlines()[-1:]}
        return json.loads(outs[0][0].strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def _runs(times: list[float]) -> str:
    return " ".join(f"{t:.2f}s" for t in times)


def _fmt(x, unit="s"):
    return "-" if x is None else (f"{x:.3f}{unit}" if unit == "s" else f"{x:.2f}{unit}")


def report(gb: float, res: dict[str, dict]) -> list[dict]:
    # the state's bytes: the copy's, or any variant's (a run of some --variants only)
    size = next((r["bytes"] for v in ("copy", *res) if (r := res.get(v, {})).get("bytes")), 1)
    gib = size / 2**30
    print(f"\n=== state {gb} GB ({size / 1e9:.2f} GB of tensors) ===")
    print(f"{'variant':<12} {'stall':>9} {'persist':>9} {'MB/s':>8} {'load':>8} {'peak extra':>11}")
    for v in VARIANTS[:-1]:
        r = res.get(v, {})
        if "error" in r:
            print(f"{v:<12} ERROR {r['error']}")
            continue
        bw = size / r["persist_s"] / 1e6 if r.get("persist_s") else None
        peak = r.get("peak_extra")
        print(f"{v:<12} {_fmt(r.get('stall_s')):>9} {_fmt(r.get('persist_s')):>9} {_fmt(bw, ''):>8} "
              f"{_fmt(r.get('load_s')):>8} {'-' if peak is None else f'{peak / 2**30:.2f}GiB':>11}")
    a, c, ts, shm = (res.get(k, {}) for k in ("ftkit-async", "copy", "torch.save", "ftkit-shm"))
    if "first_stall_s" in a:
        print(f"ftkit-async first save (allocates buffers): stall {a['first_stall_s']:.3f}s; "
              f"ftkit-shm first save {shm.get('first_stall_s', float('nan')):.3f}s")
    lp = res.get("loop", {})
    if "loop_base_s" in lp:
        print(f"loop of {lp['loop_steps']} Adam steps ({lp['loop_step_s']:.3f}s each), checkpoint every "
              f"{lp['loop_every']}, medians of {len(lp['loop_runs']['none'])} rounds: none {lp['loop_base_s']:.2f}s, "
              f"ftkit-async {lp['loop_async_s']:.2f}s (+{(lp['loop_async_s'] / lp['loop_base_s'] - 1) * 100:.0f}%), "
              f"torch.save+fsync {lp['loop_sync_s']:.2f}s (+{(lp['loop_sync_s'] / lp['loop_base_s'] - 1) * 100:.0f}%)")
    goals = []

    def goal(name: str, ratio: float | None, ok: bool | None) -> None:
        if ratio is None:
            return
        goals.append({"size_gb": gb, "goal": name, "ratio": round(ratio, 3), "pass": bool(ok)})
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {ratio:.2f}")

    for name, r in (("ftkit-async", a), ("ftkit-shm", shm)):
        limit = r.get("copy_here_s") or c.get("stall_s")
        if "stall_s" in r and limit:
            q = r["stall_s"] / limit
            goal(f"{name} stall / in-memory copy in the same process (<= 1.25)", q, q <= 1.25)
        if "persist_s" in r and "raw_plain_s" in r:
            # same bytes, same process, rotating order, same preparation: medians against the
            # better raw writer
            q = min(r["raw_plain_s"], r["raw_evict_s"], r.get("raw_direct_s", float("inf"))) / r["persist_s"]
            mb = r["raw_bytes"] / 1e6
            print(f"  {name} vs raw write+fsync of {mb:.0f} MB, side by side, {len(r['persist_runs'])} rounds, "
                  f"caches {'dropped' if r.get('dropped_caches') else 'kept'}, CRC-32 by {r.get('crc', '?')}, "
                  f"persist {'with' if r.get('direct_io') else 'without'} O_DIRECT; medians (runs):")
            for label, key in (("persist", "persist"), ("raw plain", "raw_plain"), ("raw evict", "raw_evict"),
                               ("raw direct", "raw_direct"), ("raw cached", "raw_cached")):
                if key + "_s" in r:
                    print(f"    {label:<10} {mb / r[key + '_s']:6.0f} MB/s ({_runs(r[key + '_runs'])})")
            print(f"  (for reference: persist / raw cached, the dd-like write from one 16 MiB buffer: "
                  f"{r['raw_cached_s'] / r['persist_s']:.2f}; raw direct's source in huge pages: "
                  f"{r.get('raw_direct_huge', 0) * 100:.0f}%)")
            goal(f"{name} persist throughput / best raw write+fsync from memory, side by side (>= 0.8)", q, q >= 0.8)
        if "peak_extra" in r:
            q = r["peak_extra"] / size
            goal(f"{name} peak extra host memory / state size (<= 2)", q, q <= 2)
    _report_loads(res, goal)
    if abs(gb - 1) < 1e-9 and "stall_s" in a and "stall_s" in ts:
        q = ts["stall_s"] / a["stall_s"]
        goal("torch.save+fsync stall / ftkit-async stall at 1 GB (>= 5)", q, q >= 5)
    _ = gib
    return goals


def _report_loads(res: dict[str, dict], goal) -> None:
    """Cold resume: each load against the raw cold read of the same files in the same process."""
    rows = [(v, res[v]) for v in ("torch.save", "dcp", "ftkit-async", "ftkit-shm", "ftkit-dcp2", "dcp2", "ftkit-ddp2", "ddp2")
            if "load_runs" in res.get(v, {})]
    if not rows:
        return
    cold = all(r.get("load_dropped_caches") for _, r in rows)
    print("  cold resume, side by side with an O_DIRECT read of the same files (one 16 MiB read at a time, or "
          "four 4 MiB ones in flight), " + ("caches dropped before each" if cold else
                                           "CACHES NOT DROPPED (run as root): warm loads, no goal is met") +
          "; medians (runs):")
    for v, r in rows:
        mb = r["read_bytes"] / 1e6
        print(f"    {v:<11} load {r['load_s']:.3f}s ({_runs(r['load_runs'])}) = {mb / r['load_s']:5.0f} MB/s; "
              f"raw read {mb / r['read_s']:5.0f} MB/s (1: {_runs(r['read1_runs'])}; 4: {_runs(r['read4_runs'])}); "
              f"load / read {r['read_s'] / r['load_s']:.2f}")
    r = res.get("ftkit-async", {})
    if "fresh_load_s" in r:  # a requeue: the one load of a new process, the optimizer without state
        print(f"    ftkit-async, first load in a fresh process (a requeued job; its optimizer has no state yet, "
              f"the process was {r['fresh_age_s']:.1f}s old): load {r['fresh_load_s']:.3f}s "
              f"({_runs(r['fresh_load_runs'])}); load / read {r['fresh_read_s'] / r['fresh_load_s']:.2f}")
    if "load_only_s" in r:  # the job's first checkpoint: into the live tensors, what it overwrites set aside
        print(f"    ftkit-async, its only checkpoint (nothing older to fall back on): load {r['load_only_s']:.3f}s "
              f"({_runs(r['load_only_runs'])}); load / read {r['read_only_s'] / r['load_only_s']:.2f}")
    r = res.get("ftkit-dcp2", {})
    if "load_only_s" in r:
        print(f"    ftkit-dcp2, its only checkpoint (nothing older to fall back on): load {r['load_only_s']:.3f}s "
              f"({_runs(r['load_only_runs'])}); load / read {r['read_only_s'] / r['load_only_s']:.2f}")
    for name, others in (("ftkit-async", ("torch.save", "dcp")), ("ftkit-dcp2", ("dcp2",)), ("ftkit-ddp2", ("ddp2",))):
        r = res.get(name, {})
        if "load_runs" not in r:
            continue
        warm = "" if cold else " [caches not dropped: not judged]"
        q = r["read_s"] / r["load_s"]
        goal(f"{name} cold load / raw cold read of the same bytes, side by side (>= 0.8){warm}", q, cold and q >= 0.8)
        for other in others:
            o = res.get(other, {})
            if "load_s" in o:
                q = o["load_s"] / r["load_s"]
                goal(f"{other} load time / {name} load time (> 1: ftkit faster){warm}", q, cold and q > 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.25,1,3", help="state sizes in GB, comma-separated")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory on the disk to measure (same disk as the job dir)")
    ap.add_argument("--json", help="also write every measurement and goal to this file")
    ap.add_argument("--loop-max-gb", type=float, default=1.0, help="run the training-loop overhead measurement up to this size")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed persists and raw writes per variant (medians); default 15 below 1 GB, "
                         "where single writes of a tenth of a second vary by +-20%% here, else 7")
    ap.add_argument("--load-rounds", type=int, default=9,
                    help="cold loads per variant, each beside two raw reads (medians): a single cold read "
                         "varies by about +-15%% here, so five rounds put a ratio anywhere in about +-0.13")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds of pause after sync + drop caches before each timed persist or raw write")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the state lives (cuda: the GPU; snapshots go to pinned host memory)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=float, help=argparse.SUPPRESS)
    # CxD: the reader's requests C MiB, D in flight, in every worker (benchmarks/read_shape.py)
    ap.add_argument("--read-shape", help=argparse.SUPPRESS)
    # a GPU load's staging (ftkit.checkpoint.io.device.STAGING) in every worker: pinned, registered
    ap.add_argument("--staging", choices=["pinned", "registered"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.read_shape:
        os.environ["FTKIT_BENCH_READ_SHAPE"] = args.read_shape  # the workers' environment
    if args.worker and os.environ.get("FTKIT_BENCH_READ_SHAPE"):
        from read_shape import parse_shape, set_shape

        set_shape(*parse_shape(os.environ["FTKIT_BENCH_READ_SHAPE"]))
    if args.staging:
        os.environ["FTKIT_BENCH_STAGING"] = args.staging
    args.staging = os.environ.get("FTKIT_BENCH_STAGING") or None  # the workers' (one inherited too)
    if args.worker and os.environ.get("FTKIT_BENCH_STAGING"):
        from ftkit.checkpoint.io import device as _device

        _device.STAGING = os.environ["FTKIT_BENCH_STAGING"]
    if args.worker in TWO_RANKS:
        res = worker_2ranks(args.worker, args.size, Path(args.dir), args.load_rounds, args.settle)
        print(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)  # gloo objects torn down at interpreter exit can abort the process
    if args.worker == "requeue-load":
        print(json.dumps(requeue_load(args.size, Path(args.dir))))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.size, Path(args.dir), args.rounds or 7, args.settle, args.load_rounds)))
        return 0
    base_dir = Path(args.dir)
    base_dir.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    variants = args.variants.split(",")
    gpu = ""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device here")
        gpu = f", state on {torch.cuda.get_device_name()} (torch {torch.__version__})"
    shape = f", reader requests {args.read_shape} (MiB x in flight)" if args.read_shape else ""
    shape += f", GPU load staging {args.staging}" if args.staging else ""
    print(f"checkpoint_speed: sizes {sizes} GB, scratch {base_dir}, {os.cpu_count()} CPUs{gpu}{shape}")
    results: dict = {}
    goals: list[dict] = []
    for gb in sizes:
        rounds = args.rounds or (15 if gb < 1 else 7)
        res = {v: run_variant(v, gb, base_dir, rounds, args.settle, args.device, args.load_rounds)
               for v in variants if v != "loop" or gb <= args.loop_max_gb}
        results[str(gb)] = res
        goals += report(gb, res)
    failed = [g for g in goals if not g["pass"]]
    print(f"\n{len(goals) - len(failed)}/{len(goals)} goals met")
    if args.json:
        # read_shape, staging: None where the reader ran with its own CHUNK x DEPTH and staging
        Path(args.json).write_text(json.dumps({"device": args.device, "read_shape": args.read_shape,
                                                "staging": args.staging,
                                                "results": results, "goals": goals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
