"""Small durable-file helpers shared by the job-dir writers (request files, runs.json)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir"]


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
