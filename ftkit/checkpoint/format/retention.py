"""Which checkpoints to delete, and deleting one without ever leaving the checkpoint root.

The plan is a pure function of what is on disk, so it is easy to test and to reason about:

* the newest valid checkpoint, pinned ones, milestones (``step % keep_every == 0``), the
  newest ``keep_last`` valid ones and any step being written right now are always kept;
* other valid checkpoints are deleted only once a newer valid one exists (they are older
  than the newest valid, by construction);
* incomplete leftovers (sentinel or no manifest) are deleted once they are older than the
  newest valid checkpoint, or when they are a save of this process that failed;
* corrupt checkpoints are deleted once they fall behind the ``keep_last`` window (never
  with ``keep_last=None``), so a person can still look at a recent one.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from ...errors import CheckpointError
from ..config import CheckpointInfo
from .layout import MANIFEST, SENTINEL, not_ftkits, parse_step

__all__ = ["delete_checkpoint", "plan_retention"]

log = logging.getLogger(__name__)


def plan_retention(
    infos: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_every: int | None,
    in_progress: Collection[int] = (),
    failed: Collection[int] = (),
) -> list[tuple[CheckpointInfo, str]]:
    """``(checkpoint, why)`` for each checkpoint to delete; ``infos`` in any order."""
    ordered = sorted(infos, key=lambda i: i.step, reverse=True)
    valid = [i for i in ordered if i.valid]
    newest_valid = valid[0].step if valid else None
    window = valid if keep_last is None else valid[:keep_last]
    window_floor = window[-1].step if window else None
    kept_valid = {i.step for i in window}
    out: list[tuple[CheckpointInfo, str]] = []
    for info in ordered:
        if info.pinned or info.step in in_progress or info.step < 0 or info.status in ("unreadable", "unsealed"):
            continue  # (not known to be bad, never deleted; unsealed: Trainer's, from before ftkit)
        if info.valid:
            if info.step in kept_valid or info.step == newest_valid:
                continue
            if keep_every and info.step % keep_every == 0:
                continue
            out.append(
                (info, f"retention: older than the newest keep_last={keep_last} valid checkpoints")
            )
        elif info.step in failed:
            out.append((info, f"leftover of a failed save ({info.status}: {info.reason})"))
        elif info.status == "incomplete":
            if newest_valid is not None and info.step < newest_valid:
                out.append(
                    (
                        info,
                        f"incomplete leftover older than valid step {newest_valid} ({info.reason})",
                    )
                )
        elif keep_last is not None and window_floor is not None and info.step < window_floor:
            out.append((info, f"corrupt and older than the kept checkpoints ({info.reason})"))
    return out


def delete_checkpoint(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    rmtree: Callable = shutil.rmtree,
    parse: Callable[[str], int | None] = parse_step,
) -> None:
    """Delete one step directory directly inside ``root``.

    Refuses anything not named like a step directory (``parse``: ftkit's ``step-N`` names, or the
    Hugging Face integration's ``checkpoint-N``), not directly inside ``root`` or not a
    real directory (a symlink is never followed, let alone deleted through), and a directory
    that holds files but neither ftkit's sentinel nor a manifest: ftkit creates the sentinel
    before it writes anything, so such a directory is not a save of ftkit's (a person's files
    under a step-like name) and is not ftkit's to delete. The sentinel is created first, so
    a deletion cut short leaves a directory that reads as incomplete.
    """
    root_real = os.path.realpath(root)
    path = Path(path)
    if parse(path.name) is None:
        raise CheckpointError(f"refusing to delete {path}: not an ftkit step directory name")
    if os.path.realpath(path.parent) != root_real:
        raise CheckpointError(
            f"refusing to delete {path}: not directly inside checkpoint root {root}"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        what = "a symlink (never followed)" if stat.S_ISLNK(st.st_mode) else "a file, not a directory"
        raise CheckpointError(f"refusing to delete {path}: {what}; move it out of {root}")
    if not_ftkits(path):
        raise CheckpointError(
            f"refusing to delete {path}: it holds files but neither {SENTINEL} nor {MANIFEST}, so ftkit "
            f"did not write it; move it out of {root}"
        )
    try:
        fd = os.open(path / SENTINEL, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        os.close(fd)
    except OSError as exc:
        log.debug("could not mark %s incomplete before deleting: %s", path, exc)
    try:
        rmtree(path)
    except OSError as exc:
        raise CheckpointError(f"could not delete checkpoint {path}: {exc}") from exc
