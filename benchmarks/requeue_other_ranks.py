"""A requeue onto another number of ranks: a checkpoint saved by ``--saved`` ranks, loaded
cold by ``--loaded`` ranks (1 or 2 each).

    python benchmarks/requeue_other_ranks.py [--saved 2] [--loaded 1] [--gb 1] [--rounds 3] [--older] [--no-room]
                                             [--dir DIR]

``--saved`` ranks (gloo on 127.0.0.1 when 2) save the same ``--gb`` GB state
(``checkpoint_speed``'s model and Adam moments, replicated) with ftkit's Checkpointer: two
ranks write a DCP checkpoint (half of it in each rank's file), one process a state file.
``--loaded`` ranks then load it into a state of their own, in host memory, as a job requeued
onto that many ranks does (two ranks each need all of it), against the raw cold read of the
same files, once, side by side: ``--rounds`` rounds of each, order rotating, the page cache
dropped before each (``checkpoint_speed._load_rounds``). The job's only checkpoint by default
(nothing older to fall back on: the load sets aside what it writes over, or checks first);
``--older``: a second save, the newest loaded with the first to fall back on. ``--no-room``:
the loading ranks' state taken as one no copy of which fits in host memory (as a GPU's is:
``SetAside.fits`` false), the way such a load goes without a GPU. Prints the medians and
load / raw read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkpoint_speed as cs


def _ranks(ranks: int, argv: list[str]) -> None:
    """Run this script with ``argv`` as ``ranks`` processes (a process group of them when 2)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, *argv],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(ranks)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{' '.join(argv[:2])} on {ranks} rank(s) failed")


def _group() -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def save(root: Path, gb: float, saves: int) -> None:
    from ftkit.checkpoint import CheckpointConfig, make_manager

    rank, world = _group()
    model, opt, _ = cs._build(gb)
    manager = make_manager(CheckpointConfig(root=root, keep_last=None), rank=rank, world_size=world)
    for step in range(1, saves + 1):
        manager.save(step, {"model": model, "optimizer": opt})
    manager.close()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def load(root: Path, gb: float, saves: int, rounds: int, out: Path, no_room: bool = False) -> None:
    from ftkit.checkpoint import CheckpointConfig, make_manager

    if no_room:
        from ftkit.checkpoint.state.restore import SetAside

        SetAside.fits = staticmethod(lambda state, sharing=1: False)  # type: ignore[method-assign]
    rank, world = _group()
    model, opt, nbytes = cs._build(gb)  # the state of its own: Adam with moments, other values
    state = {"model": model, "optimizer": opt}
    config = CheckpointConfig(root=root, keep_last=None)

    def once() -> None:
        assert make_manager(config, rank=rank, world_size=world).load(state) == saves

    # the raw read: the checkpoint's files once (by rank 0), however many ranks load them
    files = cs._files_under(root / f"step-{saves:08d}") if rank == 0 else []
    got = cs._load_rounds(once, files, rounds, 1.0, comm=world > 1)
    if rank == 0:
        out.write_text(json.dumps({"gb": gb, "older": saves > 1, "bytes": nbytes, "load_s": got["load_s"],
                                   "load_runs": got["load_runs"], "read_s": got["read_s"],
                                   "load_per_read": got["read_s"] / got["load_s"]}))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saved", type=int, choices=(1, 2), default=2, help="ranks that save (2: DCP)")
    ap.add_argument("--loaded", type=int, choices=(1, 2), default=1, help="ranks that load")
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--older", action="store_true", help="save twice: load the newest, the first to fall back on")
    ap.add_argument("--no-room", action="store_true", help="load as where no copy of the state fits in host memory")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory on the disk to measure")
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument("--role", choices=("saver", "loader"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    saves = 2 if a.older else 1
    root = Path(a.dir) / "ftkit-requeue-other-ranks"
    result = root.parent / "ftkit-requeue-other-ranks.json"
    if a.role == "saver":
        save(root, a.gb, saves)
        return 0
    if a.role == "loader":
        load(root, a.gb, saves, a.rounds, result, a.no_room)
        return 0
    shutil.rmtree(root, ignore_errors=True)
    common = (["--gb", str(a.gb), "--dir", a.dir, "--rounds", str(a.rounds)] + (["--older"] if a.older else [])
              + (["--no-room"] if a.no_room else []))
    try:
        _ranks(a.saved, ["--role", "saver", *common])
        _ranks(a.loaded, ["--role", "loader", *common])
        r = json.loads(result.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        result.unlink(missing_ok=True)
    which = "its newest, an older one to fall back on" if a.older else "its only checkpoint"
    which += ", no room for a copy of the state" if a.no_room else ""
    runs = " ".join(f"{t:.2f}s" for t in r["load_runs"])
    saved = "2 ranks (DCP)" if a.saved == 2 else "1 process (a state file)"
    loaded = "2 ranks" if a.loaded == 2 else "1 process"
    print(f"{a.gb:g} GB saved by {saved}, loaded by {loaded} ({which}): load {r['load_s']:.3f}s ({runs}); "
          f"raw read {r['read_s']:.3f}s; load / read {r['load_per_read']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({**r, "saved": a.saved, "loaded": a.loaded}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
