"""A cold load's request shape: ftkit's reader with other request sizes and depths, side by side.

    python benchmarks/read_shape.py [--gb 1] [--device cpu|cuda] [--shapes 2x16,4x8,8x4,8x8,16x2]
                                    [--staging pinned,registered] [--rounds 5] [--settle 0.5] [--dir DIR]

The reader (:mod:`ftkit.checkpoint.io.reader`) reads a file in ``CHUNK``-byte requests,
``DEPTH`` of them in flight. ``2x8`` (2 MiB, eight) is the default, chosen on a VM whose disk
completes the reads in flight together; another disk (a cloud VM's virtio, an NVMe, a parallel
filesystem) may stream better with larger requests. This script times, in one process, cold
loads (``Checkpointer.load`` of the newest of two checkpoints, state files, the state on
``--device``) with each shape ``CxD`` (C MiB, D in flight, twice that of staging) or ``CxD:S``
(S MiB of staging; the module constants set for the measurement only), rotating with the raw ``O_DIRECT`` read of the same file (one 16 MiB request at a
time, or four 4 MiB ones in flight, as ``checkpoint_speed.py`` reads), each after ``sync``, dropping the
page cache (root) and ``--settle`` seconds of pause. Prints each shape's median load and its
ratio to the faster raw read's median.

With ``--device cuda`` the reader reads into pinned staging, where on a CPU it reads into huge
pages; the same raw reads into a buffer from torch's pinned allocator (``pinned 1``, ``pinned 4``)
are timed too, to tell a slower read into pinned memory from the copies' cost. ``--staging``
(``--device cuda`` only) times each shape with each kind of staging (``io.device.STAGING``):
torch's pinned allocator (``pinned``, the default) and huge pages registered with CUDA
(``registered``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoint_speed as cs  # the same model, raw read and preparation

MIB = 1 << 20


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"8x4"`` -> (8 MiB, 4 in flight, the reader's staging: twice that);
    ``"8x4:64"`` -> the same with 64 MiB of staging."""
    shape, _, staging = text.partition(":")
    chunk, _, depth = shape.partition("x")
    chunk_b, depth_n = int(chunk) * MIB, int(depth)
    return chunk_b, depth_n, int(staging) * MIB if staging else 2 * chunk_b * depth_n


def set_shape(chunk: int, depth: int, staging: int | None = None) -> None:
    """The reader's request size, depth and staging (default: twice what is in flight, as the
    reader's own), in every module that holds them (for a measurement)."""
    from ftkit.checkpoint import dcp_reader
    from ftkit.checkpoint.io import reader, statefile

    for mod in (reader, statefile, dcp_reader):
        mod.CHUNK = chunk
        mod.STAGING = staging or 2 * chunk * depth
    reader.DEPTH = depth
    reader.SUB = min(chunk, 2 * MIB)  # each part still in the CPU cache when placed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB (model + Adam moments)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the live state is")
    ap.add_argument("--shapes", default="2x16,4x8,8x4,8x8,16x2", help="CxD: C MiB requests, D in flight")
    ap.add_argument("--staging", default="pinned", help="GPU staging kinds, comma-separated: pinned, registered")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    stagings = [k for k in args.staging.split(",") if k]
    if not stagings or not set(stagings) <= {"pinned", "registered"}:
        ap.error(f"--staging {args.staging}: pinned, registered or both")
    if args.device != "cuda" and stagings != ["pinned"]:
        ap.error("--staging is for --device cuda: a load onto the CPU stages in huge pages")
    cs.DEVICE = args.device
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.checkpoint.io import device as _device

    torch.set_num_threads(2)
    model, opt, _ = cs._build(args.gb)
    state = {"model": model, "optimizer": opt}
    work = Path(tempfile.mkdtemp(prefix="read-shape-", dir=args.dir))
    cfg = CheckpointConfig(root=work / "ck", keep_last=None)
    mgr = make_manager(cfg)
    mgr.save(1, state)  # an older one to fall back on: the newest is read straight in
    mgr.save(2, state)
    files = cs._files_under(work / "ck" / "step-00000002")
    size = sum(f.stat().st_size for f in files)
    buf = cs._huge_copy(memoryview(bytes(cs._READ_CHUNK)))
    shapes = [s for s in args.shapes.split(",") if s]
    loads = {(f"{s}/{k}" if len(stagings) > 1 else s): (s, k) for s in shapes for k in stagings}
    pinned = None
    if args.device == "cuda":  # the raw read into pinned memory too, page-aligned, as the staging
        block = torch.empty(cs._READ_CHUNK + 4096, dtype=torch.uint8, pin_memory=True)
        start = -block.data_ptr() % 4096
        pinned = block.numpy().data.cast("B")[start : start + cs._READ_CHUNK]
    kinds = [*loads, "raw1", "raw4", *(["pinned1", "pinned4"] if pinned is not None else [])]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    set_shape(*parse_shape(shapes[0]))
    for staging in stagings:  # warm: code paths, staging, pinned pool, registered block
        _device.STAGING = staging
        assert make_manager(cfg).load(state) == 2
    for i in range(args.rounds):
        for what in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
            if what.startswith(("raw", "pinned")):
                cs._settle(args.settle)
                times[what].append(cs._raw_read(files, buf if what.startswith("raw") else pinned, depth=int(what[-1])))
                continue
            shape, _device.STAGING = loads[what]
            set_shape(*parse_shape(shape))
            cs._settle(args.settle)
            t = time.perf_counter()
            assert make_manager(cfg).load(state) == 2
            cs._sync()
            times[what].append(time.perf_counter() - t)
    raw = min(statistics.median(times["raw1"]), statistics.median(times["raw4"]))
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"read_shape: {size / 1e9:.2f} GB of state files, state on {dev}, {args.rounds} cold rounds each, "
          f"{os.cpu_count()} CPUs; raw read {size / raw / 1e6:.0f} MB/s "
          f"(1: {' '.join(f'{t:.3f}' for t in times['raw1'])}; 4: {' '.join(f'{t:.3f}' for t in times['raw4'])})")
    if pinned is not None:
        for depth in "14":
            med = statistics.median(times[f"pinned{depth}"])
            print(f"  raw read into pinned memory, {depth} in flight: {med:.3f}s  "
                  f"({' '.join(f'{t:.3f}' for t in times[f'pinned{depth}'])})  {size / med / 1e6:5.0f} MB/s, "
                  f"{raw / med:.2f} of the raw read into huge pages")
    if "registered" in stagings and _device._Registered._refused:
        print(f"  registered staging was refused ({_device._Registered._refused}): those loads staged in pinned memory")
    for s in loads:
        med = statistics.median(times[s])
        print(f"  {s:>5}  load {med:.3f}s  ({' '.join(f'{t:.3f}' for t in times[s])})  "
              f"{size / med / 1e6:5.0f} MB/s  load / raw read {raw / med:.2f}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
