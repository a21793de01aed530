"""Checkpoint settings and the description of one checkpoint on disk. No torch."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..jobdir import CHECKPOINTS

__all__ = ["RESUME_MODES", "CheckpointConfig", "CheckpointInfo"]

RESUME_MODES = ("auto", "required", "never")


def _positive_or_none(name: str, value: object, what: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"checkpoint.{name}: must be {what}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How and where checkpoints are written, kept and resumed."""

    root: Path = Path(CHECKPOINTS)
    """Where checkpoints go (created on first save). A relative path is taken under the job
    dir, so the default is ``JOBDIR/checkpoints``; a manager built without a job dir
    (``make_manager``) takes it relative to the current directory."""

    keep_last: int | None = 3
    """Keep the newest N valid checkpoints; None keeps all of them."""

    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of K (milestones); None: no milestones."""

    resume: str = "auto"
    """``auto``: resume from the newest valid checkpoint if any, else start fresh;
    ``required``: fail with NoCheckpointError if none; ``never``: always start fresh."""

    manager: str | None = None
    """Optional ``"pkg.module:Class"`` implementing CheckpointManager instead of the default."""

    verify_on_load: bool = True
    """Check every file's CRC-32 against the manifest before anything of it is restored (computed
    as the file is read for the load, so no extra read)."""

    fsync: bool = True
    """fsync files and directories during the commit. Turn off only for throwaway tests."""

    direct_io: bool | None = None
    """Write each rank's state file with ``O_DIRECT``, from memory straight to the disk without
    a copy into the page cache. None: where the filesystem accepts it (else through the page
    cache, logged once per filesystem); True: required, an error where refused; False: never
    (try it where a parallel filesystem handles direct writes worse than buffered ones)."""

    strict: bool = True
    """Resume refuses a checkpoint that lacks a key of the state (a module, an optimizer, any
    object with ``state_dict()``, or a plain value): ``CheckpointError`` naming the key and
    the checkpoint, before anything is restored. False: each missing key is left as it is,
    with a warning and a ``missing-state`` event (see ``allow_missing`` for single keys)."""

    allow_missing: tuple[str, ...] = ()
    """Keys of the state that may be missing from the checkpoint even with ``strict``
    (e.g. an object added to the training script since the checkpoint was written): left as
    they are, with a warning and a ``missing-state`` event."""

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)):
            raise ConfigError(f"checkpoint.root: expected a path, got {self.root!r}")
        self.root = Path(self.root).expanduser()
        _positive_or_none("keep_last", self.keep_last, "a positive integer or None (keep all)")
        _positive_or_none(
            "keep_every", self.keep_every, "a positive integer (keep steps that are multiples of it) or None"
        )
        if self.direct_io not in (None, True, False):
            raise ConfigError(
                f"checkpoint.direct_io: must be None (where the filesystem accepts it), true or "
                f"false, got {self.direct_io!r}"
            )
        if self.resume not in RESUME_MODES:
            raise ConfigError(
                f"checkpoint.resume: must be one of {', '.join(RESUME_MODES)}, got {self.resume!r}"
            )
        if self.manager is not None and (
            not isinstance(self.manager, str) or ":" not in self.manager
        ):
            raise ConfigError(
                f"checkpoint.manager: expected an import path like 'pkg.module:Class', got {self.manager!r}"
            )
        if not isinstance(self.strict, bool):
            raise ConfigError(f"checkpoint.strict: must be true or false, got {self.strict!r}")
        allowed = self.allow_missing
        if not isinstance(allowed, (list, tuple, set, frozenset)) or not all(
            isinstance(k, str) for k in allowed
        ):
            raise ConfigError(
                f"checkpoint.allow_missing: must be a list of state keys (strings), got {allowed!r}"
            )
        self.allow_missing = tuple(sorted(allowed)) if isinstance(allowed, (set, frozenset)) else tuple(allowed)

    def under(self, jobdir: str | os.PathLike[str]) -> CheckpointConfig:
        """This config with a relative ``root`` taken under ``jobdir`` (an absolute one stays)."""
        if self.root.is_absolute():
            return self
        root = Path(jobdir).expanduser().absolute() / self.root
        here = self.root.absolute()  # where the same text pointed before roots were taken under the job dir
        if here != root and not _has_steps(root) and _has_steps(here):
            raise ConfigError(
                f"checkpoint.root: {str(self.root)!r} is relative, so it is taken under the job dir "
                f"({root}), which holds no checkpoints, while {here} (relative to the current "
                f"directory) does. Pass root={str(here)!r} to resume from those, or an absolute path"
            )
        return dataclasses.replace(self, root=root)


def _has_steps(root: Path) -> bool:
    """Whether ``root`` holds a ``step-N`` checkpoint directory (one listing, no validation)."""
    try:
        return any(p.name.startswith("step-") for p in root.iterdir())
    except OSError:
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """One checkpoint directory as found on disk.

    ``status`` is ``valid``, ``incomplete`` (sentinel present or no manifest: a save that never
    finished), ``corrupt`` (manifest malformed, a file missing, a size or checksum mismatch),
    ``unreadable`` (an error such as permission denied kept this process from looking: not known
    to be bad; a load stops at it and nothing deletes it) or ``unsealed`` (a Hugging Face
    ``checkpoint-N`` Trainer wrote before ftkit was added: not verifiable, never deleted).
    ``reason`` says why it is not valid (empty when valid); ``saved_for`` is the free-text reason
    given to ``save`` (e.g. ``save-switch touched (JOBDIR/save-switch)``, ``periodic (every 500
    steps)``, ``SIGTERM received``).
    """

    step: int
    path: Path
    status: str
    reason: str = ""
    pinned: bool = False
    size: int = 0
    time: float | None = None
    world_size: int | None = None
    kind: str | None = None
    saved_for: str | None = None
    checksums_checked: bool = False
    files: dict[str, dict] = field(default_factory=dict, repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return self.status == "valid"

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "path": str(self.path),
            "status": self.status,
            "valid": self.valid,
            "reason": self.reason,
            "pinned": self.pinned,
            "size": self.size,
            "time": self.time,
            "world_size": self.world_size,
            "kind": self.kind,
            "saved_for": self.saved_for,
            "checksums_checked": self.checksums_checked,
        }
