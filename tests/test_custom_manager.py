"""A manager of the user's own (``CheckpointConfig(manager="pkg.mod:Class")``) driven by the
controller: it implements only the required methods, ``make_manager`` supplies the rest of the
CheckpointManager protocol, and the controller treats it as the protocol says."""

from __future__ import annotations

from pathlib import Path

import torch

import ftkit
from ftkit.checkpoint import CheckpointConfig
from ftkit.errors import CheckpointError
from ftkit.events import read_events
from tests.ckpt_helpers import FakeManager
from tests.conftest import wait_for


class BackgroundManager(FakeManager):
    """A custom manager that persists in the background and says so the way managers did before
    ``background`` existed: by having ``pending_error``. Durability is set by the test."""

    def __init__(self, config, **kw):
        super().__init__(config, **kw)
        self.steps: list[int] = []
        self.last_durable_step: int | None = None
        self.error: CheckpointError | None = None

    def on_step(self, step, state):
        self.steps.append(step)
        return False

    def pending_error(self):
        error, self.error = self.error, None
        return error


def _events(jobdir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == kind]


def _switch_seen(ft: ftkit.FaultTolerance, jobdir: Path) -> None:
    (jobdir / "save-switch").write_text("")
    wait_for(lambda: ft.box.pending, 10, what="save-switch seen")


def test_custom_manager_saves_through_the_controller(tmp_path: Path) -> None:
    cfg = ftkit.Config(checkpoint=CheckpointConfig(manager="tests.ckpt_helpers:FakeManager"))
    with ftkit.FaultTolerance(tmp_path, state={"w": torch.zeros(4)}, config=cfg) as ft:
        assert ft.resume() == 0
        mgr = ft.checkpoints
        assert type(mgr).__name__ == "FakeManager" and not mgr.background
        ft.check(0)
        _switch_seen(ft, tmp_path)
        assert ft.step(1).save
        assert mgr.saved == [1]
        # its save returned, so it is durable: the switch it answered is gone at once
        assert not (tmp_path / "save-switch").exists()
    assert _events(tmp_path, "resume")[0]["saved_world_size"] is None


def test_custom_background_manager_is_polled_and_its_durability_awaited(tmp_path: Path) -> None:
    cfg = ftkit.Config(checkpoint=CheckpointConfig(manager=f"{__name__}:BackgroundManager"))
    with ftkit.FaultTolerance(tmp_path, state={"w": torch.zeros(4)}, config=cfg) as ft:
        mgr = ft.checkpoints
        assert mgr.background
        ft.check(0)
        _switch_seen(ft, tmp_path)
        assert ft.step(1).save
        assert mgr.saved == [1]
        assert (tmp_path / "save-switch").exists()  # not durable yet: the switch stays
        mgr.last_durable_step = 1
        mgr.error = CheckpointError("disk full on the custom store")
        ft.step(2)
        assert mgr.steps == [1, 2]
        assert not (tmp_path / "save-switch").exists()
    failed = _events(tmp_path, "save-failed")
    assert [(e["step"], e["error"]) for e in failed] == [(2, "disk full on the custom store")]


class SilentBackgroundManager(FakeManager):
    """A background manager (``pending_error``) that never says when a save is durable."""

    def pending_error(self):
        return None


def test_a_background_manager_without_durability_counts_a_save_durable_when_it_returns(tmp_path: Path) -> None:
    """As before ``last_durable_step`` was in the protocol: the answered switch is removed, not kept forever."""
    cfg = ftkit.Config(checkpoint=CheckpointConfig(manager=f"{__name__}:SilentBackgroundManager"))
    with ftkit.FaultTolerance(tmp_path, state={"w": torch.zeros(4)}, config=cfg) as ft:
        mgr = ft.checkpoints
        assert mgr.background and mgr.last_durable_step is None
        ft.check(0)
        _switch_seen(ft, tmp_path)
        assert ft.step(1).save
        assert mgr.saved == [1] and mgr.last_durable_step == 1
        assert not (tmp_path / "save-switch").exists()
