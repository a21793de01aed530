"""Commit protocol, state round trip, validation, corruption fallback, resume modes, custom managers."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from ftkit.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    ResumableSampler,
    make_manager,
    validate_dir,
)
from ftkit.checkpoint import manager as manager_mod
from ftkit.errors import CheckpointError, ConfigError, NoCheckpointError
from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import REPO, env, make_mgr, small_state


def test_commit_layout_and_manifest(tmp_path):
    root = tmp_path / "checkpoints"
    seen = {}
    real_write = manager_mod.write_state_file

    def spy(directory, name, obj, **kw):
        seen["sentinel_during_write"] = (directory / "checkpoint-is-incomplete").exists()
        seen["manifest_during_write"] = (directory / "manifest.json").exists()
        return real_write(directory, name, obj, **kw)

    mgr = make_mgr(root)
    manager_mod.write_state_file, saved = spy, manager_mod.write_state_file
    try:
        info = mgr.save(7, small_state(1), reason="save-switch")
    finally:
        manager_mod.write_state_file = saved
    assert seen == {"sentinel_during_write": True, "manifest_during_write": False}
    step_dir = root / "step-00000007"
    assert (
        info.valid and info.step == 7 and info.path == step_dir and info.saved_for == "save-switch"
    )
    assert sorted(os.listdir(step_dir)) == ["manifest.json", "rank-00000.pt"]
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert (
        manifest["step"] == 7
        and manifest["world_size"] == 1
        and manifest["reason"] == "save-switch"
    )
    assert manifest["checksum"] == "crc32" and manifest["torch_version"] == torch.__version__
    data = (step_dir / "rank-00000.pt").read_bytes()
    entry = manifest["files"]["rank-00000.pt"]
    assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert (root / "latest").read_text().strip() == "step-00000007"
    assert validate_dir(step_dir, checksums=True).valid


def test_each_fsync_comes_after_what_it_must_make_durable(tmp_path, monkeypatch):
    """The commit's fsyncs, recorded with what the directory held at each: the data before the
    manifest exists, the manifest's temp file before its rename, the step directory once the
    manifest is in and the sentinel gone, the root last (the step directory's own entry)."""
    root = tmp_path / "checkpoints"
    mgr = make_mgr(root)
    mgr.save(1, small_state(1))  # the root exists before the recorded save
    step_dir = root / "step-00000002"
    real_fsync, seen = os.fsync, []

    def record(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        names = sorted(os.listdir(step_dir)) if step_dir.is_dir() else []
        latest = (root / "latest").read_text().strip()
        seen.append((os.path.relpath(target, root), names, latest))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    mgr.save(2, small_state(2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    targets = [t for t, _, _ in seen]
    assert targets[0] == "step-00000002/rank-00000.pt" and "manifest.json" not in seen[0][1]
    assert targets[1].startswith("step-00000002/.manifest.json.tmp-")
    assert seen[1][1] == [targets[1].split("/")[1], "checkpoint-is-incomplete", "rank-00000.pt"]
    assert seen[2][:2] == ("step-00000002", ["manifest.json", "rank-00000.pt"])
    assert targets[3].startswith(".latest.tmp-")
    assert seen[4] == (".", ["manifest.json", "rank-00000.pt"], "step-00000002")
    assert len(seen) == 5, targets  # docs/format.md: five fsyncs per save with one rank


def test_full_state_round_trip(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sampler = ResumableSampler(10, seed=3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    it = iter(sampler)
    first = [next(it) for _ in range(4)]
    extra = {"epoch": 2, "names": ["a", "b"], "t": torch.arange(3.0), "nested": {"k": 1.5}}
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "sampler": sampler,
        "extra": extra,
        "count": 11,
        "raw": torch.ones(2),
    }
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    mgr = make_mgr(tmp_path / "ck")
    mgr.save(5, state)
    expected = (
        random.random(),
        np.random.rand(),
        torch.rand(1).item(),
        [next(it) for _ in range(6)],
    )
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = opt.state_dict()["state"][0]["exp_avg"].clone()

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    sampler2 = ResumableSampler(10, seed=3)
    extra2 = {"epoch": 0}
    raw2 = torch.zeros(2)
    state2 = {
        "model": model2,
        "optimizer": opt2,
        "scheduler": sched2,
        "scaler": scaler2,
        "sampler": sampler2,
        "extra": extra2,
        "count": 0,
        "raw": raw2,
    }
    random.seed(99)
    assert make_mgr(tmp_path / "ck").load(state2) == 5
    got = (random.random(), np.random.rand(), torch.rand(1).item(), list(sampler2))
    assert got == expected and first + got[3] == list(ResumableSampler(10, seed=3))
    assert all(torch.equal(ref[k], v) for k, v in model2.state_dict().items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], ref_opt)
    assert sched2.state_dict() == sched.state_dict() and scaler2.get_scale() == 1024.0
    assert state2["extra"] is extra2 and extra2["epoch"] == 2 and extra2["nested"] == {"k": 1.5}
    assert torch.equal(extra2["t"], torch.arange(3.0)) and extra2["names"] == ["a", "b"]
    assert state2["count"] == 11 and state2["raw"] is raw2 and torch.equal(raw2, torch.ones(2))


def test_unsupported_object_refused_before_anything_is_written(tmp_path):
    mgr = make_mgr(tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"state\['extra'\]\['obj'\]"):  # the state's fault, not the disk's
        mgr.save(1, {"extra": {"obj": object()}})
    assert not (tmp_path / "ck").exists() or not os.listdir(tmp_path / "ck")


def _corrupt(step_dir, how):
    f = step_dir / "rank-00000.pt"
    if how == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    elif how == "flipped-byte":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
    elif how == "missing-file":
        f.unlink()
    elif how == "missing-manifest":
        (step_dir / "manifest.json").unlink()
    elif how == "garbled-manifest":
        (step_dir / "manifest.json").write_text('{"format": "ftkit-checkpoint", "st')
    elif how == "sentinel":
        (step_dir / "checkpoint-is-incomplete").touch()


CORRUPTIONS = [
    "truncated",
    "flipped-byte",
    "missing-file",
    "missing-manifest",
    "garbled-manifest",
    "sentinel",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corruption_detected_and_resume_falls_back(tmp_path, how, caplog):
    root = tmp_path / "ck"
    events = EventLog(tmp_path / "events.jsonl")
    mgr = make_mgr(root, keep_last=None, events=events)
    for step in (1, 2, 3):
        mgr.save(step, small_state(step))
    _corrupt(root / "step-00000003", how)
    info = validate_dir(root / "step-00000003", checksums=True)
    assert not info.valid and info.reason
    if how == "flipped-byte":
        assert validate_dir(root / "step-00000003").valid  # same size: only the checksum sees it
    state = small_state(0)
    with caplog.at_level(logging.WARNING, logger="ftkit.checkpoint"):
        assert make_mgr(root, events=events).load(state) == 2
    assert torch.equal(state["w"], torch.full((64,), 2.0)) and state["extra"]["value"] == 2
    assert "step-00000003" in caplog.text
    skips = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "skip"]
    assert [(e["step"], e["path"]) for e in skips] == [(3, str(root / "step-00000003"))]
    assert skips[0]["reason"]


def test_resume_modes(tmp_path):
    root = tmp_path / "ck"
    assert make_mgr(root, resume="auto").load(small_state()) is None
    with pytest.raises(NoCheckpointError, match=str(root)):
        make_mgr(root, resume="required").load(small_state())
    make_mgr(root).save(4, small_state(4))
    assert make_mgr(root, resume="never").load(small_state()) is None
    assert make_mgr(root, resume="required").load(small_state()) == 4
    (root / "step-00000004" / "checkpoint-is-incomplete").touch()
    with pytest.raises(NoCheckpointError, match="incomplete"):
        make_mgr(root, resume="required").load(small_state())


def test_load_given_step_and_resave_same_step(tmp_path):
    """Loading step 1 by number while step 2 exists forks the history: at this run's first save
    the old step 2 goes aside (kept, whole) and the new save of step 2 is written, not skipped."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    mgr.save(1, small_state(1))
    mgr.save(2, small_state(2))
    state = small_state()
    mgr = make_mgr(root, keep_last=None)
    assert mgr.load(state, step=1) == 1 and state["extra"]["value"] == 1
    before = (root / "step-00000002" / "manifest.json").read_bytes()
    info = mgr.save(2, small_state(9), pin=True)
    assert info.valid and info.pinned
    (aside,) = root.glob("set-aside-*-after-step-00000001")
    assert (aside / "step-00000002" / "manifest.json").read_bytes() == before
    assert validate_dir(aside / "step-00000002", checksums=True).valid
    state = small_state()
    assert make_mgr(root).load(state) == 2 and state["extra"]["value"] == 9


def test_incomplete_same_step_leftover_is_replaced(tmp_path):
    root = tmp_path / "ck"
    (root / "step-00000003").mkdir(parents=True)
    (root / "step-00000003" / "checkpoint-is-incomplete").touch()
    (root / "step-00000003" / "rank-00000.pt").write_bytes(b"junk")
    assert make_mgr(root).save(3, small_state(3)).valid


def test_config_validation_names_setting(tmp_path):
    for kw, setting in [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_every": -1}, "keep_every"),
        ({"resume": "maybe"}, "resume"),
        ({"manager": "nocolon"}, "manager"),
    ]:
        with pytest.raises(ConfigError, match=f"checkpoint.{setting}"):
            CheckpointConfig(root=tmp_path, **kw)


def test_custom_manager_by_import_path(tmp_path):
    mgr = make_manager(CheckpointConfig(root=tmp_path, manager="tests.ckpt_helpers:FakeManager"))
    assert type(mgr).__name__ == "FakeManager"
    mgr.save(1, {})
    assert mgr.saved == [1]
    assert isinstance(make_manager(CheckpointConfig(root=tmp_path)), Checkpointer)
    with pytest.raises(ConfigError, match="missing load, list, validate, wait, close"):
        make_manager(CheckpointConfig(root=tmp_path, manager="tests.ckpt_helpers:NotAManager"))
    with pytest.raises(ConfigError, match="cannot import"):
        make_manager(CheckpointConfig(root=tmp_path, manager="no_such_pkg.mod:X"))
    with pytest.raises(ConfigError, match="has no"):
        make_manager(CheckpointConfig(root=tmp_path, manager="tests.ckpt_helpers:Nope"))


def test_save_failure_leaves_incomplete_and_earlier_untouched(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    events = EventLog(tmp_path / "events.jsonl")
    mgr = make_mgr(root, events=events)
    mgr.save(1, small_state(1))
    before = validate_dir(root / "step-00000001", checksums=True)

    def vanish(directory, name, obj, **kw):
        import shutil

        shutil.rmtree(directory)
        raise FileNotFoundError(2, "No such file or directory", str(directory / name))

    monkeypatch.setattr(manager_mod, "write_state_file", vanish)
    with pytest.raises(CheckpointError, match=r"step-00000002.*ENOENT.*bytes"):
        mgr.save(2, small_state(2))
    monkeypatch.undo()
    after = validate_dir(root / "step-00000001", checksums=True)
    assert after.valid and after.files == before.files
    assert [e["event"] for e in read_events(tmp_path / "events.jsonl")] == ["save", "save-failed"]
    assert make_mgr(root).load(small_state()) == 1


def test_import_does_not_pull_torch():
    code = "import sys, ftkit.checkpoint, ftkit.checkpoint.format.manifest; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
