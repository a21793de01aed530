"""A small deterministic trainer for the submitit tests: ``train(ft, settings)``.

Run through ``FtkitCheckpointable`` by submitit (pickled by value, so the job needs no
``tests`` package on its path). Each run writes ``JOBDIR/ready-<pid>`` once ftkit's
handlers are installed and the first step of that run is done; the tests signal that pid.
Returns the final step, whether training completed, and a SHA-256 of the parameters.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ftkit


@dataclass(frozen=True, kw_only=True)
class Settings:
    steps: int = 60
    step_time: float = 0.05
    seed: int = 0


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(ft: ftkit.FaultTolerance, settings: Settings) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    g = torch.Generator().manual_seed(settings.seed + 1)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sampler = ftkit.ResumableSampler(len(x), seed=settings.seed)
    ft.state = {"model": model, "optimizer": opt, "sampler": sampler}
    order = iter(sampler)
    for step in ft.range(settings.steps):
        batch = []
        while len(batch) < 16:
            try:
                batch.append(next(order))
            except StopIteration:
                order = iter(sampler)
        idx = torch.tensor(batch)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        time.sleep(settings.step_time)
        ready = ft.job.root / f"ready-{os.getpid()}"
        if not ready.exists():
            ready.write_text(f"{step + 1}\n")
    return {"completed": ft.completed, "last_step": ft.last_saved_step, "params_sha256": digest(model)}
