"""The job directory layout: one place that names every file ftkit reads or writes.

    JOBDIR/
      save-switch          touch to save at the next step boundary (removed once durable)
      kill-switch          touch to save and stop for good (stays; later runs exit at once)
      requests/            request files written by ``ftkit request`` (one JSON each)
      events.jsonl         the audit trail: one JSON object per line
      checkpoints/         one directory per step (see ftkit.checkpoint)
      runs.json            requeue bookkeeping (see ftkit.slurm.requeue)
      lease.lock           fcntl-locked by rank 0 of the run that holds the job dir (see ftkit.lease)
      lease.json           who holds (or last held) the lease, with its heartbeat
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = ["JobDir"]

SAVE_SWITCH = "save-switch"
KILL_SWITCH = "kill-switch"
REQUESTS = "requests"
EVENTS = "events.jsonl"
CHECKPOINTS = "checkpoints"
RUNS = "runs.json"
LEASE = "lease.json"
LEASE_LOCK = "lease.lock"


@dataclass(frozen=True, slots=True)
class JobDir:
    """Paths inside one job directory. ``root`` is created on demand, never deleted."""

    root: Path

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> JobDir:
        return cls(Path(path).expanduser().absolute())

    @property
    def save_switch(self) -> Path:
        return self.root / SAVE_SWITCH

    @property
    def kill_switch(self) -> Path:
        return self.root / KILL_SWITCH

    @property
    def requests(self) -> Path:
        return self.root / REQUESTS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def runs(self) -> Path:
        return self.root / RUNS

    @property
    def lease(self) -> Path:
        return self.root / LEASE

    @property
    def lease_lock(self) -> Path:
        return self.root / LEASE_LOCK

    def ensure(self) -> JobDir:
        """Create the job dir (and its ``requests/``); a :class:`ConfigError` naming the path and
        the fix when the filesystem refuses."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.requests.mkdir(exist_ok=True)
        except OSError as exc:
            raise self.unusable(exc) from exc
        return self

    def unusable(self, exc: OSError) -> ConfigError:
        """The error of a run that cannot write its job dir's own files (lease, events)."""
        import errno

        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            blocker = next((p for p in (self.root, *self.root.parents) if p.exists() and not p.is_dir()), None)
            if blocker is not None:
                what = "the job dir" if blocker == self.root else f"{blocker}, on the job dir's path,"
                return ConfigError(f"cannot use job dir {self.root}: {what} is a file, not a directory; "
                                   "give another job dir, or move the file away")
        fix = {
            errno.EROFS: "the filesystem is read-only: give a job dir on a writable one",
            errno.EACCES: f"this user ({os.getuid()}) may not write there: fix the permissions, or give another job dir",
            errno.EPERM: f"this user ({os.getuid()}) may not write there: fix the permissions, or give another job dir",
            errno.ENOSPC: "the filesystem is full: free space (`ftkit ls` lists the checkpoints and their sizes)",
            errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
        }.get(exc.errno or 0, "fix the filesystem, or give another job dir")
        return ConfigError(f"cannot use job dir {self.root}: {exc.strerror or exc} on {exc.filename or self.root}; {fix}")
