"""The one durable-write helper (``ftkit._fs``), shared by the job-dir writers and the checkpoints."""

from __future__ import annotations

import contextlib
import errno
import os
import stat

import pytest

from ftkit import _fs
from ftkit.checkpoint.io import files as _files


def test_a_full_disk_leaves_the_old_file_and_no_temporary(small_fs):
    """ENOSPC halfway: the target keeps its old content, and no temporary file is left behind
    (a job dir's requests/ or a step directory would otherwise collect them). The error names
    the file (a write's ENOSPC names none: a job started on a full disk said only "No space
    left on device", from deep in the lease)."""
    target = small_fs / "runs.json"
    _fs.atomic_write(target, b"old\n")
    with pytest.raises(OSError) as err:
        _fs.atomic_write(target, b"x" * (4 << 20))  # twice the filesystem
    assert err.value.errno == errno.ENOSPC
    assert err.value.filename == str(target) and str(target) in str(err.value)
    assert target.read_bytes() == b"old\n"
    assert sorted(os.listdir(small_fs)) == ["runs.json"]


def test_both_names_write_through_the_same_temporary_and_keep_their_modes(tmp_path, monkeypatch):
    """``_files.atomic_write_bytes`` (checkpoint files, 0o666 before the umask like torch.save's)
    and ``_fs.atomic_write`` (job-dir files, 0o644) are one implementation: same ``.NAME.tmp-PID``
    temporary, renamed over the target."""
    old = os.umask(0o002)
    renamed = []
    real_replace = os.replace

    def record(src, dst):
        renamed.append((os.path.basename(src), os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record)
    try:
        _fs.atomic_write(tmp_path / "lease", b"a")
        _files.atomic_write_bytes(tmp_path / "manifest.json", b"b")
    finally:
        os.umask(old)
    pid = os.getpid()
    assert renamed == [(f".lease.tmp-{pid}", "lease"), (f".manifest.json.tmp-{pid}", "manifest.json")]
    assert stat.S_IMODE(os.stat(tmp_path / "lease").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "manifest.json").st_mode) == 0o664
    assert (tmp_path / "lease").read_bytes() == b"a" and (tmp_path / "manifest.json").read_bytes() == b"b"
    assert _files.fsync_dir is _fs.fsync_dir


def test_fsync_dir_raises_for_a_missing_directory(tmp_path):
    """A directory that cannot be fsynced for a reason other than the filesystem refusing it is
    an error: the entry just renamed there is not known to be durable."""
    with pytest.raises(FileNotFoundError):
        _fs.fsync_dir(tmp_path / "gone")


def test_replace_within_renames_inside_the_context_and_only_when_it_says_so(tmp_path):
    """The data is durable in the temporary before the context is entered; the rename happens
    inside it (the lease heartbeat holds its lock there), and a context that yields False leaves
    the target as it was and no temporary behind."""
    target = tmp_path / "lease.json"
    _fs.atomic_write(target, b"theirs\n")
    seen = []

    @contextlib.contextmanager
    def gate(answer: bool):
        tmp = tmp_path / f".lease.json.tmp-{os.getpid()}"
        seen.append((tmp.read_bytes(), target.read_bytes()))  # ours staged, theirs still in place
        yield answer
        seen.append(target.read_bytes())

    assert _fs.atomic_write(target, b"ours\n", replace_within=lambda: gate(False)) is False
    assert target.read_bytes() == b"theirs\n" and sorted(os.listdir(tmp_path)) == ["lease.json"]
    assert _fs.atomic_write(target, b"ours\n", replace_within=lambda: gate(True)) is True
    assert target.read_bytes() == b"ours\n" and sorted(os.listdir(tmp_path)) == ["lease.json"]
    assert seen == [(b"ours\n", b"theirs\n"), b"theirs\n", (b"ours\n", b"theirs\n"), b"ours\n"]
