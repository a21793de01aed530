"""The lease record (``JOBDIR/lease.json``), its config, and the pure takeover rule.

No locks taken and no threads here: ``ftkit status`` reads the record through this module
(and asks, without taking it, whether the record's process on this host holds the lock).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import socket
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, JobDirBusyError
from ..jobdir import JobDir

__all__ = [
    "JobDirBusyError",
    "LeaseConfig",
    "LeaseRecord",
    "Verdict",
    "describe_lease",
    "judge",
    "lease_status",
    "pid_alive",
]

log = logging.getLogger(__name__)



@dataclass(kw_only=True, slots=True)
class LeaseConfig:
    """The job dir's lease: one run at a time (see ``docs/concepts.md``)."""

    enabled: bool = True
    """Take the lease at start; False runs without the guard (two runs on one job dir then
    mix their checkpoints). Needed where the job dir's filesystem has no fcntl locks."""

    heartbeat: float = 30.0
    """Seconds between two rewrites of the holder's record in ``JOBDIR/lease.json``."""

    stale_after: float = 300.0
    """A holder on another host without a heartbeat for this many seconds is taken to be dead
    (node lost) and its lease is taken over. The larger of this and the holder's own value
    applies. Keep it well above ``heartbeat`` and the clock skew between nodes."""

    def __post_init__(self) -> None:
        for name in ("heartbeat", "stale_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"lease.{name}: must be a number of seconds > 0, got {value!r}")
        if self.stale_after < 3 * self.heartbeat:
            raise ConfigError(f"lease.stale_after ({self.stale_after:g} s) must be at least 3 x lease.heartbeat "
                              f"({self.heartbeat:g} s), so a late heartbeat is not taken for a dead holder")


# -- the record --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseRecord:
    """``JOBDIR/lease.json``: the run that holds (or last held) the lease."""

    job_id: str | None
    restart_count: int
    attempt: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: torchrun's worker restarts within this run (0 without torchrun)."""
    host: str
    pid: int
    world_size: int = 1
    started: float
    heartbeat: float
    """Wall time (UNIX seconds) of the holder's last heartbeat."""
    heartbeat_every: float = 30.0
    stale_after: float = 300.0
    released: float | None = None
    """Wall time the run closed and let go of the lease; None while held (or its holder died)."""
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    boot_id: str | None = None
    """The holder's kernel (``/proc/sys/kernel/random/boot_id``): a host name alone does not
    tell one machine (containers on two machines may share one), and only this kernel's own
    locks and processes are certain. None in a record of an older ftkit."""
    job_dir: str | None = None
    """The job dir the holder took the lease of (resolved): a record in another directory came
    with a copy of that job dir (``cp -a`` while its run held it). None in an older record."""

    def to_json(self) -> bytes:
        return (json.dumps({"format": "ftkit-lease", "version": 1, **asdict(self)}, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> LeaseRecord:
        """Parse a record; ValueError naming what is wrong."""
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != "ftkit-lease":
            raise ValueError("not an ftkit lease record (format is not 'ftkit-lease')")
        try:
            return cls(
                job_id=None if raw.get("job_id") is None else str(raw["job_id"]),
                restart_count=int(raw.get("restart_count") or 0), attempt=int(raw.get("attempt") or 0), host=str(raw["host"]), pid=int(raw["pid"]),
                world_size=int(raw.get("world_size") or 1), started=float(raw["started"]),
                heartbeat=float(raw["heartbeat"]), heartbeat_every=float(raw.get("heartbeat_every") or 30.0),
                stale_after=float(raw.get("stale_after") or 300.0),
                released=None if raw.get("released") is None else float(raw["released"]),
                token=str(raw.get("token") or ""),
                boot_id=None if raw.get("boot_id") is None else str(raw["boot_id"]),
                job_dir=None if raw.get("job_dir") is None else str(raw["job_dir"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad lease record field: {exc!r}") from None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> LeaseRecord | None:
        """The record at ``path``; None when there is none. An unreadable one is logged and
        read as None (it cannot name a holder; the fcntl lock still protects a live one)."""
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            log.warning("ignoring unreadable lease record %s: %s", path, exc)
            return None

    @property
    def holder(self) -> str:
        job = f"SLURM job {self.job_id} (restart {self.restart_count})" if self.job_id else "a run outside SLURM"
        if self.attempt:
            job += f" (torchrun restart {self.attempt})"
        return f"{job}, pid {self.pid} on {self.host}"

    def describe(self, now: float) -> str:
        """One line for ``ftkit status`` and error messages."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        if self.released is not None:
            return f"free (last held by {self.holder}, {self.world_size} rank(s), from {since}; released)"
        age = max(0.0, now - self.heartbeat)
        state = f"heartbeat {age:.0f} s ago" + (f", STALE (> {self.stale_after:g} s): a new run takes it over"
                                                 if age > self.stale_after else "")
        return f"held by {self.holder}, {self.world_size} rank(s), since {since}; {state}"


# -- the decision ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :func:`judge` decided: ``free``, ``takeover`` (with why) or ``busy`` (with why)."""

    kind: str
    reason: str = ""


def boot_id() -> str | None:
    """This kernel's boot id (Linux), None where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _same_host(held: LeaseRecord, me: LeaseRecord) -> bool:
    """The same host name, and not known to be another kernel (both records have a boot id
    and they differ: two machines, or containers on two machines, of one host name)."""
    return held.host == me.host and (held.boot_id is None or me.boot_id is None or held.boot_id == me.boot_id)


def _same_kernel(held: LeaseRecord, me: LeaseRecord) -> bool:
    """Known to be this kernel: the same host name and boot id."""
    return held.host == me.host and held.boot_id is not None and held.boot_id == me.boot_id


def _same_host_gone(held: LeaseRecord, me: LeaseRecord, pid_alive: Callable[[int], bool]) -> bool:
    return _same_host(held, me) and not pid_alive(held.pid)


def judge(held: LeaseRecord | None, me: LeaseRecord, *, lock_free: bool, now: float, stale_after: float,
          pid_alive: Callable[[int], bool]) -> Verdict:
    """May run ``me`` take the lease that ``held`` records? A pure function of the facts.

    ``lock_free``: byte 0 of ``lease.lock`` could be locked (no process holds it, as far as
    this node's view of the locks goes). ``stale_after``: the claimant's setting; the holder's
    own, if larger, applies.
    """
    if held is None or held.released is not None:
        if lock_free:
            return Verdict("free")
        return Verdict("busy", "its lock is held by a process that wrote no current record")
    if lock_free and held.job_dir is not None and me.job_dir is not None and _other_dir(held.job_dir, me.job_dir):
        # a copy of a job dir in use on another node (on this one, its lock says as much: below)
        return Verdict("takeover", f"the record names another job dir, {held.job_dir}, whose lease that run "
                       f"holds: it came with a copy of that job dir (cp -a while it ran)")
    if not lock_free and _same_host(held, me) and pid_alive(held.pid):
        age = now - held.heartbeat
        hung = f"; its heartbeat is {age:.0f} s old: if it hangs, end it (kill {held.pid})" if age > held.heartbeat_every * 3 else ""
        return Verdict("busy", f"it is running on this host{hung}")
    if lock_free and _same_kernel(held, me) and held.pid != me.pid and pid_alive(held.pid):
        # this kernel's locks are certain: the process the record names does not hold this lease
        return Verdict("takeover", f"its process {held.pid} on this host does not hold this job dir's lease "
                       f"lock: the record came with a copy of a job dir in use (cp -a), or that process "
                       f"ended and its pid was reused")
    if me.job_id is not None and held.job_id == me.job_id:
        if held.restart_count < me.restart_count:
            return Verdict("takeover", f"it is restart {held.restart_count} of this SLURM job {me.job_id}, which is "
                           f"now at restart {me.restart_count} (SLURM runs one instance of a job at a time)")
        if held.restart_count == me.restart_count and held.attempt < me.attempt:
            return Verdict("takeover", f"it is torchrun restart {held.attempt} of this run of SLURM job {me.job_id}, "
                           f"which is now at torchrun restart {me.attempt} (torchrun stops every worker first)")
    if lock_free and _same_host_gone(held, me, pid_alive):
        return Verdict("takeover", f"its process {held.pid} on this host is gone (it ended without releasing)")
    limit = max(stale_after, held.stale_after)
    age = now - held.heartbeat
    if age > limit:
        return Verdict("takeover", f"no heartbeat for {age:.0f} s (stale after {limit:g} s: its node is taken to be lost)")
    return Verdict("busy", f"its last heartbeat was {max(age, 0.0):.0f} s ago (taken over after {limit:g} s without one; "
                   "if that run is gone for sure, remove lease.json to free the job dir now)")


def _other_dir(held: str, mine: str) -> bool:
    """``held`` is a directory that exists and is not ``mine`` (a job dir moved away leaves no
    directory at its old path: there the record's run may still be this job dir's)."""
    try:
        return os.path.isdir(held) and not os.path.samefile(held, mine)
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- for ftkit status --------------------------------------------------------------------


def lease_status(job_dir: str | os.PathLike[str], *, now: float | None = None) -> dict[str, Any] | None:
    """The lease record as plain data plus ``state`` (``held``, ``stale``, ``released``, or
    ``dead``: its holder on this host is gone),
    ``heartbeat_age`` and ``description``; None when the job dir has no lease record."""
    job = JobDir.of(job_dir)
    record = LeaseRecord.read(job.lease)
    if record is None:
        return None
    now = time.time() if now is None else now
    age = now - record.heartbeat
    state = "released" if record.released is not None else ("stale" if age > record.stale_after else "held")
    description = record.describe(now)
    here = replace(record, host=socket.gethostname(), boot_id=boot_id(), pid=os.getpid())
    if state != "released" and record.job_dir is not None and _other_dir(record.job_dir, str(job.root.resolve())):
        state = "dead"  # judge's takeover: a copy of a job dir in use, made on any node
        description = (f"not held: the record names another job dir, {record.job_dir} ({record.holder}); it came "
                       "with a copy of that job dir; the next run here takes it over at once")
    elif state != "released" and _same_host(record, here) and not pid_alive(record.pid):
        state = "dead"  # kill -9, a crash: the next run on this host takes it over at once
        description = (f"not released by {record.holder}, whose process is gone (killed or crashed); "
                       "the next run takes it over at once")
    elif (state != "released" and _same_kernel(record, here) and record.pid != here.pid
          and lock_held(job.lease_lock) is False):
        state = "dead"  # judge's takeover: a copied job dir's record, or a reused pid
        description = (f"not held: the record names {record.holder}, which does not hold this job dir's lease "
                       "lock (the job dir was copied from one in use, or that process ended and its pid was "
                       "reused); the next run takes it over at once")
    return {**asdict(record), "state": state, "heartbeat_age": age, "description": description}


_FLOCK = "hhqqi4x"  # struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid)


def lock_held(path: Path, byte: int = 0) -> bool | None:
    """Whether another process holds an fcntl lock on ``byte`` of ``path`` (the lease's byte),
    asked with ``F_GETLK``: nothing is locked, so a run taking the lease at that moment is not
    disturbed. None where it cannot be told, and for a lease file this process holds (or is
    taking: the same lock serialises them), whose descriptors it must not close: closing any
    would drop the process's locks on it."""
    from ._holder import _HELD, _HELD_LOCK

    with _HELD_LOCK:
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in _HELD:
                return None
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
            return struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, asked))[0] != fcntl.F_UNLCK
        except (OSError, struct.error):
            return None
        finally:
            os.close(fd)


def live_holder(job_dir: str | os.PathLike[str]) -> LeaseRecord | None:
    """The run that holds the job dir's lease now, where that is certain: a process of this
    kernel (same host name and boot id) that exists and holds ``lease.lock``; else None (on
    another node, nobody can say from here)."""
    job = JobDir.of(job_dir)
    record = LeaseRecord.read(job.lease)
    if record is None or record.released is not None or record.pid == os.getpid():
        return None
    here = replace(record, host=socket.gethostname(), boot_id=boot_id(), pid=os.getpid())
    if not _same_kernel(record, here) or not pid_alive(record.pid):
        return None
    if record.job_dir is not None and _other_dir(record.job_dir, str(job.root.resolve())):
        return None  # a copy's record: that run holds another job dir
    return record if lock_held(job.lease_lock) is True else None


def describe_lease(job_dir: str | os.PathLike[str], *, now: float | None = None) -> str | None:
    """``held by SLURM job 123 (restart 0), pid 42 on node7, ...``; None without a lease record."""
    status = lease_status(job_dir, now=now)
    return None if status is None else str(status["description"])
