"""Hugging Face ``checkpoint-N`` directories made safe: mark, commit, validate, retain.

Pure file work (no torch, no transformers), so resuming and listing stay cheap.

    OUTPUT_DIR/
      checkpoint-120/
        checkpoint-is-incomplete    written before Trainer writes anything, removed last
        model.safetensors ...       whatever Trainer saves (model, optimizer, RNG, state)
        manifest.json               ftkit's commit proof: size + CRC-32 of every file

The format of ``manifest.json`` is ftkit's own (``docs/format.md``); ``kind`` is ``hf``. The
commit and the deletions are ftkit's one commit protocol (``ftkit.checkpoint.format.commit``); only
what is particular to Trainer's directories is here (marking one Trainer writes in place,
collecting the files it wrote).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointInfo, validate_dir
from ..checkpoint.format import (
    MANIFEST,
    SENTINEL,
    list_step_dirs,
    mark_incomplete,
    parse_hf_step,
    seal,
)
from ..checkpoint.format import retain as retain_dirs
from ..checkpoint.format.commit import delete as delete_dir
from ..checkpoint.io.files import crc32_file, fsync_dir, fsync_file
from ..errors import CheckpointError

__all__ = [
    "PREFIX",
    "arm",
    "checked_resume",
    "checkpoint_dirs",
    "commit",
    "discard_crashed",
    "inspect",
    "latest_valid_checkpoint",
    "retain",
]

log = logging.getLogger(__name__)

PREFIX = "checkpoint"  # checkpoint-N, the pattern transformers uses (parse_hf_step)


def checkpoint_dirs(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every real ``checkpoint-N`` directory in ``output_dir``, newest first."""
    return list_step_dirs(output_dir, parse_hf_step)


def inspect(path: str | os.PathLike[str], *, checksums: bool = False) -> CheckpointInfo:
    """:func:`ftkit.checkpoint.validate_dir` for a ``checkpoint-N`` directory (step from the name)."""
    path = Path(path)
    info = validate_dir(path, checksums=checksums)
    step = parse_hf_step(path.name)
    if step is None:
        return info
    if info.valid and info.files and _manifest_step(path) not in (None, step):
        return dataclasses.replace(info, step=step, status="corrupt",
                                   reason=f"manifest.json does not name step {step}")
    return dataclasses.replace(info, step=step)


def _manifest_step(path: Path) -> int | None:
    from ..checkpoint.format import read_manifest

    try:
        return int(read_manifest(path)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_valid_checkpoint(
    output_dir: str | os.PathLike[str],
    *,
    checksums: bool = True,
    events: Any = None,
) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that carries ftkit's commit proof, or None.

    Walks newest first and skips (with a log line and a ``skip`` event in ``events``, an
    :class:`ftkit.events.EventLog`) any directory with the ``checkpoint-is-incomplete``
    sentinel, a missing or unreadable ``manifest.json``, a missing file or a size mismatch;
    ``checksums=True`` also recomputes each file's CRC-32. Pass the result to
    ``trainer.train(resume_from_checkpoint=...)``.

    A checkpoint Trainer wrote before ftkit was added (``unsealed``: its ``trainer_state.json``,
    neither ftkit's sentinel nor a manifest) is taken where it is the newest, with a warning:
    it cannot be verified, but starting over would throw away the training it holds.
    """
    for step, path in checkpoint_dirs(output_dir):
        info = inspect(path, checksums=checksums)
        if info.valid:
            return str(path)
        if info.status == "unsealed":
            log.warning("resuming from %s, which Trainer wrote without ftkit: it has no manifest.json, so its "
                        "files cannot be verified (the next saves are sealed by ftkit)", path)
            return str(path)
        log.warning("skipping %s (%s): %s", path, info.status, info.reason)
        if events is not None:
            events.emit("skip", step=step, path=str(path), status=info.status, reason=info.reason)
    return None


def checked_resume(
    path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    checksums: bool = True,
    events: Any = None,
) -> str | None:
    """The checkpoint to resume from where ``path`` was handed to a resume (a script's
    ``resume_from_checkpoint``, often ``transformers.trainer_utils.get_last_checkpoint``'s answer).

    A path is used as given where it is valid, or where ftkit never wrote it (neither the
    ``checkpoint-is-incomplete`` sentinel nor a ``manifest.json``: Trainer's own checkpoints,
    a missing path, someone else's files). A directory ftkit knows is broken (its sentinel: a save
    that never finished; a manifest its files fail) is never loaded: where it lies in
    ``output_dir``, the newest valid checkpoint there is taken instead (None: none, start fresh),
    with a warning that names it and why; elsewhere CheckpointError says what to pass instead.
    """
    given = Path(path)
    try:
        real_dir = stat.S_ISDIR(os.lstat(given).st_mode)
    except OSError:
        return os.fspath(path)  # missing or unreadable: Trainer's own error says so
    if not real_dir or not (os.path.lexists(given / SENTINEL) or os.path.lexists(given / MANIFEST)):
        return os.fspath(path)  # not ftkit's (or a link, which ftkit never writes): as given
    info = inspect(given, checksums=checksums)
    if info.valid or info.status not in ("incomplete", "corrupt"):
        return os.fspath(path)  # valid, or unreadable here (not known to be bad): as given
    if not _same_dir(given.parent, Path(output_dir)):
        if events is not None:
            events.emit("skip", step=info.step, path=str(given.absolute()), status=info.status, reason=info.reason)
        raise CheckpointError(
            f"resume_from_checkpoint={os.fspath(path)} is not a checkpoint to resume from ({info.status}: "
            f"{info.reason}), and ftkit does not load it. Pass a valid checkpoint instead (`ftkit verify "
            f"{given.parent.absolute()}` lists them), True for the newest valid one in the output dir, "
            f"or False to start fresh")
    fallback = latest_valid_checkpoint(output_dir, checksums=checksums, events=events)  # skips it, with an event
    log.warning("resume_from_checkpoint=%s is not a checkpoint to resume from (%s: %s): %s", os.fspath(path),
                info.status, info.reason,
                f"resuming from {fallback} instead, the newest valid checkpoint in {Path(output_dir).absolute()}"
                if fallback is not None else
                f"no valid checkpoint in {Path(output_dir).absolute()}, starting fresh")
    return fallback


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.absolute() == b.absolute()


# -- the commit ----------------------------------------------------------------------------


def arm(path: str | os.PathLike[str], *, sync: bool = True) -> Path:
    """Mark ``path`` incomplete before Trainer writes into it (creating it if needed).

    If it already holds a manifest (a checkpoint of the same step being overwritten), the
    sentinel goes in first and the old manifest is removed after it, so there is no moment
    at which the directory reads as valid while its files change.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise CheckpointError(f"{path} is not a real directory; refusing to save a checkpoint through it")
    mark_incomplete(path)
    if sync:
        fsync_dir(path)
    try:
        os.unlink(path / MANIFEST)
    except FileNotFoundError:
        pass
    else:
        if sync:
            fsync_dir(path)
    return path


def _files(path: Path) -> Iterator[str]:
    """Relative POSIX names of every regular file under ``path`` except ftkit's own markers."""
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            if rel in (SENTINEL, MANIFEST) or name.startswith(f".{MANIFEST}.tmp-"):
                continue
            if stat.S_ISREG(os.lstat(full).st_mode):
                yield rel


def commit(
    path: str | os.PathLike[str],
    *,
    step: int,
    reason: str | None = None,
    world_size: int = 1,
    sync: bool = True,
    clock=time.time,
) -> CheckpointInfo:
    """Seal a directory Trainer has finished writing: fsync every file and directory, then
    :func:`ftkit.checkpoint.format.commit.seal` (``manifest.json`` with sizes + CRC-32 last, then the
    sentinel removed; no ``latest`` hint). Raises CheckpointError if it cannot."""
    path = Path(path)
    try:
        files: dict[str, dict[str, Any]] = {}
        for rel in _files(path):
            if sync:
                fsync_file(path / rel)
            size, crc = crc32_file(path / rel)
            files[rel] = {"size": size, "crc32": crc}
        if not files:
            raise CheckpointError(f"{path}: Trainer wrote no files; nothing to commit")
        if sync:
            for dirpath, _dirs, _names in os.walk(path):
                fsync_dir(dirpath)
        seal(path, step=step, files=files, kind="hf", world_size=world_size, reason=reason,
             pinned=False, time=clock(), sync=sync)
    except OSError as exc:
        raise CheckpointError(f"could not commit checkpoint {path}: {exc}") from exc
    return inspect(path)


def discard_if_empty(path: str | os.PathLike[str]) -> bool:
    """Remove a directory :func:`arm` created that Trainer never wrote into (only the sentinel)."""
    path = Path(path)
    try:
        if [e.name for e in os.scandir(path)] != [SENTINEL]:
            return False
        os.unlink(path / SENTINEL)
        os.rmdir(path)
    except OSError:
        return False
    return True


def discard_crashed(output_dir: str | os.PathLike[str], *, events: Any = None) -> list[Path]:
    """Delete the ``checkpoint-N`` directories that still hold ftkit's sentinel: saves an earlier
    run began and never finished (killed during it, its node lost). Trainer would write the
    same step into such a directory, and its commit would seal what the crash left there (a
    half-written temporary file) with the new files. Call before any save of this run
    (``on_train_begin``); a directory Trainer wrote without ftkit has no sentinel and stays."""
    root = Path(output_dir)
    deleted = []
    for _step, path in checkpoint_dirs(root):
        if not os.path.lexists(path / SENTINEL):
            continue
        if delete_dir(root, inspect(path), "leftover of a save an earlier run never finished", parse=parse_hf_step,
                      emit=events.emit if events is not None else None):
            deleted.append(path)
    return deleted


# -- retention -----------------------------------------------------------------------------


def retain(
    output_dir: str | os.PathLike[str],
    *,
    keep_last: int | None,
    protect: Collection[str | os.PathLike[str]] = (),
    events: Any = None,
) -> list[Path]:
    """Delete ``checkpoint-N`` directories through ftkit's retention (``ftkit.checkpoint.format.commit``,
    its plan in ``ftkit.checkpoint.format.retention``): the newest ``keep_last`` valid ones and the newest valid
    one always stay, incomplete leftovers go once a newer valid one exists. ``protect`` (e.g.
    Trainer's best-model checkpoint) is never deleted. Returns what was deleted."""
    root = Path(output_dir)
    keep = {os.path.realpath(p) for p in protect}
    deleted = retain_dirs(
        root, [inspect(path) for _step, path in checkpoint_dirs(root)], keep_last=keep_last,
        keep_every=None, spare=lambda info: os.path.realpath(info.path) in keep, parse=parse_hf_step,
        emit=events.emit if events is not None else None,
    )
    return [info.path for info in deleted]
