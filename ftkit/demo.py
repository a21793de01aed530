"""A small, real training run under ftkit: the README's main job and the trainer of the tests.

An MLP with dropout learns a noisy linear map from synthetic data (made from a seed, nothing
downloaded) with Adam, a step LR schedule and a shuffled, resumable sampler. Under
``torch.distributed`` (RANK / WORLD_SIZE in the environment, or SLURM's srun variables) the
model is wrapped in DDP over gloo and every rank reads its own part of each batch.

At the end it writes ``JOBDIR/result-rank{R}.json`` with the final step, the per-step losses
and a SHA-256 of the final parameters, so runs can be compared bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ftkit

__all__ = ["DemoSettings", "StepInfo", "init_distributed", "train"]


@dataclass(kw_only=True, slots=True)
class DemoSettings:
    """The demo run's knobs."""

    jobdir: Path
    """Where events, switches and checkpoints live."""
    steps: int = 2000
    """Total optimizer steps of the whole run (across requeues)."""
    step_time: float = 0.0
    """Extra seconds each step sleeps, to make a small model feel like a big one."""
    save_every: int | None = 200
    """Periodic checkpoint cadence in steps; None: only on triggers and at the end."""
    seed: int = 0
    """Seed for data, weights, dropout and shuffling."""
    batch_size: int = 32
    """Global batch size (split across ranks)."""
    agree_every: int = 10
    """Cross-rank agreement cadence in steps."""
    poll: bool = False
    """Force the polling observer for switch files."""
    async_save: bool = False
    """Save in the background: the loop stalls only for the in-memory snapshot."""


@dataclass(frozen=True, slots=True)
class StepInfo:
    step: int
    loss: float
    ft: ftkit.FaultTolerance


def init_distributed() -> tuple[int, int]:
    """Join a gloo group when launched as one of several ranks; (rank, world size)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1) if "RANK" in env or "SLURM_PROCID" in env else 1
    if world <= 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def _data(seed: int, n: int = 4096, dim: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def _params_digest(model: nn.Module) -> str:
    """SHA-256 over the parameters' names and raw bytes (read through ctypes: no numpy needed)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def train(settings: DemoSettings, *, on_step: Callable[[StepInfo], None] | None = None) -> dict[str, Any]:
    """Run (or resume) the demo training; returns what it also writes to result-rank{R}.json."""
    rank, world = init_distributed()
    torch.manual_seed(settings.seed)
    x, y = _data(settings.seed)
    model: nn.Module = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=500, gamma=0.5)
    sampler = ftkit.ResumableSampler(len(x), seed=settings.seed)
    losses: dict[str, float] = {}
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "losses": losses}
    config = ftkit.Config(
        # Ctrl-C in the demo saves and exits like SIGTERM, so a person can try the exit path
        signals=ftkit.SignalConfig(actions={"USR1": "requeue", "TERM": "save-exit", "INT": "save-exit"}),
        save_every=settings.save_every,
        async_save=ftkit.AsyncConfig() if settings.async_save else None,
        agreement=ftkit.AgreementConfig(every=settings.agree_every),
        watch=ftkit.WatchConfig(mode="polling" if settings.poll else "auto"),
    )
    per_rank = max(settings.batch_size // world, 1)
    order = iter(sampler)
    loss_fn = nn.MSELoss()
    with ftkit.FaultTolerance(settings.jobdir, state=state, config=config) as ft:
        for step in ft.range(settings.steps):
            batch: list[int] = []
            while len(batch) < settings.batch_size:
                try:
                    batch.append(next(order))
                except StopIteration:
                    order = iter(sampler)  # next epoch: the sampler reshuffles
            idx = torch.tensor(batch[rank * per_rank:(rank + 1) * per_rank])
            model.train()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses[str(step + 1)] = loss.item()
            if settings.step_time:
                time.sleep(settings.step_time)
            if on_step is not None:
                on_step(StepInfo(step + 1, losses[str(step + 1)], ft))
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        result = {
            "rank": rank,
            "world_size": world,
            "completed": ft.completed,
            "stopping": ft.stopping,
            "last_step": max((int(k) for k in losses), default=0),
            "saved_step": ft.last_saved_step,
            "reasons": list(ft.final_decision.reasons) if ft.final_decision is not None else [],
            "params_sha256": _params_digest(inner),
            "losses": losses,
        }
    out = Path(settings.jobdir) / f"result-rank{rank}.json"
    out.write_text(json.dumps(result))
    return result
