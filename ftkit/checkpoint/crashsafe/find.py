"""Checkpoint saver processes of a job on this node: find them, wait for them; remove what the
runs that are over left in ``shm_dir``. No torch.

A ``crash_safe`` saver (``python -m SAVER_MODULE``, its arguments read back from ``/proc`` with
``SaverArgs.from_cmdline``) may still be persisting the snapshot of a trainer that just died
when the batch script goes on to ``ftkit requeue``. The requeue decision counts checkpoints,
and the end of the batch script ends the batch step, whose processes SLURM then kills: so
``ftkit requeue`` first waits for the savers that write under the job directory.

When a trainer and its saver both die (a kill -9 of both, a job step SIGKILLed), nobody unlinks
their shared-memory segments: each holds a rank's whole state in RAM until the node reboots.
:func:`sweep_leftovers` (run by a node's leader before it starts its saver) removes such files of
runs that are over (see its doc for what counts as over).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..._fs import mount_of
from ..._proc import proc_start
from .args import SAVER_MODULE, SaverArgs

__all__ = ["Leftovers", "find_savers", "sweep_leftovers", "wait_for_savers"]

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


# ------------------------------------------------------------------ leftovers of runs that are over
# the names of ``crashsafe.client`` (``shm.PREFIX``; ``shm`` imports torch, this module must not)
_SEGMENT = re.compile(r"ftkit-snap-(\d+)-.+-r\d+-s\d+-g\d+")
_SOCKET = re.compile(r"ftkit-saver-(\d+)-.+\.sock")
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})


@dataclass(frozen=True, slots=True)
class Leftovers:
    """What :func:`sweep_leftovers` did: file names removed, their bytes (allocated: the memory
    freed), whose they were (leader pids); the files of dead leaders kept because something still
    uses them, and the ones it could not remove (``"name: error"``)."""

    removed: tuple[str, ...] = ()
    nbytes: int = 0
    leaders: tuple[int, ...] = ()
    kept: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Candidate:
    path: Path
    leader: int
    socket: bool
    ino: int
    nbytes: int


def _pid_exists(pid: int) -> bool:
    """Any process (a zombie, or another one that reuses the pid, too) holds ``pid``: conservative."""
    return pid > 0 and os.path.lexists(f"/proc/{pid}")


def _candidates(directory: Path) -> list[_Candidate]:
    """This user's segments and saver sockets in ``directory`` whose leader pid is not a process."""
    uid = os.geteuid()
    alive: dict[int, bool] = {}
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _SEGMENT.fullmatch(entry.name) or _SOCKET.fullmatch(entry.name)
            if match is None:
                continue
            is_socket = entry.name.startswith("ftkit-saver-")
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_uid != uid or not (stat.S_ISSOCK if is_socket else stat.S_ISREG)(st.st_mode):
                continue
            leader = int(match[1])
            if leader not in alive:
                alive[leader] = _pid_exists(leader)
            if not alive[leader]:
                found.append(_Candidate(Path(entry.path), leader, is_socket, st.st_ino, st.st_blocks * 512))
    return found


def _saver_trainer_pid(cmdline: bytes) -> int | None:
    """The ``--trainer-pid`` of a saver's command line (any ftkit version's), else None."""
    argv = cmdline.split(b"\0")
    module = SAVER_MODULE.encode()
    if not any(argv[i] == b"-m" and argv[i + 1] == module for i in range(len(argv) - 1)):
        return None
    with contextlib.suppress(ValueError):
        at = argv.index(b"--trainer-pid")
        return int(argv[at + 1])
    return None


def _base_name(target: str) -> str:
    """The file name of a ``/proc`` link target or maps path (``... (deleted)`` once unlinked)."""
    return os.path.basename(target.removesuffix(" (deleted)"))


def _in_use(cands: list[_Candidate]) -> tuple[set[int], set[str]]:
    """One pass over ``/proc``: the leaders whose saver still runs (it may be rescuing, and opens
    its leader's segments only then), and the names of the candidates some process has open
    (``/proc/PID/fd``) or mapped (``/proc/PID/maps``), or a socket some process listens on
    (``/proc/net/unix``). Processes this user cannot look into are skipped: they cannot open
    this user's 0600 files (root aside)."""
    leaders = {c.leader for c in cands}
    names = {c.path.name for c in cands}
    busy_leaders: set[int] = set()
    busy: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        base = f"/proc/{entry}"
        try:
            with open(f"{base}/cmdline", "rb") as f:
                trainer = _saver_trainer_pid(f.read())
        except OSError:
            continue  # gone
        if trainer in leaders:
            busy_leaders.add(trainer)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{base}/fd"):
                with contextlib.suppress(OSError):
                    name = _base_name(os.readlink(f"{base}/fd/{fd}"))
                    if name in names:
                        busy.add(name)
        try:
            with open(f"{base}/maps", encoding="utf-8", errors="surrogateescape") as f:
                maps = f.read()
        except OSError:
            continue
        if "ftkit-snap-" not in maps:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)  # address perms offset dev inode [path]
            if len(fields) == 6 and _base_name(fields[5]) in names:
                busy.add(_base_name(fields[5]))
    if any(c.socket for c in cands):
        with contextlib.suppress(OSError), open("/proc/net/unix", encoding="utf-8", errors="surrogateescape") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split(None, 7)  # Num RefCount Protocol Flags Type St Inode [Path]
                if len(fields) == 8 and os.path.basename(fields[7]) in names:
                    busy.add(os.path.basename(fields[7]))
    return busy_leaders, busy


def _unlink_unused(path: Path, ino: int) -> bool:
    """Unlink the regular file ``path`` unless the kernel says a file description of it is open
    anywhere: a write lease is refused while another one exists, in any process, mapped or not,
    in any PID namespace (the ``/proc`` pass sees this namespace's processes only). False: kept.
    Where leases are not available, the ``/proc`` pass alone has decided."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BlockingIOError:
        return False  # someone holds a lease on it
    try:
        if os.fstat(fd).st_ino != ino:
            return False  # replaced since it was looked at
        try:
            # someone opening it while the lease is held would break it, which signals its
            # holder: SIGURG (ignored by default), not SIGIO (which would end this process)
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY, errno.EWOULDBLOCK):
                return False
            log.debug("no lease on %s (%s): the /proc pass decides", path, exc)
        os.unlink(path)
        return True
    finally:
        os.close(fd)  # also drops the lease


def sweep_leftovers(directory: str | os.PathLike[str]) -> Leftovers:
    """Remove the crash-safe segments (``ftkit-snap-<leader pid>-...``) and saver sockets
    (``ftkit-saver-<leader pid>-....sock``) that runs that are over left in ``directory``.

    A file is removed only when all of these hold: it is this user's (a regular file, or a
    socket); no process has its leader's pid (a zombie, or a later process that reuses the pid,
    keeps it); no saver of that leader runs (one rescuing a dead trainer opens its segments only
    then); no process has it open or mapped (``/proc/*/fd``, ``/proc/*/maps``), listens on it
    (``/proc/net/unix``), or (a segment) holds any file description of it (the kernel's lease
    check, which also sees other PID namespaces). Only on a node-local memory filesystem (tmpfs,
    ramfs): elsewhere the pids in the names may be another host's. ``/proc`` is read once, and
    only when some file's leader is gone. Per-file errors are listed in ``failed``; the
    directory unreadable raises ``OSError``.
    """
    directory = Path(directory)
    if not os.path.isdir("/proc/self"):
        return Leftovers()  # no /proc: nothing can be told apart
    mount = mount_of(directory)
    if mount is None or mount.fstype not in _MEMORY_FS:
        log.debug("not sweeping %s: not a tmpfs (%s)", directory, mount)
        return Leftovers()
    try:
        cands = _candidates(directory)
    except FileNotFoundError:
        return Leftovers()
    if not cands:
        return Leftovers()
    busy_leaders, busy = _in_use(cands)
    removed, kept, failed, leaders, nbytes = [], [], [], set(), 0
    for c in cands:
        name = c.path.name
        if c.leader in busy_leaders or name in busy:
            kept.append(name)
            continue
        try:
            if c.socket:
                os.unlink(c.path)
            elif not _unlink_unused(c.path, c.ino):
                kept.append(name)
                continue
        except FileNotFoundError:
            continue  # removed meanwhile (another run's sweep)
        except OSError as exc:
            failed.append(f"{name}: {exc.strerror or exc}")
            continue
        removed.append(name)
        leaders.add(c.leader)
        nbytes += c.nbytes
    if kept:
        log.debug("kept %d file(s) of gone leaders still in use: %s", len(kept), kept)
    return Leftovers(tuple(removed), nbytes, tuple(sorted(leaders)), tuple(kept), tuple(failed))
