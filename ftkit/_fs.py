"""Small filesystem helpers: durable writes for the job-dir writers (request files, runs.json),
and which mount holds a path."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import NamedTuple

__all__ = ["Mount", "atomic_write", "fsync_dir", "mount_of"]

log = logging.getLogger(__name__)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or create in it is durable (a no-op where refused)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` so ``path`` appears complete or not at all: a dot-temp sibling, fsync,
    ``os.replace``, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return path


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
