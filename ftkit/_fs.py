"""Small filesystem helpers: durable writes (the one implementation, for the job-dir writers
such as request files and runs.json, and for the checkpoint commit through
:mod:`ftkit.checkpoint.io.files`), and which mount holds a path. No torch."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

__all__ = ["Mount", "atomic_write", "fsync_dir", "mount_of"]

log = logging.getLogger(__name__)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (creations, renames, removals) durable.

    A filesystem that refuses fsync on a directory (``EINVAL``, ``ENOTSUP``) is let be: there
    is nothing more to do there. Any other error (``EIO``, a missing directory) is raised, since
    the entry just written may then not survive a crash of the machine: the caller must not
    report it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    sync: bool = True,
    sync_dir: bool = True,
    mode: int = 0o644,
    replace_within: Callable[[], AbstractContextManager[bool]] | None = None,
) -> bool:
    """Write ``data`` so ``path`` appears complete or not at all: a temporary sibling
    ``.NAME.tmp-PID``, fsync, ``os.replace`` over ``path``, fsync of the directory.

    The temporary name is hidden (a dot) and does not end in the target's suffix (``*.json``
    globs skip it); every leftover of one target starts with ``.NAME.tmp-`` (the pid last),
    which is how a reader tells it from real content. On any failure the
    temporary file is removed and the error raised (an ``OSError`` that names no file, as a
    full disk's, raised again naming ``path``); ``path`` is left as it was. ``sync=False``
    skips both fsyncs (throwaway runs); ``sync_dir=False`` leaves the directory's fsync to a
    caller that changes more entries there first and then fsyncs them all at once. ``mode``
    (before the umask) is the new file's.

    ``replace_within``: a context entered once the data is durable in the temporary file; the
    replace happens inside it, and only if it yields True (else the temporary file is removed,
    ``path`` is left as it was and the result is False). It is how a writer checks "is this
    still mine to write?" under a lock held only for the check and the rename, not the write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:  # a buffered file writes all of ``data`` or raises
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        with replace_within() if replace_within is not None else contextlib.nullcontext(True) as go:
            if go:
                os.replace(tmp, path)
        if not go:
            os.unlink(tmp)
            return False
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            # a write, flush or fsync names no file ("No space left on device"): name the target
            raise OSError(exc.errno, exc.strerror, str(path)).with_traceback(exc.__traceback__) from None
        raise
    if sync and sync_dir:
        fsync_dir(path.parent)
    return True


class Mount(NamedTuple):
    """One line of the mount table."""

    point: str
    fstype: str
    options: tuple[str, ...]


def _unescape_mount(field: str) -> str:
    """Undo the octal escapes of /proc/mounts (``\\040`` is a space, ``\\134`` a backslash)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _under(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str | os.PathLike[str], *, mounts: str | os.PathLike[str] = "/proc/self/mounts") -> Mount | None:
    """The mount holding ``path``: the longest mount point containing the resolved path (the
    last one listed wins for stacked mounts), from the table ``mounts``. None when the table
    cannot be read (not Linux) or no entry contains the path."""
    target = os.path.realpath(path)
    best: Mount | None = None
    try:
        with open(mounts, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        log.debug("cannot read mount table %s: %s", mounts, exc)
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount(fields[1])
        if _under(target, point) and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fields[2], tuple(fields[3].split(",")) if len(fields) > 3 else ())
    return best
