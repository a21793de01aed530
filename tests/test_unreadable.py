"""A checkpoint this process cannot read (permission denied): not known to be bad, so a load
stops at it, naming the file, instead of falling back past it, and nothing deletes it.

The loads run without the capabilities that let root read any file whatever its mode
(``setpriv --bounding-set=-dac_override,-dac_read_search``): as a user who may not read it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftkit.checkpoint import CheckpointInfo, validate_dir
from ftkit.checkpoint.format.retention import plan_retention
from ftkit.errors import CheckpointError
from tests.ckpt_helpers import make_mgr, small_state

LOAD = textwrap.dedent("""
    import sys
    from tests.ckpt_helpers import make_mgr, small_state
    from ftkit.errors import CheckpointError
    state = small_state()
    try:
        step = make_mgr(sys.argv[1], keep_last=1).load(state)
    except CheckpointError as exc:
        print("refused:", exc)
    else:
        print("loaded", step, state["extra"]["value"])
""")


def without_override(*args: str) -> subprocess.CompletedProcess:
    """``args`` run as root without the capabilities to read past a file's mode."""
    assert os.geteuid() == 0, "this machine runs the tests as root"
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", *args],
                          capture_output=True, text=True, timeout=120, cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)})


def test_a_load_stops_at_a_checkpoint_it_cannot_read(tmp_path: Path) -> None:
    root = tmp_path / "job" / "checkpoints"
    mgr = make_mgr(root, keep_last=None)
    for step in (1, 2):
        mgr.save(step, small_state(step))
    manifest = root / "step-00000002" / "manifest.json"
    manifest.chmod(0o000)

    out = without_override(sys.executable, "-c", LOAD, str(root))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr  # not "loaded 1 1.0"
    assert str(manifest) in out.stdout and "Permission denied" in out.stdout
    ls = without_override(sys.executable, "-m", "ftkit", "ls", str(root.parent))
    assert "unreadable" in ls.stdout + ls.stderr and "corrupt" not in ls.stdout, ls.stdout + ls.stderr
    assert "incomplete" not in ls.stdout, ls.stdout
    # and `ftkit status` says the next run stops there, not that it resumes from step 1
    status = without_override(sys.executable, "-m", "ftkit", "status", str(root.parent), "--json")
    verdict = json.loads(status.stdout)["verdict"]
    assert verdict.startswith("if the job dies now, its next run stops at step 2 instead of resuming"), verdict
    assert str(manifest) in verdict, verdict

    # a directory it cannot enter reads as unreadable too, not as an incomplete leftover
    manifest.chmod(0o644)
    (root / "step-00000002").chmod(0o000)
    info = without_override(sys.executable, "-c", "import sys; from ftkit.checkpoint import validate_dir; "
                            "print(validate_dir(sys.argv[1]).status)", str(root / "step-00000002"))
    assert info.stdout.strip() == "unreadable", info.stdout + info.stderr

    # root reads it: intact, loaded, nothing was deleted on the way
    (root / "step-00000002").chmod(0o755)
    assert validate_dir(root / "step-00000002", checksums=True).valid
    state = small_state()
    assert make_mgr(root).load(state) == 2 and state["extra"]["value"] == 2


def test_retention_never_deletes_an_unreadable_checkpoint(tmp_path: Path) -> None:
    infos = [CheckpointInfo(step=s, path=tmp_path / f"step-{s:08d}", status="valid") for s in (3, 4, 5)]
    infos.append(CheckpointInfo(step=1, path=tmp_path / "step-00000001", status="unreadable", reason="denied"))
    infos.append(CheckpointInfo(step=2, path=tmp_path / "step-00000002", status="corrupt", reason="bad"))
    doomed = {info.step for info, _ in plan_retention(infos, keep_last=1, keep_every=None)}
    assert doomed == {2, 3, 4}


def test_a_switch_in_a_job_dir_this_user_may_not_write_names_the_cause(tmp_path: Path) -> None:
    """``ftkit kill`` by a user who may not write in the job dir: the error says so (it said to
    remove whatever is in the switch's place), exit 2, and no traceback."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "events.jsonl").write_text("")
    job.chmod(0o555)
    out = without_override(sys.executable, "-m", "ftkit", "kill", str(job))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    said = " ".join(out.stderr.split())
    assert f"this user may not write in {job}" in said and "remove whatever" not in said, said
    assert not (job / "kill-switch").exists()


def test_a_manifest_that_is_a_directory_is_corrupt_not_unreadable(tmp_path: Path) -> None:
    """Only errors that say the process may not or cannot look (permissions, I/O, a network
    filesystem) make a checkpoint unreadable; a broken layout stays corrupt, and a resume
    falls back past it."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    for step in (1, 2):
        mgr.save(step, small_state(step))
    manifest = root / "step-00000002" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()
    info = validate_dir(root / "step-00000002")
    assert info.status == "corrupt" and "Is a directory" in info.reason, info
    state = small_state()
    assert make_mgr(root).load(state) == 1 and state["extra"]["value"] == 1


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EMFILE, errno.ENOMEM, errno.EINTR])
def test_an_error_of_the_system_is_unreadable_not_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code) -> None:
    """A stale NFS handle, too many open files, no memory: the checkpoint is not known to be bad.
    ``validate_dir`` says unreadable (only a broken layout is corrupt), and a resume stops there
    naming it instead of falling back past it, and sets nothing aside."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    for step in (1, 2):
        mgr.save(step, small_state(step))
    newest = root / "step-00000002"
    victim = newest / next(iter(json.loads((newest / "manifest.json").read_text())["files"]))
    lstat = os.lstat

    def failing(path, *args, **kwargs):
        if Path(path) == victim:
            raise OSError(code, os.strerror(code), str(path))
        return lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", failing)
    info = validate_dir(newest)
    assert info.status == "unreadable" and os.strerror(code) in info.reason, info
    with pytest.raises(CheckpointError, match="step-00000002"):
        make_mgr(root).load(small_state())
    monkeypatch.setattr(os, "lstat", lstat)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000001", "step-00000002"]
    assert not [p for p in root.iterdir() if p.name.startswith("set-aside")]
    state = small_state()
    assert make_mgr(root).load(state) == 2 and state["extra"]["value"] == 2


def test_a_switch_on_a_full_or_read_only_filesystem_names_that_cause(tmp_path: Path) -> None:
    """``ftkit save`` and ``ftkit request`` where the job dir's filesystem is full (no inode
    left), then read-only: the error names that, not a permission problem or "remove whatever
    is there", and exits 2 (a setting or path to fix)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=8", "tmpfs", str(mnt)], check=True)
    try:
        job = mnt / "job"
        job.mkdir()
        (job / "events.jsonl").write_text("")
        repo = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(repo)}
        try:
            for n in range(16):  # the last inodes
                (mnt / f"f{n}").touch()
        except OSError:
            pass
        for command in (["save"], ["request", "save"]):  # a switch file, a request file
            full = subprocess.run([sys.executable, "-m", "ftkit", *command, str(job)], capture_output=True,
                                  text=True, timeout=60, env=env)
            said = " ".join(full.stderr.split())
            assert full.returncode == 2 and "is full (no space or no inodes left)" in said, (command, said)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for command in (["save"], ["request", "save"]):
            ro = subprocess.run([sys.executable, "-m", "ftkit", *command, str(job)], capture_output=True, text=True,
                                timeout=60, env=env)
            said = " ".join(ro.stderr.split())
            assert ro.returncode == 2 and "read-only filesystem here" in said, (command, said)
            assert "may not write" not in said and "Traceback" not in said
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
