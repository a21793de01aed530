"""HashingWriter's early writeback: evicts what earlier calls wrote back, keeps size and CRC exact."""

from __future__ import annotations

import itertools
import os
import zlib

import pytest

from ftkit.checkpoint.io import files as _files
from ftkit.checkpoint.io.files import HashingWriter

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")


def test_writeback_ranges_reach_back_and_cover_the_file(tmp_path, monkeypatch):
    every = 1 << 16
    monkeypatch.setattr(_files, "_WRITEBACK_EVERY", every)
    monkeypatch.setattr(_files, "_WRITEBACK_DROP", 2 * every)
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, offset + length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(_files.os, "posix_fadvise", spy)
    data = os.urandom(every // 4 * 25)  # 6.25 intervals, written in quarter-interval pieces
    w = HashingWriter(tmp_path / "f")
    for i in range(0, len(data), every // 4):
        w.write(data[i : i + every // 4])
    w.close()
    assert (tmp_path / "f").read_bytes() == data
    assert w.size == len(data) and w.checksum == f"{zlib.crc32(data):08x}"
    assert len(calls) == 6
    assert calls[0] == (0, every)
    for (_, prev_end), (start, end) in itertools.pairwise(calls):
        assert end == prev_end + every  # each call starts the writeback of what is new
        assert start == max(0, prev_end - 2 * every)  # and reaches back to evict older pages


def test_no_writeback_without_sync(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "_WRITEBACK_EVERY", 1 << 12)
    monkeypatch.setattr(_files.os, "posix_fadvise", lambda *a: pytest.fail("fadvise called"))
    w = HashingWriter(tmp_path / "f", writeback=False)
    w.write(b"x" * (1 << 14))
    w.close(sync=False)
    assert w.size == 1 << 14


def test_fadvise_failure_disables_writeback_only(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "_WRITEBACK_EVERY", 1 << 12)
    calls = []

    def refuse(*a):
        calls.append(a)
        raise OSError(95, "not supported")

    monkeypatch.setattr(_files.os, "posix_fadvise", refuse)
    data = os.urandom(1 << 15)
    w = HashingWriter(tmp_path / "f")
    for i in range(0, len(data), 1 << 12):
        w.write(data[i : i + (1 << 12)])
    w.close()
    assert len(calls) == 1
    assert (tmp_path / "f").read_bytes() == data and w.checksum == f"{zlib.crc32(data):08x}"
