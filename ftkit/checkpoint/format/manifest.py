"""The manifest (commit proof) and validation of a checkpoint directory. Pure file work, no torch.

A checkpoint directory is valid when: it is a real directory (not a symlink), the
``checkpoint-is-incomplete`` sentinel is absent, ``manifest.json`` parses and names this
step, and every file it lists exists with the recorded size. ``checksums=True`` also
recomputes each file's CRC-32 and compares it with the manifest (:func:`verify_files`: each
file read once, at the device's speed, by :mod:`ftkit.checkpoint.io.reader`).

With several ranks a load checks each file once, not once per rank (:func:`verify_share`):
a rank's own state file is checked by the rank that reads it, as it reads it; the DCP files
are shared out among the ranks, each rank taking those it wrote (which, at the same world
size, are the ones it will read), before anything is restored, and the ranks agree on the
result.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from ..config import CheckpointInfo
from ..io.files import CHECKSUM, atomic_write_bytes
from ..io.reader import FileProblem, check_file
from .layout import MANIFEST, PIN, SENTINEL, not_ftkits, parse_hf_step, parse_step

__all__ = [
    "FORMAT",
    "VERSION",
    "build_manifest",
    "validate_dir",
    "verify_files",
    "verify_share",
    "write_manifest",
]

FORMAT = "ftkit-checkpoint"
VERSION = 1
HF_TRAINER_STATE = "trainer_state.json"
"""What Trainer writes into a ``checkpoint-N`` last: one without ftkit's sentinel and manifest
that holds it was saved before ftkit was added (``unsealed``), not a save that never finished."""


@functools.cache
def _versions() -> tuple[str, str]:
    """ftkit's and torch's versions, looked up once per process (``metadata.version`` scans
    ``sys.path``, a cost on every save, larger where it lies on a network filesystem)."""
    from importlib import metadata

    try:
        ftkit_version = metadata.version("ftkit")
    except metadata.PackageNotFoundError:
        ftkit_version = "unknown"
    try:
        import sys

        torch = sys.modules.get("torch")
        torch_version = str(torch.__version__) if torch is not None else metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    return ftkit_version, torch_version


def build_manifest(
    *,
    step: int,
    time: float,
    world_size: int,
    kind: str,
    reason: str | None,
    pinned: bool,
    files: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    ftkit_version, torch_version = _versions()
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "time": time,
        "world_size": world_size,
        "kind": kind,
        "reason": reason,
        "pinned_at_save": pinned,
        "ftkit_version": ftkit_version,
        "torch_version": torch_version,
        "checksum": CHECKSUM,
        "files": {name: dict(meta) for name, meta in sorted(files.items())},
    }


def write_manifest(
    directory: Path, manifest: Mapping[str, Any], *, sync: bool = True, sync_dir: bool = True
) -> None:
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(directory / MANIFEST, data, sync=sync, sync_dir=sync_dir)


def _safe_relpath(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name


def verify_files(
    directory: Path,
    files: Mapping[str, Mapping[str, Any]],
    names: Iterable[str] | None = None,
    *,
    cache: bool = False,
) -> str:
    """Recompute the CRC-32 of ``names`` (default: all files); return "" or the first problem.

    Each file is read once (:func:`ftkit.checkpoint.io.reader.check_file`): with ``O_DIRECT`` into reused
    buffers, or with ``cache=True`` through the page cache, for files that a reader on this
    node (DCP's) reads right after, which then finds them in memory."""
    for name in sorted(files) if names is None else names:
        try:
            check_file(directory / name, files[name], name=name, cache=cache)
        except FileProblem as exc:
            return str(exc)
    return ""


def _dcp_writer(name: str) -> int | None:
    """The rank that wrote ``dcp/__<rank>_<n>.distcp`` (None for other files)."""
    leaf = PurePosixPath(name).name
    if not leaf.startswith("__") or not leaf.endswith(".distcp"):
        return None
    rank = leaf[2:].split("_", 1)[0]
    return int(rank) if rank.isdigit() else None


def verify_share(
    files: Mapping[str, Mapping[str, Any]], rank: int, world_size: int, *, skip: Iterable[str] = ()
) -> list[str]:
    """The files ``rank`` checks before a load of several ranks: each file once among the
    ranks, none of ``skip`` (the state files, which their readers check as they read them).

    A ``dcp/__<r>_<n>.distcp`` file goes to rank ``r`` (mod ``world_size``): at the same world
    size the rank that will read it, so on a multi-node job the file is read from the disk
    on the node that needs it and left in its page cache (``verify_files(cache=True)``).
    The rest (``.metadata``, files of other layouts) is dealt out round-robin."""
    skipped = set(skip)
    rest = sorted(n for n in files if n not in skipped and _dcp_writer(n) is None)
    mine = [n for i, n in enumerate(rest) if i % world_size == rank]
    for name in sorted(files):
        owner = _dcp_writer(name)
        if name not in skipped and owner is not None and owner % world_size == rank:
            mine.append(name)
    return mine


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and structurally check ``manifest.json``; raise ValueError with the problem."""
    raw = (directory / MANIFEST).read_bytes()
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"manifest.json is not an {FORMAT} manifest")
    if not isinstance(manifest.get("step"), int):
        raise ValueError("manifest.json has no integer 'step'")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError("manifest.json lists no files")
    for name, meta in files.items():
        if (
            not _safe_relpath(name)
            or not isinstance(meta, dict)
            or not isinstance(meta.get("size"), int)
        ):
            raise ValueError(f"manifest.json has a bad file entry {name!r}")
    return manifest


_SAYS_BAD = {errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG}
"""Errors that say the checkpoint's layout is broken (a manifest that is a directory, a file
under something that is not one, a link loop): such a checkpoint is ``corrupt``. Any other error
(permissions, I/O, a network filesystem's stale handle or timeout, too many open files, memory)
says only that this process cannot look now: ``unreadable``, not known to be bad."""


def _exists(path: Path) -> bool:
    """Whether ``path`` exists (not following a link); an error other than its absence raises."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _unreadable(exc: OSError, where: Path) -> str:
    """Why a checkpoint could not be looked at: not that it is bad, that this process cannot tell."""
    return (f"cannot read {exc.filename or where}: {exc.strerror or exc} (the checkpoint may be intact: "
            "fix the permissions or the filesystem, or move the directory away to use an older one)")


def known_broken(problem: str) -> bool:
    """Whether a checkpoint a load skipped for ``problem`` (the ranks' agreed one, as the
    ``skip`` event records it) is known broken: its contents do not match its manifest (a
    checksum, a size, a state file that does not parse, a manifest that does not). Not a save
    that never finished (``incomplete``: retention's to remove), nor a read the system failed
    (``[Errno N]``, "cannot read": a stale NFS handle, a transient I/O error), after which the
    checkpoint may load next time."""
    if problem.startswith("incomplete:"):
        return False
    return not re.search(r"\[Errno \d+\]|(^|: )cannot read ", problem)


def validate_dir(path: str | os.PathLike[str], *, checksums: bool = False) -> CheckpointInfo:
    """Describe the checkpoint directory ``path``; never raises for a bad checkpoint.

    ``unsealed``: a Hugging Face ``checkpoint-N`` that Trainer wrote without ftkit (its
    ``trainer_state.json``, neither ftkit's sentinel nor a manifest): not known to be bad, not
    verifiable; a resume takes it where it is the newest, and nothing deletes it.

    ``unreadable``: an error such as permission denied, an I/O or a network filesystem error
    kept this process from looking: the checkpoint is not known to be bad, so
    a load stops rather than fall back past it and nothing deletes it."""
    path = Path(path)
    step = parse_step(path.name)
    step = parse_hf_step(path.name) if step is None else step  # a Hugging Face checkpoint-N, sealed by ftkit
    step = -1 if step is None else step
    pinned = os.path.lexists(path / PIN)

    def info(status: str, reason: str = "", **kw: Any) -> CheckpointInfo:
        return CheckpointInfo(
            step=step, path=path, status=status, reason=reason, pinned=pinned, **kw
        )

    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return info("corrupt", "not a directory (symlinks are never followed)")
        if _exists(path / SENTINEL):
            return info("incomplete", f"{SENTINEL} present: the save never finished")
        if not _exists(path / MANIFEST):
            if parse_hf_step(path.name) is not None and _exists(path / HF_TRAINER_STATE):
                return info("unsealed", f"written without ftkit (Trainer's {HF_TRAINER_STATE}, no "
                                        f"{SENTINEL}, no manifest.json): its files cannot be verified")
            if not_ftkits(path):  # files, but not even the sentinel ftkit creates before any of them
                return info("incomplete", f"neither manifest.json nor {SENTINEL}: not a save of ftkit's (files "
                                          "of someone else's under a checkpoint's name?); ftkit never deletes it")
            return info("incomplete", "no manifest.json: the save never finished")
        manifest = read_manifest(path)
    except FileNotFoundError as exc:  # gone meanwhile (retention, a person)
        return info("corrupt", f"{exc.filename or path} vanished")
    except OSError as exc:
        if exc.errno in _SAYS_BAD:  # a manifest that is a directory, a link loop, ...
            return info("corrupt", f"{exc.filename or path}: {exc.strerror or exc}")
        return info("unreadable", _unreadable(exc, path))
    except ValueError as exc:
        return info("corrupt", str(exc))
    files = manifest["files"]
    common = {
        "size": sum(m["size"] for m in files.values()),
        "time": manifest.get("time"),
        "world_size": manifest.get("world_size"),
        "kind": manifest.get("kind"),
        "saved_for": manifest.get("reason"),
        "files": files,
    }
    if step >= 0 and manifest["step"] != step:
        return info(
            "corrupt",
            f"manifest.json says step {manifest['step']}, directory is {path.name}",
            **common,
        )
    for name, meta in files.items():
        try:
            fst = os.lstat(path / name)
        except FileNotFoundError:
            return info("corrupt", f"{name} is missing", **common)
        except OSError as exc:
            if exc.errno in _SAYS_BAD:
                return info("corrupt", f"cannot stat {name}: {exc.strerror or exc}", **common)
            return info("unreadable", _unreadable(exc, path / name), **common)
        if not stat.S_ISREG(fst.st_mode):
            return info("corrupt", f"{name} is not a regular file", **common)
        if fst.st_size != meta["size"]:
            return info(
                "corrupt",
                f"{name}: size {fst.st_size} bytes, manifest says {meta['size']}",
                **common,
            )
    if checksums:
        problem = verify_files(path, files)
        if problem:
            return info("corrupt", problem, checksums_checked=True, **common)
    return info("valid", checksums_checked=checksums, **common)
