"""Two DDP ranks over gloo under FaultTolerance with periodic background saves (the thread
worker, ``commit_timeout`` left at 600 s); one rank can be made to stall inside a save, so that a
test kills it there with kill -9 and watches its peer.

    python tests/programs/peer_death.py JOBDIR [--steps N] [--save-every S] [--stall-rank R --stall-at K]
                                               [--commit-timeout T]

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment. ``--stall-rank 0``: rank
0's checkpoint worker stops right after it created step K's ``checkpoint-is-incomplete``
sentinel, before it names the save in it (rank 1's worker waits for that name);
``--stall-rank 1``: rank 1's worker stops before it writes its part of step K (rank 0's worker
waits for that part). Either way the stalled rank touches ``JOBDIR/stalled-rank-R`` and its loop
goes no further than step K, so its peer sits in step K+1's all-reduce until the stalled rank
is killed (with K = N, the last step, both ranks are in ``close()`` by then, waiting for it). Each step's batch comes from the step number. Exits 0 once ``ft.range`` completed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ftkit


def stall_worker(rank: int, step: int, marker: Path) -> None:
    """Make this rank's checkpoint worker stop for good at the point of step ``step``'s save
    the module doc names, touching ``marker`` there."""
    from ftkit.checkpoint.background import commit
    from ftkit.checkpoint.format.layout import SENTINEL, step_name

    where = step_name(step)

    def stop() -> None:
        marker.touch()
        time.sleep(3600)

    if rank == 0:  # the sentinel exists (prepare made it); the save id is written next
        real_write = commit.atomic_write_bytes

        def write(path, data, **kw):
            if Path(path).name == SENTINEL and Path(path).parent.name == where:
                stop()
            return real_write(path, data, **kw)

        commit.atomic_write_bytes = write
    else:  # the sentinel names this save; the part comes next
        real_state = commit.write_state_file

        def write_state(directory, name, obj, **kw):
            if Path(directory).name == where:
                stop()
            return real_state(directory, name, obj, **kw)

        commit.write_state_file = write_state


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--stall-rank", type=int)
    ap.add_argument("--stall-at", type=int)
    ap.add_argument("--commit-timeout", type=float, default=600.0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    # a collective waits for a live peer far longer than the tests wait for anything
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    marker = a.jobdir / f"stalled-rank-{rank}"
    stalls = a.stall_rank == rank
    if stalls:
        stall_worker(rank, a.stall_at, marker)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = ftkit.Config(save_every=a.save_every, async_save=ftkit.AsyncConfig(commit_timeout=a.commit_timeout))
    with ftkit.FaultTolerance(a.jobdir, state={"model": model, "optimizer": opt}, config=config) as ft:
        for step in ft.range(a.steps):
            if stalls and step == a.stall_at:  # step K is being saved: go no further
                while True:
                    time.sleep(1)
            g = torch.Generator().manual_seed(step * 2 + rank)
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()  # DDP's all-reduce: fails at once once the peer is gone
            opt.step()
    print(f"rank {rank} completed {ft.completed}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
