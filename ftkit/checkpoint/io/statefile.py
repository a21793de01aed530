"""One rank's flat state as a single ``torch.save`` file, checksummed while it is written.

The file is an ordinary ``torch.save`` zip archive (``torch.load`` reads it), written through
:class:`HashingWriter` (CRC-32 in a helper thread, overlapping the writes and the fsync). It
is written without torch's own per-record zip CRC-32s, which ``torch.load`` never checks and
which cost a full extra pass over the data in the writing thread; the manifest's CRC-32
of the whole file replaces them. The zip CRC fields are therefore 0 (``unzip -t`` complains).
Should a torch release change the private serializer entry points used for this, the file
is written with plain ``torch.save`` (same format, zip CRCs filled in, slower). Where the
filesystem accepts it the file is written with ``O_DIRECT`` (:mod:`ftkit.checkpoint.io.direct`), its tensor
records aligned to 4096 bytes instead of torch's 64.

Reading never unpickles arbitrary objects: only what ``weights_only`` allows. The file is read
once, at the device's sequential speed (:mod:`ftkit.checkpoint.io.reader`: ``O_DIRECT`` into fresh
page-aligned memory, several large reads in flight), with its CRC-32 compared with the manifest
as the bytes arrive (``verify=True``), and only then parsed, in place: the tensors are views of
the bytes read (one storage per record, as a memory-mapped load makes them), so they are
neither copied out of the file nor out of the buffer; a flipped byte is never parsed. Plain
state is unpickled by the C unpickler (:class:`ftkit.checkpoint.io.unpickle.PlainUnpickler`,
globals that ``weights_only`` allows too), any other by torch's own loader with its
``weights_only`` unpickler, given the bytes as the archive's one storage. The caller copies out what it keeps
(:func:`ftkit.checkpoint.state.restore.own_tensors`). Should a torch release change those private
entry points, the buffer is parsed by plain ``torch.load`` (same result, each tensor copied).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import itertools
import logging
import pickle
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, out_of_memory
from . import reader as _reader
from .archive import Held, LayoutGuess, archive_records, archive_records_guessed, check_guess
from .device import DeviceCopies, load_copies
from .direct import BLOCK, address
from .files import CHECKSUM, HashingWriter
from .reader import (
    CHUNK,
    FRESH_THREADS,
    STAGING,
    Destination,
    Fetch,
    FileProblem,
    Target,
    read_file,
    scatter_file,
)
from .unpickle import PlainUnpickler, Storage

__all__ = ["FILE_FORMAT", "UndoLog", "Undoable", "aside_memory", "parse_state_file", "read_state_bytes", "read_state_file",
           "read_state_into", "write_state_file"]

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
    try:
        ser._save(payload, zip_file, pickle, ser.DEFAULT_PROTOCOL, False)
    except BaseException:  # a write failed (ENOSPC), or Ctrl-C twice raised inside one
        writer.abort()
        # end the archive now, its writes dropped: unended, the writer ends it when it is freed,
        # in a C++ destructor, and a failure there (its offsets no longer match) aborts the process
        with contextlib.suppress(BaseException):
            zip_file.write_end_of_file()
        raise
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
    bounce: bool = False,
) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``directory/name``; return its manifest entry (size, crc32).

    ``direct``: write with O_DIRECT (``checkpoint.direct_io``: None where the filesystem
    accepts it, True required, False never). ``bounce``: a direct write stages every byte
    (the crash-safe saver's, whose tensors lie in tmpfs pages; :class:`ftkit.checkpoint.io.direct.DirectFile`)."""
    payload = {"format": FILE_FORMAT, "version": 1, **obj}
    # the snapshot's tensors outlive the save: the CRC thread may read them after write returns
    writer = HashingWriter(directory / name, stable=_storage_ranges(payload), writeback=sync, direct=direct,
                           bounce=bounce)
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


def _can_parse_in_place() -> bool:
    """Whether this torch has the private pieces ``torch.load`` is made of, as expected: the
    zip reader over a file object and ``state.keys`` taking the file's bytes as one storage (what
    ``torch.load(mmap=True)`` passes it), so that tensors are views of the bytes read."""
    ser = torch.serialization
    try:
        params = inspect.signature(ser._load).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        "overall_storage" in params
        and hasattr(ser, "_weights_only_unpickler")
        and hasattr(torch._C, "PyTorchFileReader")
    )


_PARSE_IN_PLACE = _can_parse_in_place()


class _MemoryFile:
    """A read-only binary file over a buffer, for torch's zip reader (which reads only the
    archive's directory and small records from it: the tensors are views of the buffer)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._view.nbytes)[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        part = self._view[self._pos : self._pos + out.nbytes]
        out[: part.nbytes] = part
        self._pos += part.nbytes
        return part.nbytes

    def read(self, n: int = -1) -> bytes:
        end = self._view.nbytes if n is None or n < 0 else self._pos + n
        data = bytes(self._view[self._pos : end])
        self._pos += len(data)
        return data


class _StateUnpickler(PlainUnpickler):
    """The pickle of a state file whose bytes are in ``view`` (one ``storage`` over them, the
    archive's ``records``): each tensor a view of its record's bytes, as ``torch.load``
    makes it from the storage it is given (``mmap=True``), the tensors of one record on one
    storage."""

    def __init__(self, view: memoryview, storage: torch.UntypedStorage, records: Mapping[str, tuple[int, int]],
                 prefix: str) -> None:
        a, n = records[f"{prefix}data.pkl"]
        super().__init__(bytes(view[a : a + n]))
        self._storage, self._records, self._prefix = storage, records, prefix
        self._held: dict[str, torch.UntypedStorage] = {}

    def storage(self, dtype: torch.dtype, key: str, numel: int) -> Any:
        held = self._held.get(key)
        if held is None:
            record = self._records.get(f"{self._prefix}data/{key}")
            nbytes = numel * dtype.itemsize
            if record is None or record[1] < nbytes:
                raise pickle.UnpicklingError(f"storage {key}: no record of {nbytes} bytes")
            held = self._held[key] = self._storage[record[0] : record[0] + nbytes]
        return Storage(dtype, key, numel, held)

    def tensor(self, storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        return torch.empty((0,), dtype=storage.dtype).set_(storage.held, offset, size, stride)


def _parse_plain(view: memoryview, storage: torch.UntypedStorage, records: Mapping[str, tuple[int, int]]) -> Any:
    """``torch.load``'s payload of a state file of plain state (:class:`_StateUnpickler`);
    raises where it is not plain, or its byte order is not this machine's."""
    prefix = next(name[: -len("data.pkl")] for name in records if name.endswith("/data.pkl") and name.count("/") == 1)
    order = records.get(f"{prefix}byteorder")
    if (bytes(view[order[0] : order[0] + order[1]]) if order else b"little") != sys.byteorder.encode():
        raise pickle.UnpicklingError("stored in the other byte order")
    return _StateUnpickler(view, storage, records, prefix).load()


def _parse(view: memoryview, mapping: Any, records: Mapping[str, tuple[int, int]] | None = None) -> Any:
    """``torch.load(weights_only=True)`` of the archive in ``view``; tensors are views of it."""
    ser = torch.serialization
    if not _PARSE_IN_PLACE:  # same result; each storage copied out of the buffer
        return torch.load(_MemoryFile(view), map_location="cpu", weights_only=True)  # type: ignore[arg-type]
    # the storage keeps `mapping` alive as long as any tensor viewing it
    storage = torch.frombuffer(mapping, dtype=torch.uint8, count=view.nbytes).untyped_storage()
    if records is None:
        with contextlib.suppress(FileProblem, zipfile.BadZipFile):
            records = archive_records(view, Held())  # type: ignore[arg-type]
    if records:  # plain state through the C unpickler; any other, from the start, through torch's
        try:
            return _parse_plain(view, storage, records)
        except Exception as exc:  # torch's parser reads it, or says what is wrong with it
            log.debug("state file parsed by torch's weights_only unpickler: %s", exc)
    reader = torch._C.PyTorchFileReader(_MemoryFile(view))  # type: ignore[call-overload]
    try:
        return ser._load(reader, "cpu", ser._weights_only_unpickler, overall_storage=storage,
                         encoding="utf-8")
    except pickle.UnpicklingError as exc:  # torch.load's words for it where this torch has them (not 2.13's)
        said = getattr(ser, "_get_wo_message", None)
        raise pickle.UnpicklingError(said(str(exc)) if callable(said) else
                                     f"its contents do not parse as a state file (corrupt?): {exc}") from None


def read_state_file(
    directory: Path,
    name: str,
    meta: Mapping[str, Any],
    *,
    verify: bool = True,
    mmap: bool = False,
    direct: bool | None = None,
) -> dict[str, Any]:
    """Load a state file written by :func:`write_state_file` (weights_only, CPU).

    The file is read once (:func:`ftkit.checkpoint.io.reader.read_file`: ``O_DIRECT`` where the filesystem
    accepts it, ``direct`` as ``checkpoint.direct_io``), its CRC-32 checked against ``meta``
    as the bytes arrive when ``verify``, and only then parsed, in place: the payload's tensors
    are views of the bytes read (anonymous memory, not the file), so a corrupt file raises
    :class:`CheckpointError` before anything of it reaches a caller. ``mmap`` is accepted for
    the callers that asked for views of the file: they get views of the read buffer, which
    is freed when the last of them is; the caller copies out what it keeps
    (:func:`ftkit.checkpoint.state.restore.own_tensors`) so that no kept tensor holds all of it.
    """
    del mmap  # every load is in place now; see the docstring
    return parse_state_file(directory / name, read_state_bytes(directory, name, meta, verify=verify, direct=direct))


def read_state_bytes(directory: Path, name: str, meta: Mapping[str, Any], *, verify: bool = True,
                     direct: bool | None = None) -> tuple[Any, memoryview]:
    """The first half of :func:`read_state_file`: the file's bytes, checked (``(mapping, view)``
    of :func:`ftkit.checkpoint.io.reader.read_file`), for :func:`parse_state_file` later: a
    load reads its small state file, starts the bulk of its other files, then parses."""
    try:
        return read_file(directory / name, meta, verify=verify, direct=direct)
    except FileProblem as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc


def parse_state_file(path: Path, read: tuple[Any, memoryview]) -> dict[str, Any]:
    """The second half of :func:`read_state_file`: the payload of the bytes ``read`` of ``path``."""
    mapping, view = read
    try:
        payload = _parse(view, mapping)
    except Exception as exc:
        if out_of_memory(exc):  # no fault of the file's: not a corrupt checkpoint to skip
            raise
        raise CheckpointError(f"cannot load {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path} is not an {FILE_FORMAT} file")
    return payload


def _fetch_all_but_storages(view: memoryview, fetch: Fetch,
                            guess: bool = False) -> tuple[dict[str, tuple[int, int]], list[tuple[int, bytes, int, int]]]:
    """Read everything torch's parser looks at into ``view``: the zip directory, every local
    header, every record but the tensor storages (``*/data/<key>``), which stay unread. The
    archive's records (name -> (offset, size)). ``guess``: the local headers are not read but
    their places inferred (:func:`ftkit.checkpoint.io.archive.archive_records_guessed`), and
    returned to be checked once the file is read (else an empty list)."""
    records, checks = archive_records_guessed(view, fetch) if guess else (archive_records(view, fetch), [])
    fetch.many([(start, start + size) for name, (start, size) in records.items()
                if "/data/" not in name or name.endswith(".pkl")])
    return records, checks


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _fresh(saved: torch.Tensor) -> torch.Tensor:
    """Memory of its own for a payload tensor, of its kind: a Parameter stays one, and a
    tensor that requires grad still does, as ``torch.load`` gives them."""
    fresh = torch.empty(saved.shape, dtype=saved.dtype)
    if isinstance(saved, torch.nn.Parameter):
        return torch.nn.Parameter(fresh, requires_grad=saved.requires_grad)
    return fresh.requires_grad_() if saved.requires_grad else fresh


def _substitute(value: Any, swap: Mapping[int, torch.Tensor]) -> Any:
    """``value`` with each tensor whose id is in ``swap`` replaced, dicts and lists in place
    (a module's state dict keeps its ``_metadata``)."""
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, dict):
        for k, v in value.items():
            new = _substitute(v, swap)
            if new is not v:
                value[k] = new
    elif isinstance(value, list):
        value[:] = [_substitute(v, swap) for v in value]
    elif isinstance(value, tuple):
        new = [_substitute(v, swap) for v in value]
        if any(a is not b for a, b in zip(new, value, strict=True)):  # else as it is (a torch.Size)
            return tuple(new)
    return value


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def placeable(t: torch.Tensor, copies: DeviceCopies | None) -> bool:
    """Whether the reader can put a file's bytes straight into ``t``: host memory, or a CUDA
    tensor's when the load has ``copies`` (:func:`ftkit.checkpoint.io.device.load_copies`)."""
    if t.is_conj() or t.is_neg():  # a lazily conjugated or negated view: its memory holds other values
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and copies is not None)


def destination(t: torch.Tensor, copies: DeviceCopies | None) -> memoryview | Destination:
    """Where the reader puts ``t``'s bytes (``t`` contiguous and :func:`placeable`)."""
    if t.device.type == "cuda" and copies is not None:
        return copies.target(t)
    return tensor_memory(t.detach())


def aside_memory(nbytes: int) -> torch.Tensor:
    """Memory for the live bytes :class:`Undoable` sets aside: small pages, not huge ones,
    which after a while of page-cache churn the kernel compacts memory to make, for seconds
    (a 1 GB load here: 0.8 s with small pages, 1.9-3.9 s with ``MADV_HUGEPAGE``)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class UndoLog:
    """What a load wrote over in live memory, each part in the order it was set aside (each
    writer records it after copying it aside and before writing: ``list.append`` is
    thread-safe), and :meth:`undo` puts the parts back last first. Where two writes cover the
    same bytes (tied weights: a checkpoint holds the weight twice, the live model once) the
    first one recorded set aside the bytes from before the load, since the other wrote only
    once recorded itself, and it is put back last: the memory ends as it was, whichever
    placing thread wrote first."""

    def __init__(self) -> None:
        self._parts: list[tuple[Any, ...]] = []  # (owner, live address, aside address, n) or (owner, live, copy)

    def span(self, owner: object, live: int, aside: int, n: int) -> None:
        """``n`` bytes at address ``live``, just copied to ``aside``, are about to be written."""
        self._parts.append((owner, live, aside, n))

    def copy(self, owner: object, live: torch.Tensor) -> None:
        """``live`` is about to be copied into: a copy of it set aside."""
        self._parts.append((owner, live, live.detach().clone()))

    def undo(self, owner: object = None) -> None:
        """Every part recorded (only ``owner``'s, when given) put back, the last recorded first."""
        mine = [p for p in self._parts if owner is None or p[0] is owner]
        self._parts = [p for p in self._parts if not (owner is None or p[0] is owner)]
        with torch.no_grad():
            for part in reversed(mine):
                if len(part) == 4:
                    ctypes.memmove(part[1], part[2], part[3])
                else:
                    part[1].copy_(part[2])


class Undoable:
    """A live host tensor's memory that a corrupt file must leave as it was (a
    :class:`ftkit.checkpoint.io.reader.Destination`): before the file's bytes are written over
    a part of it, that part is copied aside and recorded in ``log`` (:meth:`UndoLog.undo`
    puts it back), under ``owner`` (a file's read)."""

    def __init__(self, live: int, aside: int, log: UndoLog, owner: object = None) -> None:
        self.live, self.aside = live, aside  # addresses of the tensor's bytes and of their copy
        self.log, self.owner = log, owner

    def write(self, at: int, src: int, n: int) -> None:
        ctypes.memmove(self.aside + at, self.live + at, n)
        self.log.span(self.owner, self.live + at, self.aside + at, n)
        ctypes.memmove(self.live + at, src, n)


def read_state_into(
    directory: Path,
    name: str,
    meta: Mapping[str, Any],
    targets: Callable[[dict[str, Any]], Mapping[int, torch.Tensor]],
    *,
    verify: bool = True,
    direct: bool | None = None,
    undo: Callable[[torch.Tensor], bool] | None = None,
    keep: Callable[[Callable[[], None]], None] | None = None,
) -> dict[str, Any]:
    """:func:`read_state_file`, with the bytes of some tensors read straight into live ones.

    The archive's directory and pickle are read and parsed first (the storages are not read
    yet); ``targets(payload)`` names, by ``id`` of the payload's tensor, the live CPU tensor
    of the same shape and dtype that will take its values. The file then streams through
    :func:`ftkit.checkpoint.io.reader.scatter_file`: those tensors' bytes go straight into the live tensors
    (memory already faulted in: a resume's model and optimizer; a GPU's, by host-to-device
    copies from pinned staging as the pieces arrive, :mod:`ftkit.checkpoint.io.device`), the others into fresh
    memory of each tensor's own (not one buffer for all: the load keeps them, an optimizer's
    moments when it has none yet). In the payload returned each tensor is the live tensor or
    its own, and ``payload["owned"]`` is True when none is a view of a shared read buffer
    (then :func:`ftkit.checkpoint.state.restore.own_tensors` has nothing to copy). On :class:`CheckpointError` the
    live tensors may hold the corrupt file's bytes: the caller must have an older checkpoint
    to overwrite them with.

    ``undo(live)``: that live tensor must hold what it held before if the file turns out
    corrupt (the only checkpoint, which a fresh start may follow). In host memory, each part
    of it is copied aside just before the file's bytes are written over it, on the placing
    threads while the device reads on (so the read stays one pass at the device's speed, for
    one more copy in memory and the aside memory, at most the size of those tensors); on any
    error the parts written are put back before this raises. One on a GPU is read into host
    memory of its own and copied into it once the file checks out, as a payload tensor of
    another layout is. The tensors ``undo`` declines (an optimizer's moments in memory the
    load just made for them) are read into straight away.

    ``keep(put_back)`` (with ``undo``; several ranks, which agree on the read only after it):
    once the file checked out here, what it wrote over stays set aside, and ``put_back()``
    puts it back should another rank's read or restore fail (a live tensor of another layout
    is copied aside before it is copied into)."""
    if not _PARSE_IN_PLACE:  # no in-place parse, nothing to aim at: the plain read
        return read_state_file(directory, name, meta, verify=verify, direct=direct)
    try:
        return _read_state_into(directory, name, meta, targets, verify=verify, direct=direct, guess=True, undo=undo,
                                keep=keep)
    except LayoutGuess as exc:  # a zip writer of another kind: read again, the local headers first
        log.info("%s: %s; reading it again, its local headers first", directory / name, exc)
    return _read_state_into(directory, name, meta, targets, verify=verify, direct=direct, guess=False, undo=undo,
                            keep=keep)


def _read_state_into(directory: Path, name: str, meta: Mapping[str, Any],
                     targets: Callable[[dict[str, Any]], Mapping[int, torch.Tensor]], *, verify: bool,
                     direct: bool | None, guess: bool,
                     undo: Callable[[torch.Tensor], bool] | None = None,
                     keep: Callable[[Callable[[], None]], None] | None = None) -> dict[str, Any]:
    """:func:`read_state_into`; ``guess``: the local headers' places inferred from the archive's
    directory and checked once the file is read (:class:`LayoutGuess` when one is wrong)."""
    path = directory / name
    holder: dict[str, Any] = {"fresh": 0, "undo": UndoLog()}

    def plan(mapping: Any, view: memoryview, fetch: Fetch) -> list[Target]:
        records, holder["checks"] = _fetch_all_but_storages(view, fetch, guess)
        try:
            return aim(mapping, view, fetch, records)
        except Exception as exc:
            if holder["checks"] and not out_of_memory(exc):  # parsed at guessed places: the guess may be what is wrong
                raise LayoutGuess(f"the file did not parse at the places its directory implies ({exc})") from exc
            raise

    def aim(mapping: Any, view: memoryview, fetch: Fetch, records: dict[str, tuple[int, int]]) -> list[Target]:
        fetch.done()
        payload = holder["payload"] = _parse(view, mapping, records)
        if not isinstance(payload, dict) or payload.get("format") != FILE_FORMAT:
            raise FileProblem(f"{name} is not an {FILE_FORMAT} file")
        base = address(view)
        wanted = _live_side(targets, payload, path) if base is not None else {}
        # (start, end, id of the payload's tensor, memory its bytes go to, live tensor to copy
        # them into once the file is read and checked: one the reader cannot write into)
        aims: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = []
        swap: dict[int, torch.Tensor] = {}
        for saved in _tensors(payload):
            if base is None or not saved.is_contiguous():
                continue
            if saved.numel() == 0:
                swap[id(saved)] = _fresh(saved)
                continue
            live = wanted.get(id(saved))
            later = None
            if live is None or saved.shape != live.shape or saved.dtype != live.dtype:
                # no live tensor takes it: memory of its own (the load keeps it), not the buffer
                live = _fresh(saved)
                holder["fresh"] += saved.numel() * saved.element_size()
            elif not (placeable(live, copies) and live.is_contiguous()) or (
                    undo is not None and live.device.type != "cpu" and undo(live)):
                # a live tensor of another layout (a channels_last weight's moments, a conj
                # view), or a GPU's that must survive a corrupt file: read into memory of its
                # own, copied into it once the file checks out
                live, later = _fresh(saved), live
            start = saved.data_ptr() - base
            aims.append((start, start + saved.numel() * saved.element_size(), id(saved), live, later))
        aims.sort(key=lambda a: a[0])
        # bytes that two payload tensors share (views of one storage) go to the buffer
        reach = list(itertools.accumulate((a[1] for a in aims), max, initial=0))  # reach[i]: aims[:i]'s end
        alone = [a for i, a in enumerate(aims) if reach[i] <= a[0] and (i + 1 == len(aims) or a[1] <= aims[i + 1][0])]
        swap.update({a[2]: a[4] if a[4] is not None else a[3] for a in alone})
        holder["swap"] = swap
        holder["later"] = [(a[3], a[4]) for a in alone if a[4] is not None]
        holder["owned"] = len(swap) == len(_tensors(payload))
        guarded = {a[2] for a in alone if undo is not None and a[4] is None and a[3].device.type == "cpu"
                   and a[3] is wanted.get(a[2]) and undo(a[3])}
        aside_at = 0
        if guarded:  # one buffer for the copies set aside: fresh memory, faulted in as it is written
            aside = sum(a[1] - a[0] for a in alone if a[2] in guarded)
            holder["aside"] = aside_memory(aside)
            holder["fresh"] += aside
            aside_at = holder["aside"].data_ptr()
        out: list[Target] = []
        for a in alone:
            if a[2] in guarded:
                out.append((a[0], a[1], Undoable(a[3].data_ptr(), aside_at, holder["undo"])))
                aside_at += a[1] - a[0]
            else:
                out.append((a[0], a[1], destination(a[3], copies)))
        return out

    # live tensors on a GPU: pinned staging, each piece copied to the device as it arrives
    with load_copies(chunk=CHUNK, count=STAGING // CHUNK) as copies:
        try:
            _, view = scatter_file(path, meta, plan, verify=verify, direct=direct,
                                   stages=copies.stages() if copies is not None else None,
                                   # a fresh optimizer's moments: page faults, which more threads share
                                   placers=lambda: _reader.FRESH_WORKERS if holder["fresh"] >= FRESH_THREADS else _reader.WORKERS)
            check_guess(view, holder["checks"])  # the bytes parsed are the file's: so are the places?
        except BaseException as exc:
            holder["undo"].undo()  # (the placing threads are done) what must survive, put back
            if isinstance(exc, (LayoutGuess, CheckpointError)) or not isinstance(exc, Exception) or out_of_memory(exc):
                raise  # (memory running out is no fault of the file's: the load fails, nothing is skipped)
            if isinstance(exc, FileProblem):
                raise CheckpointError(f"{directory}: {exc}") from exc
            raise CheckpointError(f"cannot load {path}: {exc}") from exc
        finally:
            aside = holder.pop("aside", None)  # the copies set aside: freed once the file checks out
    if keep is not None:  # ... or once every rank's did (the caller's put_back: the copies below too)
        keep(functools.partial(_put_back, holder["undo"], aside))
    with torch.no_grad():
        for fresh, live in holder["later"]:
            if keep is not None and undo is not None and undo(live):  # (on a GPU too: state outside the modules)
                holder["undo"].copy(None, live)
            live.copy_(fresh)
    payload = _substitute(holder["payload"], holder["swap"])
    payload["owned"] = holder["owned"]
    return payload


def _put_back(log: UndoLog, aside: torch.Tensor | None) -> None:
    """What ``log`` recorded put back, from ``aside`` (the memory it was set aside in: held by
    whoever holds this call until then) and its copies."""
    log.undo()
    del aside


def _live_side(targets: Callable[[dict[str, Any]], Mapping[int, torch.Tensor]], payload: dict[str, Any],
               path: Path) -> Mapping[int, torch.Tensor]:
    """``targets(payload)``; none where naming them fails. That is the live state's doing (a
    ``state_dict()`` that raises, a tensor of a kind not foreseen), not the file's: the file
    is read into memory of its own, and the restore meets the live state's problem itself."""
    try:
        return targets(payload)
    except Exception as exc:
        log.info("%s: no live tensors to read it into (%s: %s); reading it into memory of its own",
                 path, type(exc).__name__, exc)
        return {}
