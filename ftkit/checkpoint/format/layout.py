"""Names inside the checkpoint root. Pure path work: no torch, no I/O beyond listing.

ROOT/                            (JOBDIR/checkpoints)
  latest                         hint: name of the newest committed step dir
  step-00000123/
    checkpoint-is-incomplete     sentinel: present from creation until commit
    rank-00000.pt                torch.save of one rank's flat state
    dcp/                         sharded state (torch.distributed.checkpoint), multi-rank only
    manifest.json                written last: the commit proof
    pinned                       marker: retention keeps this checkpoint
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "LATEST",
    "MANIFEST",
    "PIN",
    "SENTINEL",
    "list_step_dirs",
    "not_ftkits",
    "parse_hf_step",
    "parse_step",
    "rank_file",
    "step_name",
]

SENTINEL = "checkpoint-is-incomplete"
MANIFEST = "manifest.json"
PIN = "pinned"
LATEST = "latest"
DCP_DIR = "dcp"

_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_name(step: int) -> str:
    """Directory name of ``step``: ``step-00000123`` (at least 8 digits)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def parse_step(name: str) -> int | None:
    """The step of a directory named by :func:`step_name`, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


_HF_RE = re.compile(r"^checkpoint-(\d+)$")  # Hugging Face Trainer's (ftkit.integrations.hf seals them)


def parse_hf_step(name: str) -> int | None:
    """The step of a Hugging Face Trainer ``checkpoint-N`` directory, else None."""
    m = _HF_RE.match(name)
    return int(m.group(1)) if m else None


def not_ftkits(path: Path) -> bool:
    """A directory with entries but neither ftkit's sentinel nor a manifest (see
    :func:`delete_checkpoint`); False where it cannot be read (the deletion says why)."""
    try:
        with os.scandir(path) as entries:
            names = {e.name for e in entries}
    except OSError:
        return False
    return bool(names) and SENTINEL not in names and MANIFEST not in names


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """A directory that is not a symlink (``lstat``, never follows links)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def list_step_dirs(
    root: str | os.PathLike[str], parse: Callable[[str], int | None] | None = None
) -> list[tuple[int, Path]]:
    """``(step, path)`` of every real step directory directly inside ``root``, newest first.

    Symlinks and anything ``parse`` (default: ftkit's ``step-N`` names) does not accept are ignored.
    """
    parse = parse_step if parse is None else parse
    root = Path(root)
    out: list[tuple[int, Path]] = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        step = parse(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        out.append((step, root / entry.name))
    out.sort(key=lambda item: item[0], reverse=True)
    return out
