"""What a hang leaves behind: the stack file, native frames, the peers' heartbeats.

The file side of :mod:`ftkit.control.watchdog`, called from its thread once it has declared
a hang; every function here may block on a hung filesystem, which the watchdog's ``grace``
timer bounds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from .hangs import Heartbeat, suspicion

__all__ = ["append_native", "claim_first", "iso", "read_peers", "write_stacks"]


def write_stacks(path: Path, header: str) -> Path:
    """``header``, then every thread's Python stack (``faulthandler``), durable; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(header)
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
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
