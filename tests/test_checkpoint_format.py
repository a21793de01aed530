"""The single-process state file: a torch.save zip archive written through HashingWriter.

Round trips of every dtype and layout, the CRC-32 of the bytes on disk (computed in a helper
thread, never by reading the file back), the fast writer without torch's zip CRCs and the
plain ``torch.save`` fallback, files of the earlier writer, and real write errors.
"""

from __future__ import annotations

import errno
import io
import os
import random
import threading
import zipfile
import zlib

import pytest
import torch

from ftkit.checkpoint.io import direct as _direct
from ftkit.checkpoint.io import files as _files
from ftkit.checkpoint.io import statefile as _single
from ftkit.checkpoint.io.files import HashingWriter, _CrcThread
from ftkit.checkpoint.io.statefile import FILE_FORMAT, read_state_file, write_state_file
from ftkit.errors import CheckpointError

BIG = 3 << 20  # above the writer's copy limit: queued by reference or waited for


def _crc_of(path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def _state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(64, 32)
    return {
        "f32": torch.randn(BIG // 4),  # one big record
        "bf16": torch.randn(1000).to(torch.bfloat16),  # numpy cannot view these
        "f16": torch.randn(7, 3).half(),
        "f64": torch.randn(5, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (33,), dtype=torch.int8),
        "u8": torch.randint(0, 255, (BIG + 1,), dtype=torch.uint8),  # odd size, unaligned end
        "i64": torch.arange(10),
        "bool": torch.rand(17) > 0.5,
        "c64": torch.randn(4, dtype=torch.complex64),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3],
        "nested": {"list": [torch.ones(3), (torch.zeros(2), 4)], "name": "x", "n": 2**40},
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("fast", [True, False], ids=["no-zip-crc", "torch.save-fallback"])
def test_round_trip_every_dtype_and_layout(tmp_path, monkeypatch, fast):
    if fast and not _single._SKIP_ZIP_CRC:
        pytest.skip("this torch lacks the serializer pieces the fast path needs")
    monkeypatch.setattr(_single, "_SKIP_ZIP_CRC", fast)
    state = _state()
    entry = write_state_file(tmp_path, "rank-00000.pt", {"state": state, "rng": {}})
    path = tmp_path / "rank-00000.pt"
    assert entry == _crc_of(path)  # the checksum is of exactly the bytes on disk
    payload = read_state_file(tmp_path, "rank-00000.pt", entry, verify=True)
    assert payload["format"] == FILE_FORMAT and payload["version"] == 1
    _assert_same(state, payload["state"])
    plain = torch.load(path, weights_only=True)  # still an ordinary torch.save file
    _assert_same(state, plain["state"])


def test_fast_path_leaves_zip_crcs_zero_and_fallback_fills_them(tmp_path, monkeypatch):
    if not _single._SKIP_ZIP_CRC:
        pytest.skip("this torch lacks the serializer pieces the fast path needs")
    obj = {"state": {"w": torch.ones(1000)}}
    write_state_file(tmp_path, "fast.pt", obj, direct=False)  # torch's alignment, as the fallback's
    monkeypatch.setattr(_single, "_SKIP_ZIP_CRC", False)
    write_state_file(tmp_path, "slow.pt", obj, direct=False)
    with (
        zipfile.ZipFile(tmp_path / "fast.pt") as fast,
        zipfile.ZipFile(tmp_path / "slow.pt") as slow,
    ):
        assert [i.filename for i in fast.infolist()] == [i.filename for i in slow.infolist()]
        assert {i.CRC for i in fast.infolist()} == {0}
        assert all(zlib.crc32(slow.read(i)) == i.CRC for i in slow.infolist())
        assert [i.file_size for i in fast.infolist()] == [i.file_size for i in slow.infolist()]
        with pytest.raises(zipfile.BadZipFile, match="CRC"):  # documented: zip tools complain
            fast.read(fast.infolist()[0])
    assert (tmp_path / "fast.pt").stat().st_size == (tmp_path / "slow.pt").stat().st_size


def test_file_of_the_earlier_writer_still_loads(tmp_path):
    payload = {"format": FILE_FORMAT, "version": 1, "state": {"w": torch.arange(5.0)}, "rng": {}}
    torch.save(payload, tmp_path / "old.pt")  # what the earlier writer produced
    meta = _crc_of(tmp_path / "old.pt")
    got = read_state_file(tmp_path, "old.pt", meta, verify=True)
    assert torch.equal(got["state"]["w"], torch.arange(5.0))


def test_views_of_one_storage_are_stored_once_and_stay_views(tmp_path):
    # torch.save semantics; take_snapshot clones every tensor, so checkpoints never share
    base = torch.arange(12.0)
    write_state_file(tmp_path, "s.pt", {"state": {"a": base, "b": base[3:7].view(2, 2)}})
    got = read_state_file(tmp_path, "s.pt", _crc_of(tmp_path / "s.pt"))["state"]
    assert torch.equal(got["b"], base[3:7].view(2, 2))
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()


def test_flipped_byte_in_tensor_data_is_refused_before_parsing(tmp_path):
    entry = write_state_file(tmp_path, "s.pt", {"state": {"w": torch.zeros(BIG // 4)}})
    path = tmp_path / "s.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor record: torch.load alone would not notice
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["state"]["w"].abs().sum() > 0
    with pytest.raises(CheckpointError, match="checksum"):
        read_state_file(tmp_path, "s.pt", entry, verify=True)


@pytest.mark.parametrize("stable,bounce", [(True, False), (False, False), (False, True)],
                         ids=["queued-by-reference", "waited-for", "staged-direct"])
def test_writer_crc_matches_random_write_sequence(tmp_path, monkeypatch, stable, bounce):
    """The CRC thread checksums the written buffers; a direct file that stages every byte
    (the saver's) checksums them itself, and nothing goes to the CRC thread."""
    if bounce:
        monkeypatch.setattr(_CrcThread, "put", lambda *a: pytest.fail("queued to the CRC thread"))
    rng = random.Random(1)
    bufs = [
        bytearray(rng.randbytes(rng.choice([0, 1, 100, 70_000, 300_000, BIG + 3])))
        for _ in range(30)
    ]
    addresses = [(torch.frombuffer(b, dtype=torch.uint8).data_ptr(), len(b)) for b in bufs if b]
    w = HashingWriter(tmp_path / "f", stable=addresses if stable else (), direct=bounce, bounce=bounce)
    for b in bufs:
        assert w.write(b) == len(b)
        assert w.tell() == w.size
    w.close()
    assert {"size": w.size, "crc32": w.checksum} == _crc_of(tmp_path / "f")
    assert not [t for t in threading.enumerate() if t.name == "ftkit-crc32"]
    with pytest.raises(ValueError):
        w.write(b"late")


def test_write_error_is_the_real_oserror_and_stops_the_crc_thread(tmp_path, monkeypatch):
    class FullDisk(HashingWriter):  # a real ENOSPC from the kernel: writes go to /dev/full
        def __init__(self, path, **kw):
            super().__init__(path, **kw)
            self._f.close()
            self._f = open("/dev/full", "wb")  # noqa: SIM115 - closed by abort()
            self.direct = False

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    monkeypatch.setattr(_single, "HashingWriter", FullDisk)
    progress = _single.WriteProgress()
    with pytest.raises(OSError) as err:
        write_state_file(tmp_path, "s.pt", {"state": {"w": torch.ones(BIG)}}, progress=progress)
    assert err.value.errno == errno.ENOSPC
    assert progress.writer is not None and progress.writer.path == tmp_path / "s.pt"
    assert not [t for t in threading.enumerate() if t.name == "ftkit-crc32"]


def test_crc_is_zlib_ng_and_equals_the_standard_zlib_crc(tmp_path):
    # zlib-ng is a dependency: a checkpoint is checksummed at its speed, never silently at zlib's
    assert _files.CRC_IMPL == "zlib-ng"
    rng = random.Random(2)
    for n in (0, 1, 7, 4095, 1 << 20, (5 << 20) + 3):
        data = rng.randbytes(n)
        assert _files.crc32(data) == zlib.crc32(data)
        seed = rng.getrandbits(32)  # incremental, as the writer's thread and crc32_file use it
        assert _files.crc32(memoryview(data)[n // 3 :], seed) == zlib.crc32(data[n // 3 :], seed)
    data = rng.randbytes((9 << 20) + 5)  # more than two of crc32_file's 4 MiB reads
    (tmp_path / "f").write_bytes(data)
    assert _files.crc32_file(tmp_path / "f") == (len(data), f"{zlib.crc32(data):08x}")


def test_empty_and_tiny_files(tmp_path):
    w = HashingWriter(tmp_path / "empty")
    w.close()
    assert (w.size, w.checksum) == (0, "00000000")
    buf = io.BytesIO()
    torch.save({}, buf)
    with HashingWriter(tmp_path / "tiny") as w:
        w.write(buf.getvalue())
    assert {"size": w.size, "crc32": w.checksum} == _crc_of(tmp_path / "tiny")


def test_no_numpy_means_every_big_write_waits_for_its_crc(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "address", lambda view: None)
    monkeypatch.setattr(_direct, "address", lambda view: None)  # and the direct writer stages by slicing
    entry = write_state_file(tmp_path, "s.pt", {"state": {"w": torch.randn(BIG)}})
    assert entry == _crc_of(tmp_path / "s.pt")
