"""Checkpoint saver processes of a job on this node: find them, wait for them. No torch.

A ``crash_safe`` saver (``python -m SAVER_MODULE``, its arguments read back from ``/proc`` with
``SaverArgs.from_cmdline``) may still be persisting the snapshot of a trainer that just died
when the batch script goes on to ``ftkit requeue``. The requeue decision counts checkpoints,
and the end of the batch script ends the batch step, whose processes SLURM then kills: so
``ftkit requeue`` first waits for the savers that write under the job directory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..._proc import proc_start
from .args import SaverArgs

__all__ = ["find_savers", "wait_for_savers"]

log = logging.getLogger(__name__)


def _saver_root(pid: int) -> Path | None:
    """The checkpoint root of saver process ``pid`` (ours, alive), or None if it is not one."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return None
        args = SaverArgs.from_cmdline(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return None
    if args is None or proc_start(pid) is None:
        return None
    return args.config.root.resolve()


def find_savers(jobdir: str | os.PathLike[str]) -> list[int]:
    """Pids of this user's live saver processes whose checkpoint root is inside ``jobdir``."""
    job = Path(jobdir).resolve()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            root = _saver_root(int(entry))
            if root is not None and (root == job or job in root.parents):
                found.append(int(entry))
    return sorted(found)


def wait_for_savers(
    jobdir: str | os.PathLike[str],
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[int], list[int], float]:
    """Wait up to ``timeout`` seconds for the job's savers to exit.

    Returns ``(waited for, still running, seconds)``. Savers that are still running after the
    timeout are left alone (and logged): they may still finish before the job ends.
    """
    began = clock()
    first = find_savers(jobdir)
    if not first:
        return [], [], 0.0
    log.warning("waiting up to %.0fs for checkpoint saver(s) %s to finish writing under %s", timeout, first, jobdir)
    left = first
    while left and clock() - began < timeout:
        sleep(0.2)
        left = [pid for pid in find_savers(jobdir) if pid in first]
    if left:
        log.error("checkpoint saver(s) %s still running after %.0fs; deciding without waiting longer", left, timeout)
    return first, left, clock() - began
