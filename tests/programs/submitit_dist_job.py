"""A data-parallel trainer for the multi-task submitit tests: ``train(ft, settings)``.

Run through ``FtkitCheckpointable`` by submitit with several tasks (pickled by value, so the
job needs no ``tests`` package on its path). It does not initialise ``torch.distributed``:
the helper must have done so before ``ft`` was built. Every rank computes the same batch
(drawn from the step number) and averages the gradients with ``all_reduce``, so the final
parameters are bit-identical to a one-process run. Each run writes
``JOBDIR/ready-<rank>-<pid>`` once ftkit's handlers are installed and its first step is done.
While ``JOBDIR/hold`` exists a step does not end: a test holds the job inside a step while
SLURM preempts it.
Returns the rank, the world sizes seen, the final step, whether training completed, and a
SHA-256 of the parameters.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ftkit
from tests.programs.submitit_job import Settings, digest  # (both modules go to the job by value)


def train(ft: ftkit.FaultTolerance, settings: Settings) -> dict[str, Any]:
    group = dist.is_initialized()
    world = dist.get_world_size() if group else 1
    torch.manual_seed(settings.seed)
    g = torch.Generator().manual_seed(settings.seed + 1)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft.state = {"model": model, "optimizer": opt}
    for step in ft.range(settings.steps):
        idx = torch.randint(0, len(x), (16,), generator=torch.Generator().manual_seed(settings.seed + 100 + step))
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        if group:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        time.sleep(settings.step_time)
        while (ft.job.root / "hold").exists():
            time.sleep(0.05)
        ready = ft.job.root / f"ready-{ft.rank}-{os.getpid()}"
        if not ready.exists():
            ready.write_text(f"{step + 1}\n")
    return {"rank": ft.rank, "world_size": ft.world_size, "dist_world_size": world, "completed": ft.completed,
            "last_step": ft.last_saved_step, "params_sha256": digest(model)}


def train_initialising_the_group(ft: ftkit.FaultTolerance, settings: Settings) -> dict[str, Any]:
    """What the docs told users before FtkitCheckpointable set up the group: fn does it."""
    dist.init_process_group("gloo")
    return train(ft, settings)
