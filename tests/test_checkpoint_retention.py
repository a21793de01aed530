"""Retention: keep_last, milestones, pins, leftovers; never the newest valid, never outside the root."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftkit.checkpoint import CheckpointInfo, pin_checkpoint, unpin_checkpoint, validate_dir
from ftkit.checkpoint import manager as manager_mod
from ftkit.checkpoint.format.retention import delete_checkpoint, plan_retention
from ftkit.errors import CheckpointError
from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import make_mgr, small_state


def _info(step, status="valid", pinned=False):
    return CheckpointInfo(step=step, path=Path(f"/r/step-{step:08d}"), status=status, pinned=pinned)


def _deleted(infos, **kw):
    return sorted(i.step for i, _ in plan_retention(infos, **kw))


def test_plan_keep_last_milestones_pins_leftovers():
    infos = [_info(s) for s in range(1, 11)]
    assert _deleted(infos, keep_last=3, keep_every=None) == [1, 2, 3, 4, 5, 6, 7]
    assert _deleted(infos, keep_last=3, keep_every=4) == [1, 2, 3, 5, 6, 7]
    assert _deleted(infos, keep_last=None, keep_every=None) == []
    infos[0] = _info(1, pinned=True)
    assert _deleted(infos, keep_last=2, keep_every=None) == [2, 3, 4, 5, 6, 7, 8]
    # leftovers: incomplete older than the newest valid go; newer ones stay unless our own failure
    mixed = [
        _info(1),
        _info(2, "incomplete"),
        _info(3),
        _info(4, "incomplete"),
        _info(5, "corrupt"),
    ]
    assert _deleted(mixed, keep_last=5, keep_every=None) == [2]
    assert _deleted(mixed, keep_last=5, keep_every=None, failed={4}) == [2, 4]
    assert _deleted(mixed, keep_last=5, keep_every=None, in_progress={2}) == []
    assert _deleted([_info(1, "corrupt"), _info(2), _info(3)], keep_last=1, keep_every=None) == [
        1,
        2,
    ]
    assert (
        _deleted([_info(1, "corrupt"), _info(2), _info(3)], keep_last=None, keep_every=None) == []
    )
    # no valid checkpoint at all: nothing is deleted
    assert (
        _deleted([_info(1, "incomplete"), _info(2, "corrupt")], keep_last=1, keep_every=None) == []
    )


def test_delete_refuses_outside_root_and_symlinks(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    outside = tmp_path / "outside" / "step-00000001"
    outside.mkdir(parents=True)
    (root / "step-00000002").symlink_to(outside)
    for bad in (outside, root / "step-00000002", root / "notes"):
        with pytest.raises(CheckpointError, match="refusing"):
            delete_checkpoint(root, bad)
    assert outside.is_dir() and (root / "step-00000002").is_symlink()


def test_keep_every_and_events(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    mgr = make_mgr(tmp_path / "ck", keep_last=2, keep_every=3, events=events)
    for step in range(1, 8):
        mgr.save(step, small_state(step))
    assert [i.step for i in mgr.list()] == [7, 6, 3]
    deletes = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "delete"]
    assert sorted(e["step"] for e in deletes) == [1, 2, 4, 5]
    assert all(e["path"].startswith(str(tmp_path / "ck")) and e["reason"] for e in deletes)


def _snapshot_tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.booleans()),
        st.tuples(st.just("fail"), st.integers(0, 2)),
        st.tuples(st.just("crash-leftover"), st.booleans()),
        st.tuples(st.just("pin"), st.integers(0, 30)),
        st.tuples(st.just("unpin"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=ops,
    keep_last=st.one_of(st.none(), st.integers(1, 3)),
    keep_every=st.one_of(st.none(), st.integers(2, 4)),
)
def test_retention_property(ops, keep_last, keep_every):
    base = Path(tempfile.mkdtemp(prefix="ftkit-ret-"))
    try:
        _run_ops(base, ops, keep_last, keep_every)
    finally:
        shutil.rmtree(base)


def _run_ops(base: Path, ops, keep_last, keep_every):
    root = base / "checkpoints"
    root.mkdir()
    outside = base / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (outside / "step-00000000").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "n.txt").write_text("sibling")
    (root / "step-00999999").symlink_to(outside / "step-00000000")  # a step-looking symlink
    (root / "elsewhere").symlink_to(outside)
    before_outside = _snapshot_tree(outside)

    mgr = make_mgr(root, keep_last=keep_last, keep_every=keep_every, fsync=False)
    real_write = manager_mod.write_state_file
    committed: list[int] = []
    pinned: set[int] = set()
    for step, (op, arg) in enumerate(ops, start=1):
        if op == "save":
            info = mgr.save(step, small_state(step), pin=arg)
            committed.append(step)
            if arg:
                pinned.add(step)
            assert info.valid
        elif op == "fail":

            def failing(directory, name, obj, *, _arg=arg, **kw):
                if _arg:
                    (directory / name).write_bytes(b"x" * 100 * _arg)
                raise OSError(errno.ENOSPC, "No space left on device", str(directory / name))

            manager_mod.write_state_file = failing
            try:
                with pytest.raises(CheckpointError, match="ENOSPC"):
                    mgr.save(step, small_state(step))
            finally:
                manager_mod.write_state_file = real_write
            assert validate_dir(root / f"step-{step:08d}").status == "incomplete"
        elif op == "crash-leftover":  # a save killed after its sentinel, or between its mkdir and sentinel
            d = root / f"step-{step:08d}"  # (files without either are not ftkit's: never deleted, tested below)
            d.mkdir()
            if arg:
                (d / "checkpoint-is-incomplete").touch()
                (d / "rank-00000.pt").write_bytes(b"partial")
        elif op in ("pin", "unpin") and committed:
            target = committed[arg % len(committed)]
            if (root / f"step-{target:08d}").is_dir():
                (pin_checkpoint if op == "pin" else unpin_checkpoint)(root, target, sync=False)
                (pinned.add if op == "pin" else pinned.discard)(target)
        # invariants after every operation
        valid = {i.step for i in mgr.list() if i.valid}
        if committed:
            assert committed[-1] in valid, "newest valid checkpoint deleted"
            want = committed if keep_last is None else committed[-keep_last:]
            assert set(want) <= valid
            assert {s for s in committed if keep_every and s % keep_every == 0} <= valid
            assert {s for s in pinned if s in committed} <= valid
        assert _snapshot_tree(outside) == before_outside
        assert (root / "notes" / "n.txt").read_text() == "sibling"
        assert (root / "step-00999999").is_symlink() and (root / "elsewhere").is_symlink()
    # leftovers older than the newest valid are gone after the last successful save
    if committed and ops[-1][0] == "save":
        newest = committed[-1]
        assert all(i.valid or i.step > newest or i.pinned for i in mgr.list())
    os.sync()


def test_a_directory_ftkit_did_not_write_is_never_deleted(tmp_path, caplog):
    """A person's files under step-like names in the checkpoint root (neither the sentinel ftkit
    creates first nor a manifest): retention leaves them with a warning naming them, and a
    save of the same step stops with an error naming the path instead of "File exists"."""
    root = tmp_path / "ckpt"
    mine = root / "step-00000007"
    mine.mkdir(parents=True)
    (mine / "NOTES.txt").write_text("eval notes")
    (root / "step-00000030").write_text("a file, not a directory")
    empty = root / "step-00000003"  # a save killed between its mkdir and its sentinel
    empty.mkdir()
    assert "not a save of ftkit's" in validate_dir(mine).reason
    mgr = make_mgr(root, keep_last=1)
    for step in (10, 20):
        mgr.save(step, small_state(step))
    assert (mine / "NOTES.txt").read_text() == "eval notes"
    assert not empty.exists() and not (root / "step-00000010").exists()
    assert any(f"refusing to delete {mine}" in r.getMessage() and "move it out of" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(CheckpointError, match=r"step-00000030 is in the way and ftkit did not write it"):
        mgr.save(30, small_state(30))
    assert (root / "step-00000030").read_text() == "a file, not a directory"
    assert validate_dir(root / "step-00000020").valid
