"""One rank's flat state as a single ``torch.save`` file, checksummed while it is written.

Reading never unpickles arbitrary objects: ``torch.load(weights_only=True)`` only. With
``verify=True`` the file's CRC-32 is recomputed (one sequential read) and compared with the
manifest before torch parses it, so a flipped byte is never loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ._files import CHECKSUM, HashingWriter
from ._manifest import verify_files

__all__ = ["FILE_FORMAT", "read_state_file", "write_state_file"]

FILE_FORMAT = "ftkit-state"


class WriteProgress:
    """Bytes written so far by one save, for error messages."""

    __slots__ = ("done", "writer")

    def __init__(self) -> None:
        self.done = 0
        self.writer: HashingWriter | None = None

    @property
    def total(self) -> int:
        return self.done + (self.writer.size if self.writer is not None else 0)


def write_state_file(
    directory: Path,
    name: str,
    obj: Mapping[str, Any],
    *,
    sync: bool = True,
    progress: WriteProgress | None = None,
) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``directory/name``; return its manifest entry (size, crc32)."""
    payload = {"format": FILE_FORMAT, "version": 1, **obj}
    writer = HashingWriter(directory / name)
    if progress is not None:
        progress.writer = writer
    try:
        torch.save(payload, writer)  # type: ignore[arg-type]  # a binary file-like object
        writer.close(sync=sync)
    except BaseException as exc:
        writer.abort()
        if writer.error is not None and writer.error is not exc:
            raise writer.error from exc  # the real cause (ENOSPC, EIO, ...), not torch's wrapper
        raise
    if progress is not None:
        progress.done += writer.size
        progress.writer = None
    return {"size": writer.size, CHECKSUM: writer.checksum}


def read_state_file(
    directory: Path, name: str, meta: Mapping[str, Any], *, verify: bool = True
) -> dict[str, Any]:
    """Load a state file written by :func:`write_state_file` (weights_only, CPU)."""
    path = directory / name
    if verify:
        problem = verify_files(directory, {name: meta})
        if problem:
            raise CheckpointError(f"{directory}: {problem}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path} is not an {FILE_FORMAT} file")
    return payload
