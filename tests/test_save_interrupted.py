"""A state file's write interrupted inside ``torch.save`` (Ctrl-C twice raising KeyboardInterrupt
in ftkit's writer, a write error such as ENOSPC): the exception reaches the caller and the file
is given up, and the process is never aborted afterwards by torch's zip writer ending itself,
unended, in a C++ destructor (``terminate called ...``, SIGABRT) once it is freed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
import zlib
from pathlib import Path

import pytest

from ftkit.checkpoint.io import files as _files
from ftkit.checkpoint.io.files import HashingWriter

ROOT = Path(__file__).resolve().parent.parent

# one process tries every case in turn: an abort at any of them kills it, and the test fails
INTERRUPTED = r"""
import errno, gc, shutil, sys
from pathlib import Path
import torch
from ftkit.checkpoint.io import files, statefile

out = Path(sys.argv[1])
state = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 18), "c": [torch.randn(100) for _ in range(10)]}
real = files.HashingWriter.write
for direct in (None, False):
    for what in ("KeyboardInterrupt", "ENOSPC"):
        for at in (1, 2, 3, 8):
            calls = [0]

            def write(self, data, at=at, what=what):
                calls[0] += 1
                if calls[0] == at:
                    raise KeyboardInterrupt if what == "KeyboardInterrupt" else OSError(errno.ENOSPC, "No space left")
                return real(self, data)

            files.HashingWriter.write = write
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                statefile.write_state_file(out, "rank-00000.pt", state, direct=direct)
            except (KeyboardInterrupt, OSError, RuntimeError) as exc:
                got = type(exc).__name__
            else:
                got = "nothing"
            gc.collect()  # frees what the traceback held: torch's zip writer among them
            print(direct, what, at, got, flush=True)
"""


def test_a_state_file_write_interrupted_inside_torch_save_raises_and_never_aborts_the_process(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "terminate called" not in proc.stderr and proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert len(lines) == 16, proc.stdout
    for direct, what, at, got in lines:
        expected = "KeyboardInterrupt" if what == "KeyboardInterrupt" else "OSError"
        assert got == expected, (direct, what, at, got)


def test_a_crc_thread_whose_start_is_interrupted_is_given_up_cleanly(tmp_path, monkeypatch) -> None:
    """Ctrl-C twice inside ``Thread.start`` of the writer's CRC thread: the write raises
    KeyboardInterrupt, ``abort`` then ends the writer (no "cannot join thread before it is
    started" in place of the interrupt), and writes after it are dropped, not refused."""
    real = threading.Thread.start

    def interrupted(self: threading.Thread) -> None:
        if self.name == "ftkit-crc32":
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    monkeypatch.setattr(_files, "_COPY_MAX", 0)  # every write goes through the CRC thread
    writer = HashingWriter(tmp_path / "f", direct=False)
    with pytest.raises(KeyboardInterrupt):
        writer.write(b"x" * 100)
    writer.abort()
    assert writer.write(b"y" * 10) == 10  # dropped: the file is given up
    writer.abort()  # twice is once
    monkeypatch.undo()

    # a close (not an abort) after such a write cannot know the checksum: it says so
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    monkeypatch.setattr(_files, "_COPY_MAX", 0)
    other = HashingWriter(tmp_path / "g", direct=False)
    with pytest.raises(KeyboardInterrupt):
        other.write(b"x" * 100)
    with pytest.raises(RuntimeError, match="checksum is unknown"):
        other.close()
    monkeypatch.undo()

    # and an uninterrupted writer still checksums every byte
    fine = HashingWriter(tmp_path / "h", direct=False)
    fine.write(b"z" * 4096)
    fine.close()
    assert fine.checksum == f"{zlib.crc32(b'z' * 4096):08x}"


def test_a_write_interrupted_while_its_buffer_is_checksummed_returns_only_once_it_is_read(tmp_path, monkeypatch):
    """Ctrl-C twice while ``write`` waits for the CRC thread to finish reading the caller's
    buffer: ``write`` raises only once the thread is done with it (torch frees the buffer as
    the exception passes through it)."""
    reading = threading.Event()
    read: list[bool] = []

    def slow_crc32(data, value=0):
        reading.set()
        threading.Event().wait(0.3)  # a large buffer
        read.append(True)
        return zlib.crc32(data, value)

    class Interrupted(threading.Event):
        interrupted = False

        def wait(self, timeout=None):
            if not self.interrupted:  # the first wait, as the CRC thread reads
                self.interrupted = True
                reading.wait()
                raise KeyboardInterrupt
            return super().wait(timeout)

    monkeypatch.setattr(_files, "crc32", slow_crc32)
    monkeypatch.setattr(_files, "threading", types.SimpleNamespace(**{**vars(threading), "Event": Interrupted}))
    writer = HashingWriter(tmp_path / "f", direct=False)
    with pytest.raises(KeyboardInterrupt):
        writer.write(bytearray(_files._COPY_MAX + 1))  # copied to the CRC thread by reference
    assert read == [True]
    writer.abort()
