"""DCP's files read once each, checksummed as they arrive, straight into the tensors DCP asks for.

``dcp.FileSystemReader`` reads every item of a ``.distcp`` file by itself through a buffered
stream and ``torch.load``s it: each tensor lands in fresh memory, is copied into the tensor
DCP resolved for it, and ftkit had read the same file once before to check its CRC-32. Here
:class:`StreamingReader` reads each file the load needs with :func:`ftkit.checkpoint.io.reader.scatter_file`:
once, with ``O_DIRECT``, through reused staging buffers, the CRC-32 compared with the
manifest as the pieces arrive; each tensor item's bytes go straight into the tensor DCP
resolved for it (the live model's and optimizer's memory; on a GPU, by host-to-device copies
from pinned staging as the pieces arrive, :mod:`ftkit.checkpoint.io.device`), so no fresh
memory is faulted in for them.

Each tensor item of a ``.distcp`` file is a small ``torch.save`` archive, and before the bulk
of the file is read the load must know where each item's storage bytes lie in it. Reading
every item's directory and pickle first costs a round of small reads all over the file, which
queues behind the other ranks' bulk reads (~35 ms on the 2-CPU VM), and a parse per item
while the bulk waits (~0.08 ms alone, several times that beside DCP's planning: ~0.45 s for
the 952 items of a rank's 1.5 GB). So only one item per storage size modulo torch's record
alignment is read and parsed first (a bias, a step counter): the others' records lie as its
do, counted back from the item's end, so each item's storage is taken to end where that
reference's tail begins, and its tensor to be the contiguous chunk DCP's metadata describes.
As the file streams, each guessed item's directory and pickle are parsed from the read buffer
once the item's last byte is placed there, and compared with the guess; where one differs,
the tensors got bytes from the wrong places and the file is read again, every item's headers
first.

Items that are not one contiguous range of the file into one contiguous CPU tensor (a
resharded read of a non-leading dimension, a strided view) take the plain route: their bytes
land in the read buffer and are copied from there. Checkpoints with storage transforms (DCP's
extensions) are read by ``FileSystemReader`` itself.

The live tensors hold a file's bytes before its CRC-32 is known: a corrupt file raises
:class:`CorruptFile` (DCP hands it to every rank in a ``CheckpointException``) after they
were written, so :mod:`ftkit.checkpoint.manager` uses this reader only with an older checkpoint to fall
back on, whose load overwrites them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import logging
import math
import pickle
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointError
from .format.layout import DCP_DIR
from .io import reader as _reader
from .io.archive import Held, archives_records
from .io.device import DeviceCopies, load_copies
from .io.reader import (
    CHUNK,
    FRESH_THREADS,
    STAGING,
    Fetch,
    FileProblem,
    Target,
    check_file,
    read_file,
    read_spans,
    scatter_file,
)
from .io.statefile import Undoable, UndoLog, aside_memory, destination, placeable
from .io.unpickle import NotOneTensor, meta_tensor

__all__ = ["CorruptFile", "StreamingReader", "corrupt_file_in"]

log = logging.getLogger(__name__)

_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's file of the rank that wrote it
_METADATA = ".metadata"  # DCP's metadata file (FileSystemWriter's name)
_ITEM_TAIL = 4 << 10  # the end of one item's archive: a directory of a few records and its end record
_ALIGN = 64  # torch.save starts each record's data at a multiple of this from the archive's start
_ZIP64 = 0xFFFFFFFF  # a storage this large gets zip64 fields in its archive (another layout)
_HEADER = 30  # a zip local header's fixed part: no record's data begins before it


class CorruptFile(CheckpointError):
    """A DCP file does not match its manifest entry; the live tensors may hold its bytes."""


class _Unsupported(Exception):
    """An item this reader does not take apart: the whole load goes to FileSystemReader."""


class _GuessWrong(Exception):
    """A file's items do not lie where :func:`_guess_items` took them to: read it again."""


def corrupt_file_in(exc: BaseException) -> CorruptFile | None:
    """The :class:`CorruptFile` behind ``exc`` (raised here, or by any rank inside DCP's
    ``CheckpointException``), else None."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CorruptFile):
            return e
        if isinstance(e, tuple) and e:
            todo.append(e[0])
        elif isinstance(e, BaseException):
            todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    return None


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a saved chunk a read item asks for (what DCP's own reader takes)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _archives(view: memoryview, fetch: Fetch, spans: list[tuple[int, int]], where: str,
              extra: Sequence[tuple[int, int]] = ()) -> list[tuple[bytes, dict[str, int]]]:
    """For the ``torch.save`` archive at each ``[start, end)`` of the file: its pickle, and where
    each of its storage records' bytes begin in the file (by storage key). The small reads of
    all archives go out together (:func:`ftkit.checkpoint.io.archive.archives_records`), the
    ``extra`` ranges with their first round."""
    try:
        every = archives_records(view, fetch, spans, tail=_ITEM_TAIL, extra=extra)
    except Exception as exc:  # a file that is not what it says (corrupt: the CRC-32 of DCP's way says so)
        raise _Unsupported(f"{where}: {type(exc).__name__}: {exc}") from None
    pickles: list[tuple[int, int]] = []
    for (start, _), records in zip(spans, every, strict=True):
        pickled = [(a, n) for name, (a, n) in records.items() if name.endswith("data.pkl")]
        if len(pickled) != 1:
            raise _Unsupported(f"{where} at byte {start}: not one data.pkl in the item")
        pickles.append(pickled[0])
    fetch.many([(a, a + n) for a, n in pickles])
    return [(bytes(view[a : a + n]), {name.rsplit("/", 1)[1]: a for name, (a, _) in records.items()
                                      if "/data/" in name and not name.endswith(".pkl")})
            for (a, n), records in zip(pickles, every, strict=True)]


Shape = tuple[torch.dtype, tuple[int, ...]]
"""A tensor item's dtype and chunk sizes, from DCP's metadata."""


@functools.lru_cache(maxsize=1024)
def _meta_item(pickle_bytes: bytes) -> tuple[torch.Tensor, str]:
    """:func:`ftkit.checkpoint.io.unpickle.meta_tensor`, once per distinct pickle: the items of
    a model's repeated layers pickle the same (the tensor on ``meta`` is only read)."""
    return meta_tensor(pickle_bytes)


@functools.lru_cache(maxsize=1024)
def _chunk(dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor:
    """The contiguous tensor on ``meta`` an item of DCP's metadata is taken to hold."""
    return torch.empty(sizes, dtype=dtype, device="meta")


def _as_described(tensor: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """Whether an item's saved tensor is the contiguous chunk its metadata describes, alone in
    its storage (DCP clones any other before it saves it)."""
    return (tensor.dtype == dtype and tuple(tensor.size()) == sizes and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == math.prod(sizes) * dtype.itemsize)


def _guess_items(view: memoryview, fetch: Fetch, spans: list[tuple[int, int]], shapes: Mapping[int, Shape],
                 values: Sequence[tuple[int, int]], where: str
                 ) -> tuple[dict[int, tuple[torch.Tensor, int]], list[tuple[int, int]]] | None:
    """Item start -> (its tensor on ``meta``, the file offset of its storage bytes) for every
    item at ``spans``, reading and parsing only a reference item per storage size modulo
    :data:`_ALIGN` (the smallest; with ``values``, in one round of small reads; storages of
    4 GiB or more apart: their archives have zip64 fields); and the items whose places were
    guessed, to check as the file is read (:func:`_check_guesses`). None where the
    references rule the guess out (a tensor not as the metadata says, an item the metadata
    does not size): the caller reads every item's headers."""
    sized: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...], int]] = {}
    for start, end in spans:
        shape = shapes.get(start)
        if shape is None:
            return None
        nbytes = math.prod(shape[1]) * shape[0].itemsize
        if nbytes == 0:
            return None
        sized[(start, end)] = (*shape, nbytes)

    def kind(nbytes: int) -> tuple[int, bool]:
        return nbytes % _ALIGN, nbytes >= _ZIP64

    refs: dict[tuple[int, bool], tuple[int, int]] = {}  # kind of storage size -> its smallest item
    for span in spans:
        k = kind(sized[span][2])
        if k not in refs or span[1] - span[0] < refs[k][1] - refs[k][0]:
            refs[k] = span
    read = sorted(refs.values())
    found: dict[int, tuple[torch.Tensor, int]] = {}
    tails: dict[tuple[int, bool], int] = {}  # kind of storage size -> bytes from the storage's end to the item's
    for span, (pickle_bytes, records) in zip(read, _archives(view, fetch, read, where, values), strict=True):
        tensor, at = StreamingReader._item(pickle_bytes, records, f"{where} item at byte {span[0]}")
        dtype, sizes, nbytes = sized[span]
        if not _as_described(tensor, dtype, sizes):
            return None
        found[span[0]] = (tensor, at)
        tails[kind(nbytes)] = span[1] - (at + nbytes)
    guessed = []
    for span in spans:
        if span[0] in found:
            continue
        dtype, sizes, nbytes = sized[span]
        at = span[1] - tails[kind(nbytes)] - nbytes
        if at < span[0] + _HEADER:
            return None
        found[span[0]] = (_chunk(dtype, sizes), at)
        guessed.append(span)
    return found, guessed


def _check_guesses(view: memoryview, guessed: list[tuple[int, int]], found: Mapping[int, tuple[torch.Tensor, int]],
                   where: str) -> None:
    """Raise :class:`_GuessWrong` unless each guessed item's directory and pickle, parsed
    from ``view`` (which holds the file's bytes but the storages'), put a tensor as the
    metadata describes at the offset guessed."""
    try:
        archives = _archives(view, Held(), guessed, where)  # type: ignore[arg-type]
        for (start, _), (pickle_bytes, records) in zip(guessed, archives, strict=True):
            tensor, at = StreamingReader._item(pickle_bytes, records, f"{where} item at byte {start}")
            want, want_at = found[start]
            if at != want_at or not _as_described(tensor, want.dtype, tuple(want.size())):
                raise _GuessWrong(f"{where}: the item at byte {start} holds {tuple(tensor.size())} "
                                  f"{tensor.dtype} at byte {at}, not {tuple(want.size())} {want.dtype} at byte {want_at}")
    except _GuessWrong:
        raise
    except Exception as exc:  # the bytes at the guessed places are not an item's headers
        raise _GuessWrong(f"{where}: {exc}") from exc


class StreamingReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` that reads each file once (see the module doc).

    ``files``: the manifest's entries (``dcp/<name>`` -> size, CRC-32); ``verify``: compare
    each file's CRC-32; ``direct`` as ``checkpoint.direct_io``. :attr:`files_read` names the
    files this rank read. ``shared``: several ranks of this host read each file another rank
    checks that this one reads whole (:meth:`_mostly_needed`): through the page cache, which
    the disk fills once for all of them, not with ``O_DIRECT`` once per rank.

    :attr:`guard` (set before ``read_data``; :meth:`ftkit.checkpoint.state.restore.SetAside.guard`):
    the live host tensors whose bytes must survive a load that does not happen (the only
    checkpoint, a corrupt file on any rank). What the load writes over in them is copied aside
    first: the streamed pieces on the placing threads just before each is written, a tensor
    copied in another way (another layout, DCP's own reader) before the copy. :meth:`undo`
    puts all of it back; :meth:`close` lets the copies go."""

    def __init__(self, path: Path, files: Mapping[str, Any], *, verify: bool = True,
                 direct: bool | None = None, rank: int = 0, world_size: int = 1, shared: bool = False) -> None:
        super().__init__(str(path))
        self._root = Path(path)
        self._files = files
        self._verify = verify
        self._direct = direct
        self._shared = shared
        self._rank, self._world = rank, world_size
        self.files_read: list[str] = []
        """The files this rank read whole (and checked), in the order it read them."""
        self._early: dict[str, _FileRead] = {}
        self._values: dict[tuple[str, int], bytes] = {}  # (file, offset) -> an item of another rank's file
        self._metadata: Metadata | None = None
        self.guard: Callable[[torch.Tensor], bool] | None = None
        self._reads: list[_FileRead] = []  # every file read begun, for undo
        self._log = UndoLog()  # what the reads and copies wrote over in guarded tensors, for undo

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, read once per load (the early read, the state keys and DCP's
        planning each ask for it) and checked against its manifest entry as it is read (size,
        CRC-32; :class:`CorruptFile` if it differs), so that no rank checks it beforehand.
        A rank's own metadata file (``rank=``, DCP's fallback) is DCP's read."""
        if args or kwargs:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            try:
                _, view = read_file(self._root / _METADATA, self._meta(_METADATA), verify=self._verify,
                                    direct=self._direct)
            except FileProblem as exc:
                raise CorruptFile(f"{self._root.parent}: {exc}") from exc
            metadata = pickle.loads(view)  # as FileSystemReader reads it, which then sets its load id
            if hasattr(self, "load_id"):
                from torch.distributed.checkpoint.metadata import StorageMeta

                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def prefetch(self) -> None:
        """Start reading the first file this rank reads whole now, on a thread of its own,
        before DCP has planned the load (its metadata read, a few collectives). The items'
        headers are read before this returns (alone: queued behind a bulk read, each small
        read would wait for it, up to the I/O scheduler's deadline: half a second under
        Linux's mq-deadline); then the bulk of the file streams into the staging buffers while
        the headers are parsed and DCP plans, and ``read_data`` only has to say where the
        tensors go. Without it (or when the metadata cannot be read here) the file is read when
        ``read_data`` asks. :meth:`close` stops it if the load never gets there."""
        try:
            metadata = self.read_metadata()
        except CheckpointError:  # a corrupt file, or one the manifest lacks: the load stops here
            raise
        except Exception:  # DCP's own read of it reports the problem
            return
        storage = metadata.storage_data or {}
        if any(getattr(info, "transform_descriptors", None) for info in storage.values()):
            return  # read by FileSystemReader itself (read_data)
        names = sorted({info.relative_path for info in storage.values() if self._checks(info.relative_path)})
        if not names:
            return
        tensors = {fqn for fqn, meta in metadata.state_dict_metadata.items()
                   if isinstance(meta, TensorStorageMetadata)}
        try:
            read = self._early[names[0]] = self._begin(names[0], metadata)
        except CheckpointError:  # not in the manifest: read_data reports it
            return
        # the values of files other ranks read whole (DCP stores a value every rank holds in one
        # rank's file) are small reads too: read now, beside the headers, not queued behind the
        # bulk, nor through the page cache with its read-ahead as DCP's own reader would
        self._read_values(sorted({(info.relative_path, info.offset, info.length) for index, info in storage.items()
                                  if info.relative_path not in names and index.fqn not in tensors}))
        # its small reads go first, alone: this thread's Python work would hold the GIL they
        # need after each read, and a bulk read would queue them behind its pieces
        read.headers_read.wait()

    def _begin(self, name: str, metadata: Metadata, *, cached: bool = False) -> _FileRead:
        """A read of file ``name`` begun before DCP has planned it: its items' places from the
        metadata (guessed from a few of their headers), its bulk streaming into the staging
        buffers until ``give`` says where the bytes go. Raises :class:`CheckpointError` for a
        file the manifest lacks."""
        storage = metadata.storage_data or {}
        tensors = {fqn for fqn, meta in metadata.state_dict_metadata.items()
                   if isinstance(meta, TensorStorageMetadata)}
        spans = sorted({(info.offset, info.offset + info.length) for index, info in storage.items()
                        if info.relative_path == name and index.fqn in tensors})
        values = sorted({(info.offset, info.offset + info.length) for index, info in storage.items()
                         if info.relative_path == name and index.fqn not in tensors})
        chunks = {(fqn, tuple(chunk.offsets)): (meta.properties.dtype, tuple(chunk.sizes))
                  for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
                  for chunk in meta.chunks}
        shapes = {info.offset: chunks[key] for index, info in storage.items()
                  if info.relative_path == name and (key := (index.fqn, tuple(index.offset or ()))) in chunks}
        return _FileRead(self, name, spans, values, shapes, cached=cached)

    def _read_values(self, ranges: list[tuple[str, int, int]]) -> None:
        """Read the items at ``(file, offset, length)`` into :attr:`_values` with small direct
        reads, those of a file together. A file that cannot be read here is left to DCP's own
        reader, and to the rank that checks it, to report."""
        files: dict[str, list[tuple[int, int]]] = {}
        for name, offset, length in ranges:
            files.setdefault(name, []).append((offset, offset + length))
        for name, spans in files.items():
            try:
                got = read_spans(self._root / name, int(self._meta(name)["size"]), spans, direct=self._direct)
            except (CheckpointError, FileProblem, KeyError, TypeError, ValueError):
                continue
            self._values.update({(name, a): value for (a, _), value in got.items()})

    def close(self) -> None:
        """Stop and join the reads :meth:`prefetch` started that ``read_data`` did not take, and
        free what :attr:`guard` set aside (the load is done, or undone)."""
        self._stop()
        self._reads, self._log = [], UndoLog()

    def undo(self) -> None:
        """Put back every byte of a :attr:`guard`-ed tensor this load wrote over (the reads are
        over: ``read_data`` returned or raised)."""
        self._log.undo()
        for read in self._reads:
            read.release()

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, about to be copied into: set aside first if :attr:`guard` says so."""
        if self.guard is not None and self.guard(t):
            self._log.copy(None, t)
        return t

    def _stop(self) -> None:
        early, self._early = self._early, {}
        for read in early.values():
            read.cancel()
        for read in early.values():
            read.wait()

    def _checks(self, name: str) -> bool:
        """Whether this rank reads and checks file ``name`` whole: ``__R_*.distcp`` is rank
        ``R % world_size``'s (at the same world size the rank that wrote it, and the one that
        needs most of it); a name of another shape, every rank's."""
        match = _FILE.match(name)
        return match is None or int(match.group(1)) % self._world == self._rank

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        plain = False
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            plain = plain or bool(getattr(info, "transform_descriptors", None))
            per_file.setdefault(info.relative_path, []).append(item)
        mine = sorted({info.relative_path for info in self.storage_data.values() if self._checks(info.relative_path)})
        theirs = self._mostly_needed(per_file, mine)
        others = [item for name, items in per_file.items() if name not in mine and name not in theirs for item in items]
        if not plain:
            try:
                for name in theirs:  # begun now, beside this rank's own file: by the time that is
                    if name not in self._early:  # read, their headers are read and their bulk staged
                        self._early[name] = self._begin(name, self.read_metadata(), cached=self._shared)
                for name in [*mine, *theirs]:  # whole, checked as it arrives; the items this rank needs land
                    early = self._early.pop(name, None)
                    if name in per_file or early is not None:
                        read = early or _FileRead(self, name, None, cached=self._shared and name in theirs)
                        read.give(per_file.get(name, []), planner)
                        try:
                            if others:  # the few items of files another rank checks, while this
                                # rank's file streams (its plan made: one thread at a time asks the
                                # planner), not after it: values read early, the rest by DCP's reader
                                read.planned.wait()
                                others = self._give_values(others, planner)
                                if others:
                                    super().read_data(dataclasses.replace(plan, items=others),
                                                      self._keeping(planner)).wait()
                                    others = []
                            read.finish(planner)
                        except _GuessWrong as exc:  # its tensors got bytes from the wrong places
                            log.info("%s; reading it again, its items' headers first", exc)
                            read.undo()  # what was set aside is what they held before
                            read = _FileRead(self, name, None, cached=self._shared and name in theirs)
                            read.give(per_file.get(name, []), planner)
                            read.finish(planner)
                        except BaseException:  # it streams into the tensors: done before the load goes on
                            read.wait()
                            raise
                        self.files_read.append(name)
                    else:
                        self._check(name)
                others = self._give_values(others, planner)
                if others:
                    return super().read_data(dataclasses.replace(plan, items=others), self._keeping(planner))
                done: Future[None] = Future()
                done.set_result(None)
                return done
            except _Unsupported as exc:
                log.info("reading %s the way DCP does: %s", self._root, exc)
        # DCP's own reader, every item again from the start; the files this rank checks are
        # checked first, through the page cache, where DCP's reads then find them
        self._stop()
        self.undo()  # the streamed reads' bytes: set aside again as DCP's reader writes its own
        self.files_read.clear()
        for name in mine:
            self._check(name, cache=True)
        return super().read_data(plan, self._keeping(planner))

    def _mostly_needed(self, per_file: Mapping[str, list[Any]], mine: Sequence[str]) -> list[str]:
        """The files another rank checks whose bytes this rank needs at least half of: a model
        every rank holds whole (DDP's), whose tensors DCP stored once, each in one rank's file,
        while every rank loads all of them. Read whole here too (begun beside this rank's own
        file, placed after it), rather than item by item through DCP's reader (buffered reads and a ``torch.load`` per
        item: 0.58 of the raw read, two ranks, 0.25 GB). Each is checked as it streams, as its
        own rank checks it (``O_DIRECT`` unless :attr:`_shared`: with two ranks on a host, as
        much from the disk as its own rank's read and this one's through the page cache)."""
        out = []
        for name, items in sorted(per_file.items()):
            if name in mine:
                continue
            try:
                size = int(self._meta(name)["size"])
            except (CheckpointError, KeyError, TypeError, ValueError):  # DCP's reader reports it
                continue
            needed = sum(self.storage_data[item.storage_index].length for item in items
                         if item.type != LoadItemType.BYTE_IO)
            if size and 2 * needed >= size:
                out.append(name)
        return out

    def _keeping(self, planner: LoadPlanner) -> LoadPlanner:
        """``planner``, whose ``resolve_tensor`` (DCP's reader asks it for the tensor it copies
        an item into) sets the tensor aside first where :attr:`guard` says so."""
        if self.guard is None:
            return planner
        return _Keeping(planner, self._keep)  # type: ignore[return-value]

    def _give_values(self, items: list[Any], planner: LoadPlanner) -> list[Any]:
        """Hand DCP the values of ``items`` that :meth:`_read_values` read; the other items."""
        rest = []
        for item in items:
            info = self.storage_data[item.storage_index]
            value = self._values.get((info.relative_path, info.offset))
            if item.type == LoadItemType.BYTE_IO and value is not None and len(value) == info.length:
                planner.load_bytes(item, io.BytesIO(value))
            else:
                rest.append(item)
        return rest

    def _check(self, name: str, *, cache: bool = False) -> None:
        """Check a file's size and CRC-32 without keeping it (``cache``: through the page cache)."""
        try:
            check_file(self._root / name, self._meta(name), cache=cache, direct=self._direct)
        except FileProblem as exc:
            raise CorruptFile(f"{self._root.parent}: {exc}") from exc
        self.files_read.append(name)

    def _meta(self, name: str) -> Mapping[str, Any]:
        meta = self._files.get(f"{DCP_DIR}/{name}")
        if meta is None:
            raise CheckpointError(f"{self._root / name} is not in its checkpoint's manifest")
        return meta

    @staticmethod
    def _item(pickle_bytes: bytes, records: dict[str, int], where: str) -> tuple[torch.Tensor, int]:
        """The item's tensor on ``meta`` and the file offset of its storage bytes."""
        try:
            tensor, key = _meta_item(pickle_bytes)
        except NotOneTensor as exc:
            raise _Unsupported(f"{where}: {exc}") from None
        except Exception as exc:  # a pickle that does not parse: corrupt, which DCP's way finds
            raise _Unsupported(f"{where}: {type(exc).__name__}: {exc}") from None
        if key not in records:
            raise _Unsupported(f"{where}: storage {key} not in the archive")
        return tensor, records[key]


class _Keeping:
    """A load planner whose tensors are set aside (``keep``) before DCP's reader copies into them."""

    def __init__(self, planner: LoadPlanner, keep: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._planner, self._keep_it = planner, keep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        return self._keep_it(self._planner.resolve_tensor(item))


class _Progress:
    """How much of a file :func:`ftkit.checkpoint.io.reader.scatter_file` has placed, for a
    thread that looks at the bytes while the read goes on."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._upto = 0
        self._ended = False

    def __call__(self, upto: int) -> None:
        with self._turn:
            self._upto = max(self._upto, upto)
            self._turn.notify_all()

    def end(self) -> None:
        with self._turn:
            self._ended = True
            self._turn.notify_all()

    def wait(self, upto: int) -> int:
        """How many of the file's first bytes are placed, once ``upto`` are or the read ended."""
        with self._turn:
            self._turn.wait_for(lambda: self._upto >= upto or self._ended)
            return self._upto


class _Cancelled(Exception):
    """The load stopped before it said what it wants from a file read early."""


def _handed(planner: LoadPlanner, item: Any, value: memoryview) -> bytes | None:
    """Hand DCP ``item``'s ``value`` now: the bytes handed, None if its pickle does not parse
    (to be handed again once its file is checked)."""
    got = bytes(value)
    try:
        planner.load_bytes(item, io.BytesIO(got))
    except Exception:  # not swallowed: handed again once the file is checked, raising there if it is whole
        return None
    return got


class _FileRead:
    """One ``.distcp`` file of :class:`StreamingReader`, read whole on a thread of its own.

    ``spans`` (the file's tensor items, from the checkpoint's metadata) lets the read begin
    before DCP planned the load: the items' headers are read and parsed, then the bulk of the
    file streams into the staging buffers while :meth:`give` is awaited with the items the
    load wants from it and the planner that resolves their tensors; only then do the bytes go
    to their tensors. With ``spans`` None the read parses the items it is given. ``values``
    (its other items: small pickled values, such as an optimizer's hyperparameters) are read
    with the headers, so that DCP gets them while the bulk streams, not after it. ``shapes``
    (item start -> dtype and chunk sizes, from the metadata): the items' places are guessed
    from a few of them (:func:`_guess_items`) and checked as the file streams (:meth:`finish`
    raises :class:`_GuessWrong` if one was wrong). ``cached``: through the page cache (a file
    its own rank reads too, and every other rank of a DDP job on this host), not with
    ``O_DIRECT``."""

    def __init__(self, reader: StreamingReader, name: str, spans: list[tuple[int, int]] | None,
                 values: Sequence[tuple[int, int]] = (), shapes: Mapping[int, Shape] | None = None,
                 *, cached: bool = False) -> None:
        self._reader, self.name, self._spans, self._values, self._shapes = reader, name, spans, values, shapes
        self._found: dict[int, tuple[torch.Tensor, int]] = {}
        self._guessed: list[tuple[int, int]] = []  # items whose places were guessed, not read
        self._progress = _Progress()
        self._view: memoryview | None = None  # the read buffer, once the read began
        self._values_read: list[tuple[Any, memoryview]] = []  # (item, its bytes) read with the headers
        self.planned = threading.Event()
        """The read knows where the bytes go (:meth:`give`'s planner is done with), or ended."""
        self.path = reader._root / name
        self._meta = reader._meta(name)
        self.direct = False if cached else reader._direct
        self._wanted: concurrent.futures.Future[tuple[list[Any], LoadPlanner] | None] = concurrent.futures.Future()
        self._after: list[tuple[Any, str, Any]] = []  # (item, how, what) for once the file is read
        self._result: tuple[Any, memoryview] | None = None
        self._error: BaseException | None = None
        self._copies: DeviceCopies | None = None
        self._aside: torch.Tensor | None = None  # what the guarded tensors' pieces written held
        reader._reads.append(self)
        self.headers_read = threading.Event()  # the small reads are over (or the read ended)
        self._thread = threading.Thread(target=self._run, name="ftkit-dcp-file", daemon=True)
        self._thread.start()

    def give(self, items: list[Any], planner: LoadPlanner) -> None:
        self._wanted.set_result((items, planner))

    def cancel(self) -> None:
        if not self._wanted.done():
            self._wanted.set_result(None)

    def wait(self) -> None:
        self._thread.join()

    def _placers(self) -> int:
        """Threads that checksum and place (asked once the plan is made): with much set aside,
        as for fresh memory, whose first writes fault its pages in (CPU work threads share)."""
        fresh = self._aside is not None and self._aside.numel() >= FRESH_THREADS
        return _reader.FRESH_WORKERS if fresh else _reader.WORKERS

    def undo(self) -> None:
        """Put back what this read wrote over in guarded tensors (once its placing threads are
        done), and free the memory it was set aside in."""
        self._reader._log.undo(self)
        self.release()

    def release(self) -> None:
        """Free the memory set aside (its bytes put back, or no longer needed)."""
        self._aside = None

    def _run(self) -> None:
        try:
            # live tensors on a GPU: pinned staging, each piece copied to the device as it arrives
            with load_copies(chunk=CHUNK, count=STAGING // CHUNK) as self._copies:
                self._result = scatter_file(self.path, self._meta, self._plan, verify=self._reader._verify,
                                            direct=self.direct,
                                            stages=self._copies.stages() if self._copies is not None else None,
                                            placers=self._placers, progress=self._progress)
        except FileProblem as exc:
            self._error = CorruptFile(f"{self._reader._root.parent}: {exc}")
            self._error.__cause__ = exc
        except BaseException as exc:
            self._error = exc
        finally:
            self.headers_read.set()
            self.planned.set()
            self._progress.end()

    def _parse(self, view: memoryview, fetch: Fetch, spans: list[tuple[int, int]],
               values: Sequence[tuple[int, int]] = (), shapes: Mapping[int, Shape] | None = None,
               ) -> dict[int, tuple[torch.Tensor, int]]:
        """Item start -> (its tensor on ``meta``, the file offset of its storage bytes); the
        bulk read may start once the items' headers (and ``values``) are read, before they are
        parsed. With ``shapes``, the places are guessed (:func:`_guess_items`) where they can be."""
        where = str(self.path)
        guess = _guess_items(view, fetch, spans, shapes, values, where) if shapes else None
        if guess is not None:
            self._found, self._guessed = guess
            fetch.done()
            self.headers_read.set()
            return dict(self._found)
        archives = _archives(view, fetch, spans, where, values)
        fetch.done()
        self.headers_read.set()
        return {start: StreamingReader._item(pickle_bytes, records, f"{where} item at byte {start}")
                for (start, _), (pickle_bytes, records) in zip(spans, archives, strict=True)}

    def _plan(self, mapping: Any, view: memoryview, fetch: Fetch) -> list[Target] | None:
        # with spans, the headers are read and parsed and the bulk streams while DCP plans
        parsed = self._parse(view, fetch, self._spans, self._values, self._shapes) if self._spans is not None else {}
        wanted = self._wanted.result()
        if wanted is None:
            raise _Cancelled(f"{self.path}: the load stopped before it read this file")
        items, planner = wanted
        if not items:
            self._guessed = []  # nothing placed, nothing to check
            self.planned.set()
            return None  # nothing of it wanted here: checked as it streams, nothing kept
        self._view = view
        storage = self._reader.storage_data
        tensors = []
        for item in items:
            info = storage[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                a, b = info.offset, info.offset + info.length
                if fetch.covered(a, b):  # read with the headers: DCP gets it while the bulk streams
                    self._values_read.append((item, view[a:b]))
                else:
                    self._after.append((item, "bytes", (a, b)))
            else:
                tensors.append((item, info))
        missing = sorted({(info.offset, info.offset + info.length) for _, info in tensors if info.offset not in parsed})
        if missing:
            parsed.update(self._parse(view, fetch, missing))
        fetch.done()
        aims: list[tuple[int, int, Any, torch.Tensor]] = []
        for item, info in tensors:
            where = f"{self.path} item {item.storage_index}"
            saved, data_start = parsed[info.offset]
            narrowed = _narrow(saved, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != narrowed.size():
                raise CheckpointError(f"{where}: saved {tuple(narrowed.size())}, live {tuple(target.size())}")
            if (narrowed.is_contiguous() and target.is_contiguous() and placeable(target, self._copies)
                    and target.dtype == narrowed.dtype and narrowed.numel() > 0):
                start = data_start + narrowed.storage_offset() * narrowed.element_size()
                aims.append((start, start + narrowed.numel() * narrowed.element_size(), item, target))
            else:
                self._after.append((item, "copy", (saved, data_start, target)))
        aims.sort(key=lambda a: a[0])
        guard = self._reader.guard
        guarded = [guard is not None and target.device.type == "cpu" and guard(target) for *_, target in aims]
        if any(guarded):  # one buffer for what they hold: fresh memory, faulted in as it is written
            self._aside = aside_memory(sum(a[1] - a[0] for a, g in zip(aims, guarded, strict=True) if g))
        aside_at = self._aside.data_ptr() if self._aside is not None else 0
        targets: list[Target] = []
        for i, (start, end, item, target) in enumerate(aims):
            if i and aims[i - 1][1] > start:
                raise _Unsupported(f"{self.path}: items overlap")
            if guarded[i]:
                targets.append((start, end, Undoable(target.data_ptr(), aside_at, self._reader._log, self)))
                aside_at += end - start
            else:
                targets.append((start, end, destination(target, self._copies)))
            self._after.append((item, "direct", target))
        self.planned.set()
        return targets

    def _check_as_read(self) -> _GuessWrong | None:
        """Check the guessed items (:func:`_check_guesses`) as the read places them, each once
        its last byte is placed, while the rest of the file streams: the first one that is not
        where it was taken to be (its tensor got bytes from the wrong place), else None. Stops
        where the read ended short (its error says why)."""
        if not self._guessed or self._view is None:
            return None
        pending = sorted(self._guessed, key=lambda span: span[1])
        k = 0
        while k < len(pending):
            upto = self._progress.wait(pending[k][1])
            j = k
            while j < len(pending) and pending[j][1] <= upto:
                j += 1
            if j == k:
                return None
            try:
                _check_guesses(self._view, pending[k:j], self._found, str(self.path))
            except _GuessWrong as exc:
                return exc
            k = j
        return None

    def finish(self, planner: LoadPlanner) -> None:
        """Wait for the read, checking the guessed items as it goes, then hand DCP every other
        item it wanted from the file.

        The values read with the headers go to DCP while the bulk streams: DCP's ``torch.load``
        of each costs about 0.07 ms, a dozen of them after the read are on the load's path. They
        land in DCP's load target, where an optimizer's per-parameter state is the live one's, so
        they go early only where the read writes straight over the live tensors anyway (the file
        checked before, or, found corrupt now, overwritten by the older checkpoint loaded
        instead). Where the reader sets aside what it writes over (:attr:`StreamingReader.guard`),
        and for a value whose pickle does not parse (a corrupt file, whose CRC-32 is not known
        yet: the load must skip it, not fail on DCP's error), only once the file's CRC-32 says
        their bytes are the ones saved; as is a value whose bytes the read then found otherwise."""
        self.planned.wait()
        early = {}  # the items handed early, by the bytes they were handed
        if self._reader.guard is None:
            early = {id(item): got for item, value in self._values_read if (got := _handed(planner, item, value)) is not None}
        wrong = self._check_as_read()
        self.wait()
        if self._error is not None:  # a corrupt file is that, whatever its items looked like
            raise self._error
        if wrong is not None:
            raise wrong
        assert self._result is not None
        for item, value in self._values_read:  # the bulk rewrote these bytes with the same ones
            if early.get(id(item)) != value:  # else handed early, as the file's CRC-32 has them
                planner.load_bytes(item, io.BytesIO(bytes(value)))
        mapping, view = self._result
        for item, how, what in self._after:
            if how == "bytes":
                planner.load_bytes(item, io.BytesIO(bytes(view[what[0] : what[1]])))
            elif how == "direct":
                planner.commit_tensor(item, what)
            else:
                meta_tensor, data_start, target = what
                nbytes = meta_tensor.untyped_storage().nbytes()
                storage = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes,
                                           offset=data_start).untyped_storage()
                saved = torch.empty(0, dtype=meta_tensor.dtype).set_(
                    storage, meta_tensor.storage_offset(), meta_tensor.size(), meta_tensor.stride())
                self._reader._keep(target).copy_(_narrow(saved, item.storage_offsets, item.lengths))
                planner.commit_tensor(item, target)
