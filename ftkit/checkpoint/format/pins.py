"""Pin and unpin: a ``pinned`` marker file in the step directory. The manifest is never rewritten."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ...errors import CheckpointError
from ..io.files import fsync_dir
from .layout import PIN, is_real_dir, step_name

__all__ = ["pin_checkpoint", "unpin_checkpoint"]


def _step_dir(root: str | os.PathLike[str], step: int) -> Path:
    path = Path(root) / step_name(step)
    if not is_real_dir(path):
        raise CheckpointError(f"no checkpoint for step {step}: {path} is not a directory")
    return path


def pin_checkpoint(root: str | os.PathLike[str], step: int, *, sync: bool = True) -> Path:
    """Mark ``step`` so retention keeps it; returns the step directory. Idempotent."""
    path = _step_dir(root, step)
    fd = os.open(path / PIN, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    os.close(fd)
    if sync:
        fsync_dir(path)
    return path


def unpin_checkpoint(root: str | os.PathLike[str], step: int, *, sync: bool = True) -> Path:
    """Remove the pin of ``step``; retention may delete it later. Idempotent."""
    path = _step_dir(root, step)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / PIN)
    if sync:
        fsync_dir(path)
    return path
