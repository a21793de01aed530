"""One rank of a training job resumed on another number of ranks (tests/test_topology.py).

    python topology_train.py JOBDIR --total T --out PREFIX [--async] [--fsdp]

The usual user code: a small MLP wrapped in DDP only when WORLD_SIZE > 1 (or sharded with
FSDP2 ``fully_shard`` with ``--fsdp``, on one rank too), Adam, StepLR, a shuffled
ResumableSampler, a plain counter, trained under ``ft.range(T)`` with ``save_every=5`` and a
save at the end. RANK/WORLD_SIZE/MASTER_* come from the environment (WORLD_SIZE > 1 or
``--fsdp``: a gloo group).

Writes ``PREFIX.rankR.json``: hashes of the canonical (unwrapped, unsharded) model parameters
and buffers, optimizer state, scheduler state, sampler position, step and torch RNG state,
taken right after resuming (``resumed``) and after the last step, which is the checkpoint
this run saved last (``final``); the dataset indices this rank consumed, per epoch; the losses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

N, BATCH = 30, 3  # samples, per-rank batch


def _digest(t) -> str:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective for a DTensor
    full = full.detach().cpu().contiguous()
    h = hashlib.sha256(f"{full.dtype} {tuple(full.shape)}".encode())
    h.update(full.view(-1).view(__import__("torch").uint8).numpy().tobytes() if full.numel() else b"")
    return h.hexdigest()[:16]


def _name(n: str) -> str:
    return n[len("module.") :] if n.startswith("module.") else n


def hashes(state: dict, step: int) -> dict:
    """What must come back bit for bit, independent of wrapping and sharding (same order on
    every rank: full_tensor is a collective)."""
    import torch

    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    names = {id(p): _name(n) for n, p in model.named_parameters()}
    optim = {}
    for group in opt.param_groups:
        for p in group["params"]:
            optim[names[id(p)]] = {k: _digest(v) for k, v in sorted(opt.state.get(p, {}).items())}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {
        "step": step,
        "model": {_name(k): _digest(v) for k, v in sorted(model.state_dict().items())},
        "optimizer": optim,
        "param_groups": json.loads(json.dumps(groups, default=str)),
        "scheduler": json.loads(json.dumps(sched.state_dict(), default=str)),
        "sampler": {"epoch": state["sampler"].epoch, "global": state["sampler"].global_position},
        "counter": state["counter"],
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
    }


def build_state(rank: int, world: int, *, fsdp: bool = False):
    """The training state and loader, as a user writes them: wrapped only with several ranks."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ftkit.checkpoint import ResumableSampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    y = x[:, :2] * 2 + 0.1 * torch.randn(N, 2, generator=g)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(6, 11), nn.ReLU(), nn.Dropout(0.2), nn.Linear(11, 2))
    if fsdp:  # one rank too: FSDP2 on one process (a gloo group of one)
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # 11 rows on 2 or 3 ranks: uneven shards
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(1 + rank)  # per-rank dropout streams
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    sampler = ResumableSampler(N, seed=7, rank=rank, world_size=world)
    loader = DataLoader(TensorDataset(x, y, torch.arange(N)), batch_size=BATCH, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "counter": 0}
    return state, loader


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--async", dest="background", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn

    import ftkit
    from ftkit.checkpoint import AsyncConfig, CheckpointConfig

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 or a.fsdp:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state, loader = build_state(rank, world, fsdp=a.fsdp)
    model, opt, sched, sampler = (state[k] for k in ("model", "optimizer", "scheduler", "sampler"))
    config = ftkit.Config(
        save_every=5,
        checkpoint=CheckpointConfig(root=a.jobdir / "checkpoints", keep_last=2, fsync=False),
        async_save=AsyncConfig(max_in_flight=1) if a.background else None,
    )
    report: dict = {"rank": rank, "world_size": world, "indices": {}, "losses": []}
    with ftkit.FaultTolerance(a.jobdir, state=state, config=config) as ft:
        start = ft.resume()
        report["resumed"] = hashes(state, start)
        batches = iter(loader)
        for _step in ft.range(a.total, start=start):
            try:
                epoch = sampler.epoch  # a short last batch ends the sampler's epoch before it comes
                xb, yb, ib = next(batches)
            except StopIteration:  # the sampler moved to the next epoch by itself
                batches = iter(loader)
                epoch = sampler.epoch
                xb, yb, ib = next(batches)
            report["indices"].setdefault(str(epoch), []).extend(ib.tolist())
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            state["counter"] += 1
            report["losses"].append(loss.item())
        if not ft.completed:
            raise SystemExit(f"rank {rank}: training stopped before step {a.total}")
    report["final"] = hashes(state, a.total)
    Path(f"{a.out}.rank{rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    code = main()
    # gloo objects torn down at interpreter exit can abort the process; results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
