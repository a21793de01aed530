"""A tiny training run for the lease tests.

    python lease_train.py JOBDIR CONTROL --steps N [--save-every K] [--hold-at S]
                          [--heartbeat H] [--stale-after T] [--stop-in-heartbeat-write] [--root DIR]

Trains a linear model with ``ft.range`` and periodic checkpoints. With ``--hold-at S`` every
rank writes ``CONTROL/holding-rankR`` (its pid) at step S and waits there until
``CONTROL/release`` exists, so a test can start a second run, or ``kill -9`` this one, while
it holds the job dir. Nothing of the test's own goes into JOBDIR. Under torch.distributed
(RANK/WORLD_SIZE/MASTER_* set) it joins a gloo group first. A refused lease ends the process
with ftkit's own exit (code 86, no traceback): the program does not catch it.

``--stop-in-heartbeat-write``: once holding, the process stops itself (SIGSTOP, after writing
``CONTROL/stopping``) the next time the lease heartbeat starts writing ``JOBDIR/lease.json``:
the moment a node cut off from the file server is most likely caught in, as its write is the
slow part of a heartbeat. ``SIGCONT`` lets the write go on.
"""

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import ftkit
from ftkit.checkpoint import CheckpointConfig
from ftkit.lease import LeaseConfig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("control", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--hold-at", type=int)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--stale-after", type=float, default=600.0)
    ap.add_argument("--stop-in-heartbeat-write", action="store_true")
    ap.add_argument("--root", type=Path, help="the checkpoint root (default JOBDIR/checkpoints)")
    args = ap.parse_args()
    stop_armed = threading.Event()
    if args.stop_in_heartbeat_write:
        _stop_in_heartbeat_write(args.control, stop_armed)

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    config = ftkit.Config(
        save_every=args.save_every,
        agreement=ftkit.AgreementConfig(every=1),
        budget=ftkit.BudgetConfig(use_slurm=False),  # tests fake SLURM_JOB_ID: never ask scontrol
        lease=LeaseConfig(heartbeat=args.heartbeat, stale_after=args.stale_after),
        checkpoint=None if args.root is None else CheckpointConfig(root=args.root),
    )
    with ftkit.FaultTolerance(args.jobdir, state={"model": model, "optimizer": opt}, config=config) as ft:
        for step in ft.range(args.steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == args.hold_at:
                holding = args.control / f"holding-rank{rank}"  # whole once it exists: written beside
                holding.with_name(holding.name + ".tmp").write_text(str(os.getpid()))
                holding.with_name(holding.name + ".tmp").replace(holding)
                stop_armed.set()
                deadline = time.monotonic() + 300
                while not (args.control / "release").exists():
                    if time.monotonic() > deadline:
                        raise SystemExit("lease_train: nobody released the hold within 300 s")
                    time.sleep(0.02)
    (args.control / f"done-rank{rank}").write_text(str(ft.completed))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _stop_in_heartbeat_write(control: Path, armed: threading.Event) -> None:
    """Wrap the lease module's ``atomic_write``: the first heartbeat write of ``lease.json``
    after ``armed`` is set stops the whole process before it writes anything."""
    from ftkit.lease import _holder

    real = _holder.atomic_write

    def stopping_write(path, data, **kw):  # type: ignore[no-untyped-def]
        if (armed.is_set() and threading.current_thread().name == "ftkit-lease-heartbeat"
                and Path(path).name == "lease.json"):
            armed.clear()
            (control / "stopping").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(path, data, **kw)

    _holder.atomic_write = stopping_write


if __name__ == "__main__":
    sys.exit(main())
