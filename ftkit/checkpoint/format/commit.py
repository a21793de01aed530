"""The commit protocol: the one owner of a checkpoint directory's lifecycle. Pure file work, no torch.

Every write path commits through here: the synchronous manager (one rank, or several over DCP),
its background thread, the multi-rank commit over files (``background.commit``), the crash-safe saver
(through those two) and the Hugging Face integration (``checkpoint-N`` directories).

1. **prepare** (:meth:`Committer.prepare`): ``step-N/`` is created with the
   ``checkpoint-is-incomplete`` sentinel in it (:func:`mark_incomplete`), the ``pinned`` marker if
   asked and ``dcp/`` with several ranks. Nothing is fsynced yet: until the manifest is durable the
   directory is incomplete (no manifest, or the sentinel), after a crash of the process or of the
   machine alike, so nothing needs to be fsynced before the data.
2. the writers put their files in and fsync them (not here).
3. **commit** (:func:`seal`): ``manifest.json`` last (temp file, fsync, ``os.replace``), the
   sentinel removed, one fsync of the directory for the entries of the data files, the manifest
   and the sentinel (any subset of those a crash keeps reads as incomplete or as committed, never
   as valid with a file missing), then the ``latest`` hint (a hint only: temp file, fsync,
   ``os.replace``) and an fsync of the root for the step directory's own entry.
4. **abandon** (:meth:`Committer.abandon`): a failed save's directory stays marked incomplete and
   is deleted before the next save; **delete** (:func:`delete`, through
   :func:`ftkit.checkpoint.format.retention.delete_checkpoint`): the sentinel first, never outside the root.
5. **retention** (:func:`retain`): :func:`ftkit.checkpoint.format.retention.plan_retention`'s choice, which never takes
   the newest valid checkpoint, pinned ones or a step being written.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..config import CheckpointConfig, CheckpointInfo
from ..io.files import atomic_write_bytes, fsync_dir
from .layout import DCP_DIR, LATEST, PIN, SENTINEL, list_step_dirs, parse_step, step_name
from .manifest import build_manifest, validate_dir, write_manifest
from .pins import pin_checkpoint
from .retention import delete_checkpoint, plan_retention

__all__ = ["Committer", "delete", "mark_incomplete", "retain", "save_error", "seal"]

log = logging.getLogger(__name__)

Emit = Callable[..., object]  # returns whether the event was written (a truthy value)
"""``emit(event, **fields)``: where delete and save events go (an ``EventLog.emit``), or nowhere."""


def mark_incomplete(path: Path, *, exclusive: bool = False) -> None:
    """Put the sentinel into ``path`` (never through a symlink); ``exclusive``: fail if it exists."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else 0)
    os.close(os.open(path / SENTINEL, flags, 0o644))


def seal(
    path: Path,
    *,
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    kind: str,
    world_size: int,
    reason: str | None,
    pinned: bool,
    time: float,
    sync: bool,
    latest_in: Path | None = None,
) -> None:
    """Commit ``path`` whose ``files`` are written and fsynced (stage 3 of the module doc).

    ``latest_in``: the root whose ``latest`` hint names ``path`` afterwards (ftkit's own roots;
    a Hugging Face output directory has none). Raises OSError when the commit cannot be made.
    """
    manifest = build_manifest(step=step, time=time, world_size=world_size, kind=kind,
                              reason=reason, pinned=pinned, files=files)
    write_manifest(path, manifest, sync=sync, sync_dir=False)
    with contextlib.suppress(FileNotFoundError):  # a directory nobody marked (an unseen HF save)
        os.unlink(path / SENTINEL)
    if sync:  # one fsync for the entries of the data files, the manifest and the sentinel
        fsync_dir(path)
    if latest_in is None:
        return
    try:
        atomic_write_bytes(latest_in / LATEST, f"{path.name}\n".encode(), sync=sync, sync_dir=False)
    except OSError as exc:  # a hint only; listing never depends on it
        log.warning("could not update %s: %s", latest_in / LATEST, exc)
    if sync:  # the step directory's own entry (and latest's)
        fsync_dir(latest_in)


def delete(
    root: Path,
    info: CheckpointInfo,
    why: str,
    *,
    parse: Callable[[str], int | None] = parse_step,
    emit: Emit | None = None,
) -> bool:
    """Delete ``info``'s directory inside ``root`` and report it; False (with a warning) if refused."""
    try:
        delete_checkpoint(root, info.path, parse=parse)
    except CheckpointError as exc:
        said = str(exc)  # once per process: retention asks again after every save
        log.log(logging.DEBUG if said in _REFUSED else logging.WARNING, "%s", said)
        _REFUSED.add(said)
        return False
    log.info("deleted checkpoint %s: %s", info.path, why)
    if emit is not None:
        emit("delete", step=info.step, path=str(info.path), reason=why, status=info.status)
    return True


_REFUSED: set[str] = set()
"""Refusals to delete already logged as warnings (:func:`delete`)."""


def retain(
    root: Path,
    infos: Iterable[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_every: int | None,
    in_progress: Iterable[int] = (),
    failed: Iterable[int] = (),
    spare: Callable[[CheckpointInfo], bool] | None = None,
    parse: Callable[[str], int | None] = parse_step,
    emit: Emit | None = None,
) -> list[CheckpointInfo]:
    """Delete what the retention plan says, except what ``spare`` keeps; returns what was deleted."""
    plan = plan_retention(list(infos), keep_last=keep_last, keep_every=keep_every,
                          in_progress=set(in_progress), failed=set(failed))
    return [info for info, why in plan
            if not (spare is not None and spare(info)) and delete(root, info, why, parse=parse, emit=emit)]


def save_error(exc: OSError, step: int, path: Path, progress: Any, nbytes: int) -> CheckpointError:
    """The error of a save whose write failed with ``exc``: what, where, how far, what is left.

    ``progress``: the write's :class:`ftkit.checkpoint.io.statefile.WriteProgress` (the file being written, bytes so far).
    """
    name = errno.errorcode.get(exc.errno or 0, "error")
    where = exc.filename or (progress.writer.path if progress.writer else path)
    full = _on_disk(path) if exc.errno in (errno.ENOSPC, errno.EDQUOT) and step >= 0 else ""  # not per rank's part
    return CheckpointError(
        f"could not save checkpoint step {step} to {path}: {name} ({exc.strerror or exc}) on {where} "
        f"after writing {progress.total} bytes; the snapshot holds {nbytes} bytes of tensors{full}. "
        f"The partial checkpoint stays marked incomplete ({SENTINEL}) and is removed later; "
        "earlier checkpoints are untouched"
    )


def _on_disk(path: Path) -> str:
    """What a checkpoint takes on disk, from the newest valid one beside ``path``: more than
    its tensors (each file's alignment, the RNG states, the manifest), by far for a small state.
    A disk that must hold ``keep_last + 1`` checkpoints is sized by this, not the tensors."""
    try:
        for _, other in list_step_dirs(path.parent):
            if other != path:
                info = validate_dir(other)
                if info.valid:
                    return f" (the newest valid checkpoint, {other.name}, takes {info.size} bytes on disk)"
    except OSError:
        pass
    return ""


class Committer:
    """The step directories of one manager's checkpoint root: prepare, commit, abandon, retention.

    It keeps what retention must know besides the disk: the steps being written right now, and the
    steps whose directory is known dead (this manager's failed saves, and incomplete directories
    found when it first looked at the root: crash leftovers of an earlier run, as one job writes a
    checkpoint root at a time), removed before the next save. Only rank 0 prepares and commits.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        clock: Callable[[], float] = time.time,
        emit: Emit | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._clock = clock
        self._sink = emit
        self._in_progress: set[int] = set()
        self._failed: set[int] = set()
        self._looked = False
        # keep_last applies before this run's first save and after a failed one, not only after a
        # commit: a run given a lower keep_last for a full disk gets the room back it asks for
        self._failing = True
        self._fork: int | None = None  # see fork()
        self._broken = False

    @property
    def root(self) -> Path:
        return self.config.root

    def path(self, step: int) -> Path:
        return self.root / step_name(step)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every step directory in the root, newest first, with its validity (sizes only)."""
        return [validate_dir(p) for _, p in list_step_dirs(self.root)]

    # ------------------------------------------------------------------ one save
    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Around one save of ``step`` (on every rank): retention leaves its directory alone meanwhile."""
        self._in_progress.add(step)
        try:
            yield self.path(step)
        finally:
            self._in_progress.discard(step)

    def fork(self, base: int | None, *, broken: bool = False) -> None:
        """This run goes on from checkpoint ``base`` (None: from nothing), a step loaded by number
        or ``resume='never'``: the root's later checkpoints, if any, are of another history
        (``broken``: the load fell back past them, finding them corrupt). Before this run's first
        save or snapshot they are set aside (:meth:`set_aside_fork`), so that a later resume
        takes this run's checkpoints, not theirs, and none of this run's saves is taken for one
        of them. Set the same way on every rank; a later load replaces it."""
        self._fork = -1 if base is None else base
        self._broken = broken

    def unfork(self) -> None:
        self._fork = None

    @property
    def forked(self) -> bool:
        """A :meth:`fork` whose checkpoints are not set aside yet."""
        return self._fork is not None

    def set_aside_fork(self) -> Path | None:
        """Rank 0, before the first save or snapshot after :meth:`fork`: move every step
        directory after the fork's base into ``ROOT/set-aside-<UTC time>-after-step-N/``
        (nothing is deleted; resume, retention and ``ftkit ls`` see only the root's own step
        directories). The directory it made, or None. The fork stays pending if a move fails
        (CheckpointError), so no save of this run mixes with the other history."""
        base = self._fork
        if base is None or self.rank != 0:
            return None
        later = [path for step, path in list_step_dirs(self.root) if step > base]
        if not later:
            self._fork = None
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        aside = self.root / (f"set-aside-{stamp}" + (f"-after-{step_name(base)}" if base >= 0 else ""))
        try:
            os.makedirs(aside, exist_ok=True)
            for path in sorted(later):
                os.rename(path, aside / path.name)
            fsync_dir(aside)
            fsync_dir(self.root)
        except OSError as exc:
            raise CheckpointError(
                f"cannot set aside the checkpoints after step {base} in {self.root} (this run does not go on "
                f"from them) into {aside}: {exc.strerror or exc}; move them out of {self.root} by hand") from exc
        self._fork = None
        steps = [parse_step(p.name) for p in sorted(later)]
        self._failed.difference_update(s for s in steps if s is not None)
        names = ", ".join(path.name for path in sorted(later))
        since = f"from step {base}" if base >= 0 else "fresh (checkpoint.resume='never')"
        if self._broken:
            since = f"from step {base}" if base >= 0 else "fresh"
            log.warning("this run went on %s, past the later checkpoints its load found broken (%s), so they were "
                        "moved to %s: none of this run's saves is taken for one of them; look into them (ftkit verify), "
                        "then delete that directory", since, names, aside)
        else:
            log.warning("this run went on %s, so the later checkpoints of another history (%s) were moved to %s: "
                        "resume takes this run's checkpoints now; delete that directory once it is not wanted",
                        since, names, aside)
        self._emit("set-aside", step=base if base >= 0 else None, path=str(aside), steps=steps)
        return aside

    def prepare(self, step: int, *, pin: bool) -> CheckpointInfo | None:
        """Start ``step-N/`` (stage 1); returns the checkpoint instead if a valid one is there already
        (written by this run: the same state)."""
        path = self.path(step)
        self.root.mkdir(parents=True, exist_ok=True)
        self.set_aside_fork()
        self.note_leftovers()
        if self._failing and self.rank == 0:
            self._retain()  # (the newest valid checkpoint always stays)
        else:
            self.clean_leftovers()
        if os.path.lexists(path):
            info = validate_dir(path)
            if info.valid:
                log.info("checkpoint step %d already exists and is valid; not rewriting it", step)
                if pin and not info.pinned:
                    pin_checkpoint(self.root, step, sync=self.config.fsync)
                return validate_dir(path)
            if info.status == "unreadable":  # not known to be bad: not this save's to delete
                raise CheckpointError(f"cannot save step {step}: {path} is already there and {info.reason}")
            if not self.delete(info, "replaced by a new save of the same step") and os.path.lexists(path):
                raise CheckpointError(f"cannot save step {step}: {path} is in the way and ftkit did not write it "
                                      f"({info.reason or info.status}); move it out of {self.root}")
        try:
            os.mkdir(path)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {path}: {exc.strerror or exc} (0 bytes written)"
            ) from exc
        try:
            mark_incomplete(path, exclusive=True)
            if pin:
                os.close(os.open(path / PIN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            if self.world_size > 1:
                os.mkdir(path / DCP_DIR)
            # no fsync here: see the module doc; seal fsyncs the directory and the root
        except OSError as exc:
            if not os.path.lexists(path / SENTINEL):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise CheckpointError(
                f"cannot start checkpoint {path}: {exc.strerror or exc} (0 bytes written)"
            ) from exc
        return None

    def commit(
        self, step: int, files: Mapping[str, Mapping[str, Any]], *, pin: bool, reason: str | None
    ) -> CheckpointInfo:
        """Seal ``step-N/`` once every rank's ``files`` are durable (stage 3); the committed checkpoint."""
        path = self.path(step)
        seal(path, step=step, files=files, kind="dcp" if self.world_size > 1 else "single",
             world_size=self.world_size, reason=reason, pinned=pin, time=self._clock(),
             sync=self.config.fsync, latest_in=self.root)
        return validate_dir(path)

    def committed(self, info: CheckpointInfo, *, seconds: float, reason: str | None) -> None:
        """After a commit: log it, write the ``save`` event, apply retention (rank 0)."""
        self._failing = False
        log.info("saved checkpoint step %d to %s (%d bytes, %d ranks, %.2fs)",
                 info.step, info.path, info.size, self.world_size, seconds)
        self._emit("save", step=info.step, path=str(info.path), bytes=info.size,
                     seconds=round(seconds, 3), reason=reason)
        if self.rank == 0:
            try:
                self.apply_retention()
            except Exception as exc:  # the checkpoint is committed; retention can retry next time
                log.warning("retention after saving step %d failed: %s", info.step, exc)

    def abandon(self, step: int, error: BaseException, *, reason: str | None = None) -> None:
        """A save of ``step`` failed: its directory stays incomplete and goes before the next
        save. Writes the ``save-failed`` event and, where it was written (rank 0, with an
        event log), marks ``error`` with its step (``event_step``) so that whoever reports it
        further (the controller) does not write a second one."""
        self._failed.add(step)
        self._failing = True
        fields = {} if reason is None else {"reason": reason}
        if self._emit("save-failed", step=step, path=str(self.path(step)), error=str(error), **fields):
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__
                error.event_step = step  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ retention
    def note_leftovers(self) -> None:
        """Once, on rank 0: the incomplete directories an earlier run left are known dead.
        Before this run's first save or retention (not in ``load``: its cold reads of every step
        directory would be on a resume's path, and the other ranks would wait for rank 0)."""
        if self._looked or self.rank != 0:
            return
        self._looked = True
        for info in self.list():
            if info.status == "incomplete" and info.step not in self._in_progress:
                log.info(
                    "found incomplete checkpoint %s from an earlier run: %s", info.path, info.reason
                )
                self._failed.add(info.step)

    def clean_leftovers(self) -> None:
        """Delete the invalid directories retention would delete (before a save)."""
        self._retain(spare=lambda info: info.valid)

    def apply_retention(self) -> builtins.list[Path]:
        """Delete what the retention policy says (rank 0 only); returns the deleted paths."""
        if self.rank != 0:
            return []
        self.note_leftovers()
        return [info.path for info in self._retain()]

    def _retain(self, spare: Callable[[CheckpointInfo], bool] | None = None) -> builtins.list[CheckpointInfo]:
        deleted = retain(self.root, self.list(), keep_last=self.config.keep_last,
                         keep_every=self.config.keep_every, in_progress=self._in_progress,
                         failed=self._failed, spare=spare, emit=self._emit)
        self._failed.difference_update(info.step for info in deleted)
        return deleted

    def delete(self, info: CheckpointInfo, why: str) -> bool:
        """Delete one step directory of the root (never outside it); False if refused."""
        if not delete(self.root, info, why, emit=self._emit):
            return False
        self._failed.discard(info.step)
        return True

    def _emit(self, event: str, **fields: Any) -> bool:
        """Hand ``event`` to the sink; whether it was written."""
        return bool(self._sink(event, **fields)) if self._sink is not None else False
