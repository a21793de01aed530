"""One rank's flat state as a single ``torch.save`` file, checksummed while it is written.

The file is an ordinary ``torch.save`` zip archive (``torch.load`` reads it), written through
:class:`HashingWriter` (CRC-32 in a helper thread, overlapping the writes and the fsync). It
is written without torch's own per-record zip CRC-32s, which ``torch.load`` never checks and
which cost a full extra pass over the data in the writing thread; the manifest's CRC-32
of the whole file replaces them. The zip CRC fields are therefore 0 (``unzip -t`` complains).
Should a torch release change the private serializer entry points used for this, the file
is written with plain ``torch.save`` (same format, zip CRCs filled in, slower). Where the
filesystem accepts it the file is written with ``O_DIRECT`` (:mod:`._direct`), its tensor
records aligned to 4096 bytes instead of torch's 64.

Reading never unpickles arbitrary objects: ``torch.load(weights_only=True)`` only. With
``verify=True`` the file's CRC-32 is recomputed (one sequential read) and compared with the
manifest before torch parses it, so a flipped byte is never loaded. With ``mmap=True`` the
tensors are views of the file mapped copy-on-write (``torch.load(weights_only=True,
mmap=True)``): the pages the CRC pass just read are used in place instead of being copied
into fresh memory, which on a VM whose first touch of memory is slow costs seconds per GiB;
the caller must copy out what it keeps (:func:`ftkit.checkpoint._state.own_tensors`).
"""

from __future__ import annotations

import inspect
import logging
import mmap as _mmap
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ._direct import BLOCK
from ._files import CHECKSUM, HashingWriter
from ._manifest import verify_files

__all__ = ["FILE_FORMAT", "read_state_file", "write_state_file"]

log = logging.getLogger(__name__)

FILE_FORMAT = "ftkit-state"
_SAVE_PARAMS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


def _can_skip_zip_crc() -> bool:
    """Whether this torch has the private pieces ``torch.save`` is made of, as expected."""
    ser = torch.serialization
    try:
        params = list(inspect.signature(ser._save).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        params == _SAVE_PARAMS
        and hasattr(torch._C, "PyTorchFileWriter")
        and callable(getattr(ser, "_get_storage_alignment", None))
    )


_SKIP_ZIP_CRC = _can_skip_zip_crc()


def _torch_save(payload: Any, writer: HashingWriter) -> None:
    """``torch.save(payload, writer)`` without torch's per-record zip CRC-32 when possible.

    Same steps as ``torch.save`` to a file object (pickle protocol, storage alignment,
    byteorder record), but with ``compute_crc32=False`` for this one writer instead of
    flipping torch's process-wide ``set_crc32_options``, which would race with other threads.
    A direct writer gets records aligned to its block (4096), so that page-aligned tensors go
    to the disk without a copy (``torch.load`` reads any alignment).
    """
    ser = torch.serialization
    if not _SKIP_ZIP_CRC:
        torch.save(payload, writer)  # type: ignore[arg-type]  # a binary file-like object
        return
    alignment = max(BLOCK, ser._get_storage_alignment()) if writer.direct else ser._get_storage_alignment()
    zip_file = torch._C.PyTorchFileWriter(writer, False, alignment)  # type: ignore[call-overload]
    ser._save(payload, zip_file, pickle, ser.DEFAULT_PROTOCOL, False)
    zip_file.write_end_of_file()
    writer.flush()


def _storage_ranges(obj: Any) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of the CPU storage of every tensor in ``obj`` (dicts, lists, tuples)."""
    ranges: list[tuple[int, int]] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                storage = value.untyped_storage()
                ranges.append((storage.data_ptr(), storage.nbytes()))
        elif isinstance(value, (Mapping, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, Mapping) else value)
    return ranges


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
    direct: bool | None = None,
) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``directory/name``; return its manifest entry (size, crc32).

    ``direct``: write with O_DIRECT (``checkpoint.direct_io``: None where the filesystem
    accepts it, True required, False never)."""
    payload = {"format": FILE_FORMAT, "version": 1, **obj}
    # the snapshot's tensors outlive the save: the CRC thread may read them after write returns
    writer = HashingWriter(directory / name, stable=_storage_ranges(payload), writeback=sync, direct=direct)
    if progress is not None:
        progress.writer = writer
    try:
        _torch_save(payload, writer)
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


def _mappable(path: Path) -> bool:
    """Whether ``path`` can be memory-mapped (some FUSE filesystems cannot), with a warning if not."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # torch.load names the problem
    try:
        if os.fstat(fd).st_size:
            _mmap.mmap(fd, 0, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ).close()
        return True
    except (OSError, ValueError) as exc:
        log.warning("cannot memory-map %s (%s); reading it into memory instead", path, exc)
        return False
    finally:
        os.close(fd)


def read_state_file(
    directory: Path,
    name: str,
    meta: Mapping[str, Any],
    *,
    verify: bool = True,
    mmap: bool = False,
) -> dict[str, Any]:
    """Load a state file written by :func:`write_state_file` (weights_only, CPU).

    ``mmap``: tensors are copy-on-write views of the mapped file (see the module doc).
    """
    path = directory / name
    if verify:
        problem = verify_files(directory, {name: meta})
        if problem:
            raise CheckpointError(f"{directory}: {problem}")
    try:
        mapped = mmap and _mappable(path)
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:
        raise CheckpointError(f"cannot load {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path} is not an {FILE_FORMAT} file")
    return payload
