"""One run per job dir: the lease rank 0 holds for a run's life.

Two runs writing one job dir at once remove each other's checkpoints as "leftovers" and
leave a mix of both. So the first run to start takes the job dir's lease and a second one
stops before it touches anything (:class:`JobDirBusyError`, exit code 86, never requeued).

Two files, both in the job dir:

``lease.lock``
    The lock: rank 0 holds an ``fcntl`` byte-range lock on byte 0 for the run's life.
    fcntl locks (unlike ``flock``) are seen across nodes on NFS (NLM/NFSv4) and on Lustre
    mounted with ``-o flock``, and the kernel drops them when the process dies (``kill -9``
    included). Byte 1 is a short mutex held while a run decides and writes the record, so
    two runs starting together cannot both win.
``lease.json``
    The record (:class:`LeaseRecord`): who holds the lease (SLURM job id and restart count,
    host, pid, world size), since when, and the last heartbeat, which a daemon thread rewrites
    every ``LeaseConfig.heartbeat`` seconds (atomically: readers never see half a record).
    ``released`` is set when the run closes.

A held lock means busy, with two exceptions: a record of an earlier restart of the same
SLURM job (SLURM runs one instance of a job at a time, so that holder is gone: a lock still
held belongs to a node that died) and a record without a heartbeat for ``stale_after`` from
another host (a node lost with its lock not yet reclaimed by the file server). Then the lock
file is replaced by a new one, which the old holder's lock does not cover. A free lock does
not by itself mean the holder is gone (``localflock`` Lustre mounts only see locks of the same
node), so the record decides: a released record, a holder on this host whose pid is gone, or
an earlier restart of the same SLURM job are taken over at once; any other holder only once
its heartbeat is ``stale_after`` old. Every takeover is logged (``lease-takeover`` event).

The decision is the pure function :func:`judge`; :class:`Lease` performs it. The heartbeat
thread also checks that the lease is still this run's; if another run took it over (this
run looked stale), it logs ``lease-lost`` and calls ``on_lost`` (the controller then exits
without saving and without a requeue).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ._fs import atomic_write, fsync_dir
from .errors import EXIT_JOBDIR_BUSY, ConfigError, FtkitError
from .events import EventLog
from .jobdir import JobDir

__all__ = [
    "JobDirBusyError",
    "Lease",
    "LeaseConfig",
    "LeaseRecord",
    "Verdict",
    "agree_refused",
    "describe_lease",
    "judge",
    "lease_status",
    "take_lease",
]

log = logging.getLogger(__name__)

_LEASE_BYTE = 0  # held for the run's life
_MUTEX_BYTE = 1  # held while deciding and writing the record
_MUTEX_WAIT = 10.0  # seconds to wait for another run's acquisition or release to finish


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


class JobDirBusyError(FtkitError, SystemExit):
    """Another run holds the job dir's lease; this run touched nothing but the events log.

    Also a ``SystemExit`` with ``code`` 86: uncaught, the process exits with 86 and no
    traceback (the message was logged when it was raised); ``except FtkitError`` catches it.
    """

    exit_code = EXIT_JOBDIR_BUSY

    def __init__(self, message: str, holder: LeaseRecord | None = None) -> None:
        super().__init__(message)
        self.code = EXIT_JOBDIR_BUSY
        self.holder = holder

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


def _same_host_gone(held: LeaseRecord, me: LeaseRecord, pid_alive: Callable[[int], bool]) -> bool:
    return held.host == me.host and not pid_alive(held.pid)


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
    if not lock_free and held.host == me.host and pid_alive(held.pid):
        age = now - held.heartbeat
        hung = f"; its heartbeat is {age:.0f} s old: if it hangs, end it (kill {held.pid})" if age > held.heartbeat_every * 3 else ""
        return Verdict("busy", f"it is running on this host{hung}")
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


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "") or 0)
    except ValueError:
        return 0


# -- locks -------------------------------------------------------------------------------


def _lock(fd: int, byte: int, path: Path) -> bool:
    """Try to lock ``byte`` of ``fd`` (fcntl, exclusive, non-blocking); False if another process has it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte, os.SEEK_SET)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise ConfigError(
            f"cannot take an fcntl lock on {path}: {exc.strerror or exc} (errno {exc.errno}). The job dir's "
            "filesystem has no working fcntl locks (NFS: needs lockd / NFSv4, not -o nolock; Lustre: mount with "
            "-o flock). Put the job dir on a filesystem with locks, or run without the one-run-per-job-dir "
            "guard: Config(lease=LeaseConfig(enabled=False))") from None


def _unlock(fd: int, byte: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte, os.SEEK_SET)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


# fcntl locks belong to the process, and closing any descriptor of a file drops all of the
# process's locks on it: a second FaultTolerance on the same job dir in this process must
# neither "get" the lock nor close a descriptor of the file. Held lock files, by (dev, ino):
_HELD: dict[tuple[int, int], Lease] = {}
_HELD_LOCK = threading.Lock()


class Lease:
    """Rank 0's hold on ``JOBDIR/lease.lock``; ``acquire()`` at start, ``release()`` at close."""

    def __init__(self, job: JobDir, config: LeaseConfig, *, events: EventLog, world_size: int = 1,
                 job_id: str | None = None, restart_count: int = 0, clock: Callable[[], float] = time.time,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.config = config
        self._events = events
        self._clock = clock
        self._on_lost = on_lost
        now = clock()
        self.record = LeaseRecord(job_id=job_id, restart_count=restart_count,
                                  attempt=_int_env("TORCHELASTIC_RESTART_COUNT"), host=socket.gethostname(),
                                  pid=os.getpid(), world_size=world_size, started=now, heartbeat=now,
                                  heartbeat_every=config.heartbeat, stale_after=config.stale_after)
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    # -- acquire ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease or raise :class:`JobDirBusyError` (after a ``lease-refused`` event)."""
        with _HELD_LOCK:
            try:
                verdict, held = self._acquire()
            except JobDirBusyError as exc:
                self._refuse(str(exc), exc.holder)
                raise
        if verdict.kind == "takeover":
            assert held is not None
            log.warning("ftkit: took over the lease of job dir %s from %s: %s", self.job.root, held.holder, verdict.reason)
            self._events.emit("lease-takeover", previous=asdict(held), reason=verdict.reason,
                              job_id=self.record.job_id, restart_count=self.record.restart_count)
        self._thread = threading.Thread(target=self._beat, name="ftkit-lease-heartbeat", daemon=True)
        self._thread.start()

    def _acquire(self) -> tuple[Verdict, LeaseRecord | None]:
        path = self.job.lease_lock
        fd = self._open_with_mutex(path)
        lease_fd: int | None = None
        try:
            lock_free = _lock(fd, _LEASE_BYTE, path)
            held = LeaseRecord.read(self.job.lease)
            now = self._clock()
            verdict = judge(held, self.record, lock_free=lock_free, now=now, stale_after=self.config.stale_after,
                            pid_alive=pid_alive)
            if verdict.kind == "busy":
                if lock_free:
                    _unlock(fd, _LEASE_BYTE)
                raise JobDirBusyError(self._busy_message(held, verdict), held)
            lease_fd = fd if lock_free else self._break(path)
            self.record = replace(self.record, started=now, heartbeat=now)
            atomic_write(self.job.lease, self.record.to_json())
            st = os.fstat(lease_fd)
            self._fd, self._key = lease_fd, (st.st_dev, st.st_ino)
            _HELD[self._key] = self
            return verdict, held
        except BaseException:
            if lease_fd is not None and lease_fd != fd:
                os.close(lease_fd)
            self._fd = None
            raise
        finally:
            if lease_fd == fd:
                _unlock(fd, _MUTEX_BYTE)
            else:  # nothing of ours stays on this file: closing drops the mutex
                os.close(fd)

    def _open_with_mutex(self, path: Path) -> int:
        """Open the current ``lease.lock`` with byte 1 (the mutex) locked."""
        deadline = time.monotonic() + _MUTEX_WAIT
        while True:
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) in _HELD:
                    holder = _HELD[(st.st_dev, st.st_ino)]
                    raise JobDirBusyError(self._busy_message(holder.record, Verdict("busy", "it is this process")),
                                          holder.record)
            except FileNotFoundError:
                pass
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if _lock(fd, _MUTEX_BYTE, path):
                    if _same_file(fd, path):
                        return fd
                    _unlock(fd, _MUTEX_BYTE)  # replaced meanwhile by a takeover: look again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if time.monotonic() > deadline:
                raise JobDirBusyError(
                    f"job dir {self.job.root} is busy: another run has been taking or releasing its lease "
                    f"({path}) for {_MUTEX_WAIT:g} s. Try again; see `ftkit status {self.job.root}`.")
            time.sleep(0.05)

    def _break(self, path: Path) -> int:
        """Replace ``lease.lock`` by a new file locked by this process; the old holder's lock
        (a lost node's, not yet reclaimed) stays on the old file, which nobody opens again."""
        tmp = path.with_name(f".{path.name}.{self.record.host}.{self.record.pid}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if not _lock(fd, _LEASE_BYTE, tmp):
                raise JobDirBusyError(f"job dir {self.job.root}: could not lock the new lease file {tmp}")
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return fd

    def _busy_message(self, held: LeaseRecord | None, verdict: Verdict) -> str:
        who = held.holder if held is not None else "another process"
        return (
            f"job dir {self.job.root} is in use by another run: {who} holds its lease ({self.job.lease}); "
            f"{verdict.reason}. This run exits with code {EXIT_JOBDIR_BUSY} and changed nothing in the job dir "
            f"(ftkit requeue does not requeue it). Wait for that run to end, end it (scancel, kill), or give this "
            f"run another job dir; `ftkit status {self.job.root}` shows the holder.")

    def _refuse(self, message: str, holder: LeaseRecord | None) -> None:
        log.error("%s", message)
        self._events.emit("lease-refused", job_id=self.record.job_id, restart_count=self.record.restart_count,
                          holder=None if holder is None else asdict(holder), exit_code=EXIT_JOBDIR_BUSY,
                          reason=message)

    # -- heartbeat -------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat):
            try:
                why = self._still_ours()
                if why is not None:
                    self._lose(why)
                    return
                self.record = replace(self.record, heartbeat=self._clock())
                atomic_write(self.job.lease, self.record.to_json())
            except Exception as exc:  # a full disk must not kill the run; the record just ages
                log.warning("lease heartbeat on %s failed: %s", self.job.lease, exc)

    def _still_ours(self) -> str | None:
        assert self._fd is not None
        if not _same_file(self._fd, self.job.lease_lock):
            return f"{self.job.lease_lock} was replaced"
        current = LeaseRecord.read(self.job.lease)
        if current is not None and current.token != self.record.token:
            return f"{self.job.lease} now names {current.holder}"
        return None

    def _lose(self, why: str) -> None:
        current = LeaseRecord.read(self.job.lease)
        self.lost = (f"this run lost the lease of job dir {self.job.root} ({why}): another run took it over "
                     "after this run's heartbeat looked stale. Stopping without saving, so the two runs do not mix "
                     "checkpoints")
        log.error("%s", self.lost)
        self._events.emit("lease-lost", reason=self.lost, holder=None if current is None else asdict(current))
        if self._on_lost is not None:
            self._on_lost(self.lost)

    # -- release ---------------------------------------------------------------------------

    def release(self) -> None:
        """Stop the heartbeat, mark the record released (if it is still ours), unlock. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        fd = self._fd
        if fd is None:
            return
        with _HELD_LOCK:
            try:
                deadline = time.monotonic() + _MUTEX_WAIT
                while not _lock(fd, _MUTEX_BYTE, self.job.lease_lock) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.lost is None and self._still_ours() is None:
                    atomic_write(self.job.lease, replace(self.record, released=self._clock()).to_json())
            except Exception as exc:
                log.warning("could not mark the lease %s released: %s (the lock is let go anyway)", self.job.lease, exc)
            finally:
                _HELD.pop(self._key, None)  # type: ignore[arg-type]
                self._fd = self._key = None
                os.close(fd)  # drops both locks


def agree_refused(refused: int, group: Any, device: str | None = None) -> int:
    """All ranks learn rank 0's outcome (0: lease taken, else a failure code): MAX over ranks."""
    import torch
    import torch.distributed as dist

    if device is None:
        backend = str(dist.get_backend(group)).lower()
        device = f"cuda:{torch.cuda.current_device()}" if "nccl" in backend else "cpu"
    flag = torch.tensor([int(refused)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


# -- for ftkit status --------------------------------------------------------------------


def lease_status(job_dir: str | os.PathLike[str], *, now: float | None = None) -> dict[str, Any] | None:
    """The lease record as plain data plus ``state`` (``held``, ``stale`` or ``released``),
    ``heartbeat_age`` and ``description``; None when the job dir has no lease record."""
    job = JobDir.of(job_dir)
    record = LeaseRecord.read(job.lease)
    if record is None:
        return None
    now = time.time() if now is None else now
    age = now - record.heartbeat
    state = "released" if record.released is not None else ("stale" if age > record.stale_after else "held")
    return {**asdict(record), "state": state, "heartbeat_age": age, "description": record.describe(now)}


def describe_lease(job_dir: str | os.PathLike[str], *, now: float | None = None) -> str | None:
    """``held by SLURM job 123 (restart 0), pid 42 on node7, ...``; None without a lease record."""
    status = lease_status(job_dir, now=now)
    return None if status is None else str(status["description"])


def take_lease(job: JobDir, config: LeaseConfig, *, events: EventLog, rank: int = 0, world_size: int = 1,
               group: Any = None, device: str | None = None, job_id: str | None = None, restart_count: int = 0,
               on_lost: Callable[[str], None] | None = None) -> Lease | None:
    """Rank 0 takes the lease; every rank learns the outcome (one all-reduce when
    ``world_size > 1``) and raises the same way, so no rank waits in a later collective for a
    rank that stopped. Returns rank 0's :class:`Lease` (None on other ranks or when disabled)."""
    if not config.enabled:
        return None
    lease: Lease | None = None
    error: BaseException | None = None
    outcome = 0
    if rank == 0:
        lease = Lease(job, config, events=events, world_size=world_size, job_id=job_id,
                      restart_count=restart_count, on_lost=on_lost)
        try:
            lease.acquire()
        except JobDirBusyError as exc:
            outcome, error = 1, exc
        except Exception as exc:
            outcome, error = 2, exc
    if world_size > 1:
        try:
            outcome = agree_refused(outcome, group, device)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
    if outcome == 0:
        return lease
    if error is not None:
        raise error
    if outcome == 1:
        holder = LeaseRecord.read(job.lease)
        message = (f"job dir {job.root} is in use by another run ({'holder: ' + holder.holder if holder else 'see rank 0'}); "
                   f"rank 0 found its lease {job.lease} held. This rank exits with code {EXIT_JOBDIR_BUSY} and changed "
                   f"nothing; `ftkit status {job.root}` shows the holder.")
        log.error("%s", message)
        raise JobDirBusyError(message, holder)
    raise FtkitError(f"rank 0 could not take the lease of job dir {job.root}; its log says why")
