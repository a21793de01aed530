"""A full disk during a save, on a real 2 MiB tmpfs (needs root to mount; skipped otherwise)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from ftkit.checkpoint import validate_dir
from ftkit.errors import CheckpointError
from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import make_mgr


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_during_save(small_fs, tmp_path):
    root = small_fs / "checkpoints"
    events = EventLog(tmp_path / "events.jsonl")
    mgr = make_mgr(root, keep_last=3, events=events)
    mgr.save(1, {"w": torch.ones(100_000)})  # ~400 KB
    before = validate_dir(root / "step-00000001", checksums=True)
    assert before.valid
    original = (root / "step-00000001" / "rank-00000.pt").read_bytes()

    with pytest.raises(CheckpointError) as err:
        mgr.save(2, {"w": torch.ones(1_000_000)})  # ~4 MB: does not fit
    msg = str(err.value)
    assert "ENOSPC" in msg and str(root / "step-00000002") in msg
    assert "bytes" in msg and "4000000 bytes of tensors" in msg
    on_disk = validate_dir(root / "step-00000001").size  # a disk is sized by what a checkpoint takes there
    assert f"(the newest valid checkpoint, step-00000001, takes {on_disk} bytes on disk)" in msg, msg
    partial = validate_dir(root / "step-00000002")
    assert (
        partial.status == "incomplete"
        and (root / "step-00000002" / "checkpoint-is-incomplete").exists()
    )
    after = validate_dir(root / "step-00000001", checksums=True)
    assert after.valid and after.files == before.files
    assert (root / "step-00000001" / "rank-00000.pt").read_bytes() == original

    state = {"w": torch.zeros(100_000)}
    assert make_mgr(root).load(state) == 1 and torch.equal(state["w"], torch.ones(100_000))

    # the next save cleans up the failed partial first, so it fits again
    assert mgr.save(3, {"w": torch.full((100_000,), 3.0)}).valid
    assert not (root / "step-00000002").exists()
    assert validate_dir(root / "step-00000001", checksums=True).valid
    kinds = [(e["event"], e.get("step")) for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == [("save", 1), ("save-failed", 2), ("delete", 2), ("save", 3)]


def test_leftover_of_an_earlier_run_is_removed_before_the_next_save(small_fs):
    root = small_fs / "checkpoints"
    make_mgr(root).save(1, {"w": torch.ones(10)})
    with pytest.raises(CheckpointError, match="ENOSPC"):
        make_mgr(root).save(
            2, {"w": torch.ones(1_000_000)}
        )  # that run dies, its partial fills the disk
    assert validate_dir(root / "step-00000002").status == "incomplete"
    restarted = make_mgr(root)  # a requeued run: the partial is a crash leftover, not in progress
    assert restarted.load({"w": torch.zeros(10)}) == 1
    assert restarted.save(3, {"w": torch.ones(10)}).valid
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000003"]


def test_a_lower_keep_last_gets_the_room_back_on_a_full_disk(small_fs, tmp_path):
    """A run with keep_last=3 fills the 2 MiB disk (three ~600 KB checkpoints, the fourth save
    fails); the next run, given keep_last=1 for it, deletes the two oldest before its first
    save, which then fits: the newest valid checkpoint stays throughout."""
    root = small_fs / "checkpoints"
    events = EventLog(tmp_path / "events.jsonl")
    state = {"w": torch.ones(150_000)}
    first = make_mgr(root, keep_last=3, events=events)
    for step in (1, 2, 3):
        first.save(step, state)
    with pytest.raises(CheckpointError, match="ENOSPC"):
        first.save(4, state)
    first.close()

    again = make_mgr(root, keep_last=1, events=events)
    again.save(5, state)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005"]
    assert validate_dir(root / "step-00000005", checksums=True).valid
    deleted = [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "delete"]
    assert sorted(deleted) == [1, 2, 3, 4], deleted
