"""What a hang leaves behind: the heartbeats, the stack file, native frames, the peers' heartbeats.

The file side of :mod:`ftkit.control.watchdog`. Every function here may block on a hung
filesystem (``fsfreeze``, an NFS server that stopped answering), so the watchdog runs them on
threads of their own (:class:`Offloaded`): its checks and its ``grace`` timer must never wait
behind a job-dir write, or a hung job dir would keep a hung job alive.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .hangs import Heartbeat, suspicion

__all__ = ["Offloaded", "append_native", "capture_stacks", "claim_first", "iso", "read_peers",
           "write_heartbeat", "write_stacks"]

log = logging.getLogger(__name__)


class Offloaded:
    """Job-dir writes on a thread of their own, one at a time, so that a write blocked on a
    hung filesystem blocks only that thread (a process blocked in the kernel on a frozen
    filesystem cannot even be interrupted). A write offered while the previous one still runs
    is refused: the caller skips it (the next heartbeat supersedes it) or says so."""

    __slots__ = ("_began", "_clock", "_name", "_thread")

    def __init__(self, name: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._began = 0.0

    def busy_for(self) -> float | None:
        """Seconds the write in progress has taken so far; None when none is in progress."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return None
        return self._clock() - self._began

    def offer(self, write: Callable[[], None]) -> bool:
        """Start ``write`` on a new thread unless the previous write still runs (then False)."""
        if self.busy_for() is not None:
            return False
        self._began = self._clock()
        self._thread = threading.Thread(target=self._run, args=(write,), name=self._name, daemon=True)
        self._thread.start()
        return True

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the write in progress; whether none runs now."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.busy_for() is None

    @staticmethod
    def _run(write: Callable[[], None]) -> None:
        try:
            write()
        except Exception:  # the watchdog must never take training down by itself
            log.exception("hang watchdog: a write to the job dir failed (it keeps running)")


def write_heartbeat(path: Path, beat: Heartbeat) -> None:
    """Replace ``path`` with ``beat`` (atomically: a reader never sees half a heartbeat)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(beat.to_json()))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("hang watchdog: could not write heartbeat %s: %s", path, exc)


def capture_stacks() -> str:
    """Every thread's Python stack (``faulthandler``) as text. It goes through an in-memory
    file: faulthandler writes with the GIL held, so writing it straight into a file on a hung
    filesystem would stop every Python thread, the watchdog's ``grace`` timer too."""
    memfd = getattr(os, "memfd_create", None)
    with (open(memfd("ftkit-stacks"), "w+b") if memfd is not None else tempfile.TemporaryFile()) as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read().decode(errors="replace")


def write_stacks(path: Path, text: str) -> Path:
    """``text`` (the summary and the stacks), durable; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return path


def append_native(f: IO[str], spy: str, *, limit: float) -> None:
    """Append native frames (C++ of torch, NCCL, the CUDA driver) from ``py-spy dump --native``.

    py-spy stops this process's threads with ptrace while it unwinds them; if it is killed
    (too slow: symbolising libtorch takes seconds), a pending stop could leave the whole
    process stopped for good. So a shell runs it under ``timeout`` and then sends SIGCONT.
    """
    pid = os.getpid()
    f.write(f"\n--- {spy} dump --native --pid {pid} ---\n")
    f.flush()
    timeout = shutil.which("timeout")
    if timeout is None:
        f.write("skipped: no `timeout` command to bound py-spy with\n")
        return
    _allow_ptrace()
    script = '"$1" -s KILL "$2" "$3" dump --native --pid "$4"; s=$?; kill -CONT "$4"; exit $s'
    try:
        out = subprocess.run(["sh", "-c", script, "sh", timeout, f"{limit:.0f}", spy, str(pid)],
                             capture_output=True, timeout=limit + 10)
        f.write(out.stdout.decode(errors="replace") + out.stderr.decode(errors="replace"))
        if out.returncode:
            f.write(f"py-spy ended with code {out.returncode}\n")
    except (OSError, subprocess.SubprocessError) as exc:
        f.write(f"py-spy failed: {exc}\n")
    f.flush()
    os.fsync(f.fileno())


def claim_first(marker: Path, rank: int) -> bool:
    """Whether no other rank of this run declared a hang yet (creates ``marker``). Only the
    first reads its peers' heartbeats: N ranks each reading N files would load a shared
    filesystem. Rank 0 removes the marker when a run starts."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True
    with contextlib.suppress(OSError):
        os.write(fd, f"{rank}\n".encode())
    os.close(fd)
    return True


def read_peers(folder: Path, *, rank: int, world_size: int, job: str, now: float) -> list[Heartbeat]:
    """The other ranks' heartbeats of this job as judged at UNIX time ``now``, most suspect
    first; those of another job, or of ranks beyond the world size, are left out."""
    peers = []
    for path in sorted(folder.glob("rank*.json")):
        try:
            beat = Heartbeat.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if beat.rank == rank or beat.rank >= world_size or beat.job != job:
            continue
        peers.append(beat.seen(now))
    return sorted(peers, key=suspicion)


def _allow_ptrace() -> None:
    """Let py-spy, our child, attach: Yama (``kernel.yama.ptrace_scope=1``, common on clusters)
    only lets a process trace its descendants, not its parent, unless the parent allows it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0)


def iso(wall: float | None) -> str:
    """UNIX time as UTC ISO-8601 with milliseconds (the stack file compares across hosts)."""
    if wall is None:
        return "none"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z"
