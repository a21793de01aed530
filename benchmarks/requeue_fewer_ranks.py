"""A requeue onto fewer ranks: a DCP checkpoint saved by two ranks, loaded cold by one process.

    python benchmarks/requeue_fewer_ranks.py [--gb 1] [--rounds 3] [--older] [--dir DIR]

Two ranks (gloo on 127.0.0.1) save the same ``--gb`` GB state (``checkpoint_speed``'s model
and Adam moments, replicated: DCP writes half of it to each rank's file) with ftkit's
Checkpointer; one process then loads it into a state of its own, in host memory, as a job
requeued onto one rank does, against the raw cold read of the same files, side by side:
``--rounds`` rounds of each, order rotating, the page cache dropped before each
(``checkpoint_speed._load_rounds``). The job's only checkpoint by default (nothing older to
fall back on: the load sets aside what it writes over); ``--older``: a second save, the
newest loaded with the first to fall back on. Prints the medians and load / raw read.
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


def save(root: Path, gb: float, saves: int) -> None:
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, opt, _ = cs._build(gb)
    manager = make_manager(CheckpointConfig(root=root, keep_last=None), rank=rank, world_size=2)
    for step in range(1, saves + 1):
        manager.save(step, {"model": model, "optimizer": opt})
    dist.barrier()
    dist.destroy_process_group()


def load(root: Path, gb: float, saves: int, rounds: int) -> dict:
    from ftkit.checkpoint import CheckpointConfig, make_manager

    model, opt, nbytes = cs._build(gb)  # the state of its own: Adam with moments, other values
    state = {"model": model, "optimizer": opt}
    config = CheckpointConfig(root=root, keep_last=None)

    def once() -> None:
        assert make_manager(config, rank=0, world_size=1).load(state) == saves

    files = cs._files_under(root / f"step-{saves:08d}")
    got = cs._load_rounds(once, files, rounds, 1.0)
    return {"gb": gb, "older": saves > 1, "bytes": nbytes, "load_s": got["load_s"],
            "load_runs": got["load_runs"], "read_s": got["read_s"], "load_per_read": got["read_s"] / got["load_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--older", action="store_true", help="save twice: load the newest, the first to fall back on")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory on the disk to measure")
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument("--saver", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    saves = 2 if a.older else 1
    root = Path(a.dir) / "ftkit-requeue-fewer-ranks"
    if a.saver:
        save(root, a.gb, saves)
        return 0
    shutil.rmtree(root, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--saver", "--gb", str(a.gb), "--dir", a.dir] + (["--older"] if a.older else [])
    savers = [subprocess.Popen(argv, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                          "MASTER_PORT": str(port)}) for r in range(2)]
    if any(p.wait() != 0 for p in savers):
        raise SystemExit("the two-rank save failed")
    try:
        r = load(root, a.gb, saves, a.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    which = "its newest, an older one to fall back on" if a.older else "its only checkpoint"
    runs = " ".join(f"{t:.2f}s" for t in r["load_runs"])
    print(f"{a.gb:g} GB saved by 2 ranks, loaded by 1 process ({which}): load {r['load_s']:.3f}s ({runs}); "
          f"raw read {r['read_s']:.3f}s; load / read {r['load_per_read']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
