"""The saves that end a run, in real processes: the end of training's, and a save-switch's at
the step just resumed from."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftkit.checkpoint import validate_dir
from ftkit.events import read_events

# Trains STEPS steps of a small model, saving every 10 (checkpoints under ROOT, keeping 3);
# after FILL_AT steps it fills ROOT's filesystem with a file, so the next save finds it full.
LOOP = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch

    import ftkit
    from ftkit.checkpoint import AsyncConfig, CheckpointConfig

    jobdir, root, steps, fill_at, background = Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = ftkit.Config(
        budget=ftkit.BudgetConfig(enabled=False), save_every=10,
        checkpoint=CheckpointConfig(root=root, keep_last=3),
        async_save=AsyncConfig() if background else None,
    )
    with ftkit.FaultTolerance(jobdir, state={"model": model, "optimizer": opt}, config=config) as ft:
        for step in ft.range(steps):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            if step + 1 == fill_at:
                ft.checkpoints.wait()  # the last periodic checkpoint is durable first
                with open(root / "filler", "wb") as f:
                    try:
                        while True:
                            f.write(b"x" * 65536)
                    except OSError:
                        pass
    print("completed" if ft.completed else "stopped", flush=True)
""")


def run_loop(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOOP, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("background", [0, 1], ids=["sync", "async"])
def test_a_failed_end_of_training_save_fails_the_run(tmp_path: Path, small_fs: Path, background: int) -> None:
    """The last steps' only copy is the end of training's checkpoint: when it cannot be written
    the process exits non-zero and its exit event says it did not complete, so the requeue
    policy sees a crash and the next run resumes from the last checkpoint written."""
    jobdir = tmp_path / "job"
    root = small_fs / "checkpoints"
    out = run_loop(jobdir, root, 25, 21, background)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "completed" not in out.stdout
    assert "No space left on device" in out.stderr or "ENOSPC" in out.stderr, out.stderr
    events = list(read_events(jobdir / "events.jsonl"))
    failed = [e for e in events if e["event"] == "save-failed"]
    assert [e["step"] for e in failed][-1:] == [25] and failed[-1]["reason"] == "end of training"
    assert len([e for e in failed if e["step"] == 25]) == 1, failed  # one event, not the committer's and the controller's
    ends = [e for e in events if e["event"] == "exit"]
    assert ends and ends[-1]["completed"] is False
    assert validate_dir(root / "step-00000020").valid
    assert not validate_dir(root / "step-00000025").valid


def test_a_save_switch_answered_by_the_checkpoint_resumed_from_pins_it(tmp_path: Path) -> None:
    """A save-switch asks for a pinned checkpoint. Present when a run resumes at the step of its
    newest checkpoint, it is answered by that checkpoint, which is pinned: retention keeps it."""
    jobdir, root = tmp_path / "job", tmp_path / "job" / "checkpoints"
    first = run_loop(jobdir, root, 20, -1, 0)
    assert first.returncode == 0 and "completed" in first.stdout, first.stderr
    assert validate_dir(root / "step-00000020").valid and not (root / "step-00000020" / "pinned").exists()
    (jobdir / "save-switch").touch()
    again = run_loop(jobdir, root, 20, -1, 0)
    assert again.returncode == 0, again.stderr
    assert (root / "step-00000020" / "pinned").exists()
    assert not (jobdir / "save-switch").exists()
    more = run_loop(jobdir, root, 60, -1, 0)  # four more checkpoints, keep_last 3
    assert more.returncode == 0, more.stderr
    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps == ["step-00000020", "step-00000040", "step-00000050", "step-00000060"], steps
