"""The zip archives ``torch.save`` writes, read a few records at a time while a load streams.

A state file is one such archive; a DCP ``.distcp`` file is many, back to back, one per item.
Before a load streams a file, it must know where each tensor's bytes lie in it: each archive's
directory (at its end) names its records and their local headers, and each local header says
where its record's data begins. :func:`archives_records` reads that for any number of archives
in a few rounds of small reads (:class:`ftkit.checkpoint.io.reader.Fetch`), and parses the
directories of the plain kind ``torch.save`` writes directly (``struct``); :mod:`zipfile` reads
any other kind, through :class:`Fetching`.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable, Sequence

from .reader import Fetch, FileProblem

__all__ = ["HEAD", "TAIL", "Fetching", "Held", "LayoutGuess", "archive_records", "archive_records_guessed",
           "archives_records", "check_guess"]


class Fetching:
    """A read-only file for :mod:`zipfile` over bytes ``[start, end)`` of a file being read
    into ``view`` (at the file's offsets), reading through ``fetch`` what it is asked for:
    an archive's directory lands in the buffer at its place, for torch's parser after it."""

    def __init__(self, view: memoryview, fetch: Callable[[int, int], None], start: int = 0,
                 end: int | None = None) -> None:
        self._view, self._fetch = view, fetch
        self._start, self._end = start, view.nbytes if end is None else end
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = (0, self._pos, self._end - self._start)[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        size = self._end - self._start
        end = size if n is None or n < 0 else min(size, self._pos + n)
        a, b = self._start + self._pos, self._start + max(end, self._pos)
        self._fetch(a, b)
        data = bytes(self._view[a:b])
        self._pos = max(end, self._pos)
        return data


class Held:
    """What :func:`archives_records` reads through where the buffer already holds the
    archives' bytes (a file read whole): there is nothing left to read."""

    def __call__(self, start: int, end: int) -> None:
        pass

    def many(self, ranges: object) -> None:
        pass

    def covered(self, start: int, end: int) -> bool:
        return True


TAIL = 64 << 10  # the end of an archive read at once: its directory, unless it has thousands of records


_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record (22 bytes, then a comment)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry (46 bytes, then name, extra, comment)
_ZIP64 = 0xFFFFFFFF


def _directory(view: memoryview, start: int, end: int, read: int) -> list[tuple[str, int, int, int]] | None:
    """The directory of the zip archive at ``[start, end)`` of the file, parsed from its last
    ``read`` bytes, which ``view`` holds: ``(name, local header offset from start, size,
    compression)`` per record. None where the archive is not of the plain kind ``torch.save``
    writes (zip64, a directory larger than what was read): :mod:`zipfile` reads those."""
    found = _central(view, start, end, read)
    return None if found is None else [(name, offset, size, method) for name, offset, size, method, _ in found[0]]


def _central(view: memoryview, start: int, end: int,
             read: int) -> tuple[list[tuple[str, int, int, int, int]], int] | None:
    """:func:`_directory` with each record's general purpose flags, and where the directory
    begins (from the archive's start)."""
    tail = bytes(view[max(start, end - read) : end])
    at = tail.rfind(b"PK\x05\x06", 0, max(0, len(tail) - _EOCD.size + 4))  # the last one that fits
    if at < 0 or at + _EOCD.size + _EOCD.unpack_from(tail, at)[7] != len(tail):
        return None
    _, disk, cd_disk, here, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    if disk or cd_disk or here != count or count == 0xFFFF or _ZIP64 in (cd_size, cd_offset):
        return None
    first = (end - len(tail)) - start  # the archive offset tail[0] is at
    if cd_offset < first or cd_offset + cd_size > first + at:
        return None
    pos = cd_offset - first
    out: list[tuple[str, int, int, int, int]] = []
    for _ in range(count):
        if pos + _CENTRAL.size > at:
            return None
        fields = _CENTRAL.unpack_from(tail, pos)
        if fields[0] != 0x02014B50:
            return None
        method, csize, usize, name_len, extra_len, comment_len, offset = (
            fields[4], fields[8], fields[9], fields[10], fields[11], fields[12], fields[16])
        if _ZIP64 in (csize, usize, offset):
            return None
        name = tail[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8")
        out.append((name, offset, usize, method, fields[3]))
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return out, cd_offset


def _directory_start(view: memoryview, start: int, end: int, read: int) -> int | None:
    """Where in the file the directory of the archive at ``[start, end)`` begins, from its end
    record in the last ``read`` bytes (``view`` holds them); None where it is not found."""
    tail = bytes(view[max(start, end - read) : end])
    at = tail.rfind(b"PK\x05\x06", 0, max(0, len(tail) - _EOCD.size + 4))
    if at < 0:
        return None
    cd_size, cd_offset = _EOCD.unpack_from(tail, at)[5:7]
    if _ZIP64 in (cd_size, cd_offset) or not 0 <= cd_offset < end - start:
        return None
    return start + cd_offset


def archives_records(view: memoryview, fetch: Fetch, spans: list[tuple[int, int]], *, tail: int = TAIL,
                     extra: Sequence[tuple[int, int]] = ()) -> list[dict[str, tuple[int, int]]]:
    """For the zip archive at each ``[start, end)`` of the file, every record: name -> (offset
    of its data in the file, size), from the archive's directory and each record's local
    header; the records' data is not read. All archives' ends are read at once
    (``fetch.many``), then all their local headers at once: a few rounds of small reads for
    any number of archives, not a few per archive (the first round's reads, a few KiB each,
    usually hold the local headers too). ``tail``: how much of each archive's end to read
    first (its directory and end record). The directory is parsed directly where the archive
    is of the plain kind ``torch.save`` writes, else by :mod:`zipfile`. ``extra``: other
    ranges of the file the caller wants, read with the first round."""
    # each archive's end and its first local header (where the next archive follows this
    # one, the two are one read)
    fetch.many([(max(start, end - tail), end) for start, end in spans] + [(start, start + 30) for start, _ in spans]
               + list(extra))
    directories: list[list[tuple[str, int, int, int]]] = []
    for start, end in spans:
        entries = _directory(view, start, end, tail)
        whole = _directory_start(view, start, end, tail) if entries is None else None
        if whole is not None:  # a directory longer than the end read first: the rest of it
            fetch(whole, end)
            entries = _directory(view, start, end, end - whole)
        if entries is None:
            with zipfile.ZipFile(Fetching(view, fetch, start, end)) as archive:  # type: ignore[arg-type]
                entries = [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in archive.infolist()]
        directories.append(entries)
    fetch.many([(start + offset, start + offset + 30)
                for (start, _), entries in zip(spans, directories, strict=True) for _, offset, _, _ in entries])
    out: list[dict[str, tuple[int, int]]] = []
    for (start, _), entries in zip(spans, directories, strict=True):
        records: dict[str, tuple[int, int]] = {}
        for name, offset, size, method in entries:
            if method != zipfile.ZIP_STORED:
                raise FileProblem(f"record {name} is compressed")
            head = start + offset
            if not fetch.covered(head, head + 30):  # read in the rounds above, nearly always
                fetch(head, head + 30)
            name_len, extra_len = struct.unpack("<HH", bytes(view[head + 26 : head + 30]))
            if not fetch.covered(head + 30, head + 30 + name_len + extra_len):
                fetch(head + 30, head + 30 + name_len + extra_len)
            records[name] = (head + 30 + name_len + extra_len, size)
        out.append(records)
    return out


def archive_records(view: memoryview, fetch: Fetch, start: int = 0,
                    end: int | None = None) -> dict[str, tuple[int, int]]:
    """:func:`archives_records` of the one archive at ``[start, end)`` of the file."""
    return archives_records(view, fetch, [(start, view.nbytes if end is None else end)])[0]


HEAD = 64 << 10  # the start of an archive read with its end: its pickle (``data.pkl``, written first)
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header (30 bytes, then name and extra field)
_ENCRYPTED, _DESCRIPTOR = 0x1, 0x8  # general purpose flags: encrypted; sizes in a descriptor after the data
_DD = struct.Struct("<IIII")  # data descriptor: signature, CRC-32, compressed and uncompressed size


class LayoutGuess(FileProblem):
    """A record's local header does not begin where :func:`archive_records_guessed` took it to."""


def _back_to_back(entries: list[tuple[str, int, int, int, int]], cd_offset: int,
                  start: int) -> tuple[dict[str, tuple[int, int]], list[tuple[int, bytes, int, int]]] | None:
    """Each record's data ``(offset in the file, size)``, from the directory alone: records lie
    back to back (what zip writers write, ``torch.save``'s too), so a record's data ends where
    the next record's local header (the directory, for the last) begins, less the data
    descriptor that follows it where its flags say so (16 bytes, with its signature, as
    ``torch.save`` and :mod:`zipfile` write it). The local headers and descriptors to check
    once the file is read: ``(header offset, name, data offset, descriptor offset or -1)``.
    None where the directory rules it out (a compressed or encrypted record, no room for a
    header)."""
    ordered = sorted(entries, key=lambda e: e[1])
    records: dict[str, tuple[int, int]] = {}
    checks: list[tuple[int, bytes, int, int]] = []
    for k, (name, offset, size, method, flags) in enumerate(ordered):
        data_end = (ordered[k + 1][1] if k + 1 < len(ordered) else cd_offset) - (_DD.size if flags & _DESCRIPTOR else 0)
        data = data_end - size
        encoded = name.encode("utf-8")
        if method != zipfile.ZIP_STORED or flags & _ENCRYPTED or data < offset + _LOCAL.size + len(encoded):
            return None
        records[name] = (start + data, size)
        checks.append((start + offset, encoded, start + data, start + data_end if flags & _DESCRIPTOR else -1))
    return records, checks


def archive_records_guessed(view: memoryview, fetch: Fetch, *, head: int = HEAD,
                            tail: int = TAIL) -> tuple[dict[str, tuple[int, int]], list[tuple[int, bytes, int, int]]]:
    """:func:`archive_records` of a whole file in one round of small reads where the archive
    allows it: its end (the directory) and its first ``head`` bytes (the pickle, written
    first) together, the data offsets taken from the directory (:func:`_back_to_back`) instead
    of a second round that reads every record's local header (a few KiB each, all over the
    file: the round a load otherwise waits for before its bulk read starts). Returns the
    records and the local headers the guess rests on: the caller reads the file (its bulk
    passes them) and calls :func:`check_guess` before it trusts anything parsed with them.
    The checks are empty where the records were read the usual way (nothing guessed)."""
    size = view.nbytes
    fetch.many([(max(0, size - tail), size), (0, min(size, head))])
    found = _central(view, 0, size, tail)
    guessed = _back_to_back(*found, 0) if found is not None else None
    if guessed is None:
        return archive_records(view, fetch), []
    return guessed


def check_guess(view: memoryview, checks: list[tuple[int, bytes, int, int]]) -> None:
    """Raise :class:`LayoutGuess` unless each ``(header offset, name, data offset, descriptor
    offset)`` of :func:`archive_records_guessed` is a local header of that name whose data
    begins there, followed by a data descriptor where one was taken to be (``view`` holds the
    file's bytes at those places)."""
    for offset, name, data, descriptor in checks:
        shown = name.decode(errors="replace")
        if offset + _LOCAL.size > view.nbytes or descriptor + _DD.size > view.nbytes:
            raise LayoutGuess(f"record {shown}: its local header or data descriptor would lie past the end")
        fields = _LOCAL.unpack_from(view, offset)
        name_len, extra_len = fields[9], fields[10]
        got = bytes(view[offset + _LOCAL.size : offset + _LOCAL.size + name_len])
        if fields[0] != 0x04034B50 or got != name or offset + _LOCAL.size + name_len + extra_len != data:
            raise LayoutGuess(f"record {shown}: the local header at byte {offset} does not put its data at byte {data}")
        if descriptor >= 0 and _DD.unpack_from(view, descriptor)[0] != 0x08074B50:
            raise LayoutGuess(f"record {shown}: no data descriptor at byte {descriptor}")
