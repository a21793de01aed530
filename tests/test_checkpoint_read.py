"""Loading reads each checkpoint file once, checksummed as it arrives (``ftkit.checkpoint.io.reader``).

Real files: every byte of a state file is read exactly once by a load (no verification pass
of its own), with O_DIRECT where the filesystem takes it; any size comes back byte for byte
with the CRC-32 of zlib, through short reads and refused O_DIRECT too; a file that changes
while it is read is refused by name; a corruption found only during that one read makes the
resume fall back to the older checkpoint with exactly its state, and leaves the live state
untouched when there is nothing older; with several ranks each file is checked by one rank.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import gc
import itertools
import os
import random
import re
import shutil
import threading
import time
import warnings
import weakref
import zlib
from pathlib import Path

import pytest
import torch

from ftkit.checkpoint import manager as _manager
from ftkit.checkpoint.format.manifest import verify_files, verify_share
from ftkit.checkpoint.io import aio as _aio
from ftkit.checkpoint.io import archive as _archive
from ftkit.checkpoint.io import direct as _direct
from ftkit.checkpoint.io import reader as _reader
from ftkit.checkpoint.io import reads as _reads
from ftkit.checkpoint.io import statefile as _single
from ftkit.checkpoint.io import unpickle as _unpickle
from ftkit.checkpoint.io.reader import FileProblem, check_file, read_file
from ftkit.checkpoint.io.statefile import read_state_file, write_state_file
from ftkit.errors import CheckpointError
from tests.ckpt_helpers import assert_same_values, make_mgr, native_aio, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(root, saved_by, *steps)``: ``root`` as the helper trainer leaves it after
    ``run_ranks(["train", "--root", root, "--steps", s, "--stop-at", s], saved_by)`` for each
    step ``s`` in turn (a checkpoint at each, the later runs resuming from the one before).
    Made by those real runs once per test process and copied for each test, since many tests
    start from the same checkpoints and each run of ranks costs seconds of imports."""
    cache = tmp_path_factory.mktemp("trained")
    made: dict[tuple[int, tuple[int, ...]], Path] = {}

    def make(root: Path, saved_by: int, *steps: int) -> Path:
        for i in range(len(steps)):
            key = (saved_by, steps[: i + 1])
            if key in made:
                continue
            work = cache / ("by{}-{}".format(saved_by, "-".join(map(str, key[1]))))
            shutil.rmtree(work, ignore_errors=True)  # what a failed run left
            if i:
                shutil.copytree(made[(saved_by, steps[:i])], work)
            run_ranks(["train", "--root", str(work), "--steps", str(steps[i]), "--stop-at", str(steps[i])], saved_by)
            made[key] = work
        shutil.copytree(made[(saved_by, steps)], root)
        return root

    return make


def _entry(path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


class _Reads(list):
    """(inode, offset, bytes, O_DIRECT) of each read; ``bulk`` those of them made by the
    reader's one pass over the file, ``small`` the others (headers, indexes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bulk: list[tuple[int, int, int, bool]] = []
        self.small: list[tuple[int, int, int, bool]] = []
        self.fds: dict[int, set[bool]] = {}  # inode -> O_DIRECT of every descriptor the kernel read it through
        self.engines: set[str] = set()


def _direct_fd(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _spy_reads(monkeypatch) -> _Reads:
    """Every read the reader makes, whichever way (native AIO or threads): (inode, offset,
    bytes read, O_DIRECT), the last from the descriptors handed to the kernel."""
    reads = _Reads()
    real_completed, real_preadv, real_submit = _reads.Reads._completed, os.preadv, _aio.AioContext.submit

    def completed(self, tag, view, offset, n, kind):
        ino = os.fstat(self.source.fd).st_ino
        record = (ino, offset, n, all(reads.fds.get(ino, {False})))
        reads.append(record)
        (reads.bulk if kind == "bulk" else reads.small).append(record)
        reads.engines.add(self.engine)
        return real_completed(self, tag, view, offset, n, kind)

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        if n:
            reads.fds.setdefault(os.fstat(fd).st_ino, set()).add(_direct_fd(fd))
        return n

    def submit(self, batch):
        batch = list(batch)
        for _tag, fd, *_ in batch:
            reads.fds.setdefault(os.fstat(fd).st_ino, set()).add(_direct_fd(fd))
        return real_submit(self, batch)

    monkeypatch.setattr(_reads.Reads, "_completed", completed)
    monkeypatch.setattr(_reads.os, "preadv", preadv)
    monkeypatch.setattr(_aio.AioContext, "submit", submit)
    return reads


@pytest.fixture(params=["aio", "threads"])
def engine(request, monkeypatch, tmp_path):
    """The reader's two ways to keep reads in flight: native AIO where the kernel and the
    filesystem give it (this machine's local disk), threads elsewhere."""
    if request.param == "threads":
        monkeypatch.setattr(_reads, "open_context", lambda depth: None)
    elif why := native_aio(tmp_path):
        pytest.skip(f"no native AIO here: {why}")
    return request.param


@pytest.fixture(params=[1, 3], ids=["1-placer", "3-placers"])
def placers(request, monkeypatch):
    """Threads that checksum and place the arrived pieces: the reading thread alone (a 2-CPU
    machine's setting, this one's) or with helpers (a bigger machine's)."""
    monkeypatch.setattr(_reader, "WORKERS", request.param)
    return request.param


def _coverage(reads, ino: int) -> list[tuple[int, int]]:
    return sorted((off, off + n) for i, off, n, _ in reads if i == ino and n)


@pytest.mark.parametrize("chunk", [1 << 20, 16 << 20], ids=["1MiB-pieces", "16MiB-pieces"])
def test_a_load_reads_every_byte_of_the_file_once_with_o_direct(tmp_path, monkeypatch, chunk, engine):
    monkeypatch.setattr(_reader, "CHUNK", chunk)
    state = {"w": torch.randn(5_000_000), "b": torch.arange(7), "extra": {"value": 3}}
    mgr = make_mgr(tmp_path / "ck")
    mgr.save(1, state)
    path = tmp_path / "ck" / "step-00000001" / "rank-00000.pt"
    size = path.stat().st_size
    reads = _spy_reads(monkeypatch)
    crc_passes = []
    monkeypatch.setattr(_reader, "check_file", lambda *a, **k: crc_passes.append(a))
    fresh = {"w": torch.zeros(5_000_000), "b": torch.zeros(7, dtype=torch.int64), "extra": {"value": 0}}
    where = fresh["w"].data_ptr()
    assert make_mgr(tmp_path / "ck").load(fresh) == 1
    assert torch.equal(fresh["w"], state["w"]) and torch.equal(fresh["b"], state["b"])
    assert fresh["w"].data_ptr() == where  # read into the live tensor (its only checkpoint: with an undo)
    assert fresh["extra"]["value"] == 3
    ino = path.stat().st_ino
    spans = sorted((off, off + n) for i, off, n, _ in reads.bulk if i == ino and n)
    # the bulk: contiguous, no overlap, exactly the file: every byte once
    assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert sum(b - a for a, b in spans) == size
    assert sum(n for i, _, n, _ in reads.small if i == ino) <= 1 << 20  # before it: the zip directory's few pages
    assert all(d for i, _, n, d in reads if i == ino and n)  # O_DIRECT reads
    assert crc_passes == []  # no verification pass besides the read
    assert reads.engines == {engine}


@pytest.mark.parametrize("direct", [None, False], ids=["o-direct", "page-cache"])
def test_any_size_reads_back_byte_for_byte_with_zlibs_crc(tmp_path, monkeypatch, direct, engine, placers):
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)  # many pieces, a window of them in flight
    rng = random.Random(7)
    piece = 64 << 10
    sizes = [0, 1, 511, 4095, 4096, 4097, piece - 1, piece, piece + 1, 9 * piece + 4097]
    for size in sizes:
        data = rng.randbytes(size)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        meta = _entry(path)
        _mapping, view = read_file(path, meta, direct=direct)
        assert view.nbytes == size and bytes(view) == data, size
        assert _direct.address(view) is None or size == 0 or _direct.address(view) % 4096 == 0
        for cache in (False, True):
            check_file(path, meta, direct=direct, cache=cache)
        bad = dict(meta, crc32=f"{(zlib.crc32(data) ^ 1):08x}")
        with pytest.raises(FileProblem, match=rf"f{size}: checksum crc32 .* does not match"):
            read_file(path, bad, direct=direct)
        with pytest.raises(FileProblem, match="does not match"):
            check_file(path, bad, direct=direct)


def test_short_direct_reads_are_completed_through_the_page_cache(tmp_path, monkeypatch, engine):
    """A direct read may stop anywhere, even off a block: the rest of the piece is read through
    the page cache (with AIO, the bytes past the cut are wiped first, so only that read can
    bring them back)."""
    monkeypatch.setattr(_reader, "CHUNK", 256 << 10)
    data = random.Random(1).randbytes(3 * (256 << 10) + 1000)
    path = tmp_path / "f"
    path.write_bytes(data)
    real = os.preadv
    kinds = []
    cut = 4096 + 100  # as if the device stopped after 4196 bytes

    def short(fd, buffers, offset):
        direct = _direct_fd(fd)
        kinds.append(direct)
        if direct:
            view = memoryview(buffers[0])
            n = real(fd, [view[: min(view.nbytes, 8192)]], offset)
            return min(n, cut)
        return real(fd, buffers, offset)

    monkeypatch.setattr(_reads.os, "preadv", short)
    if engine == "aio":
        asked: dict[int, int] = {}
        real_submit, real_wait = _aio.AioContext.submit, _aio.AioContext.wait

        def submit(self, batch):
            batch = list(batch)
            asked.update((tag, address) for tag, _fd, address, *_ in batch)
            kinds.extend(True for _ in batch)
            return real_submit(self, batch)

        def wait(self, least=1):
            out = []
            for tag, n in real_wait(self, least):
                if n > cut:
                    ctypes.memset(asked[tag] + cut, 0, n - cut)
                    n = cut
                out.append((tag, n))
            return out

        monkeypatch.setattr(_aio.AioContext, "submit", submit)
        monkeypatch.setattr(_aio.AioContext, "wait", wait)
    _mapping, view = read_file(path, _entry(path))
    assert bytes(view) == data
    assert True in kinds and False in kinds  # the unaligned rest came through the page cache


def test_a_file_that_changes_while_it_is_read_is_refused_by_name(tmp_path, monkeypatch, engine, placers):
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)
    path = tmp_path / "rank-00000.pt"
    path.write_bytes(os.urandom(10 * (64 << 10)))
    meta = _entry(path)
    real = _reads.Reads.submit

    def truncating(self, reads, kind):
        reads = list(reads)
        if any(offset == 0 for _, offset in reads):
            os.truncate(path, 3 * (64 << 10) + 5)  # another process cuts it short
        return real(self, reads, kind)

    monkeypatch.setattr(_reads.Reads, "submit", truncating)
    with pytest.raises(FileProblem, match=r"rank-00000\.pt: .* the file changed while it was read"):
        read_file(path, meta)
    with pytest.raises(FileProblem, match=r"rank-00000\.pt: size 196613 bytes, manifest says"):
        check_file(path, meta)
    with pytest.raises(FileProblem, match=r"rank-00000\.pt is missing"):
        check_file(tmp_path / "nothing", meta, name="rank-00000.pt")


def test_refused_o_direct_reads_through_the_page_cache_or_fails_by_the_setting(tmp_path, monkeypatch):
    state = {"state": {"w": torch.randn(70_000)}}
    entry = write_state_file(tmp_path, "s.pt", state)
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(_direct.os, "open", refusing_open)
    monkeypatch.setattr(_direct, "_refused", {})
    with pytest.raises(CheckpointError, match=r"checkpoint\.direct_io=True") as err:
        read_state_file(tmp_path, "s.pt", entry, direct=True)
    assert "s.pt" in str(err.value)
    reads = _spy_reads(monkeypatch)
    got = read_state_file(tmp_path, "s.pt", entry)
    assert torch.equal(got["state"]["w"], state["state"]["w"])
    assert reads and not any(d for *_, d in reads)


def test_the_plain_torch_load_parser_gives_the_same_payload(tmp_path, monkeypatch):
    base = torch.arange(12.0)
    obj = {"state": {"a": base, "b": base[3:7].view(2, 2), "h": torch.randn(3).half(), "n": [1, "x"]}}
    entry = write_state_file(tmp_path, "s.pt", obj)
    in_place = read_state_file(tmp_path, "s.pt", entry)["state"]
    monkeypatch.setattr(_single, "_PARSE_IN_PLACE", False)
    copied = read_state_file(tmp_path, "s.pt", entry)["state"]
    for got in (in_place, copied):
        assert torch.equal(got["a"], base) and torch.equal(got["b"], base[3:7].view(2, 2))
        assert torch.equal(got["h"], obj["state"]["h"]) and got["n"] == [1, "x"]
        assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()


def _flip(path, where: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def _state(value: float):
    torch.manual_seed(int(value))
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"value": value, "t": torch.full((5,), value)}}


def _snapshot(state) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "opt": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for s in state["optimizer"].state.values()],
        "extra": (state["extra"]["value"], state["extra"]["t"].clone()),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and len(a["opt"]) == len(b["opt"])
        and all(x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
                for x, y in zip(a["opt"], b["opt"], strict=True))
        and a["extra"][0] == b["extra"][0] and torch.equal(a["extra"][1], b["extra"][1])
    )


@pytest.mark.parametrize("where", [0.5, 0.999], ids=["in-tensor-data", "in-the-zip-directory"])
def test_corruption_found_during_the_read_falls_back_to_exactly_the_older_state(tmp_path, where):
    import random

    def with_schedule(value: int, steps: int) -> dict:
        state = _state(value)
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=1, gamma=0.5)
        for _ in range(steps):
            state["optimizer"].step()
            state["scheduler"].step()
        return state

    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    older = with_schedule(2, 2)
    torch.manual_seed(1234)
    random.seed(1234)
    rng_at_2, py_rng_at_2 = torch.get_rng_state(), random.getstate()
    mgr.save(2, older)
    want = _snapshot(older)
    want_schedule, want_lr = older["scheduler"].state_dict(), [g["lr"] for g in older["optimizer"].param_groups]
    mgr.save(3, with_schedule(3, 3))
    _flip(root / "step-00000003" / "rank-00000.pt", where)

    live = with_schedule(9, 5)  # a run that went on: every tensor and counter differs from both checkpoints
    torch.manual_seed(99)
    random.seed(99)
    assert make_mgr(root).load(live) == 2
    assert _same(_snapshot(live), want)
    assert torch.equal(torch.get_rng_state(), rng_at_2) and random.getstate() == py_rng_at_2  # the RNGs are step 2's too
    assert live["scheduler"].state_dict() == want_schedule and want_schedule["last_epoch"] == 2  # and the counters
    assert [g["lr"] for g in live["optimizer"].param_groups] == want_lr == [0.025]


def _cut_short_during_the_bulk(path, monkeypatch) -> None:
    """Another process truncates ``path`` once its bulk read has begun: the read stops part of
    the way, with some of the file placed (64 KiB pieces, four in flight: the first are in)."""
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)
    monkeypatch.setattr(_reader, "STAGING", 4 * (64 << 10))
    real = _reads.Reads.submit
    size = path.stat().st_size

    def truncating(self, reads, kind):
        reads = list(reads)
        if kind == "bulk" and any(offset >= 4 * (64 << 10) for _, offset in reads) and path.stat().st_size == size:
            os.truncate(path, size // 2)
        return real(self, reads, kind)

    monkeypatch.setattr(_reads.Reads, "submit", truncating)


@pytest.mark.parametrize("how", ["in-tensor-data", "in-the-zip-directory", "cut-short-mid-read"])
def test_with_nothing_older_a_corrupt_newest_leaves_the_live_state_untouched(tmp_path, monkeypatch, how):
    """The only checkpoint is read straight into the live tensors too, but the bytes it writes
    over are set aside on the way: when its checksum fails after the whole read (or the read
    stops half-way), they are put back, and the fresh start begins from the state exactly as
    it was (resume="auto"; "required" and an explicit step raise, the state as it was too)."""
    root = tmp_path / "ck"
    make_mgr(root).save(3, _state(3))
    path = root / "step-00000003" / "rank-00000.pt"
    state_file_reads = []
    real_into = _manager.read_state_into
    monkeypatch.setattr(_manager, "read_state_into",
                        lambda *a, **k: state_file_reads.append(k.get("undo")) or real_into(*a, **k))
    placed: list[int] = []  # parts of live tensors written over (and set aside first)
    real_write = _single.Undoable.write
    monkeypatch.setattr(_single.Undoable, "write", lambda self, at, src, n: placed.append(n) or real_write(self, at, src, n))
    good = path.read_bytes()
    for resume, step in [("auto", None), ("required", None), ("auto", 3)]:
        placed.clear()
        path.write_bytes(good)
        live = _state(9)
        before, pointers = _snapshot(live), _pointers(live)
        torch.manual_seed(5)
        rng = torch.get_rng_state()
        with monkeypatch.context() as cut:
            if how == "cut-short-mid-read":
                _cut_short_during_the_bulk(path, cut)
            else:
                _flip(path, 0.5 if how == "in-tensor-data" else 0.999)
            said = "checksum" if how != "cut-short-mid-read" else "the file changed while it was read"
            if resume == "auto" and step is None:
                assert make_mgr(root).load(live) is None  # resume="auto": a fresh start ...
            else:
                with pytest.raises(CheckpointError, match=said):
                    make_mgr(root, resume=resume).load(live, step=step)
        assert _same(_snapshot(live), before)  # ... from the state as it was, nothing of step 3 in it
        assert _pointers(live) == pointers and torch.equal(torch.get_rng_state(), rng)
        assert state_file_reads[-1] is not None and placed  # read into the live tensors, and undone


@pytest.mark.parametrize("placers", [1, 3], ids=["one-placer", "three-placers"])
def test_tied_weights_written_twice_by_a_corrupt_only_checkpoint_are_put_back_as_they_were(tmp_path, monkeypatch,
                                                                                          placers):
    """A model whose output layer shares its weight with the embedding (tied weights): the
    checkpoint holds that weight twice (a snapshot copies each tensor), and the load writes
    both into the one live storage. With the only checkpoint corrupt, the undo must put back
    the bytes from before the load, not the checkpoint's that the first write left and the
    second write set aside (whichever of the placing threads wrote first)."""
    monkeypatch.setattr(_reader, "WORKERS", placers)
    monkeypatch.setattr(_reader, "FRESH_WORKERS", placers)
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)  # several pieces per tensor

    def tied(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(300, 128), torch.nn.Linear(128, 300, bias=False))
        model[1].weight = model[0].weight
        return {"model": model}

    root = tmp_path / "ck"
    make_mgr(root).save(3, tied(3))
    _flip(root / "step-00000003" / "rank-00000.pt", 0.5)  # in tensor data: found once every byte is placed
    live = tied(9)
    before = live["model"][0].weight.detach().clone()
    assert make_mgr(root).load(live) is None
    assert live["model"][1].weight is live["model"][0].weight
    assert torch.equal(live["model"][0].weight, before)


@pytest.mark.parametrize("case", ["valid", "corrupt"])
def test_tied_weights_of_two_ranks_read_from_their_only_dcp_checkpoint_in_one_pass(tmp_path, case):
    """Tied weights (two layers of one weight) on two DDP ranks, their only checkpoint a DCP one,
    read in one pass with what it writes over set aside: each rank writes the tied weight once
    per key into the one live storage. Valid: the trained values, the layers still tied.
    Corrupt (rank 1's file, found during its read): a fresh start on both, the tied weight as
    built (the bytes from before the load, not the first key's bytes that the second write
    set aside), still tied."""
    from tests.ckpt_helpers import build_state

    root, out = tmp_path / "ck", tmp_path / "trained"
    run_ranks(["train", "--root", str(root), "--steps", "4", "--stop-at", "4", "--tied", "--out", str(out)], 2)
    if case == "corrupt":
        _flip_dcp_file(root, 4, 1)
    outs = run_ranks(["load", "--root", str(root), "--tied", "--out", str(tmp_path / "loaded")], 2, timeout=90)
    want = (torch.load(f"{out}.rank0", weights_only=True)["model"] if case == "valid"
            else build_state(tied=True)[0]["model"].state_dict())
    assert torch.equal(want["0.weight"], want["2.weight"])
    for rank, said in enumerate(o.strip().splitlines() for o in outs):
        assert said[-2:] == ["tied True", "loaded 4" if case == "valid" else "loaded None"], said
        assert any(line.startswith("reader direct=") for line in said), said  # one pass, the streaming reader
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True)["model"]
        assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items()), rank


def test_the_only_checkpoint_is_read_straight_into_the_live_tensors_exactly(tmp_path, monkeypatch):
    """With nothing older to fall back on, the file's tensors still go straight into the live
    tensors (none of them through the read buffer), the state is exactly step 3's, and the
    copies set aside for an undo are gone after the load."""
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)
    root = tmp_path / "ck"
    newest = _state(3)
    make_mgr(root).save(3, newest)
    want = _snapshot(newest)
    into_buffer: list[int] = []
    asides: list[weakref.ref] = []
    real_scatter, real_aside = _reader.scatter_file, _single.aside_memory

    def scatter(*args, **kwargs):
        mapping, view = real_scatter(*args, **kwargs)
        into_buffer.append(sum(1 for i in range(0, view.nbytes, 4096) if any(view[i : i + 4096])))
        return mapping, view

    def aside(nbytes):
        out = real_aside(nbytes)
        asides.append(weakref.ref(out))
        return out

    monkeypatch.setattr(_single, "scatter_file", scatter)
    monkeypatch.setattr(_single, "aside_memory", aside)
    live = _state(9)
    before = _pointers(live)
    assert make_mgr(root).load(live) == 3
    assert _same(_snapshot(live), want) and _pointers(live) == before
    tensors = sum(t.numel() * t.element_size() for t in _state(0)["model"].state_dict().values()) * 3
    assert into_buffer and into_buffer[0] * 4096 < tensors / 4  # the tensors' pages were never written there
    assert len(asides) == 1 and asides[0]() is None  # one buffer set aside, freed


def _pointers(state) -> list[int]:
    return ([t.data_ptr() for t in state["model"].state_dict().values()]
            + [v.data_ptr() for st in state["optimizer"].state.values() for v in st.values() if torch.is_tensor(v)])


def _two_checkpoints(root) -> dict:
    """Steps 2 and 3 of two different states in ``root``; step 3's snapshot."""
    mgr = make_mgr(root, keep_last=None)
    mgr.save(2, _state(2))
    newest = _state(3)
    mgr.save(3, newest)
    return _snapshot(newest)


@pytest.mark.parametrize("chunk", [64 << 10, 16 << 20], ids=["pieces-inside-tensors", "16MiB-pieces"])
def test_with_an_older_checkpoint_the_newest_is_read_once_straight_into_the_live_tensors(tmp_path, monkeypatch,
                                                                                        chunk, engine):
    """An older checkpoint to fall back on: the newest file is read once, with O_DIRECT, and
    its tensors' bytes go straight into the live model's and optimizer's tensors (no fresh
    buffer for them, nothing allocated in their place); the state is exactly step 3's."""
    monkeypatch.setattr(_reader, "CHUNK", chunk)
    root = tmp_path / "ck"
    want = _two_checkpoints(root)
    path = root / "step-00000003" / "rank-00000.pt"
    reads = _spy_reads(monkeypatch)
    into_buffer: list[int] = []
    real_scatter = _reader.scatter_file

    def scatter(*args, **kwargs):  # how many bytes the file sent to the fresh buffer
        mapping, view = real_scatter(*args, **kwargs)
        into_buffer.append(sum(1 for i in range(0, view.nbytes, 4096) if any(view[i : i + 4096])))
        return mapping, view

    monkeypatch.setattr(_single, "scatter_file", scatter)
    live = _state(9)
    before = _pointers(live)
    assert make_mgr(root).load(live) == 3
    assert _same(_snapshot(live), want)
    assert _pointers(live) == before  # the same tensors, filled in place
    spans = _coverage(reads, path.stat().st_ino)
    direct = [(off, off + n) for i, off, n, d in reads if i == path.stat().st_ino and n and d]
    assert sum(b - a for a, b in direct) >= path.stat().st_size - (1 << 20)  # the bulk: once, O_DIRECT
    assert sum(b - a for a, b in spans) <= path.stat().st_size + (1 << 20)  # + the zip directory
    tensors = sum(t.numel() * t.element_size() for t in _state(0)["model"].state_dict().values()) * 3
    assert into_buffer and into_buffer[0] * 4096 < tensors / 4  # the tensors' pages were never written there
    assert reads.engines == {engine}


def test_a_fresh_optimizer_gets_moments_of_its_own_read_straight_from_the_file(tmp_path, monkeypatch):
    """A requeued run's optimizer has no state yet: its moments have no live tensor to go to.
    They are read into memory of their own (no shared read buffer kept alive, no second copy),
    bit for bit step 3's, by :data:`FRESH_WORKERS` threads (faulting fresh pages in is work
    more threads share), where a load into live tensors only uses :data:`WORKERS`."""
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)  # pieces enough for every thread
    monkeypatch.setattr(_reader, "WORKERS", 1)
    monkeypatch.setattr(_reader, "FRESH_WORKERS", 3)
    monkeypatch.setattr(_single, "FRESH_THREADS", 64 << 10)  # these moments count as much fresh memory
    placers: list[str] = []
    real_start = threading.Thread.start

    def start(self) -> None:
        if self.name == "ftkit-read-place":
            placers.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    root = tmp_path / "ck"
    want = _two_checkpoints(root)
    assert make_mgr(root).load(_state(9)) == 3 and placers == []  # live tensors: the reading thread alone
    torch.manual_seed(9)
    model = torch.nn.Linear(300, 200)
    live = {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.1),
            "extra": {"value": 0.0, "t": torch.zeros(5)}}
    assert not live["optimizer"].state
    assert make_mgr(root).load(live) == 3
    assert len(placers) == 2  # and the reading thread
    assert _same(_snapshot(live), want)
    for st in live["optimizer"].state.values():
        for v in st.values():
            if torch.is_tensor(v):
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size()


def test_a_corrupt_newest_read_into_the_live_state_with_a_corrupt_older_one_refuses_to_start_fresh(tmp_path):
    """Both checkpoints corrupt in their tensor data: the newest was already read into the live
    tensors when its checksum failed, and nothing older overwrote them. A fresh start from that
    state would train on part of a corrupt checkpoint: the load fails and says what to do."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    mgr.save(2, _state(2))
    mgr.save(3, _state(3))
    for step in (2, 3):
        _flip(root / f"step-{step:08d}" / "rank-00000.pt", 0.5)
    with pytest.raises(CheckpointError, match=r"step-00000003 was found corrupt while it was read into the live "
                                              r"state.*Move the broken step directories"):
        make_mgr(root).load(_state(9))


def _grown(value: float, *, b: bool, ema: bool) -> dict:
    """A state whose later checkpoints hold more: a dict entry ``b``, a module ``ema``."""
    state: dict = {"stats": {"a": torch.full((4096,), value)}}
    if b:
        state["stats"]["b"] = torch.full((4096,), value)
    if ema:
        state["ema"] = torch.nn.Linear(64, 64)
        with torch.no_grad():
            for t in state["ema"].parameters():
                t.fill_(value)
    return state


@pytest.mark.parametrize("older_lacks,config,said", [
    ("b", {}, r"state\['stats'\] \(1 tensor\) still hold its bytes"),
    ("ema", {"allow_missing": ("ema",)}, r"state\['ema'\] \(2 tensors\) still hold its bytes"),
    ("ema", {}, r"loading .*step-00000001 instead failed \(checkpoint .* has no state\['ema'\]"),
], ids=["a-dict-entry", "an-allowed-missing-key", "a-refused-missing-key"])
def test_a_corrupt_newest_read_into_entries_the_older_one_lacks_stops_the_load(tmp_path, older_lacks, config, said):
    """The newest checkpoint, read straight into the live tensors, fails its checksum, and the
    older one has nothing for some of them (an entry added since, an ``allow_missing`` key):
    loading it would leave the corrupt bytes there, under the older step's name. The load
    stops naming them; with the corrupt one moved away, those entries are as initialised."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None, **config)
    mgr.save(1, _grown(1.0, b=older_lacks != "b", ema=older_lacks != "ema"))
    mgr.save(2, _grown(2.0, b=True, ema=True))
    _flip(root / "step-00000002" / "rank-00000.pt", 0.5)
    live = _grown(0.0, b=True, ema=True)
    with pytest.raises(CheckpointError, match=r"step-00000002 was found corrupt while it was read into the live "
                                              rf"state, and .*{said}.*Move .*step-00000002 out of"):
        make_mgr(root, **config).load(live)

    shutil.move(root / "step-00000002", tmp_path / "step-00000002")
    live = _grown(0.0, b=True, ema=True)
    if older_lacks == "ema" and not config:  # still refused: the older one lacks it, as said
        with pytest.raises(CheckpointError, match=r"has no state\['ema'\] \(.*\); nothing was restored"):
            make_mgr(root, **config).load(live)
        return
    assert make_mgr(root, **config).load(live) == 1
    assert torch.equal(live["stats"]["a"], torch.full((4096,), 1.0))
    unchanged = live["stats"]["b"] if older_lacks == "b" else live["ema"].weight
    assert not unchanged.any()  # as initialised


def test_a_corrupt_newest_whose_older_one_does_not_fit_the_state_stops_the_load_naming_it(tmp_path):
    """The model grew between the two checkpoints: the newest, read straight into the live
    tensors, is corrupt, and the older one's restore fails (its shapes). The load says both,
    naming the corrupt checkpoint the state now holds part of, not only the restore's error."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    mgr.save(1, {"ema": torch.nn.Linear(64, 16)})
    mgr.save(2, {"ema": torch.nn.Linear(64, 32)})
    _flip(root / "step-00000002" / "rank-00000.pt", 0.5)
    with pytest.raises(CheckpointError, match=r"(?s)step-00000002 was found corrupt while it was read into the live state, "
                                              r"and loading .*step-00000001 instead failed \(.*rank-00000.pt does not fit the live "
                                              r"state: state\['ema'\]: weight is \[16, 64\] in the checkpoint, "
                                              r"\[32, 64\] in the module"):
        make_mgr(root).load({"ema": torch.nn.Linear(64, 32)})


@pytest.mark.parametrize(("saved_by", "loaded_by", "steps"),
                         [(1, 1, (4, 7)), (1, 1, (7,)), (1, 2, (4, 7)), (1, 2, (7,)), (2, 2, (4, 7)), (2, 1, (7,))])
def test_a_model_that_changed_shape_is_refused_before_anything_is_loaded(tmp_path, trained, saved_by, loaded_by, steps):
    """The model's hidden layer is 48 wide now, 32 in the checkpoints: the load fails on every
    rank naming the newest checkpoint and the shapes, falls back to no older one (they do not
    fit either, and loading one would hide the change), and leaves the state as it was built:
    not one tensor of the checkpoint in it (``Module.load_state_dict`` alone copies every
    tensor that fits before it raises; a state file is read straight into the live tensors)."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, saved_by, *steps)
    outs = run_ranks(["load", "--root", str(root), "--hidden", "48", "--out", str(tmp_path / "after")], loaded_by)
    fresh, _ = build_state(hidden=48)
    for rank, out in enumerate(outs):
        said = out.strip().splitlines()[-1]
        assert said.startswith("CheckpointError: ") and "step-00000007" in said and "Traceback" not in said, said
        if saved_by == 1:  # ftkit's check: the file, each tensor, both shapes, what to do
            assert re.search(r"step-00000007/rank-00000.pt does not fit the live state: state\['model'\]: "
                             r"(module\.)?0.weight is \[32, 8\] in the checkpoint, \[48, 8\] in the module", said), said
            assert "The model changed since this checkpoint was saved" in said, said
        else:  # DCP's, before it reads
            assert re.search(r"step-00000007/dcp: (rank 0: )?ValueError: Size mismatch", said), said
        after = torch.load(tmp_path / f"after.rank{rank}", weights_only=True)
        assert after["optimizer"]["state"] == {}
        assert after["model"].keys() == fresh["model"].state_dict().keys()
        for key, value in fresh["model"].state_dict().items():
            assert torch.equal(after["model"][key], value), (rank, key)


def test_a_one_process_checkpoint_is_refused_by_a_changed_fsdp_model_before_anything_is_loaded(tmp_path, trained):
    """Saved by one process, loaded on two ranks into an FSDP2 model whose hidden layer is 48
    wide now: every rank refuses it naming the file and the shapes (the model's whole ones, not
    its shards), before a tensor is set, and falls back to no older one (it does not fit
    either). Torch's load of the full state dicts raises only after setting every tensor that
    fits (the last layer's bias here), and with its own message."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, 1, 4, 7)
    outs = run_ranks(["load", "--root", str(root), "--hidden", "48", "--fsdp", "--out", str(tmp_path / "after")], 2)
    fresh, _ = build_state(hidden=48)
    for rank, out in enumerate(outs):
        said = out.strip().splitlines()[-1]
        assert re.search(r"^CheckpointError: \S*step-00000007/rank-00000.pt does not fit the live state: "
                         r"state\['model'\]: 0.bias is \[32\] in the checkpoint, \[48\] in the module; "
                         r"state\['model'\]: 0.weight is \[32, 8\] in the checkpoint, \[48, 8\] in the module", said), said
        assert "Nothing of the checkpoint was loaded" in said and "Traceback" not in said, said
        after = torch.load(tmp_path / f"after.rank{rank}", weights_only=True)
        assert after["optimizer"]["state"] == {}
        assert after["model"].keys() == fresh["model"].state_dict().keys()
        for key, value in fresh["model"].state_dict().items():
            assert torch.equal(after["model"][key], value), (rank, key)


@pytest.mark.parametrize("saved_by", [1, 2], ids=["one-process", "dcp"])
def test_a_scheduler_of_another_kind_is_refused_on_every_rank_before_anything_is_loaded(tmp_path, trained, saved_by):
    """Two ranks whose scheduler is a CosineAnnealingLR where the checkpoints hold a StepLR's
    state: every rank refuses the newest naming the scheduler, falls back to no older one (it
    has the same kind), and keeps the state as built (a one-process checkpoint is read into
    the live tensors, a DCP one streamed into them: neither may reach them)."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, saved_by, 4, 7)
    outs = run_ranks(["load", "--root", str(root), "--cosine", "--out", str(tmp_path / "after")], 2)
    fresh, _ = build_state()
    for rank, out in enumerate(outs):
        said = out.strip().splitlines()[-1]
        assert re.search(r"^CheckpointError: (rank \d: )?\S*step-00000007\S* does not fit the live state: "
                         r"state\['scheduler'\]: the checkpoint's scheduler lacks T_max, eta_min of the live "
                         r"CosineAnnealingLR \(saved by another scheduler\? its settings: gamma, step_size\)", said), said
        after = torch.load(tmp_path / f"after.rank{rank}", weights_only=False)
        assert after["optimizer"]["state"] == {} and after["scheduler"]["last_epoch"] == 0
        for key, value in fresh["model"].state_dict().items():
            assert torch.equal(after["model"][key], value), (rank, key)


def test_an_fsdp_model_that_ran_forward_loads_a_one_process_checkpoint_exactly(tmp_path):
    """An FSDP2 model that ran a forward before the load (a warm-up, a sanity check): FSDP2
    left its root's unsharded parameters registered, and frees them at the next
    ``state_dict``. The load wrote the checkpoint into that freed memory (a segfault on every
    rank); resharded first, it loads on two ranks exactly what one process saved."""
    root, out = tmp_path / "ck", tmp_path / "trained"
    run_ranks(["train", "--root", str(root), "--steps", "4", "--stop-at", "4", "--out", str(out)], 1)
    outs = run_ranks(["load", "--root", str(root), "--fsdp", "--out", str(tmp_path / "after")], 2)
    trained = torch.load(f"{out}.rank0", weights_only=True)
    for rank, said in enumerate(outs):
        assert said.strip().splitlines()[-1] == "loaded 4", said
        after = torch.load(tmp_path / f"after.rank{rank}", weights_only=False)
        assert after["model"].keys() == trained["model"].keys()
        for key, value in trained["model"].items():
            assert torch.equal(after["model"][key], value), (rank, key)


class _Reshaping(torch.nn.Module):
    """A module that takes its weight in any shape of the same size (an older layout)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if key in state_dict:
            state_dict[key] = state_dict[key].reshape(self.weight.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@pytest.mark.parametrize("older", [True, False])
def test_a_module_that_converts_a_saved_shape_itself_still_loads(tmp_path, older):
    """The check for a changed model leaves alone a module with its own ``_load_from_state_dict``
    or a model with a load pre-hook: it may take a saved tensor of another shape, and does.
    ``older``: with an older checkpoint (read straight into the live tensors) or without."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    flat = _Reshaping(32)  # saved as [32], loaded as [4, 8]
    with torch.no_grad():
        flat.weight.copy_(torch.arange(32.0))
    for step in (1, 2) if older else (2,):
        mgr.save(step, {"model": torch.nn.Sequential(flat), "linear": torch.nn.Sequential(flat)})
    live = torch.nn.Sequential(_Reshaping(4, 8))
    linear = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False))  # its "0.weight": [4, 8], saved [32]

    def unflatten(module, state_dict, prefix, *args):
        state_dict[prefix + "0.weight"] = state_dict[prefix + "0.weight"].reshape(4, 8)

    linear._register_load_state_dict_pre_hook(unflatten, with_module=True)
    assert make_mgr(root).load({"model": live, "linear": linear}) == 2
    assert torch.equal(live[0].weight, torch.arange(32.0).reshape(4, 8))
    assert torch.equal(linear[0].weight, torch.arange(32.0).reshape(4, 8))


def test_a_corrupt_newest_read_into_optimizer_state_the_older_one_drops_falls_back(tmp_path):
    """A reload in the middle of a run: the live optimizer has moments for a layer that had no
    gradient yet at the older step. The corrupt newest was read into them, and the older
    optimizer state has none for it: loading it drops them from the optimizer, so nothing
    corrupt is left and the state is exactly the older step's."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    live = {"model": model, "optimizer": opt}

    def train(layers) -> None:
        layers(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train(model[0])  # step 1: the second layer has no moments yet
    mgr.save(1, live)
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    train(model)
    mgr.save(2, live)
    _flip(root / "step-00000002" / "rank-00000.pt", 0.5)
    train(model)  # the run went on
    assert len(opt.state) == 4
    assert make_mgr(root).load(live) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want_model.items())
    got = opt.state_dict()["state"]
    assert got.keys() == want_opt.keys() and len(got) == 2
    assert all(torch.equal(got[i][k], v) for i, st in want_opt.items() for k, v in st.items())


def test_a_lazy_module_not_yet_run_resumes_from_the_newest_checkpoint(tmp_path):
    """A model with a lazy layer, resumed in a fresh process: its parameters have no shape
    before the first forward, so none is a live tensor to read into; the newest checkpoint
    is read into memory of its own (not skipped as unreadable) and the module takes it."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    for step in (1, 2):
        net = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Linear(8, 2))
        net(torch.randn(3, 5))
        with torch.no_grad():
            for t in net.parameters():
                t.fill_(step)
        mgr.save(step, {"model": net})
    net = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Linear(8, 2))
    assert make_mgr(root).load({"model": net}) == 2
    assert net[0].weight.shape == (8, 5) and torch.equal(net[0].weight, torch.full((8, 5), 2.0))


def test_live_tensors_the_reader_cannot_write_into_get_the_saved_values_by_a_copy(tmp_path):
    """A conjugated view (its memory holds the conjugates) and the moments of a channels_last
    weight (another layout than the file's): each is read into memory of its own, checked,
    then copied into the live tensor, which the optimizer keeps (nothing allocated in its place)."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)

    def state(seed: int) -> dict:
        torch.manual_seed(seed)
        conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        opt = torch.optim.Adam(conv.parameters(), lr=0.1)
        conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
        opt.step()
        return {"model": conv, "optimizer": opt, "z": {"c": torch.randn(16, dtype=torch.complex64).conj()}}

    mgr.save(1, state(1))
    saved = state(2)
    mgr.save(2, saved)
    live = state(3)
    moments = [v for st in live["optimizer"].state.values() for v in st.values() if v.dim() == 4]
    assert moments and all(not m.is_contiguous() for m in moments)
    before = [m.data_ptr() for m in moments]
    assert make_mgr(root).load(live) == 2
    assert live["z"]["c"].is_conj() and torch.equal(live["z"]["c"].resolve_conj(), saved["z"]["c"].resolve_conj())
    assert [v.data_ptr() for st in live["optimizer"].state.values() for v in st.values() if v.dim() == 4] == before
    for got, want in zip(live["optimizer"].state.values(), saved["optimizer"].state.values(), strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(live["model"].parameters(), saved["model"].parameters(), strict=True))


@pytest.mark.parametrize("newest", ["valid", "corrupt"])
def test_a_fresh_optimizers_moments_are_read_into_memory_on_their_parameters_device(tmp_path, monkeypatch, newest):
    """A requeued job's optimizer has no state before its first step. Its moments are read
    straight into new memory on each parameter's device, and ``load_state_dict`` keeps that
    memory as it is. On a GPU this replaces a read into host memory followed by a copy; here
    the host stands in for the GPU (``on_gpu`` accepts every parameter). The test covers two
    groups, a parameter that already has state, a bf16 parameter whose float32 moments
    ``load_state_dict`` casts (none are made for it), and a corrupt newest checkpoint, after
    which the optimizer has exactly the older checkpoint's values."""
    from ftkit.checkpoint import manager as _manager
    from ftkit.checkpoint.state import restore as _restore

    def state(seed: int, steps: int = 1) -> dict:
        torch.manual_seed(seed)
        a, b, c = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8), torch.nn.Linear(8, 4).to(torch.bfloat16)
        opt = torch.optim.AdamW([{"params": list(a.parameters())}, {"params": list(b.parameters()), "lr": 0.01},
                                 {"params": list(c.parameters())}], lr=0.1)
        for _ in range(steps):
            c(b(a(torch.randn(4, 64))).to(torch.bfloat16)).float().sum().backward()
            opt.step()
            for q in c.parameters():  # float32 moments for bf16 parameters (saved by another optimizer)
                opt.state[q] = {"step": torch.tensor(1.0), "exp_avg": torch.randn(q.shape),
                                "exp_avg_sq": torch.rand(q.shape)}
        return {"model": torch.nn.ModuleList([a, b, c]), "optimizer": opt}

    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    older = state(1)
    mgr.save(1, older)
    mgr.save(2, state(2))
    want = older if newest == "corrupt" else state(2)
    if newest == "corrupt":
        _flip(root / "step-00000002" / "rank-00000.pt", 0.6)
    live = state(3, steps=0)
    first = next(iter(live["model"][0].parameters()))
    live["optimizer"].state[first] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros_like(first),
                                      "exp_avg_sq": torch.zeros_like(first)}  # state already: read into
    kept = live["optimizer"].state[first]["exp_avg"]
    made: list[weakref.ref] = []
    real = _restore.optimizer_homes
    monkeypatch.setattr(_restore, "optimizer_homes",
                        lambda *a: (lambda out: made.extend(map(weakref.ref, out.values())) or out)(real(*a)))
    monkeypatch.setattr(_manager, "on_gpu", lambda param: True)
    alive_during_older: list[int] = []
    real_try = _manager.Checkpointer._try_load

    def try_load(self, state, path, *a, **k):
        gc.collect()  # what ftkit no longer holds is gone
        if path.name == "step-00000001":
            alive_during_older.append(sum(r() is not None for r in made))
        return real_try(self, state, path, *a, **k)

    monkeypatch.setattr(_manager.Checkpointer, "_try_load", try_load)
    assert make_mgr(root).load(live) == (1 if newest == "corrupt" else 2)
    assert alive_during_older == ([0] if newest == "corrupt" else [])  # a GPU's would double its moments
    got, saved = live["optimizer"].state_dict(), want["optimizer"].state_dict()
    assert got["state"].keys() == saved["state"].keys() and len(got["state"]) == 6
    for pid, entry in saved["state"].items():  # pids 4 and 5: c's, cast to bf16 by load_state_dict
        assert all(torch.equal(got["state"][pid][k], v if pid < 4 or k == "step" else v.to(torch.bfloat16))
                   for k, v in entry.items())
    assert live["optimizer"].state[first]["exp_avg"] is kept
    for q in live["model"][2].parameters():  # cast by load_state_dict to the parameter's dtype
        assert live["optimizer"].state[q]["exp_avg"].dtype == torch.bfloat16
    moments = {id(v) for st in live["optimizer"].state.values() for k, v in st.items() if k != "step"}
    made = [r() for r in made]
    # two moments for each of a's bias and b's weight and bias (not c's, cast; not a's weight, which
    # has state), made for the newest checkpoint: kept where it loaded, none where it was corrupt
    # (the older one, the last, is read into memory of its own, then its moments are cloned)
    assert len(made) == 6
    assert sum(id(t) in moments for t in made) == (0 if newest == "corrupt" else 6)
    assert all(torch.equal(a, b) for a, b in zip(live["model"].parameters(), want["model"].parameters(), strict=True))


def test_new_memory_is_made_only_for_moments_torchs_own_load_state_dict_keeps():
    """``optimizer_homes``: for a fresh Adam, one new tensor per saved moment (not ``step``),
    of its shape and dtype; none for an optimizer whose ``load_state_dict`` is its own (it may
    keep its state elsewhere than its parameters' device), none where the groups do not pair up."""
    from ftkit.checkpoint.state.restore import optimizer_homes

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 6)).sum().backward()
    opt.step()
    saved = opt.state_dict()

    def fresh(cls=torch.optim.Adam, groups=1):
        params = list(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)).parameters())
        return cls([{"params": params[:2]}, {"params": params[2:]}] if groups == 2 else params)

    made = optimizer_homes(fresh(), saved, lambda param: True)
    moments = {id(v): v for st in saved["state"].values() for k, v in st.items() if k != "step"}
    assert made.keys() == moments.keys() and len(made) == 8
    assert all(made[i].shape == v.shape and made[i].dtype == v.dtype and made[i] is not v for i, v in moments.items())

    class KeepsItsOwn(torch.optim.Adam):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)

    assert optimizer_homes(fresh(KeepsItsOwn), saved, lambda param: True) == {}
    assert optimizer_homes(fresh(groups=2), saved, lambda param: True) == {}
    assert optimizer_homes(fresh(), saved, lambda param: param.dim() == 2).keys() == {
        id(saved["state"][i][k]) for i in (0, 2) for k in ("exp_avg", "exp_avg_sq")}


def test_tensors_sharing_a_storage_read_into_memory_of_their_own_keep_every_byte(tmp_path):
    """Views of one storage, one of them inside another but not next to it: the bytes they
    share stay in the read buffer, so the view around them reads them all."""
    whole = torch.arange(1 << 20, dtype=torch.float32)  # far larger than the headers' small reads
    parts = {"a": whole, "b": whole[1000:2000], "c": whole[500_000:501_000]}
    entry = write_state_file(tmp_path, "f.pt", parts)
    got = _single.read_state_into(tmp_path, "f.pt", entry, lambda payload: {})
    assert all(torch.equal(got[k], v) for k, v in parts.items())


def _dcp_reference_and_live(root, hidden: int = 32) -> tuple[dict, dict]:
    """Step 7 of ``root`` as DCP's own reader loads it (an explicit step), and a live state of
    the same shapes whose values all differ from it (nothing of them may survive a load)."""
    from tests.ckpt_helpers import build_state

    reference, _ = build_state(hidden=hidden)
    assert make_mgr(root).load(reference, step=7) == 7  # an explicit step: DCP's own reader
    state, _ = build_state(hidden=hidden)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    return reference, state


def test_a_dcp_checkpoint_is_read_once_per_file_straight_into_the_live_tensors(tmp_path, trained, monkeypatch, caplog):
    """A two-rank DCP checkpoint (with an older one to fall back on), loaded in one process:
    every ``.distcp`` file is read once, with O_DIRECT, checked as it arrives, its tensors
    straight into the live model and optimizer; the state equals DCP's own reader's."""
    from ftkit.checkpoint import dcp_reader as _dcp_reader

    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    distcp = sorted((root / "step-00000007" / "dcp").glob("*.distcp"))
    assert len(distcp) == 2
    reference, state = _dcp_reference_and_live(root)
    reads = _spy_reads(monkeypatch)
    readers = []
    monkeypatch.setattr(_dcp_reader.StreamingReader, "__init__", _recording(_dcp_reader.StreamingReader.__init__,
                                                                             readers))
    before = [p.data_ptr() for p in state["model"].parameters()]
    with caplog.at_level("INFO", logger="ftkit.checkpoint.dcp_reader"):
        assert make_mgr(root).load(state) == 7
    assert "the way DCP does" not in caplog.text
    assert [p.data_ptr() for p in state["model"].parameters()] == before
    assert all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                  reference["model"].state_dict().values(), strict=True))
    for pid, st in state["optimizer"].state_dict()["state"].items():
        want = reference["optimizer"].state_dict()["state"][pid]
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(want[k])) for k, v in st.items())
    assert len(readers) == 1 and sorted(readers[0].files_read) == [p.name for p in distcp]
    for path in distcp:
        ino, size = path.stat().st_ino, path.stat().st_size
        bulk = [r for r in reads.bulk if r[0] == ino and r[2]]
        spans = sorted((off, off + n) for _, off, n, _ in bulk)
        assert spans[0][0] == 0 and spans[-1][1] == size  # every byte once, O_DIRECT
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)) and all(d for *_, d in bulk)
        # before it, the items' headers: a few small reads, not a second pass
        small = sum(n for i, _, n, _ in reads.small if i == ino)
        assert 0 < small <= 64 << 10, small


def test_memory_running_out_in_the_early_read_fails_the_load_and_sets_nothing_aside(tmp_path, trained, monkeypatch):
    """The early read of the newest DCP checkpoint runs out of memory (no fault of its files):
    the load fails naming it, rather than skipping the checkpoint as broken and training on from
    the older one, whose first save would set the newest aside. Memory back, it loads."""
    from ftkit.checkpoint import dcp_reader as _dcp_reader
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    real = _dcp_reader.StreamingReader.prefetch

    def out_of_memory(self):
        raise MemoryError("no room for the staging buffers")

    monkeypatch.setattr(_dcp_reader.StreamingReader, "prefetch", out_of_memory)
    state, _ = build_state()
    mgr = make_mgr(root)
    with pytest.raises(CheckpointError, match=r"step-00000007.*MemoryError: no room for the staging buffers"):
        mgr.load(state)
    monkeypatch.setattr(_dcp_reader.StreamingReader, "prefetch", real)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", "set-aside"))) == [
        "step-00000004", "step-00000007"]
    assert make_mgr(root).load(build_state()[0]) == 7


def test_a_rank_reads_its_own_dcp_file_whole_and_the_values_in_anothers_in_small_direct_reads(tmp_path, monkeypatch):
    """Rank 0's share of a two-rank DCP load (driven in one process): its own ``__0_*.distcp``
    is read whole, and the small values DCP stored once in rank 1's file (an optimizer's
    hyperparameters) are read beside the headers, in small O_DIRECT reads, before the bulk,
    then handed to DCP while the bulk streams, not read through the page cache after it. The
    state is the one DCP's own reader gives, the values included."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ftkit.checkpoint.dcp import load_sharded, sharded_keys
    from ftkit.checkpoint.dcp_reader import StreamingReader
    from ftkit.checkpoint.format.manifest import validate_dir

    root = tmp_path / "ck"
    run_ranks(["train", "--root", str(root), "--steps", "7", "--stop-at", "7"], 2)
    step = root / "step-00000007"
    reference, state = _dcp_reference_and_live(root)
    for group in state["optimizer"].param_groups:
        group["lr"], group["betas"] = 123.0, (0.5, 0.25)
    reads = _spy_reads(monkeypatch)
    reader = StreamingReader(step / "dcp", validate_dir(step).files, rank=0, world_size=2)
    # as where rank 0 needs none of rank 1's tensors (a sharded model's): its DDP model needs
    # all of them, for which rank 1's file would be read whole (the test below)
    monkeypatch.setattr(reader, "_mostly_needed", lambda per_file, mine: [])
    metadata = reader.read_metadata()
    theirs = [info for index, info in metadata.storage_data.items() if info.relative_path.startswith("__1_")
              and isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)]
    assert theirs, "DCP stored no value in rank 1's file: this test shows nothing"
    reader.prefetch()
    try:
        load_sharded(state, sharded_keys(state), step, reader=reader)
    finally:
        reader.close()
    assert reader.files_read == [p.name for p in sorted((step / "dcp").glob("__0_*.distcp"))]
    assert all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                  reference["model"].state_dict().values(), strict=True))
    want = reference["optimizer"].state_dict()
    assert state["optimizer"].state_dict()["param_groups"] == want["param_groups"]
    for pid, st in state["optimizer"].state_dict()["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(want["state"][pid][k])) for k, v in st.items())
    ino = (step / "dcp" / theirs[0].relative_path).stat().st_ino
    small = [r for r in reads.small if r[0] == ino]
    assert small and all(d for *_, d in small) and sum(n for _, _, n, _ in small) <= 64 << 10
    assert not [r for r in reads.bulk if r[0] == ino]  # nothing of it read whole here
    for info in theirs:  # every value of rank 1's file among what those small reads brought
        assert any(off <= info.offset and info.offset + info.length <= off + n for _, off, n, _ in small)


def test_a_ddp_rank_reads_the_other_ranks_dcp_file_whole_too_not_through_dcps_reader(tmp_path, monkeypatch):
    """Rank 0's share of a two-rank DDP load (driven in one process): DCP stored each tensor
    of the model both ranks hold once, about half in each rank's file, and rank 0 needs all of
    them. After its own file it reads rank 1's whole as well, with O_DIRECT, checked as it
    arrives, the tensors straight into the live ones, not item by item through DCP's
    reader (buffered reads and a ``torch.load`` each: 0.58 of the raw read at 0.25 GB). The
    state is DCP's own reader's; with more ranks on the host, rank 1's file is read through the
    page cache instead. A byte flipped in rank 1's file is found by rank 0's read."""
    from torch.distributed.checkpoint import FileSystemReader

    from ftkit.checkpoint.dcp import failure_of
    from ftkit.checkpoint.dcp_reader import CorruptFile, StreamingReader

    root = tmp_path / "ck"  # files of ~120 KB: more than their headers' small reads
    run_ranks(["train", "--root", str(root), "--steps", "7", "--stop-at", "7", "--hidden", "2048"], 2)
    step = root / "step-00000007"
    reference, state = _dcp_reference_and_live(root, hidden=2048)
    reads = _spy_reads(monkeypatch)
    theirs: list[int] = []  # items DCP's own reader was asked for
    real_read_data = FileSystemReader.read_data
    monkeypatch.setattr(FileSystemReader, "read_data",
                        lambda self, plan, planner: theirs.append(len(plan.items)) or real_read_data(self, plan, planner))
    reader = _load_as_rank0_of_two(step, state)
    assert reader.files_read == ["__0_0.distcp", "__1_0.distcp"] and not theirs
    other = step / "dcp" / "__1_0.distcp"
    bulk = [r for r in reads.bulk if r[0] == other.stat().st_ino]
    assert bulk and all(direct for *_, direct in bulk)
    assert sum(n for _, _, n, _ in bulk) + 64 * 1024 >= other.stat().st_size  # all of it, but what the headers' reads brought
    assert_same_values(reference["model"].state_dict(), state["model"].state_dict(), "model")
    assert_same_values(reference["optimizer"].state_dict(), state["optimizer"].state_dict(), "optimizer")
    # more ranks on the host (``shared``): rank 1's file through the page cache, its own not
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    reads.bulk.clear()
    reader = _load_as_rank0_of_two(step, state, shared=True)
    assert reader.files_read == ["__0_0.distcp", "__1_0.distcp"] and not theirs
    own = (step / "dcp" / "__0_0.distcp").stat().st_ino
    assert [r for r in reads.bulk if r[0] == own] and all(d for i, _, _, d in reads.bulk if i == own)
    assert [r for r in reads.bulk if r[0] == other.stat().st_ino]
    assert not any(d for i, _, _, d in reads.bulk if i == other.stat().st_ino)
    assert_same_values(reference["model"].state_dict(), state["model"].state_dict(), "model")
    _flip_dcp_file(root, 7, 1)
    readers: list[StreamingReader] = []
    with pytest.raises(BaseException) as caught:
        _load_as_rank0_of_two(step, state, made=readers)
    failure = failure_of(caught.value)  # DCP's CheckpointException holds the reader's
    assert isinstance(failure, CorruptFile) and "__1_0.distcp" in str(failure), failure
    assert readers[0].files_read == ["__0_0.distcp"]


def _load_as_rank0_of_two(step, state, made: list | None = None, **kwargs):
    """Rank 0's share of a two-rank load of ``step`` into ``state``, in this process: its
    :class:`StreamingReader` (``kwargs``), prefetched, then ``load_sharded``; the reader
    (also appended to ``made``, for a load that raises)."""
    from ftkit.checkpoint.dcp import load_sharded, sharded_keys
    from ftkit.checkpoint.dcp_reader import StreamingReader
    from ftkit.checkpoint.format.manifest import validate_dir

    reader = StreamingReader(step / "dcp", validate_dir(step).files, rank=0, world_size=2, **kwargs)
    if made is not None:
        made.append(reader)
    reader.prefetch()
    try:
        load_sharded(state, sharded_keys(state), step, reader=reader)
    finally:
        reader.close()
    return reader


def _grow_dcp_item(step, name: str, by: int) -> tuple[int, int]:
    """Give one tensor item of ``step``'s DCP file ``name`` a zip comment of ``by`` bytes (the
    item still an archive torch reads; the later items, the metadata and the manifest moved to
    match): the largest item of a storage size that other items share, so that its layout is
    one the reader guesses from another item's. Returns the item's (offset, length) before."""
    import json
    import pickle
    import struct
    from dataclasses import replace

    dcp_dir = step / "dcp"
    metadata = pickle.loads((dcp_dir / ".metadata").read_bytes())
    tensors = {index: info for index, info in metadata.storage_data.items() if info.relative_path == name
               and hasattr(metadata.state_dict_metadata[index.fqn], "chunks")}
    nbytes = {index: next(c for c in metadata.state_dict_metadata[index.fqn].chunks
                          if tuple(c.offsets) == tuple(index.offset)).sizes.numel()
              * metadata.state_dict_metadata[index.fqn].properties.dtype.itemsize for index in tensors}
    kinds = [n % 64 for n in nbytes.values()]
    index = max((i for i in tensors if kinds.count(nbytes[i] % 64) > 1), key=lambda i: tensors[i].length)
    info = tensors[index]
    data = bytearray((dcp_dir / name).read_bytes())
    end = info.offset + info.length
    assert struct.unpack_from("<I", data, end - 22)[0] == 0x06054B50  # its end record, no comment yet
    struct.pack_into("<H", data, end - 2, by)
    data[end:end] = bytes(range(by))
    (dcp_dir / name).write_bytes(data)
    metadata.storage_data = {
        i: replace(s, length=s.length + by) if i == index
        else replace(s, offset=s.offset + by) if s.relative_path == name and s.offset >= end else s
        for i, s in metadata.storage_data.items()}
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    doc = json.loads((step / "manifest.json").read_text())
    for rel in (f"dcp/{name}", "dcp/.metadata"):
        doc["files"][rel].update(_entry(step / rel))
    (step / "manifest.json").write_text(json.dumps(doc))
    return info.offset, info.length


def test_a_dcp_item_not_where_its_layout_was_guessed_is_noticed_and_the_file_read_again(tmp_path, trained, caplog):
    """A DCP load reads one item per storage size first and takes the others' storages to lie
    as theirs do. An item whose archive ends differently (a zip comment: a writer of another
    kind) gets its tensor's bytes from the wrong place: once the file is read, its directory
    says so, and the file is read again, every item's headers first. The state is exactly
    the checkpoint's (as DCP's own reader gives it), not the older one's nor a shifted one."""
    import logging

    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    step = root / "step-00000007"
    name = sorted(p.name for p in (step / "dcp").glob("__0_*.distcp"))[0]
    _grow_dcp_item(step, name, 40)
    reference, state = _dcp_reference_and_live(root)
    with caplog.at_level(logging.INFO, logger="ftkit.checkpoint.dcp_reader"):
        assert make_mgr(root).load(state) == 7
    assert f"{name}: the item at byte" in caplog.text and "reading it again, its items' headers first" in caplog.text
    assert "the way DCP does" not in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                  reference["model"].state_dict().values(), strict=True))
    for pid, st in state["optimizer"].state_dict()["state"].items():
        want = reference["optimizer"].state_dict()["state"][pid]
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(want[k])) for k, v in st.items())


def test_another_ranks_dcp_file_read_whole_is_read_again_where_an_item_is_not_where_guessed(tmp_path, caplog):
    """Rank 0's share of a two-rank DDP load (driven in one process), with an item of rank 1's
    file, which rank 0 reads whole too (it needs all of its tensors), not where its layout was
    guessed: that file is read again, every item's headers first, and the state is exactly
    the checkpoint's."""
    import logging

    root = tmp_path / "ck"
    run_ranks(["train", "--root", str(root), "--steps", "7", "--stop-at", "7", "--hidden", "2048"], 2)
    step = root / "step-00000007"
    _grow_dcp_item(step, "__1_0.distcp", 40)
    reference, state = _dcp_reference_and_live(root, hidden=2048)
    with caplog.at_level(logging.INFO, logger="ftkit.checkpoint.dcp_reader"):
        reader = _load_as_rank0_of_two(step, state)
    assert "__1_0.distcp: the item at byte" in caplog.text and "reading it again" in caplog.text
    assert reader.files_read == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_values(reference["model"].state_dict(), state["model"].state_dict(), "model")
    assert_same_values(reference["optimizer"].state_dict(), state["optimizer"].state_dict(), "optimizer")


def _recording(init, into: list):
    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        into.append(self)
    return record


def test_verify_share_checks_every_file_once_among_the_ranks():
    files = {"rank-00000.pt": {}, "rank-00001.pt": {}, "rank-00002.pt": {}, "dcp/.metadata": {},
             "dcp/__0_0.distcp": {}, "dcp/__1_0.distcp": {}, "dcp/__2_0.distcp": {}, "dcp/__2_1.distcp": {}}
    skip = [n for n in files if n.startswith("rank-")]
    for world in (1, 2, 3, 5):
        shares = [verify_share(files, r, world, skip=skip) for r in range(world)]
        flat = [n for s in shares for n in s]
        assert sorted(flat) == sorted(n for n in files if n not in skip), world  # each once
        if world == 3:
            assert shares[1] == ["dcp/__1_0.distcp"]  # what rank 1 wrote (and will read)
            assert set(shares[2]) == {"dcp/__2_0.distcp", "dcp/__2_1.distcp"}
            assert "dcp/.metadata" in shares[0]


def test_verify_files_reports_the_first_bad_file_by_name(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(os.urandom(5000))
    files = {n: _entry(tmp_path / n) for n in ("a", "b")}
    assert verify_files(tmp_path, files) == ""
    assert verify_files(tmp_path, files, cache=True) == ""
    _flip(tmp_path / "b", 0.3)
    assert verify_files(tmp_path, files).startswith("b: checksum crc32")
    (tmp_path / "a").write_bytes(b"short")
    assert verify_files(tmp_path, files) == f"a: size 5 bytes, manifest says {files['a']['size']}"


def _flip_rank_file(root, step, rank):
    _flip(root / f"step-{step:08d}" / f"rank-{rank:05d}.pt", 0.6)


def _flip_dcp_file(root, step, rank):
    dcp = root / f"step-{step:08d}" / "dcp"
    _flip(sorted(dcp.glob(f"__{rank}_*.distcp"))[0], 0.6)


def _flip_dcp_metadata(root, step, rank):
    _flip(root / f"step-{step:08d}" / "dcp" / ".metadata", 0.6)


def _flip_in_a_dcp_pickle(root, step, values: bool, parses: bool = False) -> None:
    """The first byte of the pickle of a DCP item of ``step``: a value's (an optimizer's
    hyperparameter: parsed before the file's CRC-32 is known, and handed to DCP), else a
    tensor's (its header, parsed to find its bytes). ``parses`` (a value): the last byte of a
    float in it instead, so that the pickle parses and says another number (handed to DCP
    while the file streams, before its CRC-32 says it is corrupt)."""
    import io
    import pickle
    import pickletools
    import zipfile

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dcp = root / f"step-{step:08d}" / "dcp"
    metadata = pickle.loads((dcp / ".metadata").read_bytes())
    items = sorted(((i, s) for i, s in metadata.storage_data.items()
                    if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata) == values),
                   key=lambda entry: (entry[1].relative_path, entry[1].offset), reverse=True)  # rank 1's file first
    for _, info in items:
        path = dcp / info.relative_path
        data = bytearray(path.read_bytes())
        item = data[info.offset : info.offset + info.length]
        record = next(r for r in zipfile.ZipFile(io.BytesIO(bytes(item))).infolist()
                      if r.filename.endswith("data.pkl"))
        h = record.header_offset
        start = h + 30 + int.from_bytes(item[h + 26 : h + 28], "little") + int.from_bytes(item[h + 28 : h + 30], "little")
        if not parses:
            data[info.offset + start] ^= 0x10  # its first opcode: the pickle does not parse
            break
        floats = [pos for op, _, pos in pickletools.genops(bytes(item[start : start + record.compress_size]))
                  if op.name == "BINFLOAT"]
        if floats:
            data[info.offset + start + floats[0] + 8] ^= 0x01  # the lowest bit of its mantissa
            break
    else:
        raise AssertionError(f"no value of {dcp} holds a float")
    path.write_bytes(bytes(data))


def _flip_dcp_value_pickle(root, step, rank):
    _flip_in_a_dcp_pickle(root, step, values=True)


def _flip_dcp_value_float(root, step, rank):
    _flip_in_a_dcp_pickle(root, step, values=True, parses=True)


def _flip_dcp_tensor_pickle(root, step, rank):
    _flip_in_a_dcp_pickle(root, step, values=False)


@pytest.mark.parametrize(
    "worlds,corrupt",
    [((1, 1), _flip_rank_file), ((2, 2), _flip_rank_file), ((2, 2), _flip_dcp_file), ((2, 2), _flip_dcp_metadata),
     ((2, 2), _flip_dcp_value_pickle), ((2, 2), _flip_dcp_value_float), ((2, 2), _flip_dcp_tensor_pickle),
     ((1, 2), _flip_rank_file)],
    ids=["one-rank", "two-ranks-rank1-state-file", "two-ranks-dcp-file", "two-ranks-dcp-metadata",
         "two-ranks-dcp-value-pickle", "two-ranks-dcp-value-that-parses", "two-ranks-dcp-tensor-pickle",
         "one-process-file-on-two-ranks"],
)
def test_resume_past_a_corrupt_newest_is_bit_identical_to_resuming_the_older(tmp_path, trained, worlds, corrupt):
    """A real trainer (dropout, sampler, Adam, StepLR; DDP + DCP with two ranks) checkpoints at
    step 4 and 7; step 7's file is corrupted (rank 1's state file, read by rank 1 alone, or a
    DCP file; or the one state file of one process, which two ranks resume from, each reading
    it straight into its live tensors). Resuming then must give, bit for bit, what resuming
    from step 4 gives."""
    saved_by, world_size = worlds
    root, only_older = tmp_path / "ck", tmp_path / "older"
    trained(only_older, saved_by, 4)
    trained(root, saved_by, 4, 7)
    corrupt(root, 7, saved_by - 1)
    for r, out in ((root, "fallback"), (only_older, "reference")):
        run_ranks(["train", "--root", str(r), "--steps", "10", "--out", str(tmp_path / out)], world_size)
    for rank in range(world_size):
        a = torch.load(tmp_path / f"fallback.rank{rank}", weights_only=True)
        b = torch.load(tmp_path / f"reference.rank{rank}", weights_only=True)
        assert a["step"] == b["step"] == 10 and len(a["losses"]) == 6
        assert a["losses"] == b["losses"]  # dropout RNG, sampler position, lr schedule: all step 4's
        assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
        for pid, st in a["optimizer"]["state"].items():
            assert all(torch.equal(v, b["optimizer"]["state"][pid][k]) for k, v in st.items())


@pytest.mark.parametrize("values", [True, False], ids=["a-value", "a-tensor"])
def test_a_two_rank_checkpoint_with_a_pickle_that_does_not_parse_falls_back_in_one_process(tmp_path, trained, values):
    """A requeue onto one process of a two-rank DCP checkpoint whose item pickle is corrupt: it
    reads every file itself, and the pickle fails to parse before the file's CRC-32 is known.
    The checkpoint is skipped as corrupt and the older one loaded, exactly as DCP reads it
    (not DCP's raw exception out of ``load``)."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    _flip_in_a_dcp_pickle(root, 7, values=values)
    want, _ = build_state()
    assert make_mgr(root).load(want, step=4) == 4
    state, _ = build_state()
    assert make_mgr(root).load(state) == 4
    assert all(torch.equal(v, want["model"].state_dict()[k]) for k, v in state["model"].state_dict().items())
    assert state["optimizer"].state_dict()["param_groups"] == want["optimizer"].state_dict()["param_groups"]


@pytest.mark.parametrize("saved_by", [1, 2], ids=["saved-by-one-process", "saved-by-two-ranks"])
@pytest.mark.parametrize("flag,said", [
    ("--extra-key-on", r"CheckpointError: rank 1: checkpoint .*step-00000007 has no state\['only_here'\] "
                       r"\(a torch.Tensor\); nothing was restored"),
    ("--fail-restore-on", r"CheckpointError: could not restore .*step-00000007 into the state: rank 1: "
                          r"RuntimeError: rank 1: the scheduler refused its state on purpose$"),
], ids=["a-key-only-rank-1-has", "a-restore-failing-on-rank-1"])
def test_what_one_rank_refuses_or_fails_to_restore_fails_the_load_on_every_rank(tmp_path, trained, saved_by, flag, said):
    """Rank 1's state has a key the checkpoints lack (strict), or rank 1's scheduler refuses
    its saved state after the files were read and agreed on: the load fails on every rank,
    naming rank 1 (and the key, or the error). No rank hangs in a collective rank 1 never
    reaches, none reports the checkpoint loaded and trains on alone, rank 1 does not crash
    alone; for a one-process checkpoint (every rank reads the full state) and a DCP one."""
    root = tmp_path / "ck"
    trained(root, saved_by, 4, 7)
    outs = run_ranks(["load", "--root", str(root), flag, "1"], 2, timeout=90)
    said_by = [out.strip().splitlines()[-1] for out in outs]
    for line in said_by:
        assert re.match(said, line), said_by


def test_a_dcp_read_that_fails_on_one_rank_fails_the_load_on_every_rank_naming_it(tmp_path, trained):
    """Each rank reads its part of a DCP checkpoint without DCP's collectives, and the ranks
    agree before anything is set: a rank whose read fails (not a corrupt file, so nothing to
    fall back for) fails every rank's load, the others naming it, instead of one rank hanging
    or training on while another is gone. With nothing failing, the same checkpoint loads."""
    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    outs = run_ranks(["load", "--root", str(root), "--fail-read-on", "1"], 2, timeout=60)
    said = [out.strip().splitlines()[-1] for out in outs]
    for line in said:
        assert line.startswith("CheckpointError: could not load modules and optimizers from "), said
        assert "step-00000007/dcp: rank 1: RuntimeError: rank 1: the read failed on purpose" in line, said
    outs = run_ranks(["load", "--root", str(root)], 2)
    assert [out.strip().splitlines()[-1] for out in outs] == ["loaded 7", "loaded 7"]


def test_a_set_aside_names_the_live_memory_and_empties_a_fresh_optimizer_only_where_room_is(monkeypatch):
    """A one-pass load of the only DCP checkpoint: :class:`SetAside` says which memory is the
    modules' and optimizers' (a view of it too; not an optimizer's moments made after it, nor
    other tensors), ``undo`` runs what the writers registered, latest first, and empties the
    optimizers that had no state. Only where the copies fit in half of the host's available
    memory, for as many ranks as share it; else the load checks first."""
    from ftkit.checkpoint.state import restore as _restore

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    fresh, used = torch.optim.Adam(model.parameters()), _state(1)
    other = torch.zeros(4)
    state = {"model": model, "fresh": fresh, "used": used["model"], "used_opt": used["optimizer"], "n": 3,
             "other": other}
    kept = _restore.SetAside(state)
    model(torch.randn(2, 64)).sum().backward()
    fresh.step()  # as DCP's get_optimizer_state_dict gives a fresh optimizer state before it reads
    moments = [t for s in fresh.state.values() for t in s.values() if t.numel() > 1]
    old = [t for s in used["optimizer"].state.values() for t in s.values()]
    assert kept.guard(model.weight) and kept.guard(model.weight.detach()[3:5]) and all(kept.guard(t) for t in old)
    assert moments and not any(kept.guard(t) for t in moments) and not kept.guard(other)
    done: list[int] = []
    kept.by(lambda: done.append(1))
    kept.by(lambda: done.append(2))
    kept.undo()
    assert done == [2, 1] and not fresh.state and used["optimizer"].state
    nbytes = sum(t.numel() * t.element_size() for v in (model, used["model"], used["optimizer"])
                 for t in _restore.reachable_tensors(v))
    monkeypatch.setattr(_restore, "_available", lambda: 4 * nbytes)
    assert _restore.SetAside.fits(state, 2) and not _restore.SetAside.fits(state, 3)


@pytest.mark.parametrize("way", ["streamed", "another-layout", "another-ranks-file", "another-ranks-file-whole",
                                 "dcp-own-reader"])
def test_a_guarded_dcp_read_puts_back_every_byte_it_wrote_whichever_way_it_wrote(tmp_path, trained, monkeypatch, way):
    """A DCP load with nothing older (:class:`SetAside`): the streaming reader sets aside what
    it writes over in the live modules and optimizers, and ``undo`` puts back every byte of
    it, whichever way the load wrote: streamed straight into the tensors (each piece set
    aside on the placing threads), copied once the file was read (a live tensor of another
    layout), by DCP's own reader (an item of a file another rank reads whole; every item,
    where the streaming read cannot parse a file; or streamed, a file another rank checks that
    this rank needs most of). Run here on a load that succeeds, so every byte was written first."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ftkit.checkpoint import dcp_reader as _dcp_reader
    from ftkit.checkpoint.dcp import live_state_dicts, sharded_keys
    from ftkit.checkpoint.format.manifest import validate_dir
    from ftkit.checkpoint.state.restore import SetAside, reachable_tensors
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, 2, 4)
    step = root / "step-00000004"
    state, loader = build_state()
    x, y = next(iter(loader))
    torch.nn.functional.mse_loss(state["model"](x), y).backward()
    state["optimizer"].step()  # moments of its own, which the load writes over too
    if way == "another-layout":
        weight = state["model"][0].weight
        weight.data = weight.data.t().contiguous().t()  # the same values, transposed in memory
        assert not weight.is_contiguous()
    if way == "dcp-own-reader":
        monkeypatch.setattr(_dcp_reader, "_guess_items", lambda *a, **k: None)

        def unsupported(*args, **kwargs):
            raise _dcp_reader._Unsupported("not parsed, on purpose")

        monkeypatch.setattr(_dcp_reader.StreamingReader, "_item", staticmethod(unsupported))
    live = {k: state[k] for k in ("model", "optimizer")}
    tensors = [t for v in live.values() for t in reachable_tensors(v)]
    before = [t.clone() for t in tensors]
    reader = _dcp_reader.StreamingReader(step / "dcp", validate_dir(step).files, rank=0,
                                         world_size=2 if way.startswith("another-ranks-file") else 1)
    if way == "another-ranks-file":  # as for a few items of it (the DDP model here needs all)
        monkeypatch.setattr(reader, "_mostly_needed", lambda per_file, mine: [])
    kept = SetAside(live)
    reader.guard = kept.guard
    kept.by(reader.undo)
    keys = sharded_keys(live)
    with warnings.catch_warnings():  # one process, as ftkit.checkpoint.dcp.load_sharded loads
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        torch.distributed.checkpoint.load(live_state_dicts(live, keys, StateDictOptions()), storage_reader=reader,
                                          no_dist=True)
    # (DCP's own reader: the files checked first, through the page cache)
    assert reader.files_read == (["__0_0.distcp"] if way == "another-ranks-file" else ["__0_0.distcp", "__1_0.distcp"])
    streamed = [part for part in reader._log._parts if len(part) == 4]  # (read, live, aside, n)
    copied = [part[1].data_ptr() for part in reader._log._parts if len(part) == 3]  # (None, live, copy)
    assert bool(streamed) == (way != "dcp-own-reader")
    if way == "another-layout":
        assert copied == [state["model"][0].weight.data_ptr()]
    else:
        assert bool(copied) == (way in ("another-ranks-file", "dcp-own-reader"))
    assert not any(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))  # the checkpoint's values
    kept.undo()
    reader.close()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "two-ranks"])
@pytest.mark.parametrize("how,case", [("one-pass", "valid"), ("one-pass", "corrupt"), ("check-first", "valid"),
                                      ("check-first", "changed-after-the-check")])
def test_the_only_dcp_checkpoint_loads_in_one_pass_or_checked_first(tmp_path, how, case, ranks):
    """A DCP checkpoint saved by two DDP ranks, with nothing older to fall back on, loaded by two
    ranks or by one process (a requeue onto fewer: it reads both files). Two ranks read both
    files too, their own first: DCP stored each tensor of the model every rank holds once.

    One pass (every rank's modules and optimizers in host memory): each rank copies them aside,
    streams its own file straight into them (``O_DIRECT``, as with an older checkpoint), and a
    corrupt file (rank 1's) makes every rank put them back: a fresh start from the state as
    built, the optimizer without state again (DCP gave it some before it read).
    Checked first (elsewhere: a GPU's state): each rank checks its share of the files through
    the page cache, then streams its own from there (not ``O_DIRECT``, not DCP's own reader),
    its CRC-32 taken again; a file that changes in between is found then, with its bytes in
    the state: every rank's load fails, saying so. Valid: exactly the trained state."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    out = tmp_path / "trained"
    run_ranks(["train", "--root", str(root), "--steps", "4", "--stop-at", "4", "--out", str(out)], 2)
    if case == "corrupt":
        _flip_dcp_file(root, 4, 1)
    extra = ["--check-first"] if how == "check-first" else []
    extra += ["--change-after-check", str(ranks - 1)] if case == "changed-after-the-check" else []
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "loaded"), *extra], ranks, timeout=90)
    lines = [out.strip().splitlines() for out in outs]
    fresh, _ = build_state()
    direct = "False" if how == "check-first" else "None"  # None: O_DIRECT where the filesystem takes it
    for rank, said in enumerate(lines):
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True)
        own = ["__0_0.distcp", "__1_0.distcp"] if ranks == 1 else [f"__{rank}_0.distcp", f"__{1 - rank}_0.distcp"]
        if case == "valid":
            assert said[-2:] == [f"reader direct={direct} read={own}", "loaded 4"], said
            want = torch.load(f"{out}.rank{rank}", weights_only=True)
            assert all(torch.equal(v, want["model"][k]) for k, v in got["model"].items())
            assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
            for pid, st in got["optimizer"]["state"].items():
                assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(want["optimizer"]["state"][pid][k]))
                           for k, v in st.items())
        elif case == "corrupt":
            # rank 0's file, valid, was read into the state; rank 1's found corrupt
            assert said[-2:] == [f"reader direct=None read={['__0_0.distcp'] if rank == 0 else []}",
                                 "loaded None"], said
            assert all(torch.equal(v, fresh["model"].state_dict()[k]) for k, v in got["model"].items())
            assert not got["optimizer"]["state"]
        else:
            assert re.match(r"CheckpointError: .*step-00000004 was found corrupt while it was read into the live "
                            r"state, and no older checkpoint .* could be loaded", said[-1]), said


@pytest.mark.parametrize("saves,case", [
    (1, "valid"), (1, "corrupt"), (1, "misread-on-rank-1"), (1, "restore-fails-on-rank-1"), (2, "valid"),
    (2, "older-hidden-from-rank-1"), (1, "read-fails-on-rank-1"),
], ids=["only-valid", "only-corrupt", "only-misread-on-rank-1", "only-restore-fails-on-rank-1", "older-valid",
        "older-hidden-from-rank-1-no-room", "only-read-fails-on-rank-1"])
def test_a_one_process_checkpoint_loads_on_two_ranks_straight_into_their_live_tensors(tmp_path, saves, case):
    """A requeue onto more ranks: a state file saved by one process, loaded by two DDP ranks,
    each of which holds all of the model and optimizer in plain host tensors. Each rank reads
    the file whole straight into its live tensors, as one process does (through the page
    cache, which the two ranks of one host share: not ``O_DIRECT`` twice from the disk), and
    restores it as one process does (not through DCP's state-dict collectives).

    The job's only checkpoint: each rank sets aside what it writes over. A corrupt file
    (both ranks find it) is a fresh start from the state as built; so is a file that only
    rank 1 finds not as its manifest says, after rank 0 read it in whole and found it
    valid: rank 0 puts back what it had set aside. A restore that fails on rank 1 fails the
    load on both, the modules and optimizers as built; so does a read that fails on rank 1
    not for the file's sake (a RuntimeError: memory, a device), naming it, not a corrupt file
    skipped, nor rank 0 waiting for rank 1 in a collective. With an older checkpoint, the newest
    is read straight in, nothing set aside. Valid: exactly the trained state on both ranks.
    Where only rank 0 sees the older checkpoint and no copy fits (``SetAside.fits`` false),
    the ranks agree on one way for both (the file checked first, then read straight in)
    rather than rank 0 reading straight in and rank 1 waiting in another collective."""
    from tests.ckpt_helpers import build_state

    root, out = tmp_path / "ck", tmp_path / "trained"
    for step in (4, 7)[:saves]:
        run_ranks(["train", "--root", str(root), "--steps", str(step), "--stop-at", str(step), "--out", str(out)], 1)
    newest = (4, 7)[saves - 1]
    if case == "corrupt":
        _flip_rank_file(root, newest, 0)
    extra = {"misread-on-rank-1": ["--misread-on", "1"], "restore-fails-on-rank-1": ["--fail-restore-on", "1"],
             "older-hidden-from-rank-1": ["--hide-older-on", "1", "--check-first"],
             "read-fails-on-rank-1": ["--fail-state-read-on", "1"]}
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "loaded"), *extra.get(case, [])], 2,
                     timeout=90)
    lines = [o.strip().splitlines() for o in outs]
    guarded = saves == 1
    fresh, _ = build_state()
    trained = torch.load(f"{out}.rank0", weights_only=True)
    for rank, said in enumerate(lines):
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True)
        if case == "older-hidden-from-rank-1":  # no copy fits: checked first, then read straight in
            assert "state file into live: direct=False undo=False keep=False" in said, said
        else:
            assert f"state file into live: direct=False undo={guarded} keep={guarded}" in said, said
        if case in ("valid", "older-hidden-from-rank-1"):
            assert said[-1] == f"loaded {newest}", said
            assert all(torch.equal(v, trained["model"][k]) for k, v in got["model"].items())
            assert got["optimizer"]["state"].keys() == trained["optimizer"]["state"].keys()
            for pid, st in got["optimizer"]["state"].items():
                assert all(torch.equal(v, trained["optimizer"]["state"][pid][k]) for k, v in st.items())
            continue
        if case == "restore-fails-on-rank-1":
            assert re.match(r"CheckpointError: could not restore .*step-00000004 into the state: rank 1: "
                            r"RuntimeError: rank 1: the scheduler refused its state on purpose$", said[-1]), said
        elif case == "read-fails-on-rank-1":
            assert re.match(r"CheckpointError: could not read .*step-00000004/rank-00000.pt: rank 1: "
                            r"RuntimeError: rank 1: the read failed on purpose$", said[-1]), said
        else:
            assert said[-1] == "loaded None", said
        assert all(torch.equal(v, fresh["model"].state_dict()[k]) for k, v in got["model"].items())
        assert not got["optimizer"]["state"]


@pytest.mark.parametrize("case", ["valid", "corrupt", "misread-by-the-checker", "misread-by-a-reader",
                                  "misread-by-a-reader-step-asked-for", "restore-fails-on-rank-1",
                                  "valid-one-rank-per-host", "misread-on-another-host"])
def test_a_one_process_checkpoint_with_no_room_for_a_copy_is_checked_first_then_read_straight_in_on_two_ranks(
        tmp_path, case):
    """A requeue onto more ranks whose state has no room for a copy in host memory (a GPU's
    state, or one too large: ``SetAside.fits`` false), nothing older to fall back on. Rank 0
    checks the one-process state file through the page cache; once every rank agreed on it,
    each reads it straight into its live tensors (no set-aside copy; not DCP's full state
    dicts). Valid: exactly the trained state on both. Corrupt, or misread by the rank that
    checks it: a fresh start on both, nothing read into either. Misread only by a rank that
    reads it after the check (a node served other bytes): that rank's state holds some of them,
    so the load fails on both ranks naming the step directory, no fresh start on a mixed state;
    where that step was asked for (``load(state, step=4)``), it says so, not "no checkpoint"
    (``NoCheckpointError``, whose exit code a requeue policy reads as nothing to resume from).
    A restore that fails on rank 1 fails the load on both, naming it. One rank per host (as
    on several nodes): each host's first rank checks the file, through the page cache it then
    reads it from, so a host served other bytes finds them in its check: a fresh start on both,
    nothing read in."""
    from tests.ckpt_helpers import build_state

    root, out = tmp_path / "ck", tmp_path / "trained"
    run_ranks(["train", "--root", str(root), "--steps", "4", "--stop-at", "4", "--out", str(out)], 1)
    if case == "corrupt":
        _flip_rank_file(root, 4, 0)
    extra = {"misread-by-the-checker": ["--misread-on", "0"], "misread-by-a-reader": ["--misread-on", "1"],
             "misread-by-a-reader-step-asked-for": ["--misread-on", "1", "--step", "4"],
             "restore-fails-on-rank-1": ["--fail-restore-on", "1"],
             "valid-one-rank-per-host": ["--one-rank-per-host"],
             "misread-on-another-host": ["--one-rank-per-host", "--misread-on", "1"]}
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "loaded"), "--check-first",
                      *extra.get(case, [])], 2, timeout=90)
    fresh, _ = build_state()
    trained = torch.load(f"{out}.rank0", weights_only=True)
    for rank, said in enumerate(o.strip().splitlines() for o in outs):
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True)
        read_in = "state file into live: direct=False undo=False keep=False" in said
        if case.startswith("valid"):
            assert read_in and said[-1] == "loaded 4", said
            assert all(torch.equal(v, trained["model"][k]) for k, v in got["model"].items())
            for pid, st in got["optimizer"]["state"].items():
                assert all(torch.equal(v, trained["optimizer"]["state"][pid][k]) for k, v in st.items())
        elif case in ("corrupt", "misread-by-the-checker", "misread-on-another-host"):
            assert not read_in and said[-1] == "loaded None", said
            assert all(torch.equal(v, fresh["model"].state_dict()[k]) for k, v in got["model"].items())
            assert not got["optimizer"]["state"]
        elif case == "misread-by-a-reader":
            assert read_in, said
            assert re.match(r"CheckpointError: .*step-00000004 was found corrupt while it was read into the live "
                            r"state, and no older checkpoint", said[-1]), said
        elif case == "misread-by-a-reader-step-asked-for":
            assert read_in, said
            assert re.match(r"CheckpointError: .*step-00000004, the step asked for, was found corrupt while it was "
                            r"read into the live state \(.*rank-00000.pt.*\): this run cannot go on", said[-1]), said
        else:
            assert read_in, said
            assert re.match(r"CheckpointError: could not restore .*step-00000004 into the state: rank 1: "
                            r"RuntimeError: rank 1: the scheduler refused its state on purpose$", said[-1]), said


@pytest.mark.parametrize("saved_by", [2, 1], ids=["dcp", "one-process-state-file"])
def test_ranks_that_see_the_older_checkpoint_differently_take_the_same_way_past_a_corrupt_newest(tmp_path, trained,
                                                                                                 saved_by):
    """Two checkpoints, the newest corrupt (rank 1's DCP file, or the one state file); rank 1
    does not see the older one (a filesystem that shows one node a directory late), and for
    the state file rank 0's state has no room for a copy while rank 1's has. The ranks agree
    on one way for every rank, element by element (has any rank nothing older? how does any
    rank's state lie?), so none reads the newest straight in as if it had an older one to
    fall back on: the corrupt newest is skipped, leaving nothing of it in the state, and
    since rank 1 sees no older checkpoint, the start is fresh on both ranks."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, saved_by, 4, 7)
    (_flip_dcp_file if saved_by == 2 else _flip_rank_file)(root, 7, saved_by - 1)
    extra = ["--no-room-on", "0"] if saved_by == 1 else []
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "loaded"), "--hide-older-on", "1", *extra],
                     2, timeout=90)
    fresh, _ = build_state()
    for rank, out in enumerate(outs):
        said = out.strip().splitlines()
        assert said[-1] == "loaded None", said
        if saved_by == 1:  # the careful read (the file mapped, checked, then restored), on both ranks
            assert not any(line.startswith("state file into live") for line in said), said
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True)
        assert all(torch.equal(v, fresh["model"].state_dict()[k]) for k, v in got["model"].items())
        assert not got["optimizer"]["state"]


def test_crc32_combine_gives_zlibs_crc_of_the_joined_bytes_in_both_implementations():
    """The reader checksums pieces on several threads and joins their CRC-32s in file order:
    zlib-ng's ``crc32_combine`` and the Python one used without zlib-ng give zlib's value for
    the whole, whatever the split (empty parts, odd lengths, a piece's size)."""
    from ftkit.checkpoint.io import files as _files

    rng = random.Random(3)
    data = rng.randbytes(3 * (64 << 10) + 4097)
    for cuts in ([0], [1], [4095, 4096], [64 << 10, 128 << 10], sorted(rng.sample(range(len(data)), 9))):
        bounds = [0, *cuts, len(data)]
        for combine in (_files.crc32_combine, _files._combine):
            crc = 0
            for a, b in itertools.pairwise(bounds):
                crc = combine(crc, zlib.crc32(data[a:b]), b - a)
            assert crc == zlib.crc32(data), (cuts, combine)


def test_a_dcp_load_that_stops_before_the_read_leaves_no_reader_running_and_the_state_untouched(tmp_path, trained):
    """The newest DCP checkpoint's own file starts streaming before DCP has planned the load;
    a load refused after that (a state key the checkpoint lacks) stops that read: no reader
    thread is left running and nothing of the file reached the live state."""
    from tests.ckpt_helpers import build_state

    root = tmp_path / "ck"
    trained(root, 2, 4, 7)
    state, _ = build_state()
    state["not_saved"] = {"value": 1}
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match="not_saved"):
        make_mgr(root).load(state)
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("ftkit-dcp-file", "ftkit-read"))]
    assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())


class _LateCopies:
    """A destination that copies as a GPU's DMA does: later, on another thread, from the staging
    buffer's address; with ``fence``, ``write`` returns what says when the copy ran."""

    def __init__(self, nbytes: int, *, fence: bool) -> None:
        self.memory = bytearray(nbytes)
        self._at = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self._fence = fence
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="late-copy")

    def write(self, at, src, n):
        def copy():
            time.sleep(0.002)  # the copy runs while the reader goes on
            ctypes.memmove(self._at + at, src, n)

        future = self._pool.submit(copy)
        return _FutureFence(future) if self._fence else None

    def close(self):
        self._pool.shutdown(wait=True)


class _FutureFence:
    def __init__(self, future):
        self._future = future

    def wait(self):
        self._future.result()


def test_a_staging_buffer_is_read_into_again_only_after_the_copies_out_of_it_ran(tmp_path, monkeypatch, engine, placers):
    """The GPU path's contract, on a CPU: a destination whose copies run later (from the staging
    buffer, as a host-to-device DMA does) gets the file's exact bytes, because the reader waits
    for each copy's fence before it reads into that buffer again, and for all of them before it
    returns. The control, the same late copies without fences, gets bytes of later pieces: the
    test would catch a reader that reused buffers early."""
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)
    monkeypatch.setattr(_reader, "SUB", 64 << 10)
    monkeypatch.setattr(_reader, "STAGING", 4 * (64 << 10))  # four buffers, each reused many times
    data = random.Random(11).randbytes(48 * (64 << 10) + 777)
    path = tmp_path / "f"
    path.write_bytes(data)
    lo, hi = 1000, len(data) - 500  # one target: nearly the whole file
    results = {}
    for fence in (True, False):
        dest = _LateCopies(hi - lo, fence=fence)

        def plan(mapping, view, fetch, dest=dest):
            return [(lo, hi, dest)]

        try:
            _reader.scatter_file(path, _entry(path), plan)
        finally:
            dest.close()
        results[fence] = bytes(dest.memory)
    assert results[True] == data[lo:hi]
    assert results[False] != data[lo:hi]  # the control: without fences the late copies read reused buffers


@pytest.mark.parametrize("placers", [1, 3], ids=["one-placer", "three-placers"])
def test_scatter_progress_says_how_much_of_the_file_is_in_place_while_it_streams(tmp_path, monkeypatch, placers):
    """A DCP load checks its guessed items while the file still streams, each once its bytes
    are in the read buffer: ``progress(n)`` must only grow, end at the file's size, and every
    time it says ``n`` the buffer holds the file's bytes below ``n`` (those not sent to a target),
    however many threads place the pieces, in whatever order they finish."""
    monkeypatch.setattr(_reader, "CHUNK", 64 << 10)
    monkeypatch.setattr(_reader, "SUB", 64 << 10)
    monkeypatch.setattr(_reader, "STAGING", 8 * (64 << 10))
    data = random.Random(5).randbytes(40 * (64 << 10) + 333)
    path = tmp_path / "f"
    path.write_bytes(data)
    target = bytearray(64 << 10)
    lo, hi = 3 * (64 << 10) + 100, 4 * (64 << 10) + 100  # one range to a target, across two pieces
    held: dict[str, memoryview] = {}
    said: list[int] = []
    wrong: list[int] = []

    def plan(mapping, view, fetch):
        held["view"] = view
        return [(lo, hi, memoryview(target))]

    def progress(n):
        view = held["view"]
        below = [(0, min(n, lo)), (hi, n)] if n > hi else [(0, min(n, lo))]
        if any(bytes(view[a:b]) != data[a:b] for a, b in below if b > a):
            wrong.append(n)
        said.append(n)

    _reader.scatter_file(path, _entry(path), plan, placers=lambda: placers, progress=progress)
    assert not wrong, wrong
    assert said == sorted(said) and len(set(said)) == len(said) and said[-1] == len(data)
    assert bytes(target) == data[lo:hi]


def test_the_zip_directory_read_directly_is_zipfiles_or_is_left_to_it(tmp_path):
    """The directories of the archives a load reads (``torch.save``'s, several back to back as
    in a ``.distcp`` file) are parsed from their last bytes without :mod:`zipfile`, record for
    record what :mod:`zipfile` reads; an archive of another kind (a directory longer than what
    was read, zip64 counts, a damaged end record) is left to :mod:`zipfile` (None)."""
    import io
    import zipfile

    def archive(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    def zipfiles(data: bytes) -> list:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in z.infolist()]

    parts = [archive({"w": torch.randn(300, 7), "n": [1, "x"]}), archive(torch.arange(5)), archive({"e": torch.empty(0)})]
    commented = io.BytesIO()
    with zipfile.ZipFile(commented, "w") as z:
        z.writestr("a", b"x" * 100)
        z.comment = b"a comment after the end record"
    parts.append(commented.getvalue())
    whole = b"".join(parts)
    view = memoryview(bytearray(whole))
    start = 0
    for part in parts:
        assert _archive._directory(view, start, start + len(part), 4 << 10) == zipfiles(part)
        start += len(part)
    first = len(parts[0])
    assert _archive._directory(view, 0, first, 64) is None  # the directory was not all read
    damaged = bytearray(parts[0])
    at = bytes(damaged).rfind(b"PK\x05\x06")
    damaged[at + 8 : at + 10] = b"\xff\xff"  # a zip64 entry count: zipfile's to read
    assert _archive._directory(memoryview(damaged), 0, len(damaged), 4 << 10) is None


def test_an_items_tensor_is_read_from_its_pickle_as_torchs_weights_only_unpickler_reads_it(tmp_path):
    """The tensor of a DCP item's pickle (one ``torch.save``'d tensor) on ``meta``: the fast
    path (the C unpickler with a few globals) gives the dtype, shape, strides, offset and
    storage size torch's ``weights_only`` unpickler gives, for every dtype and layout; a pickle
    it does not read (a conjugate view) goes to torch's unpickler, one that names any other global
    is refused by it, and nothing in a pickle makes a storage of its own."""
    import io
    import pickle
    import zipfile

    def pickled(obj) -> tuple[bytes, list[str]]:
        buf = io.BytesIO()
        torch.save(obj, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            names = z.namelist()
            return z.read(next(n for n in names if n.endswith("data.pkl"))), [
                n.rsplit("/", 1)[1] for n in names if "/data/" in n and not n.endswith(".pkl")]

    base = torch.randn(6, 5)
    cases = [torch.randn(3, 4), torch.randn(2, 3).to(torch.bfloat16), torch.tensor(7), torch.zeros(0, 3),
             torch.ones(4, dtype=torch.bool), torch.randn(3, dtype=torch.complex64), torch.arange(5, dtype=torch.int64),
             base.t(), base[2:, 1:4], base[:, 3], torch.randn(2, 3, 4).permute(2, 0, 1), torch.randn(3).half()]
    for case in cases:
        data, records = pickled(case)
        fast = _unpickle._MetaUnpickler(data)
        got = fast.load()  # the fast path itself reads it, no fallback
        assert fast.keys == records
        tensor, key = _unpickle.meta_tensor(data)
        slow, keys = _unpickle._weights_only(data)
        for t in (got, tensor):
            assert t.device.type == "meta" and key == keys[0]
            assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (
                slow.dtype, slow.shape, slow.stride(), slow.storage_offset()) == (
                case.dtype, case.shape, case.stride(), case.storage_offset())
            assert t.untyped_storage().nbytes() == slow.untyped_storage().nbytes() == case.untyped_storage().nbytes()

    data, _ = pickled(torch.randn(2, dtype=torch.complex64).conj())  # a conjugate bit: tensor metadata
    with pytest.raises(pickle.UnpicklingError, match="not a plain tensor"):
        _unpickle._MetaUnpickler(data).load()
    tensor, _ = _unpickle.meta_tensor(data)  # torch's unpickler reads it
    assert tensor.shape == (2,) and tensor.device.type == "meta" and tensor.is_conj()

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    for evil in (pickle.dumps(Boom(), protocol=2),
                 # a storage class called directly: a storage that is not the pickle's to make
                 b"\x80\x02ctorch\nFloatStorage\nJ\x00\x00\x00\x10\x85R."):
        with pytest.raises((pickle.UnpicklingError, TypeError)):
            _unpickle.meta_tensor(evil)
    assert not (tmp_path / "ran").exists()
    with pytest.raises(_unpickle.NotOneTensor):
        _unpickle.meta_tensor(pickled({"a": torch.ones(1)})[0])


def _alike(a, b) -> bool:
    """Equal values of the same types, tensors with the same dtype, layout and storage offset."""
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
                and a.untyped_storage().nbytes() == b.untyped_storage().nbytes() and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# torch 2.14 warns that it validates a sparse tensor read with weights_only (torch's own load and ours)
@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants:UserWarning")
def test_a_state_file_of_plain_state_is_parsed_by_the_c_unpickler_as_torch_load_reads_it(tmp_path, monkeypatch):
    """A state file's pickle of plain state (containers, numbers, bytes, sets, dtypes, devices,
    sizes, tensors of every layout, a Parameter, views sharing a storage, ~1,500 tensors whose
    zip directory is longer than the end read first) is read by the C unpickler, and gives
    what ``torch.load(weights_only=True)`` gives, type for type; a state it does not read (a
    sparse tensor) is read by torch's unpickler instead, with the same result."""
    import collections
    import zipfile

    base = torch.randn(6, 5)
    plain = {
        "t": torch.randn(3, 4), "bf16": torch.randn(2, 3).to(torch.bfloat16), "scalar": torch.tensor(7),
        "empty": torch.zeros(0, 3), "t_view": base.t(), "slice": base[2:, 1:4], "base": base,
        "bool": torch.ones(4, dtype=torch.bool), "param": torch.nn.Parameter(torch.randn(2, 2)),
        "grad": torch.randn(3).requires_grad_(), "ordered": collections.OrderedDict(a=1, b=[2.5, None]),
        "bytes": b"\x00\xffraw", "set": {1, 2}, "dtype": torch.float16,
        "device": torch.device("cpu"), "size": torch.Size([2, 3]), "tuple": (1, "x", True, None, 2.5),
        "many": [torch.full((3,), float(i)) for i in range(1500)],
    }
    from torch import _weights_only_unpickler

    allowed = _weights_only_unpickler._get_allowed_globals()  # what torch.load(weights_only=True) reads
    assert all(f"{module}.{name}" in allowed for module, name in _unpickle._PLAIN_GLOBALS if not name.endswith("Storage"))
    used = []
    parse_plain = _single._parse_plain

    def spy(*args):
        try:
            out = parse_plain(*args)
        except Exception as exc:
            used.append(type(exc).__name__)
            raise
        used.append("plain")
        return out

    monkeypatch.setattr(_single, "_parse_plain", spy)
    for obj, how in ((plain, "plain"),
                     ({"sparse": torch.eye(3).to_sparse(), "t": torch.arange(4)}, "UnpicklingError")):
        (tmp_path / "s.pt").unlink(missing_ok=True)
        entry = write_state_file(tmp_path, "s.pt", {"format": _single.FILE_FORMAT, "state": obj})
        want = torch.load(tmp_path / "s.pt", weights_only=True)["state"]
        with zipfile.ZipFile(tmp_path / "s.pt") as z:
            assert how != "plain" or len(z.infolist()) > 1500
        for into in (False, True):
            used.clear()
            if into:
                got = _single.read_state_into(tmp_path, "s.pt", entry, lambda payload: {})["state"]
            else:
                got = read_state_file(tmp_path, "s.pt", entry)["state"]
            assert used == [how]
            if how == "plain":
                assert _alike(got, want)
                if not into:  # views of one read buffer, sharing the storage of their record
                    assert got["slice"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
            else:
                assert torch.equal(got["sparse"].to_dense(), torch.eye(3)) and torch.equal(got["t"], torch.arange(4))


class _Rounds:
    """A :class:`ftkit.checkpoint.io.reader.Fetch` over a buffer that already holds the whole
    file: it reads nothing, and records each round of small reads asked for."""

    def __init__(self) -> None:
        self.rounds: list[list[tuple[int, int]]] = []

    def __call__(self, start: int, end: int) -> None:
        self.many([(start, end)])

    def many(self, ranges) -> None:
        self.rounds.append(list(ranges))

    def done(self) -> None:
        pass

    def covered(self, start: int, end: int) -> bool:
        return False


def test_a_state_files_records_are_found_in_one_round_of_small_reads_and_where_a_full_read_finds_them(tmp_path):
    """The data offsets follow from the zip directory (records lie back to back), so a state
    file needs one round of small reads (its end and its start, where the pickle is) before the
    bulk instead of three; they are exactly where the local headers put them, which
    ``check_guess`` confirms from the file's bytes."""
    for direct in (False, True):
        meta = write_state_file(tmp_path, f"s{direct}.pt", {"state": _state(3)["model"].state_dict(),
                                                            "n": [1, "x"], "e": torch.empty(0)}, direct=direct)
        view = memoryview(bytearray((tmp_path / f"s{direct}.pt").read_bytes()))
        fetch = _Rounds()
        records, checks = _archive.archive_records_guessed(view, fetch)
        assert records == _archive.archive_records(view, _archive.Held())
        assert len(fetch.rounds) == 1 and sorted(fetch.rounds[0]) == [(0, _archive.HEAD),
                                                                       (meta["size"] - _archive.TAIL, meta["size"])]
        assert len(checks) == len(records)
        _archive.check_guess(view, checks)
        head, name, _, _ = checks[-1]
        view[head + 26] ^= 1  # the local header's name length: its data would begin elsewhere
        with pytest.raises(_archive.LayoutGuess, match=name.decode()):
            _archive.check_guess(view, checks)


def test_an_archive_written_as_a_stream_is_guessed_with_its_data_descriptors_and_a_compressed_one_is_not(tmp_path):
    """:mod:`zipfile` writing to a stream puts a data descriptor after each record's data, as
    ``torch.save``'s writer does: the guess allows for it and checks it; a compressed record
    is no guess (nor readable in place): the records are read one by one and refused."""
    import io
    import zipfile

    class Stream(io.RawIOBase):  # not seekable: zipfile writes data descriptors
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.data += bytes(b)
            return len(b)

    names = ("archive/data.pkl", "archive/data/0", "archive/version")
    for method in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        out = Stream()
        with zipfile.ZipFile(out, "w", method) as z:
            for name in names:
                with z.open(name, "w") as f:
                    f.write(name.encode() * 50)
        view = memoryview(out.data)
        fetch = _Rounds()
        if method == zipfile.ZIP_DEFLATED:
            with pytest.raises(FileProblem, match="compressed"):
                _archive.archive_records_guessed(view, fetch)
            continue
        records, checks = _archive.archive_records_guessed(view, fetch)
        assert len(fetch.rounds) == 1 and all(d >= 0 for *_, d in checks)  # each with its descriptor
        _archive.check_guess(view, checks)
        assert {n: bytes(view[a : a + s]) for n, (a, s) in records.items()} == {n: n.encode() * 50 for n in names}
        view[checks[1][3]] ^= 1  # the second record's descriptor signature
        with pytest.raises(_archive.LayoutGuess, match="descriptor"):
            _archive.check_guess(view, checks)


def _spread(path, gap: int, after: str) -> None:
    """Rewrite the zip archive at ``path`` with ``gap`` junk bytes after the data (and data
    descriptor) of its record ``after`` (the archive still valid: the later records' and the
    directory's offsets moved), and its checkpoint's manifest entry to match."""
    import json
    import struct
    import zipfile

    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        infos = sorted(z.infolist(), key=lambda i: i.header_offset)
    k = next(k for k, i in enumerate(infos) if i.filename.endswith("/" + after))
    cut = infos[k + 1].header_offset
    out = bytearray(data[:cut] + bytes([0xA5]) * gap + data[cut:])
    eocd = bytes(out).rfind(b"PK\x05\x06")
    count, _, cd_offset = struct.unpack_from("<HII", out, eocd + 10)
    struct.pack_into("<I", out, eocd + 16, cd_offset + gap)
    pos = cd_offset + gap
    for _ in range(count):
        n, e, c = struct.unpack_from("<HHH", out, pos + 28)
        offset = struct.unpack_from("<I", out, pos + 42)[0]
        if offset >= cut:
            struct.pack_into("<I", out, pos + 42, offset + gap)
        pos += 46 + n + e + c
    path.write_bytes(out)
    manifest = path.parent / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"][path.name].update(size=len(out), crc32=f"{zlib.crc32(bytes(out)):08x}")
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("after", ["data.pkl", "data/1"], ids=["after-the-pickle", "after-a-tensor"])
def test_a_state_file_whose_records_do_not_lie_back_to_back_still_loads_exactly(tmp_path, caplog, after):
    """A state file with bytes between two records (a zip writer of another kind) defeats the
    guess from the directory: the read into the live tensors notices (the pickle does not
    parse, or, after a tensor, the local headers do not match once the file is read and that
    tensor's bytes came from the wrong place), reads the file again the careful way, and the
    state is exactly the checkpoint's, not the older one's."""
    import logging

    root = tmp_path / "ck"
    want = _two_checkpoints(root)
    path = root / "step-00000003" / "rank-00000.pt"
    _spread(path, 4096, after)  # a whole block: every record stays aligned for the in-place parse
    assert torch.load(path, weights_only=True)["format"] == "ftkit-state"  # still an archive torch reads
    live = _state(9)
    with caplog.at_level(logging.INFO, logger="ftkit.checkpoint.io.statefile"):
        assert make_mgr(root).load(live) == 3
    assert _same(_snapshot(live), want)
    assert "reading it again" in caplog.text



def _model(change: str = "") -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
    model = torch.nn.Sequential(*(layers[:1] if change == "layer removed" else layers))
    if change == "buffer added":
        model.register_buffer("ema_count", torch.zeros(1))
    if change == "param group added":
        opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}])
    elif change == "optimizer changed":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters())
    return model, opt


@pytest.mark.parametrize("older", [True, False])
@pytest.mark.parametrize("change", ["buffer added", "layer removed", "param group added", "optimizer changed"])
def test_a_model_or_optimizer_whose_keys_changed_is_refused_before_anything_is_loaded(tmp_path, change, older):
    """A layer or buffer added or removed, a param group added, SGD where Adam was saved (torch
    loads Adam's groups into it, and its next step raises ``KeyError: 'momentum'``): refused naming the file and
    what differs, the state as it was built (``load_state_dict`` raised torch's bare error,
    naming no checkpoint, after copying every tensor that fit; the plain values and the
    optimizer's were restored or cleared by then). ``older``: with an older checkpoint (read
    straight into the live tensors) or without."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    torch.manual_seed(0)
    model, opt = _model()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    for step in (1, 2) if older else (2,):
        mgr.save(step, {"model": model, "optimizer": opt, "epoch": 7})
    torch.manual_seed(1)
    model, opt = _model(change)
    built = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model, "optimizer": opt, "epoch": 0}
    said = {"buffer added": r"state\['model'\]: ema_count is not in the checkpoint",
            "layer removed": r"state\['model'\]: 1.bias is in the checkpoint, not in the module",
            "param group added": r"state\['optimizer'\]: the checkpoint's optimizer has param groups of \[4\] "
                                 r"parameters, the live one \[2, 2\]",
            "optimizer changed": r"state\['optimizer'\]: param group 0 of the checkpoint lacks dampening, momentum "
                                 r"of the live SGD \(saved by another optimizer\? its settings: amsgrad, betas"}[change]
    with pytest.raises(CheckpointError, match=rf"step-00000002/rank-00000.pt does not fit the live state: {said}") as caught:
        make_mgr(root).load(state)
    what = {"buffer added": "model", "layer removed": "model and optimizer"}.get(change, "optimizer")
    assert f"The {what} changed since this checkpoint was saved" in str(caught.value)
    assert state["epoch"] == 0 and opt.state_dict()["state"] == {}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in built.items())


@pytest.mark.parametrize("older", [True, False])
def test_a_scheduler_of_another_kind_is_refused_before_anything_is_loaded(tmp_path, older):
    """``StepLR`` where ``CosineAnnealingLR`` was saved: torch's ``load_state_dict`` takes
    Cosine's state into the StepLR without a word, and it goes on with Cosine's learning rate
    (0 at the end of its cycle) for good. Refused naming the file, the scheduler and both kinds'
    settings, the state as it was built; the scheduler it was saved with loads."""
    root = tmp_path / "ck"
    mgr = make_mgr(root, keep_last=None)
    torch.manual_seed(0)
    model, opt = _model()
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    for step in (1, 2) if older else (2,):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        cosine.step()
        mgr.save(step, {"model": model, "optimizer": opt, "scheduler": cosine})
    torch.manual_seed(1)
    model, opt = _model()
    built = {k: v.clone() for k, v in model.state_dict().items()}
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    state = {"model": model, "optimizer": opt, "scheduler": step_lr}
    with pytest.raises(CheckpointError, match=r"step-00000002\S* does not fit the live state: state\['scheduler'\]: the "
                                              r"checkpoint's scheduler lacks step_size, gamma of the live StepLR \(saved "
                                              r"by another scheduler\? its settings: T_max, eta_min\)\. The scheduler "
                                              r"changed since this checkpoint was saved") as caught:
        make_mgr(root).load(state)
    assert "Nothing of the checkpoint was loaded" in str(caught.value)
    assert opt.state_dict()["state"] == {} and step_lr.last_epoch == 0 and "T_max" not in vars(step_lr)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in built.items())
    again = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    assert make_mgr(root).load({"model": model, "optimizer": opt, "scheduler": again}) == 2
    assert again.state_dict() == cosine.state_dict()


def test_a_changed_model_inside_a_wrapper_is_refused_naming_only_what_changed(tmp_path):
    """Saved without a wrapper, resumed inside one (``DataParallel`` here, DDP on more ranks)
    with a layer added: the message names the added layer as the model names it, not every
    key behind ``module.`` (the pairing of the saved keys with the live ones was given up
    whole once one key did not pair, and each of them was listed as added and as removed)."""
    root = tmp_path / "ck"
    torch.manual_seed(0)
    model, _ = _model()
    make_mgr(root).save(1, {"model": model})
    grown = torch.nn.DataParallel(torch.nn.Sequential(*_model()[0], torch.nn.Linear(4, 4)))
    with pytest.raises(CheckpointError) as raised:
        make_mgr(root).load({"model": grown})
    said = str(raised.value)
    assert ("does not fit the live state: state['model']: 2.bias is not in the checkpoint (added since?); "
            "state['model']: 2.weight is not in the checkpoint (added since?). The model changed") in said, said
    assert "module." not in said and "0.weight" not in said, said


def test_an_optimizer_saved_by_an_older_torch_lacking_settings_added_since_loads(tmp_path):
    """The settings a torch release added to an optimizer (``fused``, ``decoupled_weight_decay``
    in Adam's groups) are absent from a checkpoint an older one saved; the class fills them in
    when it loads, so they are not a changed optimizer: the load goes through, exactly."""
    from ftkit.checkpoint.state.restore import key_mismatches

    torch.manual_seed(0)
    model, opt = _model()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    older = {"state": saved["state"], "param_groups": [
        {k: v for k, v in g.items() if k not in ("fused", "decoupled_weight_decay", "capturable")}
        for g in saved["param_groups"]]}
    live_model, live = _model()
    assert key_mismatches({"optimizer": live}, {"optimizer": older}) == []
    assert key_mismatches({"optimizer": torch.optim.SGD(live_model.parameters(), lr=0.1, momentum=0.9)},
                          {"optimizer": older})
    live.load_state_dict(older)  # what the load does after the check
    live_model(torch.randn(2, 8)).sum().backward()
    live.step()


def test_an_optimizer_with_a_scheduler_or_named_parameters_since_loads(tmp_path):
    """Group keys that are not the optimizer's settings are no sign of another optimizer: a
    scheduler made since adds ``initial_lr``, an optimizer built from ``named_parameters()``
    has ``param_names``; torch loads without them, and so does ftkit."""
    root = tmp_path / "ck"
    torch.manual_seed(0)
    model, opt = _model()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    make_mgr(root).save(1, {"model": model, "optimizer": opt})
    model, _ = _model()
    opt = torch.optim.Adam(model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    assert {"initial_lr", "param_names"} <= set(opt.param_groups[0])
    assert make_mgr(root).load({"model": model, "optimizer": opt}) == 1
    assert opt.state_dict()["state"] and scheduler.last_epoch == 0
