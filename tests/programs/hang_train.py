"""A small DDP trainer under ftkit that hangs on demand; used by the watchdog tests and the
SLURM end-to-end tests (it runs unchanged as the ``command`` of any sbatch template).

    python tests/programs/hang_train.py JOBDIR [--steps N] [--step-time S] [--save-every K]

Ranks come from RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun), as in
``ftkit demo``; several ranks train a DDP model over gloo. Each run resumes from the newest
checkpoint and, at the end, writes ``JOBDIR/result-rank{R}.json`` (``last_step``,
``completed``). The watchdog is the default one: set ``FTKIT_HANG_TIMEOUT`` (seconds) to make
it fire quickly. What goes wrong is chosen by environment variables, so a batch script can
set them:

    FTKIT_TEST_HANG_STEP=K    block forever inside step K (steps 1..K-1 complete)
    FTKIT_TEST_HANG_RANK=R    only rank R blocks (default: every rank)
    FTKIT_TEST_HANG_HOW=how   block: wait on a lock in Python (default); stop: SIGSTOP itself,
                              like a frozen process that can write nothing
    FTKIT_TEST_HANG_ONCE=1    hang only the first time a run reaches step K (marker file
                              JOBDIR/hung-at-K): a requeued run then completes
    FTKIT_TEST_SLOW_SAVE=S    every checkpoint save takes S seconds longer (slow storage)
    FTKIT_TEST_SLOW_FIRST=S   the first step of every run takes S seconds longer (compiling)

``JOBDIR/ready-rank{R}`` holds the pid once the loop runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import ftkit
from ftkit.demo import init_distributed


class SlowSave:
    """Part of the checkpointed state whose ``state_dict`` takes ``seconds`` (a slow save)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {"seconds": self.seconds}

    def load_state_dict(self, sd: dict) -> None:
        pass


def block_forever_in_step(step: int, how: str) -> None:
    """The hang: a Python wait nothing will end, or the whole process stopped."""
    print(f"hang_train: blocking in step {step} ({how})", flush=True)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: nothing of this process runs any more
    _deadlock()


def _deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: the frame the stack dump must show


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--every", type=int, default=5, help="agreement cadence")
    args = ap.parse_args()
    env = os.environ

    rank, world = init_distributed()
    hang_step = int(env.get("FTKIT_TEST_HANG_STEP") or 0)
    hang_rank = env.get("FTKIT_TEST_HANG_RANK")
    hang_here = hang_step > 0 and (hang_rank is None or int(hang_rank) == rank)
    marker = args.jobdir / f"hung-at-{hang_step}"
    slow_first = float(env.get("FTKIT_TEST_SLOW_FIRST") or 0)

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt, "slow": SlowSave(float(env.get("FTKIT_TEST_SLOW_SAVE") or 0))}
    config = ftkit.Config(save_every=args.save_every or None, agreement=ftkit.AgreementConfig(every=args.every))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    last = 0
    with ftkit.FaultTolerance(args.jobdir, state=state, config=config) as ft:
        (args.jobdir / f"ready-rank{rank}").write_text(str(os.getpid()))
        first = True
        for step in ft.range(args.steps):
            if step + 1 == hang_step and hang_here:
                once = env.get("FTKIT_TEST_HANG_ONCE") == "1"
                if not (once and marker.exists()):
                    if once:
                        marker.write_text(str(rank))
                    block_forever_in_step(step + 1, env.get("FTKIT_TEST_HANG_HOW", "block"))
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time.sleep(args.step_time + (slow_first if first else 0.0))
            first = False
            last = step + 1
        result = {"rank": rank, "last_step": last, "completed": ft.completed}
    (args.jobdir / f"result-rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
