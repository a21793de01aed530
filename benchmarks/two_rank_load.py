"""Where a two-rank DCP load's time goes: ftkit's load side by side with the raw read of the
same files, and with ftkit's reader alone, each rank's steps timed.

    python benchmarks/two_rank_load.py [--gb 0.25] [--rounds 15] [--dir /tmp] [--timeline] [--fresh 5] [--replicated]

``checkpoint_speed.py``'s two-rank cell (``ftkit-dcp2``) in one process per rank (gloo on
127.0.0.1), without the rest of its run: both ranks save the same sharded state twice (each
rank's layers its own, so each rank reads back only its own DCP file), then, rotating, each
after ``sync`` and dropping the page cache (root):

* ``raw``: each rank reads its own files (its state file, its DCP file; rank 0 also
  ``.metadata`` and the manifest) with ``O_DIRECT``, one 16 MiB request at a time, both ranks at
  once: the benchmark's reference;
* ``reader``: the same files through ftkit's reader (:func:`ftkit.checkpoint.io.reader.check_file`:
  its staging, reads in flight and CRC-32s, nothing placed);
* ``load``: a new manager's ``load`` of the newest checkpoint (the older one to fall back on),
  as a requeued job's, into the live model and optimizer.

Prints the median of each (the first round of each left out) and raw / each, as the goal
(load / raw read >= 0.8) counts it. ``--timeline``: also the median start and end (ms after
the load began) of the manager's and the DCP reader's steps on each rank, which shows what
the load waits for (listing, manifests, the agreement, the small reads, DCP's plan, the bulk
read, the agreement after it), and the all-reduces (``dist.all_reduce``: how many, and how
long each took after the last rank reached it). ``--device``: also what the disk did in
each kind's rounds, from the kernel's block-layer trace (tracefs, root): when the first read
and the first bulk read (1 MiB or more) went to the device, when the last one completed, how
long the device had a read in flight and at what rate, where it had none (gaps over 0.15 ms
inside the reads), and how long the round went on after its last read.

``--fresh N``: then N loads as a requeued job makes them, each by a new pair of processes
(two new ranks, a new model and a fresh Adam: no moments until the load), side by side with
the raw read of the same files by the same processes (each after dropping the page cache,
the raw read first: its buffer is its own). A requeued job's load is the first of its
process: the memory it reads through (staging, the optimizer's moments) is fresh, where
the rounds above reuse what the first one faulted in. With ``--timeline``, these loads'
steps too.

``--replicated``: each rank holds the whole model and optimizer (``--gb`` of them), as a DDP
job's ranks do. DCP stores each tensor once, about half in each rank's file, and each rank
loads both files; ``raw`` and ``reader`` then read every file on each rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# the steps timed with --timeline: (module, attribute) of functions and methods, by label
_STEPS = {
    "ftkit.checkpoint.manager": ["list_step_dirs", "validate_dir", "read_state_bytes", "parse_state_file",
                                 "Checkpointer._check_here", "Checkpointer._start_read", "Checkpointer._early_problem", "Checkpointer._agree",
                                 "Checkpointer._try_load", "Checkpointer._common", "Checkpointer._agree_read"],
    "ftkit.checkpoint.comm": ["Comm.most"],
    "ftkit.checkpoint.dcp": ["fresh_state", "live_state_dicts", "_set"],
    "ftkit.checkpoint.dcp_reader": ["StreamingReader.prefetch", "StreamingReader.read_data"],
    "torch.distributed.checkpoint": ["load"],  # DCP's load (its planning, then read_data)
    "torch.distributed": ["all_reduce"],  # ftkit's agreements (its _collective calls it by name)
}
_TRACE = Path("/sys/kernel/tracing")
_BLOCK_EVENTS = ("block_rq_issue", "block_rq_complete")


def _timed(record: list[tuple[str, float, float]], clock: list[float]) -> None:
    """Wrap every step of :data:`_STEPS` to append ``(label, start, end)`` (ms after ``clock[0]``)."""
    import importlib

    for module_name, names in _STEPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            owner, _, attr = name.rpartition(".")
            holder = getattr(module, owner) if owner else module
            fn = getattr(holder, attr, None)
            if fn is None:  # renamed since: timed no more
                continue

            label = name if module_name.startswith("ftkit") else (
                f"dist.{name}" if module_name == "torch.distributed" else f"dcp.{name}")

            def wrapper(*args, _fn=fn, _label=label, **kwargs):
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    record.append((_label, (start - clock[0]) * 1e3, (time.perf_counter() - clock[0]) * 1e3))

            setattr(holder, attr, functools.wraps(fn)(wrapper))


def _trace(on: bool) -> None:
    """Start (clearing what is there) or stop tracing the block layer's reads, on the clock
    ``time.perf_counter`` reads (CLOCK_MONOTONIC)."""
    if on:
        if not (_TRACE / "trace").exists():
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(_TRACE)], check=True)
        (_TRACE / "tracing_on").write_text("0")
        (_TRACE / "buffer_size_kb").write_text("65536")
        (_TRACE / "trace_clock").write_text("mono")
        (_TRACE / "trace").write_text("")
    for event in _BLOCK_EVENTS:
        (_TRACE / "events" / "block" / event / "enable").write_text("1" if on else "0")
    (_TRACE / "tracing_on").write_text("1" if on else "0")


def _device_report(windows: dict[str, list[tuple[float, float]]]) -> None:
    """What the device did in each round (``windows``: each kind's rounds, start and end in
    ``perf_counter`` seconds), from the block-layer trace: medians over each kind's rounds
    (the first left out), and each round's idle gaps."""
    import re

    pattern = re.compile(r"\s([\d.]+): block_rq_(issue|complete): \S+ (\S+) (?:\d+ )?\(\) (\d+) \+ (\d+)")
    events = []
    for line in (_TRACE / "trace").read_text().splitlines():
        m = pattern.search(line)
        if m and m.group(3).startswith("R"):  # reads (RA, RS, RM, ...)
            events.append((float(m.group(1)), m.group(2), int(m.group(4)), int(m.group(5)) * 512))
    events.sort()
    print("device (block-layer trace): medians of each kind's rounds, ms after the round began")
    for kind, spans in windows.items():
        rows, gaps_of = [], []
        for lo, hi in spans[1:] if len(spans) > 1 else spans:
            inflight: dict[int, int] = {}
            busy = done = 0.0
            last = idle_since = lo
            first = big = end = None
            gaps = []
            for t, what, sector, size in (e for e in events if lo <= e[0] <= hi):
                if inflight:
                    busy += t - last
                last = t
                if what == "issue":
                    if not inflight and first is not None and t - idle_since > 0.00015:
                        gaps.append(((idle_since - lo) * 1e3, (t - idle_since) * 1e3))
                    first = t if first is None else first
                    big = t if big is None and size >= 1 << 20 else big
                    inflight[sector] = size
                else:
                    inflight.pop(sector, None)
                    done += size
                    end = t
                    if not inflight:
                        idle_since = t
            if first is None or end is None or busy <= 0:
                continue
            rows.append(((first - lo) * 1e3, ((big or first) - lo) * 1e3, (end - lo) * 1e3, busy * 1e3,
                         done / 1e9 / busy, (end - first) * 1e3 - busy * 1e3, (hi - end) * 1e3))
            gaps_of.append(gaps)
        if not rows:
            continue
        med = [statistics.median(r[k] for r in rows) for k in range(7)]
        print(f"  {kind:7s} first read {med[0]:5.1f}, first bulk read {med[1]:5.1f}, last done {med[2]:5.1f}; "
              f"device busy {med[3]:5.1f} ms at {med[4]:.2f} GB/s, idle inside {med[5]:4.1f} ms, "
              f"the round {med[6]:4.1f} ms after its last read")
        if kind == "load":
            for gaps in gaps_of:
                print("          idle (at: ms) " + " ".join(f"{a:.1f}:{b:.2f}" for a, b in gaps))


def _rank_and_model(gb: float, replicated: bool = False):
    """This process's rank (``RANK``), its gloo group joined, and its half of the sharded model
    (each rank's layers its own, so each rank reads back only its own DCP file); ``replicated``:
    the whole model, the same on every rank (DDP's)."""
    import checkpoint_speed as cs
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if replicated:
        torch.manual_seed(0)
        layers = max(1, round(gb * 1e9 / cs.BYTES_PER_LAYER))
        return rank, torch.nn.ModuleDict({f"l{i}": torch.nn.Linear(cs.LAYER, cs.LAYER) for i in range(layers)})
    torch.manual_seed(rank)
    layers = max(1, round(gb * 1e9 / cs.BYTES_PER_LAYER / 2))
    return rank, torch.nn.ModuleDict({f"r{rank}_{i}": torch.nn.Linear(cs.LAYER, cs.LAYER) for i in range(layers)})


def _own_files(step: Path, rank: int, replicated: bool = False) -> list[Path]:
    """The files of ``step`` this rank reads: its state file, its DCP file (``replicated``:
    every DCP file); rank 0 also the rest (``.metadata``, the manifest)."""
    import checkpoint_speed as cs

    return [p for p in cs._files_under(step)
            if p.name == f"rank-{rank:05d}.pt" or p.name.startswith(f"__{rank}_")
            or (replicated and p.name.startswith("__"))
            or (rank == 0 and not p.name.startswith(("rank-", "__")))]


def _cold(rank: int) -> None:
    """Both ranks at once from a cold page cache: rank 0 syncs and drops it, then a pause."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
    dist.barrier()
    time.sleep(0.3)
    dist.barrier()


def fresh_worker(work: Path, gb: float, timeline: bool, replicated: bool = False) -> None:
    """One requeued job's load (``--fresh``): a new model and a fresh Adam on each rank, the
    raw read of this rank's files and then the load, each cold, both ranks at once. Rank 0
    appends ``[raw ms, load ms]`` to ``work/fresh.json``; with ``timeline``, each rank its
    load's steps to ``work/fresh-steps-RANK.json``."""
    import checkpoint_speed as cs
    import torch
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager

    rank, model = _rank_and_model(gb, replicated)
    state = {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-4)}
    cfg = CheckpointConfig(root=work / "ck", keep_last=None)
    mine = _own_files(work / "ck" / "step-00000002", rank, replicated)
    buf = cs._huge_copy(memoryview(bytes(cs._READ_CHUNK)))
    record: list[tuple[str, float, float]] = []
    clock = [0.0]
    if timeline:
        _timed(record, clock)
    took = []
    for kind in ("raw", "load"):
        _cold(rank)
        record.clear()
        start = clock[0] = time.perf_counter()
        if kind == "raw":
            cs._raw_read(mine, buf)
        else:
            assert make_manager(cfg, rank=rank, world_size=2).load(state) == 2
        dist.barrier()
        took.append((time.perf_counter() - start) * 1e3)
    if timeline:
        steps = work / f"fresh-steps-{rank}.json"
        steps.write_text(json.dumps([*(json.loads(steps.read_text()) if steps.exists() else []), record]))
    if rank == 0:
        runs = json.loads((work / "fresh.json").read_text()) if (work / "fresh.json").exists() else []
        (work / "fresh.json").write_text(json.dumps([*runs, took]))
    dist.destroy_process_group()


def worker(work: Path, gb: float, rounds: int, timeline: bool, device: bool = False, replicated: bool = False) -> None:
    import checkpoint_speed as cs
    import torch
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.checkpoint.io.reader import check_file

    rank, model = _rank_and_model(gb, replicated)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = {"model": model, "optimizer": opt}
    cfg = CheckpointConfig(root=work / "ck", keep_last=None)
    saver = make_manager(cfg, rank=rank, world_size=2)
    saver.save(1, state)  # the older one to fall back on, as a job has once it saved twice
    saver.save(2, state)
    dist.barrier()
    step = work / "ck" / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    mine = _own_files(step, rank, replicated)
    buf = cs._huge_copy(memoryview(bytes(cs._READ_CHUNK)))
    record: list[tuple[str, float, float]] = []
    clock = [0.0]
    if timeline:
        _timed(record, clock)

    def raw() -> None:
        cs._raw_read(mine, buf)

    def reader() -> None:
        for path in mine:
            name = str(path.relative_to(step))
            if name in manifest:
                check_file(path, manifest[name])

    def load() -> None:
        assert make_manager(cfg, rank=rank, world_size=2).load(state) == 2

    kinds = {"raw": raw, "reader": reader, "load": load}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}  # perf_counter s
    steps: list[list[tuple[str, float, float]]] = []
    order = list(kinds)
    if device and rank == 0:
        _trace(True)
    for r in range(rounds * len(order)):
        kind = order[(r + r // len(order)) % len(order)]  # rotating, each kind after each other
        _cold(rank)
        record.clear()
        clock[0] = time.perf_counter()
        kinds[kind]()
        dist.barrier()  # both ranks done: the job goes on when the last one is
        times[kind].append((time.perf_counter() - clock[0]) * 1e3)
        windows[kind].append((clock[0], time.perf_counter()))
        if kind == "load":
            steps.append(list(record))
    if device and rank == 0:
        _trace(False)
    (work / f"steps-{rank}.json").write_text(json.dumps(steps))
    dist.barrier()
    if rank == 0:
        med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
        size = sum(p.stat().st_size for p in cs._files_under(step))
        print(f"two_rank_load: {gb} GB of state on {'each of ' if replicated else ''}two ranks ({size / 1e9:.2f} GB "
              f"of files), {rounds} cold rounds of each (the first left out), medians:")
        for k, v in med.items():
            print(f"  {k:7s} {v:7.1f} ms   raw / {k}: {med['raw'] / v:.3f}   "
                  f"(every round: {' '.join(f'{x:.1f}' for x in times[k])})")
        if device:
            _device_report(windows)
    if timeline:
        dist.barrier()
        for r in range(2):
            if r == rank:
                _print_steps(rank, steps[1:] if len(steps) > 1 else steps)
            dist.barrier()
        _print_all_reduces(rank, steps[1:] if len(steps) > 1 else steps, work)
    dist.destroy_process_group()


def _print_steps(rank: int, loads: list[list[tuple[str, float, float]]]) -> None:
    firsts: dict[str, list[tuple[float, float, float]]] = {}
    for rec in loads:
        seen: dict[str, tuple[float, float, float]] = {}
        for label, start, end in rec:
            first = seen.get(label)
            seen[label] = (first[0], end, first[2] + end - start) if first else (start, end, end - start)
        for label, value in seen.items():
            firsts.setdefault(label, []).append(value)
    print(f"rank {rank}: step, median first start and last end (ms after the load began), time inside")
    rows = sorted((statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals),
                   statistics.median(v[2] for v in vals), label) for label, vals in firsts.items())
    for start, end, inside, label in rows:
        print(f"  {start:7.2f} {end:7.2f} {inside:7.2f}  {label}")
    sys.stdout.flush()


def _print_all_reduces(rank: int, loads: list[list[tuple[str, float, float]]], work: Path) -> None:
    """Each load's all-reduces, both ranks side by side: how long each took after the last
    rank reached it (the ranks' clocks start at the same barrier)."""
    import torch.distributed as dist

    mine = [sorted((a, b) for label, a, b in rec if label == "dist.all_reduce") for rec in loads]
    (work / f"reduces-{rank}.json").write_text(json.dumps(mine))
    dist.barrier()
    if rank != 0:
        return
    other = json.loads((work / "reduces-1.json").read_text())
    after = [max(x[1], y[1]) - max(x[0], y[0]) for a, b in zip(mine, other, strict=True) for x, y in zip(a, b, strict=True)]
    if after:
        per_load = statistics.median(len(a) for a in mine)
        print(f"all-reduces: {per_load:g} per load; after the last rank reached one: median {statistics.median(after):.2f} "
              f"ms, mean {statistics.mean(after):.2f} ms, over 3 ms in {sum(x > 3 for x in after)} of {len(after)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.25, help="state size in GB (model + Adam moments, both ranks)")
    ap.add_argument("--rounds", type=int, default=15, help="cold rounds of each kind")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp dir)")
    ap.add_argument("--timeline", action="store_true", help="also time the load's steps on each rank")
    ap.add_argument("--device", action="store_true", help="also trace the device's reads (block layer, tracefs)")
    ap.add_argument("--fresh", type=int, default=0, metavar="N",
                    help="then N loads as a requeued job makes them: each by a new pair of processes")
    ap.add_argument("--replicated", action="store_true",
                    help="the whole model and optimizer on each rank, as DDP's (each rank loads every file)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--fresh-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker), args.gb, args.rounds, args.timeline, args.device, args.replicated)
        return 0
    if args.fresh_worker:
        fresh_worker(Path(args.fresh_worker), args.gb, args.timeline, args.replicated)
        return 0
    if os.geteuid() != 0:
        print("two_rank_load: dropping the page cache needs root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="two-rank-load-", dir=args.dir))
    try:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
        cmd = [sys.executable, __file__, "--worker", str(work), "--gb", str(args.gb), "--rounds", str(args.rounds)]
        cmd += ["--timeline"] if args.timeline else []
        cmd += ["--device"] if args.device else []
        cmd += ["--replicated"] if args.replicated else []
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(2)]
        code = max(p.wait() for p in procs)
        for _ in range(args.fresh if code == 0 else 0):
            env["MASTER_PORT"] = str(_free_port())
            cmd = [sys.executable, __file__, "--fresh-worker", str(work), "--gb", str(args.gb)]
            cmd += ["--timeline"] if args.timeline else []
            cmd += ["--replicated"] if args.replicated else []
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(2)]
            code = max(p.wait() for p in procs)
            if code:
                return code
        if args.fresh and code == 0:
            runs = json.loads((work / "fresh.json").read_text())
            raw, load = (statistics.median(r[k] for r in runs) for k in (0, 1))
            print(f"two_rank_load --fresh: {len(runs)} loads as a requeued job makes them (new processes, a fresh "
                  f"Adam), medians: raw {raw:.1f} ms, load {load:.1f} ms, raw / load: {raw / load:.3f}   "
                  f"(every one, raw/load ms: {' '.join(f'{a:.1f}/{b:.1f}' for a, b in runs)})")
            for r in range(2) if args.timeline else ():
                _print_steps(r, json.loads((work / f"fresh-steps-{r}.json").read_text()))
        return code
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
