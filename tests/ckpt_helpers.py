"""Shared helpers for the checkpoint tests, and a tiny trainer run as a real subprocess.

``python3 tests/ckpt_helpers.py train --root R --steps N [--stop-at K] --out F`` trains a
small dropout MLP with Adam, StepLR and a shuffled ResumableSampler, resuming from R if it
holds a checkpoint, saving at K and exiting there if asked. With ``WORLD_SIZE=2`` (and
RANK, MASTER_ADDR, MASTER_PORT) it runs DDP over gloo and checkpoints through DCP.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world_size: int = 1, timeout: float = 120) -> list[str]:
    """Run ``python3 tests/ckpt_helpers.py ARGS`` on ``world_size`` ranks; fail on any error.
    Returns each rank's output."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *args],
            env=env(
                RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    outs = collect(procs, timeout)
    for r, (p, out) in enumerate(zip(procs, outs, strict=False)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    return outs


def collect(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output once it exited; one still running after ``timeout`` fails the
    test (``TimeoutExpired``), and every process left is killed either way."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def assert_same_values(a, b, where: str = "state") -> None:
    """``b`` holds exactly ``a``'s values: tensors of the same dtype, bit for bit, in dicts,
    lists and tuples of the same keys and lengths; anything else equal."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"
        for k in a:
            assert_same_values(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_values(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def build_state(seed: int = 0, rank: int = 0, world_size: int = 1, device: str = "cpu", tied: bool = False,
                hidden: int = 32, fsdp: bool = False, cosine: bool = False):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ftkit.checkpoint import ResumableSampler

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 8, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=g)
    model: nn.Module = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(hidden, 1)).to(device)
    if tied:  # two layers that share one weight (as an output layer shares the embedding's)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False),
                              nn.Linear(8, 1)).to(device)
        model[2].weight = model[0].weight
    if world_size > 1 and fsdp:  # sharded (FSDP2): its parameters are DTensors
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(seed + 1000 * rank)  # per-rank dropout streams
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8) if cosine else
             torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7))
    sampler = ResumableSampler(len(x), seed=seed, rank=rank, world_size=world_size)
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=8,
        sampler=sampler,
        generator=torch.Generator().manual_seed(0),
    )
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": sampler,
        "extra": {"epoch": 0},
    }
    return state, loader


def train_main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--hidden", type=int, default=32)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state, loader = build_state(rank=rank, world_size=world, device=a.device, tied=a.tied, hidden=a.hidden)
    mgr = make_manager(CheckpointConfig(root=a.root, keep_last=2), rank=rank, world_size=world)
    step = mgr.load(state) or 0
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    losses: list[float] = []
    while step < a.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(a.device)), y.to(a.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if step == a.stop_at:
                mgr.save(step, state, reason="test")
                break
            if step >= a.steps:
                break
        else:
            state["extra"]["epoch"] += 1
            continue
        break
    mgr.close()
    if a.out:
        raw = model.module if hasattr(model, "module") else model
        torch.save(
            {
                "losses": losses,
                "model": raw.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
            },
            f"{a.out}.rank{rank}",
        )
    if world > 1:
        dist.destroy_process_group()


def load_main(argv: list[str]) -> None:
    """Load the newest checkpoint of ``--root`` on each rank; print what came of it as the last
    line (``loaded N`` or ``CheckpointError: ...``). ``--fail-read-on R``: rank R's DCP read
    fails (a RuntimeError of no checkpoint's making), to show what the other ranks do then.
    ``--extra-key-on R``: rank R's state has a key no checkpoint has (the others' not).
    ``--fail-restore-on R``: rank R's scheduler refuses its saved state (the state's failure,
    after the files were read and agreed on). ``--change-after-check R``: once rank R checked
    its share of the files, a byte of its DCP file changes (another process writing it).
    ``--check-first``: the ranks load a DCP checkpoint with nothing older as they do where
    its state is not all in host memory (its files checked first, then streamed in).
    ``--misread-on R``: rank R finds the bytes of every state file it reads not those its
    manifest names (a CRC-32 that differs once the whole file was read, as a network
    filesystem may serve one node other bytes than another).
    ``--hide-older-on R``: rank R sees no valid checkpoint but the newest (a filesystem that
    shows one node the older ones late, or not at all).
    ``--fail-state-read-on R``: rank R's read of a state file into its live tensors raises a
    RuntimeError once it is done (not the file's doing: memory, a device).
    ``--no-room-on R``: rank R's modules and optimizers do not fit a copy in host memory
    (as ``--check-first`` makes every rank's).
    ``--out PATH``: the model's and optimizer's state dicts after the load, to ``PATH.rankR``.
    ``--device cuda``: every rank's model and optimizer on the GPU (``train`` takes it too).
    ``--step N``: load step N (``load(state, step=N)``), not the newest valid one.
    ``--one-rank-per-host``: each rank told it is the only one on its host (torchrun's
    ``LOCAL_WORLD_SIZE=1``, ``LOCAL_RANK=0``), as on a job of one rank per node.
    ``--tied``: a model two of whose layers share one weight (``train`` takes it too); the
    line before the last says whether they still do (``tied True``).
    ``--hidden N``: the model's hidden layer N wide (not the 32 it is saved with: a changed model).
    ``--fsdp``: on several ranks, the model sharded with FSDP2 (``fully_shard``), not in DDP,
    and run forward once before the load (FSDP2 registers load hooks of its own then);
    ``--out`` then writes its whole tensors. ``--cosine``: a CosineAnnealingLR where the
    checkpoints have a StepLR's state (a scheduler of another kind).
    Before the last line, one line per DCP streaming reader: ``reader direct=... read=[...]``,
    and one per state file read into the live tensors: ``state file into live: direct=...
    undo=... keep=...``."""
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.checkpoint import manager as manager_module
    from ftkit.checkpoint.dcp_reader import StreamingReader
    from ftkit.errors import CheckpointError

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--fail-read-on", type=int)
    ap.add_argument("--extra-key-on", type=int)
    ap.add_argument("--fail-restore-on", type=int)
    ap.add_argument("--change-after-check", type=int)
    ap.add_argument("--check-first", action="store_true")
    ap.add_argument("--misread-on", type=int)
    ap.add_argument("--hide-older-on", type=int)
    ap.add_argument("--no-room-on", type=int)
    ap.add_argument("--fail-state-read-on", type=int)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--step", type=int)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--one-rank-per-host", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--cosine", action="store_true")
    a = ap.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if a.one_rank_per_host:  # as torchrun launches one rank on each of several hosts
        os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == a.fail_read_on:
        def fail(self, plan, planner):
            raise RuntimeError(f"rank {rank}: the read failed on purpose")
        StreamingReader.read_data = fail  # type: ignore[method-assign]
    state, _ = build_state(rank=rank, world_size=world, device=a.device, tied=a.tied, hidden=a.hidden, fsdp=a.fsdp,
                           cosine=a.cosine)
    if a.fsdp and world > 1:  # a warm-up forward: FSDP2's lazy init registers its load pre-hooks
        import torch

        with torch.no_grad():
            state["model"](torch.randn(2, 8))
    if rank == a.extra_key_on:
        import torch

        state["only_here"] = torch.zeros(3)
    if rank == a.fail_restore_on:
        def refuse(saved):
            raise RuntimeError(f"rank {rank}: the scheduler refused its state on purpose")
        state["scheduler"].load_state_dict = refuse
    readers: list[tuple] = []
    real_init = StreamingReader.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        readers.append((kwargs.get("direct"), self))

    StreamingReader.__init__ = spy  # type: ignore[method-assign]
    into_live: list[str] = []
    real_read_into = manager_module.read_state_into

    def read_into(*args, **kwargs):
        into_live.append(f"state file into live: direct={kwargs.get('direct')} undo={kwargs.get('undo') is not None} "
                         f"keep={kwargs.get('keep') is not None}")
        payload = real_read_into(*args, **kwargs)
        if rank == a.fail_state_read_on:
            raise RuntimeError(f"rank {rank}: the read failed on purpose")
        return payload

    manager_module.read_state_into = read_into
    if rank == a.misread_on:
        real_validate = manager_module.validate_dir

        def misread(path, **kwargs):
            info = real_validate(path, **kwargs)
            for name, meta in info.files.items():
                if name.startswith("rank-") and "crc32" in meta:
                    meta["crc32"] = f"{int(meta['crc32'], 16) ^ 1:08x}"
            return info

        manager_module.validate_dir = misread
    if rank == a.hide_older_on:
        from ftkit.checkpoint.format.layout import list_step_dirs

        seen_validate = manager_module.validate_dir
        newest = list_step_dirs(Path(a.root))[0][1]

        def hide_older(path, **kwargs):
            info = seen_validate(path, **kwargs)
            if Path(path) != newest:
                import dataclasses

                return dataclasses.replace(info, status="corrupt", reason="hidden from this rank on purpose")
            return info

        manager_module.validate_dir = hide_older
    if a.check_first or rank == a.no_room_on:
        from ftkit.checkpoint.state.restore import SetAside

        SetAside.fits = staticmethod(lambda state, sharing=1: False)  # type: ignore[method-assign]
    mgr = make_manager(CheckpointConfig(root=a.root), rank=rank, world_size=world)
    if rank == a.change_after_check:
        real_check = type(mgr)._check_here

        def check_then_change(self, path, info, **kwargs):
            problem = real_check(self, path, info, **kwargs)
            own = sorted((path / "dcp").glob(f"__{rank}_*.distcp"))[0]
            with open(own, "r+b") as f:  # through the page cache, where the checked bytes are
                f.seek(own.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x10]))
            return problem

        type(mgr)._check_here = check_then_change  # type: ignore[method-assign]
    try:
        said = f"loaded {mgr.load(state, step=a.step)}"
    except CheckpointError as exc:
        said = f"CheckpointError: {exc}"
    if a.out:
        import torch

        raw = state["model"].module if hasattr(state["model"], "module") else state["model"]
        model_sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # a collective: same order on every rank
                    for k, v in raw.state_dict().items()}
        scheduler = {k: v for k, v in state["scheduler"].state_dict().items()
                     if k != "load_state_dict"}  # --fail-restore-on's stand-in is not state
        torch.save({"model": model_sd, "optimizer": state["optimizer"].state_dict(), "scheduler": scheduler},
                   f"{a.out}.rank{rank}")
    for direct, reader in readers:
        print(f"reader direct={direct} read={reader.files_read}")
    for line in into_live:
        print(line)
    if a.tied:
        raw = state["model"].module if hasattr(state["model"], "module") else state["model"]
        print(f"tied {raw[2].weight is raw[0].weight}")
    print(said)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1] == "train":
        train_main(sys.argv[2:])
    elif sys.argv[1] == "load":
        load_main(sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")
    # Skip interpreter teardown once results are written: gloo objects torn down there can
    # abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- in-process helpers
class SlowState:
    """A stateful object whose ``state_dict()`` takes ``seconds`` (an FSDP gather, say)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict:
        time.sleep(self.seconds)
        return {"x": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


class FakeManager:
    """A custom manager selectable by import path (``tests.ckpt_helpers:FakeManager``)."""

    def __init__(self, config, *, events=None, rank=0, world_size=1, process_group=None):
        self.config = config
        self.saved: list[int] = []

    def save(self, step, state, *, pin=False, reason=None):
        self.saved.append(step)

    def load(self, state, step=None):
        return None

    def list(self):
        return []

    def validate(self, path, checksums=False):
        raise NotImplementedError

    def wait(self):
        pass

    def close(self):
        pass


class NotAManager:
    def __init__(self, config, **kw):
        pass

    def save(self, step, state):
        pass


def small_state(value: float = 0.0):
    """A tiny state: one tensor filled with ``value`` and a plain dict."""
    import torch

    return {"w": torch.full((64,), float(value)), "extra": {"value": value}}


def make_mgr(root, **kw):
    from ftkit.checkpoint import CheckpointConfig, make_manager

    events = kw.pop("events", None)
    return make_manager(CheckpointConfig(root=root, **kw), events=events)


def native_aio(path) -> str:
    """Why the reader cannot use native AIO for files under ``path`` on this machine, or ""
    (the kernel gives contexts and the filesystem's O_DIRECT reads are asynchronous)."""
    from ftkit.checkpoint.io import aio

    fd = os.open(path, os.O_RDONLY)
    try:
        fs = aio.asynchronous_fs(fd)
    finally:
        os.close(fd)
    ctx = aio.open_context(1)
    if ctx is not None:
        ctx.close()
    if ctx is None:
        return "the kernel gives no native AIO context"
    return "" if fs is not None else f"the filesystem of {path} does not take asynchronous O_DIRECT reads"


class Box:
    """A stateful object holding one number (``state_dict``/``load_state_dict``)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]
