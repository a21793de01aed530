"""Switch files and request files: the one owner of their names, writing, reading, age and removal.

``JOBDIR/save-switch`` (touch: save at the next step boundary, removed once durable),
``JOBDIR/kill-switch`` (touch: save and stop for good; stays, so later runs exit at once)
and ``JOBDIR/requests/*.json`` (one small JSON object per ``ftkit request``) are a contract
between their writers (``ftkit save|kill|request``, the batch script's signal trap, tests),
the run that acts on them (:mod:`ftkit.triggers.files` watches them, the controller removes
what it acted on), ``ftkit requeue`` (a leftover request names the cause; it removes the
spent ones) and ``ftkit status`` (shows them, and why a broken one is ignored). They all go
through this module, so a rule (what counts as a switch, what makes a request file valid)
is the same for each of them.

A switch counts when it is a regular file, not a symlink: the watcher ignores anything
else, so a run and ``ftkit requeue`` must too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._fs import atomic_write
from ..decision import Action, parse_action
from ..errors import ConfigError
from ..jobdir import JobDir

__all__ = [
    "MAX_REQUEST_BYTES",
    "RequestFile",
    "is_request_name",
    "read_request",
    "remove_handled_requests",
    "remove_handled_save_switch",
    "remove_kill_switch",
    "remove_requests",
    "request_files",
    "stale_request",
    "switch_is_set",
    "touch_switch",
    "touched_at",
    "write_request",
]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
"""A request file is a few dozen bytes; anything larger is not one (and is not read whole)."""


def _job_dir(job_dir: JobDir | str | os.PathLike[str]) -> JobDir:
    return job_dir if isinstance(job_dir, JobDir) else JobDir.of(job_dir)


def _switch_path(job: JobDir, which: str) -> Path:
    paths = {"save": job.save_switch, "kill": job.kill_switch}
    if which not in paths:
        raise ConfigError(f"which: got {which!r}; use 'save' or 'kill'")
    return paths[which]


# --------------------------------------------------------------------------------------
# switch files


def touch_switch(job_dir: JobDir | str | os.PathLike[str], which: str) -> Path:
    """Create or re-touch ``JOBDIR/save-switch`` (``which="save"``) or ``kill-switch``.

    Sets the modification time explicitly (nanoseconds), so two touches in quick
    succession are still two distinct touches for the watcher.
    """
    jd = _job_dir(job_dir)
    path = _switch_path(jd, which)
    jd.root.mkdir(parents=True, exist_ok=True)
    try:
        if not os.path.lexists(path):
            # Create complete, with its final times, in one step: one touch, one identity.
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(b"")
            now = time.time_ns()
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, path)
            return path
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        fix = _cannot_write(jd, exc) or "remove whatever is there so a regular file can be created"
        raise ConfigError(f"{path}: cannot touch the {which} switch ({exc.strerror}); {fix}") from exc
    try:
        before = os.fstat(fd).st_mtime_ns
        now = max(time.time_ns(), before + 1)
        os.utime(fd, ns=(now, now))
    finally:
        os.close(fd)
    return path


def switch_is_set(job_dir: JobDir | str | os.PathLike[str], which: str) -> bool:
    """``JOBDIR/save-switch`` (``which="save"``) or ``kill-switch`` is there and counts: a
    regular file, not a symlink or a directory (the watcher ignores those)."""
    try:
        return stat.S_ISREG(os.lstat(_switch_path(_job_dir(job_dir), which)).st_mode)
    except OSError:
        return False


def remove_kill_switch(job_dir: JobDir | str | os.PathLike[str]) -> bool:
    """Remove ``JOBDIR/kill-switch`` so the job may run again; False when there was none."""
    jd = _job_dir(job_dir)
    path = jd.kill_switch
    if not os.path.lexists(path):  # a read-only filesystem answers EROFS before ENOENT
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        fix = _cannot_write(jd, exc) or "remove it by hand"
        raise ConfigError(f"{path}: cannot remove the kill switch ({exc.strerror}); {fix}") from exc
    return True


def remove_handled_save_switch(job_dir: JobDir | str | os.PathLike[str], handled_at: float) -> bool:
    """Remove the save-switch once the save it asked for is durable, unless it was touched
    after ``handled_at`` (wall seconds): that touch asks for another save. True if removed."""
    path = _job_dir(job_dir).save_switch
    try:
        st = os.lstat(path)
        if st.st_mtime <= handled_at and stat.S_ISREG(st.st_mode):
            path.unlink()
            return True
    except FileNotFoundError:
        pass
    return False


def touched_at(path: str | os.PathLike[str]) -> float | None:
    """When a switch or request file was last touched (wall seconds), None once it is gone."""
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------------------
# request files


def _cannot_write(jd: JobDir, exc: OSError) -> str | None:
    """What to do when a file cannot be written into the job dir ``jd`` (None: not one of the
    filesystem's refusals: permissions, read-only, full)."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"this user may not write in {jd.root}: run the command as the job's owner (or a user "
                "with write access to the job dir)")
    if exc.errno == errno.EROFS:
        return (f"{jd.root} is on a read-only filesystem here: run the command where the job dir is mounted "
                "writable (the job cannot write its checkpoints there either)")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the filesystem of {jd.root} is full (no space or no inodes left): free some; the job's "
                "saves fail too (`ftkit ls` lists its checkpoints and their sizes)")
    return None


def write_request(
    job_dir: JobDir | str | os.PathLike[str], action: str, *, reason: str = "",
    run: tuple[str, int] | None = None,
) -> Path:
    """Atomically drop a request file into ``JOBDIR/requests/``; returns its path.

    ``action`` is one of the names :func:`ftkit.decision.parse_action` accepts. The file
    appears complete or not at all (temp file, fsync, ``os.replace``, fsync the directory).
    ``run``: ``(SLURM job id, restart count)`` of the one run the request is for (a batch
    script's signal trap: ``ftkit request --this-run``); a later run discards it
    (:meth:`RequestFile.stale_for`), as it would act on a signal its own job never got.
    """
    parse_action(action)  # raises ConfigError naming the accepted actions
    name = action.strip().lower().replace("_", "-")
    jd = _job_dir(job_dir)
    if not jd.root.is_dir():
        raise ConfigError(f"job directory {jd.root} does not exist; check the JOBDIR argument")
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    pid = os.getpid()
    final = jd.requests / f"{time.time_ns()}-{host}-{pid}-{name}.json"
    payload: dict[str, Any] = {"action": name, "reason": reason, "created": time.time(), "pid": pid, "host": host}
    if run is not None:
        payload["job_id"], payload["restart_count"] = str(run[0]), int(run[1])
    try:
        jd.requests.mkdir(exist_ok=True)
        atomic_write(final, (json.dumps(payload) + "\n").encode())
    except OSError as exc:
        fix = _cannot_write(jd, exc)
        if fix is None:
            raise
        raise ConfigError(f"{jd.requests}: cannot write the {name} request ({exc.strerror}); {fix}") from exc
    return final


def is_request_name(name: str) -> bool:
    """A request file's name: ``*.json``, not a dot file (writers' temp files are dot files)."""
    return not name.startswith(".") and name.endswith(".json")


def request_files(job_dir: JobDir | str | os.PathLike[str]) -> list[Path]:
    """The request files in ``JOBDIR/requests/``, oldest name first; none if it is missing
    (or cannot be listed: logged)."""
    folder = _job_dir(job_dir).requests
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        log.warning("cannot list %s: %s", folder, exc)
        return []
    return [folder / name for name in sorted(names) if is_request_name(name)]


@dataclass(frozen=True, slots=True)
class RequestFile:
    """One valid request file: a JSON object with an ``action`` string ftkit knows."""

    path: Path
    data: Mapping[str, Any]
    """The whole object (``action``, ``reason``, ``host``, ``pid``, ``created`` as
    :func:`write_request` writes them; hand-written files may hold less or more)."""
    action: Action
    requeue: bool | None
    """As :func:`ftkit.decision.parse_action` maps the action name."""

    def stale_for(self, job_id: str | None, restart_count: int) -> str | None:
        """:func:`stale_request` of this request for a run of ``job_id`` (``restart_count``)."""
        return stale_request(self.data, job_id, restart_count)

    def describe(self) -> str:
        """``stop requested by HOST:PID: REASON``: what the events log and the job's log say."""
        text = f"{str(self.data['action']).strip().lower()} requested"
        if self.data.get("host") or self.data.get("pid"):
            text += f" by {self.data.get('host', '?')}:{self.data.get('pid', '?')}"
        if isinstance(self.data.get("reason"), str) and self.data["reason"]:
            text += f": {self.data['reason']}"
        return text


def stale_request(data: Mapping[str, Any], job_id: str | None, restart_count: int) -> str | None:
    """Why a run of SLURM job ``job_id`` (restart ``restart_count``) must not act on the request
    ``data``, or None: it was written for another run (``run`` of :func:`write_request`), by a
    signal trap whose batch script was killed before ``ftkit requeue`` removed it (a ``scancel``
    whose trainer outlasted SLURM's KillWait). A request without a run is for whichever run
    reads it (a person's ``ftkit request``)."""
    owner = data.get("job_id")
    if owner is None:
        return None
    try:
        restart = int(data.get("restart_count") or 0)
    except (TypeError, ValueError):
        restart = -1
    if str(owner) == str(job_id) and restart == restart_count:
        return None
    return (f"written for SLURM job {owner} (restart {restart}) by {data.get('host', '?')}:{data.get('pid', '?')}, "
            f"not for this run (job {job_id or 'none'}, restart {restart_count}): left over from a run whose batch "
            "script ended before `ftkit requeue` removed it")


def read_request(path: str | os.PathLike[str]) -> RequestFile:
    """Read and check one request file.

    Raises OSError when it cannot be read (FileNotFoundError: gone, e.g. handled meanwhile)
    and ValueError saying why a job ignores it: empty (still being written by a non-atomic
    writer), too large, not JSON, not an object, no ``action`` string, or an unknown action
    (:class:`~ftkit.errors.ConfigError`, a ValueError, naming the accepted ones).
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_REQUEST_BYTES + 1)
    if not raw:
        raise ValueError("empty (still being written, or not written by `ftkit request`)")
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"larger than {MAX_REQUEST_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {type(data).__name__}")
    name = data.get("action")
    if not isinstance(name, str):
        raise ValueError("no 'action' string in it")
    action, requeue = parse_action(name, setting="request")
    return RequestFile(path=path, data=data, action=action, requeue=requeue)


def remove_requests(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Remove request files that were acted on (or left over), so no later run acts on them
    again; one already gone is fine, one that cannot be removed is logged."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove handled request file %s: %s", path, exc)


def remove_handled_requests(job_dir: JobDir | str | os.PathLike[str], handled_at: float) -> None:
    """Once a checkpoint is durable: remove the request files not touched after ``handled_at``
    (wall seconds), the ones the decision that saved acted on. Newer ones ask again."""
    for path in request_files(job_dir):
        if (when := touched_at(path)) is not None and when <= handled_at:
            path.unlink(missing_ok=True)
