"""The controller with background saves: exits wait for durability, switch files go only once
the checkpoint is durable, a failed background save is reported at the next step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ftkit
from ftkit.checkpoint import validate_dir
from ftkit.events import read_events
from tests.conftest import wait_for


def make_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters())}


def events(jobdir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == kind]


def test_exit_decision_waits_until_durable_and_switch_goes_after(tmp_path: Path) -> None:
    cfg = ftkit.Config(async_save=ftkit.AsyncConfig())
    with ftkit.FaultTolerance(tmp_path, state=make_state(), config=cfg) as ft:
        ft.check(0)
        (tmp_path / "save-switch").write_text("")
        wait_for(lambda: ft.box.pending, 10, what="save-switch seen")
        d = ft.step(1)
        assert d.save and not d.exit
        ft.request("save-exit", reason="SIGTERM stand-in")
        d = ft.step(2)
        assert d.exit
        # an exit returns only once its checkpoint is durable
        info = validate_dir(tmp_path / "checkpoints" / "step-00000002", checksums=True)
        assert info.valid, info.reason
    assert not (tmp_path / "save-switch").exists()
    assert validate_dir(tmp_path / "checkpoints" / "step-00000001", checksums=True).valid
    removed = events(tmp_path, "switch-removed")
    saves = {e["step"]: e for e in events(tmp_path, "save")}
    assert removed and removed[0]["time"] >= saves[1]["time"]  # removed after it was durable


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux tmpfs")
def test_background_saves_failing_in_a_row_stop_the_run_with_on_error_warn(tmp_path: Path, small_fs, caplog) -> None:
    """``on_error="warn"`` on a full checkpoint dir (a 2 MiB tmpfs, a ~3 MB state): each failed
    background save is warned of and counted, as synchronous ones are, and the third in a row
    stops the run (max_failed_saves), rather than training on to the end with nothing saved (the
    count was reset each time a snapshot was merely accepted)."""
    import logging

    cfg = ftkit.Config(async_save=ftkit.AsyncConfig(on_error="warn"), save_every=5,
                       checkpoint=ftkit.CheckpointConfig(root=small_fs / "checkpoints"))
    steps = []
    with caplog.at_level(logging.WARNING, logger="ftkit"), \
            pytest.raises(ftkit.CheckpointError, match="3 saves in a row failed") as err, \
            ftkit.FaultTolerance(tmp_path / "job", state=make_state(), config=cfg) as ft:
        for step in ft.range(200):
            steps.append(step)
    counted = [r.getMessage() for r in caplog.records if "training continues" in r.getMessage()]
    assert any("(1 of 3 in a row" in m for m in counted) and any("(2 of 3 in a row" in m for m in counted)
    assert len(steps) < 60, (len(steps), counted)  # stopped, not trained on to 200
    assert "ENOSPC" in str(err.value) or "No space" in str(err.value)


def test_background_failure_is_reported_at_next_step(tmp_path: Path, caplog) -> None:
    """A background save that fails is written as one ``save-failed`` event (with the save's
    reason: the checkpoint's committer writes it, the controller does not write it again) and
    warned of at the next step; the exit's save failing raises."""
    import logging
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        cfg = ftkit.Config(async_save=ftkit.AsyncConfig(on_error="warn"), save_every=1,
                           checkpoint=ftkit.CheckpointConfig(root=root / "checkpoints"))
        ft = ftkit.FaultTolerance(tmp_path, state=make_state(), config=cfg).start()
        ft.step(1)  # ~2 MB of state cannot fit in 1 MiB: the background write fails
        try:
            warned = "a background checkpoint failed, training continues"
            step = 1
            with caplog.at_level(logging.WARNING, logger="ftkit"):
                while warned not in caplog.text:
                    step += 1
                    assert step < 200, "a failed background save was never reported"
                    ft.step(step)
            failed = events(tmp_path, "save-failed")
            assert failed and "ENOSPC" in failed[0]["error"] and "step-0000000" in failed[0]["error"]
            assert failed[0]["reason"].startswith("periodic") and failed[0]["path"].endswith("step-00000001")
            steps = [e["step"] for e in failed]
            assert len(steps) == len(set(steps)), failed  # one event per failed save
            assert not any(info.valid for info in ft.checkpoints.list())
        finally:
            # the exit path waits for the last save; its failure is not swallowed either
            with pytest.raises(ftkit.CheckpointError, match="ENOSPC"):
                ft.close()
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
