"""Shared test set-up: leak checks for threads and child processes, the SLURM fixtures."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.slurm_fixtures"] if (Path(__file__).parent / "slurm_fixtures.py").exists() else []


def _children() -> set[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a thread or a child process running."""
    threads = set(threading.enumerate())
    children = _children()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        extra_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        extra_children = [p for p in _children() - children if _alive(p)]
        if not extra_threads and not extra_children:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    pytest.fail(f"test leaked threads {[t.name for t in extra_threads]} or child processes {extra_children}")


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB tmpfs (a full disk within a few writes); mounting it needs root."""
    assert os.geteuid() == 0, "this machine runs the tests as root (mounts a 2 MiB tmpfs)"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(path: Path) -> Path:
    """Write ``path`` until its filesystem is full (not a block left); returns it."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):  # unbuffered: close has nothing to flush
        while True:
            f.write(b"x" * 65536)
    return path


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)
