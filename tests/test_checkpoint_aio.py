"""Native AIO reads (``ftkit.checkpoint.io.aio``) where a resume meets them: signals, forks, failures.

Real files, real signals, a real fork: a signal that arrives while the reader waits in
``io_getevents`` is handled and the read goes on; a child forked after the parent's reads
(its idle contexts are the parent's, not the child's) reads with contexts of its own; a read
that fails half-way leaves no read in flight in the context kept for the next one, and the
next read is exact.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import zlib

import pytest

from ftkit.checkpoint.io import aio as _aio
from ftkit.checkpoint.io import reader as _reader
from ftkit.checkpoint.io import reads as _reads
from ftkit.checkpoint.io.reader import FileProblem, read_file
from tests.ckpt_helpers import native_aio


@pytest.fixture
def data_file(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT") or (why := native_aio(tmp_path)):
        pytest.skip(f"no native AIO here: {why or 'no O_DIRECT'}")
    monkeypatch.setattr(_reader, "CHUNK", 256 << 10)  # many reads, many waits
    monkeypatch.setattr(_reader, "SUB", 256 << 10)
    data = random.Random(5).randbytes(96 * (256 << 10) + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    return path, data, {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def _engines_used(monkeypatch) -> list[str]:
    used: list[str] = []
    real = _reads.Reads.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        used.append(self.engine)

    monkeypatch.setattr(_reads.Reads, "__init__", init)
    return used


def test_signals_during_the_reads_are_handled_and_the_read_goes_on(data_file, monkeypatch):
    """SIGUSR1 every millisecond (SLURM's warning signal can land mid-resume): ``io_getevents``
    returns EINTR, the handler runs, the wait resumes; every byte arrives."""
    path, data, meta = data_file
    used = _engines_used(monkeypatch)
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    stop = threading.Event()

    def pester():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.001)

    sender = threading.Thread(target=pester)
    sender.start()
    try:
        for _ in range(5):
            _mapping, view = read_file(path, meta)
            assert bytes(view) == data
    finally:
        stop.set()
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
    assert used and set(used) == {"aio"}
    assert len(seen) > 10


def test_a_forked_child_reads_with_contexts_of_its_own(data_file):
    """The parent's idle contexts are not the child's (the kernel does not copy them): a child
    forked after the parent read reads exactly, and so does the parent after it."""
    path, data, meta = data_file
    read_file(path, meta)
    assert _aio._idle, "the parent keeps its context for the next read"
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit status
        code = 3
        try:
            code = 0 if not _aio._idle and bytes(read_file(path, meta)[1]) == data else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(read_file(path, meta)[1]) == data


def test_a_read_that_fails_half_way_leaves_nothing_in_flight_for_the_next(data_file, monkeypatch):
    """A file cut short while it is read: the read fails by name; the context it used is drained
    before it is kept (no read lands later in a buffer reused since), and the next read is exact."""
    path, data, meta = data_file
    real = _reads.Reads.submit
    cut = []

    def truncating(self, reads, kind):
        reads = list(reads)
        if not cut and any(offset >= 20 * (256 << 10) for _, offset in reads):
            cut.append(True)
            os.truncate(path, 21 * (256 << 10) + 5)
        return real(self, reads, kind)

    monkeypatch.setattr(_reads.Reads, "submit", truncating)
    with pytest.raises(FileProblem, match="the file changed while it was read"):
        read_file(path, meta)
    assert _aio._idle and all(ctx.inflight == 0 for ctx in _aio._idle)
    monkeypatch.setattr(_reads.Reads, "submit", real)
    path.write_bytes(data)
    assert bytes(read_file(path, meta)[1]) == data
