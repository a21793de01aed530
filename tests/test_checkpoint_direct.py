"""State files written with O_DIRECT (``ftkit.checkpoint.io.direct``), on real files.

The bytes on disk are exactly the bytes written, for any mix of sizes and addresses (aligned
buffers go to the disk from where they are, the rest through the staging buffer); the file
descriptor really has O_DIRECT; a torch.save archive gets 4096-aligned records and the async
snapshot's buffers are written without a copy; a filesystem that refuses O_DIRECT falls back
to the page cache (or is an error naming ``checkpoint.direct_io`` when direct I/O is
required); ENOSPC on a real full filesystem is reported as ENOSPC.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import random
import struct
import subprocess
import sys
import threading
import time
import warnings
import zipfile
import zlib

import pytest
import torch

from ftkit.checkpoint import CheckpointConfig
from ftkit.checkpoint.background.buffers import BufferSet, layout_of
from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
from ftkit.checkpoint.crashsafe.shm import Segment
from ftkit.checkpoint.io import direct as _direct
from ftkit.checkpoint.io import statefile as _single
from ftkit.checkpoint.io.direct import BLOCK, DirectFile, aligned_empty, open_direct
from ftkit.checkpoint.io.files import HashingWriter
from ftkit.checkpoint.io.statefile import read_state_file, write_state_file
from ftkit.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


def _record_offsets(path) -> dict[str, int]:
    """File offset of each zip record's data, read from its local header."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            out[info.filename] = info.header_offset + 30 + name_len + extra_len
    return out


def _count_copies(monkeypatch) -> list[int]:
    """Record the size of every copy into the staging buffer."""
    copies: list[int] = []
    real = _direct.ctypes.memmove

    def memmove(dst, src, n):
        copies.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(_direct.ctypes, "memmove", memmove)
    return copies


@pytest.mark.parametrize("bounce", [False, True], ids=["direct", "bounce"])
def test_any_mix_of_writes_lands_byte_for_byte(tmp_path, monkeypatch, bounce):
    """Random writes land byte for byte; with ``bounce`` every byte of a source large
    enough to have an address goes through the staging buffers (the saver's mode), and
    writes larger than a staging buffer hand full buffers to the helper thread. A bouncing
    file checksums every byte as it stages it; one that does not stage them all does not."""
    copies = _count_copies(monkeypatch)
    rng = random.Random(4)
    page = mmap.mmap(-1, 64 << 20)  # page-aligned source: slices of it are aligned or not at will
    page[:] = rng.randbytes(64 << 20)
    addressed = 0
    for trial in range(12):
        path = tmp_path / f"f{trial}"
        f = open_direct(path, required=True, bounce=bounce, crc=zlib.crc32)
        assert f is not None
        assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT  # really direct
        expect = bytearray()
        for _ in range(rng.randint(0, 30)):
            kind = rng.choice(["tiny", "aligned", "unaligned", "huge", "blocks"])
            if kind == "tiny":
                data: object = rng.randbytes(rng.randint(0, 300))
            elif kind == "blocks":  # whole blocks at an aligned address, maybe with a tail
                start = rng.randrange(0, 1000) * BLOCK
                data = memoryview(page)[start : start + rng.randint(1, 40) * BLOCK + rng.choice([0, 17])]
            elif kind == "aligned":
                start = rng.randrange(0, 4000) * BLOCK
                data = memoryview(page)[start : start + rng.randint(BLOCK, 3 << 20)]
            elif kind == "unaligned":
                start = rng.randrange(1, 1 << 20)
                data = memoryview(page)[start : start + rng.randint(1, 3 << 20)]
            else:  # more than the staging buffer, from an unaligned address
                start = rng.randrange(1, BLOCK)
                data = memoryview(page)[start : start + (20 << 20) + rng.randint(0, BLOCK)]
            assert f.write(data) == len(bytes(data))
            expect += bytes(data)
            addressed += len(bytes(data)) if len(bytes(data)) >= BLOCK else 0
        f.close()
        assert f.size == len(expect)
        assert path.read_bytes() == bytes(expect), f"trial {trial}"
        assert f.crc == (zlib.crc32(expect) if bounce else None)
    if bounce:
        assert sum(copies) == addressed
    else:  # the aligned whole blocks went to the disk from `page`
        assert sum(copies) < addressed


def test_a_direct_write_waits_for_the_helper_threads_write(tmp_path, monkeypatch):
    """The file offset is shared: a write from the caller's memory must not overtake the
    staging buffer the helper thread is still writing (made slow here)."""
    real = DirectFile._writev

    def slow_on_helper(self, bufs):
        if threading.current_thread().name.startswith("ftkit-direct-io"):
            time.sleep(0.2)
        return real(self, bufs)

    monkeypatch.setattr(DirectFile, "_writev", slow_on_helper)
    page = mmap.mmap(-1, 40 << 20)
    page[:] = random.Random(5).randbytes(40 << 20)
    f = open_direct(tmp_path / "f", required=True)
    f.write(memoryview(page)[1 : (16 << 20) + 1])  # unaligned: staged, a full buffer handed over
    f.write(memoryview(page)[16 << 20 : 32 << 20])  # aligned, at a block boundary: direct
    f.close()
    assert (tmp_path / "f").read_bytes() == page[1 : (16 << 20) + 1] + page[16 << 20 : 32 << 20]


def test_empty_file_and_exact_blocks(tmp_path):
    f = open_direct(tmp_path / "empty", required=True)
    f.close()
    assert (tmp_path / "empty").stat().st_size == 0
    buf = aligned_empty((3 * BLOCK,), torch.uint8)
    buf.copy_(torch.randint(0, 255, (3 * BLOCK,), dtype=torch.uint8))
    f = open_direct(tmp_path / "blocks", required=True)
    f.write(memoryview(buf.numpy()))
    f.close()
    assert (tmp_path / "blocks").read_bytes() == bytes(buf.numpy())


def test_state_file_records_are_page_aligned_and_aligned_tensors_are_not_copied(tmp_path, monkeypatch):
    torch.manual_seed(0)
    big = aligned_empty((1024, 1024), torch.float32)  # 4 MiB, as the snapshot's buffers are
    big.copy_(torch.randn(1024, 1024))
    state = {"big": big, "small": torch.randn(10), "odd": torch.randint(0, 9, (70001,), dtype=torch.uint8)}
    copies = _count_copies(monkeypatch)
    entry = write_state_file(tmp_path, "s.pt", {"state": state}, direct=True)
    data = (tmp_path / "s.pt").read_bytes()
    assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    # only headers, the small tensors and the odd tail were staged, never the 4 MiB tensor
    assert sum(copies) < 200_000, copies
    offsets = _record_offsets(tmp_path / "s.pt")
    assert all(off % BLOCK == 0 for name, off in offsets.items() if "/data/" in name), offsets
    got = read_state_file(tmp_path, "s.pt", entry, verify=True, mmap=True)["state"]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert torch.equal(torch.load(tmp_path / "s.pt", weights_only=True)["state"]["big"], big)

    plain = write_state_file(tmp_path, "p.pt", {"state": state}, direct=False)  # torch's 64
    assert not all(off % BLOCK == 0 for name, off in _record_offsets(tmp_path / "p.pt").items() if "/data/" in name)
    assert plain["size"] < entry["size"]


def test_async_snapshot_buffers_and_shm_slots_are_page_aligned(tmp_path, monkeypatch):
    tensors = [("a", torch.randn(256, 257)), ("b", torch.randn(3)), ("c", torch.randn(100, 1000))]
    bufs = BufferSet().buffers_for(tensors)
    assert bufs[0].data_ptr() % BLOCK == 0 and bufs[2].data_ptr() % BLOCK == 0  # from 64 KiB up
    seg = Segment(tmp_path, "t", 0, 0, layout_of(tensors), 0)  # the crash-safe slot
    try:
        assert [off % BLOCK == 0 for off, _, _ in seg.table] == [True, False, True]
    finally:
        seg.close()
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 3))
    for crash_safe in (False, True):
        root = tmp_path / f"ck-{crash_safe}"
        copies = _count_copies(monkeypatch) if not crash_safe else None  # the saver is another process
        mgr = AsyncCheckpointer(CheckpointConfig(root=root, direct_io=True),
                                async_config=AsyncConfig(crash_safe=crash_safe))
        try:
            mgr.save(5, {"model": model})
            mgr.wait()
        finally:
            mgr.close()
        path = root / "step-00000005" / "rank-00000.pt"
        offsets = _record_offsets(path)
        weight = [off for name, off in offsets.items() if "/data/" in name]
        assert weight and all(off % BLOCK == 0 for off in weight)
        if copies is not None:  # the 1 MiB weight went to the disk from the buffer itself
            assert sum(copies) < 100_000, copies


_HUGE_PROGRAM = r"""
import os, sys, torch
from ftkit.checkpoint.io.direct import aligned_empty
big = aligned_empty((1536, 1024), torch.float32)  # 6 MiB: three 2 MiB pieces
small = aligned_empty((100, 1000), torch.float32)  # 400 KiB: pages only
big.fill_(1.5); small.fill_(2.5)
lo, hi = big.data_ptr(), big.data_ptr() + big.numel() * 4
huge = 0  # AnonHugePages of the mapping that holds `big`
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= lo < end
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1]) << 10
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a forked child (a DataLoader worker) sees zeros, not a copy-on-write share
    os.write(w, f"{big[0, 0].item()} {big[-1, -1].item()} {small[5, 5].item()}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(big.data_ptr() % (2 << 20), small.data_ptr() % 4096, huge, os.read(r, 100).decode(), big[0, 0].item())
"""


def test_host_buffers_are_huge_page_aligned_and_not_shared_with_a_forked_child():
    """From 2 MiB up a buffer starts on a 2 MiB boundary and, where the kernel's THP mode
    allows it, lies in huge pages (a device reads them in large segments); a child forked
    after the snapshot sees zeros there while the parent keeps its values."""
    out = subprocess.run([sys.executable, "-c", _HUGE_PROGRAM], capture_output=True, text=True,
                         check=True).stdout.split()
    big_off, small_off, huge, child, parent = int(out[0]), int(out[1]), int(out[2]), out[3:6], out[6]
    assert (big_off, small_off) == (0, 0)
    assert child == ["0.0", "0.0", "0.0"] and parent == "1.5"
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[always]" in mode or "[madvise]" in mode:  # else 4 KiB pages are all there is
        assert huge == 6 << 20, f"THP mode {mode.strip()!r} but {huge} bytes in huge pages"


def test_refused_o_direct_falls_back_or_fails_by_the_setting(tmp_path, monkeypatch, caplog):
    # No filesystem here refuses O_DIRECT (ext4 and tmpfs on Linux >= 6.6 accept it), so the
    # refusal is made as Linux makes it: the file is created, then open fails with EINVAL.
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(_direct.os, "open", refusing_open)
    monkeypatch.setattr(_direct, "_refused", {})
    state = {"state": {"w": torch.randn(70_000)}}
    with pytest.raises(CheckpointError, match=r"checkpoint\.direct_io=True") as err:
        write_state_file(tmp_path, "req.pt", state, direct=True)
    assert str(tmp_path) in str(err.value)
    assert not (tmp_path / "req.pt").exists()  # the half-opened file is not left behind
    with caplog.at_level(logging.INFO, logger="ftkit.checkpoint.io.direct"):
        entry = write_state_file(tmp_path, "auto.pt", state, direct=None)
        write_state_file(tmp_path, "auto2.pt", state, direct=None)
    refusals = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(refusals) == 1 and str(tmp_path) in refusals[0].getMessage()  # once per filesystem
    assert entry["size"] == (tmp_path / "auto.pt").stat().st_size
    assert torch.equal(read_state_file(tmp_path, "auto.pt", entry)["state"]["w"], state["state"]["w"])
    w = HashingWriter(tmp_path / "h", direct=None)
    assert not w.direct
    w.close()


def test_enospc_on_a_full_filesystem_is_enospc(small_fs):
    buf = aligned_empty((4 << 20,), torch.uint8)
    f = open_direct(small_fs / "big", required=True)  # tmpfs takes O_DIRECT since Linux 6.6
    assert isinstance(f, DirectFile)
    with pytest.raises(OSError) as err:
        f.write(memoryview(buf.numpy()))
        f.close()
    f.abort()
    assert err.value.errno == errno.ENOSPC


def test_enospc_of_the_helper_threads_write_is_raised_by_the_next_write(small_fs, monkeypatch):
    """Bounced writes: the first full staging buffer is written by the helper thread, which
    meets ENOSPC; the caller's next hand-over raises it, and close frees everything."""
    buf = aligned_empty((8 << 20,), torch.uint8)
    f = open_direct(small_fs / "big", required=True, bounce=True)
    assert isinstance(f, DirectFile)
    with pytest.raises(OSError) as err:
        for _ in range(6):  # 48 MiB: three hand-overs of 16 MiB
            f.write(memoryview(buf.numpy()))
    assert err.value.errno == errno.ENOSPC and f._io is not None
    f.abort()
    assert f.closed and not any(t.name.startswith("ftkit-direct-io") for t in threading.enumerate())


def test_direct_io_setting_is_checked():
    with pytest.raises(ConfigError, match=r"checkpoint\.direct_io"):
        CheckpointConfig(root="/tmp/x", direct_io="yes")  # type: ignore[arg-type]


def test_sync_save_snapshot_is_written_without_a_copy(tmp_path, monkeypatch):
    from ftkit.checkpoint import make_manager

    torch.manual_seed(1)
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    copies = _count_copies(monkeypatch)
    mgr = make_manager(CheckpointConfig(root=tmp_path, direct_io=True))
    mgr.save(3, {"model": model, "optimizer": opt})
    assert sum(copies) < 100_000, copies  # weight, exp_avg, exp_avg_sq: 6 MiB, none staged
    fresh = torch.nn.Linear(1024, 512)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert make_manager(CheckpointConfig(root=tmp_path)).load({"model": fresh, "optimizer": fresh_opt}) == 3
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])


def test_plain_torch_save_fallback_writes_direct_too(tmp_path, monkeypatch):
    # a torch whose private serializer pieces changed: plain torch.save into the direct writer
    monkeypatch.setattr(_single, "_SKIP_ZIP_CRC", False)
    state = {"state": {"w": torch.randn(300_001), "s": torch.ones(3)}}
    entry = write_state_file(tmp_path, "f.pt", state, direct=True)
    data = (tmp_path / "f.pt").read_bytes()
    assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert torch.equal(read_state_file(tmp_path, "f.pt", entry)["state"]["w"], state["state"]["w"])


def test_quantized_tensors_keep_their_own_copy_path(tmp_path):
    # a page-aligned plain buffer cannot hold a quantized tensor: those are cloned as before
    from ftkit.checkpoint import make_manager

    back: dict = {"q": {"w": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated (creating and loading them)
        q = torch.quantize_per_tensor(torch.randn(300, 300), 0.1, 0, torch.qint8)  # 90 KB
        make_manager(CheckpointConfig(root=tmp_path, direct_io=True)).save(1, {"q": {"w": q}})
        assert make_manager(CheckpointConfig(root=tmp_path)).load(back) == 1
    assert back["q"]["w"].is_quantized and torch.equal(back["q"]["w"].int_repr(), q.int_repr())


@pytest.fixture
def tmpfs(tmp_path):
    """Mount real tmpfs filesystems with the given options (root, as the tests run here)."""
    mounted = []

    def mount(name: str, options: str):
        assert os.geteuid() == 0, "this machine runs the tests as root (mounts a tmpfs)"
        mnt = tmp_path / name
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_huge_pages_is_read_from_the_mount_options(tmp_path, tmpfs):
    from ftkit.checkpoint.crashsafe.shm import huge_pages

    huge = tmpfs("huge", "size=64m,huge=within_size")
    (huge / "sub").mkdir()
    plain = tmpfs("plain", "size=64m")
    advise = tmpfs("advise", "size=64m,huge=advise")  # fallocate takes no huge page there
    assert huge_pages(huge) and huge_pages(huge / "sub")
    assert not huge_pages(plain) and not huge_pages(advise) and not huge_pages(tmp_path)


@pytest.mark.parametrize("huge", [False, True], ids=["bounced", "huge-tmpfs"])
def test_crash_safe_saves_from_either_kind_of_tmpfs_resume_exactly(tmp_path, tmpfs, huge):
    """The saver writes a tmpfs without huge pages through its staging buffers (bounce)
    and one with huge pages from the segment itself; both give the same exact checkpoint."""
    shm = tmpfs("shm", "size=256m" + (",huge=within_size" if huge else ""))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 7))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    root = tmp_path / "ck"
    mgr = AsyncCheckpointer(CheckpointConfig(root=root, direct_io=True),
                            async_config=AsyncConfig(crash_safe=True, shm_dir=shm))
    try:
        mgr.save(9, {"model": model, "optimizer": opt})
        mgr.wait()
    finally:
        mgr.close()
    assert list(shm.iterdir()) == []  # the segments are gone with the saver
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 7))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    from ftkit.checkpoint import make_manager

    assert make_manager(CheckpointConfig(root=root)).load({"model": fresh, "optimizer": fresh_opt}) == 9
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
