"""What a path given to the ``ftkit`` command is, and where a job dir's checkpoints are.

A person types the path, and the usual slips (the ``checkpoints/`` dir, a step dir, the
parent of several job dirs, a file) must be refused with a message that names the right
path, never accepted with a success message the job never sees. Pure file work: no torch.

A **job dir** holds a file only an ftkit job writes there (``events.jsonl``, ``lease.json``,
``lease.lock``, ``runs.json``, a switch file), a ``requests/`` dir of request files or a
``checkpoints/`` dir that is a checkpoint root; an **empty** dir may be the job dir of a job
that has not started yet (the sbatch template creates it, and its signal trap may write a
request into it before the training starts). A **step dir** is
named ``step-N`` or holds ``manifest.json`` / ``checkpoint-is-incomplete``; a **checkpoint
root** holds step dirs or a ``latest`` hint.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobdir import (
    CHECKPOINTS,
    EVENTS,
    KILL_SWITCH,
    LEASE,
    LEASE_LOCK,
    REQUESTS,
    RUNS,
    SAVE_SWITCH,
)

__all__ = ["Place", "Root", "checkpoint_root", "place", "wrong_place"]

JOB_FILES = (EVENTS, LEASE, LEASE_LOCK, RUNS, SAVE_SWITCH, KILL_SWITCH)
"""Names only an ftkit job (or ``ftkit save|kill``) writes into a job dir."""

STARTED_WITH = "the directory the job was started with"


@dataclass(frozen=True, slots=True)
class Place:
    """``kind``: ``job``, ``fresh`` (an empty dir), ``other`` (a dir that is none of the
    others), ``step``, ``root``, ``inside`` (a dir inside a job dir), ``file`` or ``missing``.
    ``job``: the job dir it lies in, where one is found above it."""

    path: Path
    kind: str
    job: Path | None = None
    job_dirs: tuple[Path, ...] = ()
    """For ``other``: job dirs directly inside it (the parent of several jobs was given)."""


def _has_job_files(d: Path) -> bool:
    return any(os.path.lexists(d / name) for name in JOB_FILES)


def _has_requests_dir(d: Path) -> bool:
    """``d/requests/`` as ``ftkit request`` or a job left it: empty, or request files only."""
    from ..triggers.switches import is_request_name

    try:
        with os.scandir(d / REQUESTS) as entries:
            return all(is_request_name(e.name) or e.name.startswith(".") for e in entries)  # . : a writer's temp
    except (FileNotFoundError, NotADirectoryError):
        return False


def _is_job_dir(d: Path) -> bool:
    return _has_job_files(d) or _has_requests_dir(d) or _is_root(d / CHECKPOINTS)


def _enclosing_job(path: Path) -> Path | None:
    """The nearest directory above ``path`` that is a job dir (one that cannot be read is not)."""
    for parent in path.parents:
        try:
            if _is_job_dir(parent):
                return parent
        except OSError:
            continue
    return None


def _is_step_dir(d: Path) -> bool:
    from ..checkpoint.format import MANIFEST, SENTINEL, parse_step

    return parse_step(d.name) is not None or os.path.lexists(d / MANIFEST) or os.path.lexists(d / SENTINEL)


def _is_root(d: Path) -> bool:
    from ..checkpoint.format import LATEST, list_step_dirs

    return os.path.lexists(d / LATEST) or bool(list_step_dirs(d))


def place(path: str | os.PathLike[str]) -> Place:
    """What ``path`` is. A permission error propagates (the CLI prints it, naming the path)."""
    p = Path(path).expanduser().absolute()
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return Place(p, "missing", _enclosing_job(p))
    if not is_dir:
        return Place(p, "file", _enclosing_job(p))
    if _is_job_dir(p):
        return Place(p, "job", p)
    if _is_step_dir(p):
        return Place(p, "step", _enclosing_job(p))
    if _is_root(p):
        return Place(p, "root", _enclosing_job(p))
    job = _enclosing_job(p)
    if job is not None:
        return Place(p, "inside", job)
    with os.scandir(p) as entries:
        names = list(entries)
    if not names:
        return Place(p, "fresh")
    # the parent of several job dirs? (the first 1000 entries: $HOME on NFS must not take minutes)
    jobs = tuple(sorted(Path(e.path) for e in names[:1000] if e.is_dir() and _has_job_files(Path(e.path))))
    return Place(p, "other", job_dirs=jobs)


def _listed(paths: Iterable[Path], most: int = 3) -> str:
    paths = list(paths)
    shown = ", ".join(str(p) for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def wrong_place(where: Place, *, takes: str = "a job dir", instead: str = "") -> str:
    """Why ``where`` is not what a command ``takes``, and what to pass instead (a message);
    ``instead`` replaces the usual "pass the job dir ..." advice."""
    p, job = where.path, where.job
    if where.kind == "missing":
        if not instead and job is None and takes == "a job dir":
            return f"job dir {p} does not exist; pass the directory the job was started with"
        what = f"{p} does not exist"
    elif where.kind == "file":
        what = f"{p} is a file, not {takes}"
        if _is_step_dir(p.parent):
            what += f" (it belongs to the checkpoint {p.parent})"
    elif where.kind == "step":
        what = f"{p} is a checkpoint (a step dir), not {takes}"
    elif where.kind == "root":
        what = f"{p} is a checkpoint root (it holds step dirs), not {takes}"
    elif where.kind == "inside":
        what = (f"{p} is the checkpoints dir of a job dir, not {takes}" if job is not None and p == job / CHECKPOINTS
                else f"{p} is a directory inside a job dir, not {takes}")
    elif where.job_dirs:
        jobs = _listed(where.job_dirs)
        return f"{p} is not a job dir but holds job dirs ({jobs}); {instead}" if instead else \
            f"{p} is not a job dir but holds job dirs ({jobs}); pass one of them"
    else:  # the names are jobdir.py's EVENTS, REQUESTS, LEASE, RUNS
        what = f"{p} is not a job dir: no ftkit job has written to it (it holds no events.jsonl, requests/, lease.json, runs.json or switch file) and it is not empty"
    if instead:
        return f"{what}; {instead}"
    return f"{what}; pass the job dir {job}" if job is not None else f"{what}; pass {STARTED_WITH}"


@dataclass(frozen=True, slots=True)
class Root:
    """A job dir's checkpoint root and where it was found, in words (``found_in``: empty for
    the default ``JOBDIR/checkpoints``)."""

    path: Path
    found_in: str = ""
    hf: bool = False  # Hugging Face Trainer's checkpoint-N dirs (ftkit.integrations.hf), not step-N

    @property
    def exists(self) -> bool:
        return self.path.is_dir()

    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of its step directories (``checkpoint-N`` ones for Trainer's), newest first."""
        from ..checkpoint.format import list_step_dirs, parse_hf_step, parse_step

        return list_step_dirs(self.path, parse_hf_step if self.hf else parse_step)

    def __str__(self) -> str:
        return f"{self.path} (the job's checkpoint root, {self.found_in})" if self.found_in else str(self.path)


def _same(a: Path, b: Path) -> bool:
    try:
        return a == b or os.path.samefile(a, b)  # one directory seen through two mount paths
    except (FileNotFoundError, NotADirectoryError):
        return False


def checkpoint_root(job: Path, events: Iterable[dict[str, Any]]) -> Root:
    """The checkpoint root the job's runs used.

    The parent of the step dir named by the newest event that names one (``save``, ``load``,
    ``delete``, ...), or the ``checkpoint_root`` of a newer ``start`` event: a
    ``CheckpointConfig(root=...)`` outside the job dir is found there. But
    ``JOBDIR/checkpoints`` when it holds step dirs and the recorded root is gone or is another
    job dir's (this job dir was moved or copied: the log keeps the old absolute paths). Without
    such an event, ``JOBDIR/checkpoints``, or the job dir itself where it holds the step dirs.
    Hugging Face Trainer's ``checkpoint-N`` live in its output dir, named by the ``save`` events
    and the ``start`` and ``resume`` events (``kind`` ``hf``); the job dir itself where it is that output dir,
    moved or copied.
    """
    from ..checkpoint.format import list_step_dirs, parse_hf_step, parse_step

    default = job / CHECKPOINTS
    recorded, hf = None, False
    for e in events:
        path = e.get("path")
        if isinstance(path, str) and parse_step(Path(path).name) is not None:
            recorded, hf = Path(path).parent, False
        elif isinstance(path, str) and e.get("kind") == "hf" and parse_hf_step(Path(path).name) is not None:
            recorded, hf = Path(path).parent, True  # Trainer's output_dir (its save events say kind "hf")
        elif e.get("event") in ("start", "resume") and isinstance(e.get("checkpoint_root"), str):
            # the root a run started with, before it saved (Trainer's output dir: kind "hf"; its
            # callback's resume event names it where the run had started before it knew it)
            recorded, hf = Path(e["checkpoint_root"]), e.get("kind") == "hf"
    if hf and recorded is not None:
        root = recorded if recorded.is_absolute() else job / recorded
        if not _same(root, job) and list_step_dirs(job, parse_hf_step) and (not root.is_dir() or _is_job_dir(root)):
            # a moved or copied job dir that is its own output dir: the log keeps the old paths
            return Root(job, "Hugging Face Trainer's output dir: this job dir, moved or copied", hf=True)
        return Root(root, f"Hugging Face Trainer's output dir, recorded in {job / EVENTS}", hf=True)
    if recorded is None:
        if not default.is_dir() and _is_root(job):
            return Root(job, "the job dir itself holds the step dirs")
        return Root(default)
    root = recorded if recorded.is_absolute() else job / recorded
    if _same(root, default):
        return Root(default)
    if list_step_dirs(default):
        if not root.is_dir() or (root.name == CHECKPOINTS and _has_job_files(root.parent)):
            return Root(default)  # a moved or copied job dir
        return Root(root, f"recorded in {job / EVENTS}; {default} holds older ones")
    return Root(root, f"recorded in {job / EVENTS}")
