"""A run that goes on from an older checkpoint than the newest (a rollback: a step loaded by
number), or from nothing (``resume='never'``), in a job dir that holds later checkpoints of
another history. Before, a save of a step that existed kept the old checkpoint and dropped the
new state (one INFO line), and a later resume took the other history's newest: the rollback's
training was lost. Now those later checkpoints are set aside, whole, at the run's first save."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftkit.checkpoint import validate_dir
from ftkit.events import read_events

# Trains to STEPS with lr LR, saving every 20; LOAD >= 0: from that checkpoint, by number;
# HOW: sync, thread (async), shm (async, crash-safe saver) or shm-periodic (the saver persists
# the memory snapshots of every 10th step every 20 steps, on_step). Prints the weights' checksum.
TRAIN = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch

    import ftkit
    from ftkit.checkpoint import AsyncConfig, CheckpointConfig

    jobdir, steps, load, lr, how, resume = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:7]
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    config = ftkit.Config(
        budget=ftkit.BudgetConfig(enabled=False), save_every=None if how == "shm-periodic" else 20,
        checkpoint=CheckpointConfig(keep_last=2, resume=resume),
        async_save=None if how == "sync" else AsyncConfig(crash_safe=how != "thread",
                                                          **({"memory_every": 10, "persist_every": 2}
                                                             if how == "shm-periodic" else {})),
    )
    state = {"model": model, "optimizer": opt}
    with ftkit.FaultTolerance(jobdir, state=state, config=config) as ft:
        start = None
        if load >= 0:
            start = ft.checkpoints.load(state, step=load)
            for group in opt.param_groups:
                group["lr"] = lr
        for step in ft.range(steps, start=start):
            torch.manual_seed(step)
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    print("weights", float(model.weight.sum()), flush=True)
""")


def train(jobdir: Path, steps: int, *, load: int = -1, lr: float = 0.01, how: str = "sync",
          resume: str = "auto") -> float:
    out = subprocess.run([sys.executable, "-c", TRAIN, str(jobdir), str(steps), str(load), str(lr), how, resume],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return float(out.stdout.split("weights")[-1])


def steps_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("step-*"))


@pytest.mark.parametrize("how", ["sync", "thread", "shm", "shm-periodic"])
def test_a_rollback_sets_the_later_history_aside_and_keeps_its_own(tmp_path: Path, how: str) -> None:
    job, root = tmp_path / "job", tmp_path / "job" / "checkpoints"
    train(job, 60, how=how)
    assert steps_in(root) == ["step-00000040", "step-00000060"]
    old60 = (root / "step-00000060" / "manifest.json").read_bytes()

    # back to step 40 with another learning rate, to step 80: its 60 is not the old 60
    rolled = train(job, 80, load=40, lr=0.001, how=how)
    (aside,) = root.glob("set-aside-*-after-step-00000040")
    assert steps_in(aside) == ["step-00000060"]
    assert (aside / "step-00000060" / "manifest.json").read_bytes() == old60
    assert validate_dir(aside / "step-00000060", checksums=True).valid
    assert steps_in(root) == ["step-00000060", "step-00000080"]
    assert (root / "step-00000060" / "manifest.json").read_bytes() != old60
    moved = [e for e in read_events(job / "events.jsonl") if e["event"] == "set-aside"]
    assert [(e["step"], e["steps"]) for e in moved] == [(40, [60])]

    # the next run resumes the rollback's history: same weights as the rollback ended with
    assert train(job, 80, how=how) == rolled
    # and the rollback's result is what a run straight through with those settings gets
    straight = tmp_path / "straight"
    train(straight, 40, how=how)
    assert train(straight, 80, load=40, lr=0.001, how=how) == rolled


def test_a_fresh_start_sets_the_old_history_aside(tmp_path: Path) -> None:
    job, root = tmp_path / "job", tmp_path / "job" / "checkpoints"
    train(job, 40)
    old = {name: (root / name / "manifest.json").read_bytes() for name in steps_in(root)}
    fresh = train(job, 40, lr=0.001, resume="never")
    (aside,) = root.glob("set-aside-*")
    assert not aside.name.endswith("step-00000000") and "-after-" not in aside.name
    assert {name: (aside / name / "manifest.json").read_bytes() for name in steps_in(aside)} == old
    assert steps_in(root) == ["step-00000020", "step-00000040"]
    assert train(job, 40) == fresh  # auto resume: the fresh run's 40, nothing left to train
