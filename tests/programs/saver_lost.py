"""A crash-safe run whose node's saver process is killed with kill -9 half-way (as the OOM
killer would kill it), by the trainer itself at a given step, which then trains on.

    python tests/programs/saver_lost.py JOBDIR [--steps N] [--kill-at K] [--save-every S]

One process, or each rank of a torchrun/gloo job (RANK, WORLD_SIZE, MASTER_* in the
environment): rank ``--kill-rank`` (0), its node's leader (SLURMD_NODENAME tells the nodes
apart), kills the saver it started, right after the step's body: with ``--kill-at`` one past a
save step, while that save is being written (``--ballast-mb`` makes the parts bigger). Each step's model is
deterministic (its batch from the step number), so a resume can be compared with an
uninterrupted run. At the end, rank 0 writes JOBDIR/final.pt: the model's state dict and the
step. Exits 0 once ``ft.range`` completed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch

import ftkit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--kill-rank", type=int, default=0, help="the rank whose node's saver is killed")
    ap.add_argument("--ballast-mb", type=int, default=0, help="MB of state beside the model (slower parts)")
    ap.add_argument("--commit-timeout", type=float, default=600.0)
    ap.add_argument("--on-error", default="raise", help="AsyncConfig.on_error")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(32, 32)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = ftkit.Config(save_every=a.save_every,
                          async_save=ftkit.AsyncConfig(crash_safe=True, commit_timeout=a.commit_timeout,
                                                       on_error=a.on_error))
    state = {"model": model, "optimizer": opt, "ballast": torch.zeros(a.ballast_mb << 18)}
    with ftkit.FaultTolerance(a.jobdir, state=state, config=config) as ft:
        for step in ft.range(a.steps):
            g = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 32, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step + 1 == a.kill_at and rank == a.kill_rank:  # the leader of its node
                saver = ft.checkpoints._backend.saver_pid
                os.kill(saver, signal.SIGKILL)
                print(f"killed saver {saver} at step {a.kill_at}", flush=True)
    if rank == 0:
        raw = getattr(model, "module", model)
        torch.save({"step": a.steps, "model": raw.state_dict()}, a.jobdir / "final.pt")
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0 if ft.completed else 1


if __name__ == "__main__":
    sys.exit(main())
