"""Rank 0's hold on ``JOBDIR/lease.lock``: fcntl locks, the heartbeat thread, the takeover,
and sharing the outcome with every rank."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .._collective import all_reduce_max, flag_device
from .._fs import atomic_write, fsync_dir
from ..errors import EXIT_JOBDIR_BUSY, ConfigError, FtkitError
from ..events import EventLog
from ..jobdir import JobDir
from ._record import JobDirBusyError, LeaseConfig, LeaseRecord, Verdict, boot_id, judge, pid_alive

__all__ = ["Lease", "agree_refused", "take_lease"]

log = logging.getLogger(__name__)

ROOT_OWNER = "job-dir"
"""In a checkpoint root outside its job dir: the job dir that uses it (:meth:`Lease._claim_root`)."""

_LEASE_BYTE = 0  # held for the run's life
_MUTEX_BYTE = 1  # held while deciding and writing the record
_MUTEX_WAIT = 10.0  # seconds to wait for another run's acquisition or release to finish


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
                 on_lost: Callable[[str], None] | None = None, checkpoint_root: Path | None = None) -> None:
        self.job = job
        self.checkpoint_root = checkpoint_root
        """The job's checkpoint root where it lies outside the job dir: claimed too (:meth:`_claim_root`)."""
        self.config = config
        self._events = events
        self._clock = clock
        self._on_lost = on_lost
        now = clock()
        self.record = LeaseRecord(job_id=job_id, restart_count=restart_count,
                                  attempt=_int_env("TORCHELASTIC_RESTART_COUNT"), host=socket.gethostname(),
                                  pid=os.getpid(), world_size=world_size, started=now, heartbeat=now,
                                  heartbeat_every=config.heartbeat, stale_after=config.stale_after,
                                  boot_id=boot_id(), job_dir=_resolved(job.root))
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    # -- acquire ---------------------------------------------------------------------------

    def acquire(self, *, idle_if_busy: bool = False) -> None:
        """Take the lease or raise :class:`JobDirBusyError` (after a ``lease-refused`` event).

        ``idle_if_busy``: this run will do nothing (the kill switch is on), so a held lease is
        no error: the event says ``idle`` and exit code 0, and the log a warning."""
        with _HELD_LOCK:
            try:
                verdict, held = self._acquire()
            except JobDirBusyError as exc:
                self._refuse(str(exc), exc.holder, idle=idle_if_busy)
                raise
        try:
            self._claim_root()
        except JobDirBusyError as exc:
            self.release()
            self._refuse(str(exc), exc.holder, idle=idle_if_busy)
            raise
        except BaseException:
            self.release()
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

    def _claim_root(self) -> None:
        """A checkpoint root outside the job dir is this job's: ``ROOT/job-dir`` names the job
        dir that last ran on it. Another job dir whose run holds its lease now (a copied job
        dir, or a script that names the same absolute root) refuses this run, which has changed
        nothing: two runs on one root delete each other's saves in progress and mix their
        histories, and the job dir's lease alone cannot see it. The check and the write hold
        ``ROOT/job-dir.lock``, so two job dirs starting at once do not both pass. A root this
        run cannot write (read only) or another job dir it may not read is only warned about."""
        root = self.checkpoint_root
        if root is None:
            return
        mine = self.job.root.resolve()
        owner_file = root / ROOT_OWNER
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / f"{ROOT_OWNER}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.warning("cannot claim checkpoint root %s for job dir %s (%s): another job dir's run on it "
                        "would go unseen", root, mine, exc.strerror or exc)
            return
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                other = Path(owner_file.read_text().strip())
            except FileNotFoundError:
                other = None
            if other is not None and self._runs_elsewhere(other, mine):
                held = LeaseRecord.read(JobDir.of(other).lease)
                assert held is not None
                raise JobDirBusyError(
                    f"checkpoint root {root} is in use by the run of another job dir, {other} ({held.holder}; "
                    f"see {owner_file}): two runs must not write one checkpoint root. Give this job dir "
                    f"({mine}) a checkpoint.root of its own, or stop that run first. This run changed nothing",
                    held)
            if other is not None and other != mine and self._another_job_dir(other, mine):
                # its run is over (else refused above); a reused script naming the same root would
                # resume another experiment's weights without a word, and retention delete them
                log.warning("checkpoint root %s was last used by another job dir, %s (%s): this job dir (%s) "
                            "takes it over: its run resumes from that job dir's checkpoints and its retention "
                            "deletes them. Intended for a job dir copied or moved; else give this one a "
                            "checkpoint.root of its own", root, other, owner_file, mine)
            if other != mine:
                atomic_write(owner_file, f"{mine}\n".encode())
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot claim checkpoint root %s for job dir %s (%s): another job dir's run on it "
                        "would go unseen", root, mine, getattr(exc, "strerror", None) or exc)
        finally:
            os.close(fd)  # drops the lock

    @staticmethod
    def _another_job_dir(other: Path, mine: Path) -> bool:
        """``other`` is a job dir that still exists, not ``mine`` under another path."""
        try:
            return other.is_dir() and _is_job_dir_path(other) and not os.path.samefile(other, mine)
        except OSError:
            return False

    def _runs_elsewhere(self, other: Path, mine: Path) -> bool:
        """Whether ``other``, named by a checkpoint root's ``job-dir``, is another job dir than
        ``mine`` (not the same one under another path) whose run holds its lease now."""
        try:
            if not other.is_dir() or os.path.samefile(other, mine):
                return False
            held = LeaseRecord.read(JobDir.of(other).lease)
        except OSError as exc:
            log.warning("cannot tell whether job dir %s, which last used this checkpoint root, runs now: %s",
                        other, exc.strerror or exc)
            return False
        if held is None or held.released is not None:
            return False
        if held.host == self.record.host and (held.pid == self.record.pid or not pid_alive(held.pid)):
            return False
        return self._clock() - held.heartbeat <= max(held.stale_after, self.config.stale_after)

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
        me = self.record
        if (held is not None and held.job_id is not None and (held.host, held.pid) != (me.host, me.pid)
                and (held.job_id, held.restart_count, held.attempt) == (me.job_id, me.restart_count, me.attempt)):
            # the same run of the same job: another task of it, not "another run"
            cause = ("Both see world size 1: the job runs several tasks, but torch.distributed was not "
                     "initialised when ftkit started, so each task took itself for the only one. Initialise "
                     "the process group before FaultTolerance is built (under submitit, "
                     "FtkitCheckpointable(distributed='auto') does it, and fn must not initialise it again), "
                     "or give each task its own job dir if the tasks are separate runs" if me.world_size == 1 and held.world_size == 1 else
                     "Two process groups of one job (two job steps?) must not share a job dir: give each its "
                     "own, or run all tasks in one process group")
            return (
                f"job dir {self.job.root} is in use by another task of this same run: {who} holds its lease "
                f"({self.job.lease}); {verdict.reason}. {cause}. This task exits with code {EXIT_JOBDIR_BUSY} and "
                f"changed nothing in the job dir.")
        return (
            f"job dir {self.job.root} is in use by another run: {who} holds its lease ({self.job.lease}); "
            f"{verdict.reason}. This run exits with code {EXIT_JOBDIR_BUSY} and changed nothing in the job dir "
            f"(ftkit requeue does not requeue it). Wait for that run to end, end it (scancel, kill), or give this "
            f"run another job dir; `ftkit status {self.job.root}` shows the holder.")

    def _refuse(self, message: str, holder: LeaseRecord | None, *, idle: bool = False) -> None:
        if idle:
            who = holder.holder if holder is not None else "another process"
            message = (f"job dir {self.job.root} is in use by another run ({who}), and its kill-switch "
                       f"{self.job.kill_switch} is on: this run runs without the lease, saves nothing and exits "
                       "at its first check with code 0 (ftkit requeue does not requeue it)")
            log.warning("%s", message)
        else:
            log.error("%s", message)
        self._events.emit("lease-refused", job_id=self.record.job_id, restart_count=self.record.restart_count,
                          holder=None if holder is None else asdict(holder),
                          exit_code=0 if idle else EXIT_JOBDIR_BUSY, idle=idle, reason=message)

    # -- heartbeat -------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat):
            try:
                why = self._still_ours()
                if why is not None:
                    self._lose(why)
                    return
                record = replace(self.record, heartbeat=self._clock())
                if atomic_write(self.job.lease, record.to_json(), replace_within=self._if_still_ours):
                    self.record = record
            except Exception as exc:  # a full disk must not kill the run; the record just ages
                log.warning("lease heartbeat on %s failed: %s", self.job.lease, exc)

    @contextlib.contextmanager
    def _if_still_ours(self) -> Iterator[bool]:
        """Around the rename of a heartbeat's record: True only while this run still holds the
        lease, with the mutex byte of its ``lease.lock`` held so no acquisition on that file
        (which writes ``lease.json`` under the same byte) comes in between.

        Checking before the write would not do: a holder stopped within its write (a node cut
        off from the file server mid-fsync) and resumed after a takeover would rename its own
        record over the new holder's; that holder would then find "its" record gone and stop
        too, or, if it had already ended, leave the job dir naming the displaced run. Busy
        mutex (another run is acquiring right now): skip this heartbeat, the next one decides."""
        assert self._fd is not None
        if not _lock(self._fd, _MUTEX_BYTE, self.job.lease_lock):
            yield False
            return
        try:
            yield self._still_ours() is None
        finally:
            _unlock(self._fd, _MUTEX_BYTE)

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

    flag = torch.tensor([int(refused)], dtype=torch.int32, device=device or flag_device(group))
    all_reduce_max(flag, group)
    return int(flag.item())


def _resolved(path: Path) -> str | None:
    try:
        return str(path.resolve())
    except OSError:
        return None


def _is_job_dir_path(path: Path) -> bool:
    """``path`` holds a job dir's own files (events log, lease): not a directory left empty."""
    job = JobDir.of(path)
    return job.events.exists() or job.lease.exists()


def _destroy_group_at_exit() -> None:
    """This process ends on ftkit's exception while its process group lives: tear the group
    down at interpreter exit. A gloo group left to the interpreter's shutdown aborts it now
    and then ("terminate called without an active exception", SIGABRT), and exit code 86
    would become -6, which ``ftkit requeue`` reads as a crash."""
    import atexit

    def destroy() -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    atexit.register(destroy)


def take_lease(job: JobDir, config: LeaseConfig, *, events: EventLog, rank: int = 0, world_size: int = 1,
               group: Any = None, device: str | None = None, job_id: str | None = None, restart_count: int = 0,
               on_lost: Callable[[str], None] | None = None, idle_if_busy: bool = False,
               checkpoint_root: Path | None = None) -> Lease | None:
    """Rank 0 takes the lease; every rank learns the outcome (one all-reduce when
    ``world_size > 1``) and raises the same way, so no rank waits in a later collective for a
    rank that stopped. Returns rank 0's :class:`Lease` (None on other ranks or when disabled).

    ``idle_if_busy`` (rank 0's counts): the run will do nothing because the kill switch is on,
    so a lease held by another run returns None on every rank instead of raising: a later
    job on a killed job dir ends with code 0 even while another one is still exiting.
    ``checkpoint_root``: the job's checkpoint root, claimed too where it lies outside the job
    dir (:meth:`Lease._claim_root`)."""
    if not config.enabled:
        return None
    lease: Lease | None = None
    error: BaseException | None = None
    outcome = 0  # 0: taken, 1: held by another run, 2: failed, 3: held, and this run stays idle
    if rank == 0:
        lease = Lease(job, config, events=events, world_size=world_size, job_id=job_id,
                      restart_count=restart_count, on_lost=on_lost, checkpoint_root=checkpoint_root)
        try:
            lease.acquire(idle_if_busy=idle_if_busy)
        except JobDirBusyError as exc:
            outcome, error = (3, None) if idle_if_busy else (1, exc)
            lease = None if idle_if_busy else lease
        except Exception as exc:
            outcome, error = 2, exc
    if world_size > 1:
        try:
            outcome = agree_refused(outcome, group, device)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if outcome in (1, 2):
            _destroy_group_at_exit()
    if outcome == 0:
        return lease
    if outcome == 3:
        return None
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
