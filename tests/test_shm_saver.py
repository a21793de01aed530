"""crash_safe: a saver process persists the trainer's shared-memory snapshot after a real kill -9.

``python3 tests/test_shm_saver.py MODE ROOT MB`` is the trainer: it snapshots a state of about
MB megabytes (tensors filled with the step number), prints one JSON line and waits to be killed.
MODE ``save``: ``save(3)`` returned (the saver is still writing it); ``failed``: the saver's
persist of ``save(3)`` failed (a full disk); ``memory``: only memory
snapshots (steps 1..3), never asked to persist; ``midcopy``: a complete snapshot of step 1, then
the trainer SIGKILLs itself half-way through copying step 2 (into the second slot's first
segment, after the walk); ``midwalk``: complete snapshots of steps 1 and 2, then the trainer
SIGKILLs itself in the copy of step 3's first tensor, started during the walk into the slot that
held step 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


def _alive(pid: int) -> bool:
    from ftkit._proc import proc_start

    return proc_start(pid) is not None


def _savers_of(trainer_pid: int) -> list[int]:
    from ftkit.checkpoint.crashsafe.args import SAVER_MODULE

    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if SAVER_MODULE.encode() in cmd and str(trainer_pid).encode() in cmd and _alive(int(entry)):
            out.append(int(entry))
    return out


def _segments_of(trainer_pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"ftkit-snap-{trainer_pid}-*"))


def _wait_gone(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"saver {pid} still running after {timeout}s"
        time.sleep(0.05)


def _crash(tmp_path, mode: str, mb: int) -> tuple[dict, bool]:
    from ftkit.checkpoint import validate_dir
    from tests.ckpt_helpers import env

    root = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, __file__, mode, str(root), str(mb)], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "trainer exited before reporting"
        info = json.loads(line)
        if mode != "midcopy":
            valid_at_kill = validate_dir(root / f"step-{info['step']:08d}").valid
            os.kill(proc.pid, signal.SIGKILL)
        else:
            valid_at_kill = False
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    _wait_gone(info["saver"])
    assert _savers_of(proc.pid) == [] and _segments_of(proc.pid) == []
    return info, valid_at_kill


def _check_restored(root: Path, step: int, mb: int) -> None:
    import torch

    from ftkit.checkpoint import validate_dir
    from tests.ckpt_helpers import make_mgr

    info = validate_dir(root / f"step-{step:08d}", checksums=True)
    assert info.valid, info.reason
    n = mb * (1 << 20) // 8
    state = {"a": torch.zeros(n), "b": torch.zeros(n), "extra": {}}
    assert make_mgr(root).load(state) == step
    assert torch.equal(state["a"], torch.full((n,), float(step)))
    assert torch.equal(state["b"], torch.full((n,), float(step)))
    assert state["extra"]["step"] == step


def test_kill9_right_after_save_still_commits_the_snapshot(tmp_path):
    info, valid_at_kill = _crash(tmp_path, "save", 400)
    assert not valid_at_kill, "the persist finished before the kill; make the state bigger"
    _check_restored(tmp_path / "ck", info["step"], 400)


def test_kill9_with_memory_snapshots_only_persists_the_newest(tmp_path):
    info, _ = _crash(tmp_path, "memory", 16)
    assert [p.name for p in (tmp_path / "ck").glob("step-*")] == [f"step-{info['step']:08d}"]
    _check_restored(tmp_path / "ck", info["step"], 16)


@pytest.mark.parametrize("mode,complete", [("midcopy", 1), ("midwalk", 2)])
def test_kill9_mid_copy_persists_the_previous_complete_snapshot(tmp_path, mode, complete):
    info, _ = _crash(tmp_path, mode, 64)
    assert info["step"] == complete
    assert [p.name for p in (tmp_path / "ck").glob("step-*")] == [f"step-{complete:08d}"]
    _check_restored(tmp_path / "ck", complete, 64)  # never the half-copied next step


def test_a_snapshot_whose_persist_failed_is_persisted_when_the_trainer_dies(tmp_path):
    """The saver's write of step 3 fails (the checkpoint root's 8 MiB tmpfs is full); space is
    freed, then the trainer is killed: the saver's rescue writes step 3 from shared memory (it
    said the snapshot "is being persisted already" and wrote nothing)."""
    mnt = tmp_path / "ck"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        from tests.ckpt_helpers import env
        from tests.conftest import fill_up

        fill_up(mnt / "filler")

        proc = subprocess.Popen([sys.executable, __file__, "failed", str(mnt), "1"], env=env(), cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        try:
            info = json.loads(proc.stdout.readline())
            (mnt / "filler").unlink()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        _wait_gone(info["saver"])
        _check_restored(mnt, 3, 1)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_clean_close_stops_the_saver_and_unlinks(tmp_path):
    import torch

    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from tests.ckpt_helpers import make_mgr

    cfg = make_mgr(tmp_path).config
    mgr = AsyncCheckpointer(cfg, async_config=AsyncConfig(memory_every=1, crash_safe=True))
    saver = mgr._backend.proc.pid
    mgr.on_step(1, {"w": torch.ones(1000)})  # memory only: a clean close does not persist it
    assert len(_segments_of(os.getpid())) == 1
    mgr.close()
    assert not _alive(saver) and _segments_of(os.getpid()) == []
    assert list(tmp_path.glob("step-*")) == []


def test_saver_reads_requests_in_a_batch_thread_and_writes_in_normal_ones(tmp_path):
    """The saver's main thread, woken by a persist request, never preempts the trainer
    (SCHED_BATCH); its workers and writer threads, woken by their I/O, are normal threads."""
    import torch

    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from tests.ckpt_helpers import make_mgr

    mgr = AsyncCheckpointer(make_mgr(tmp_path).config, async_config=AsyncConfig(crash_safe=True))
    try:
        mgr.save(1, {"w": torch.ones(1 << 20)})  # the saver's worker (and writer) threads exist
        mgr.wait()
        saver = mgr._backend.proc.pid
        threads = [int(t) for t in os.listdir(f"/proc/{saver}/task") if int(t) != saver]
        assert threads  # the rank's worker, at least
        assert os.sched_getscheduler(saver) == os.SCHED_BATCH
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_OTHER}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the trainer is left as it was
    finally:
        mgr.close()


def test_a_saver_killed_while_the_trainer_lives_is_said_and_its_saves_go_on_from_the_trainer(tmp_path, caplog):
    """The saver process is killed with kill -9 between saves (the OOM killer's choice): the next
    saves are not lost to it. They are persisted from a thread of the trainer, durable and valid,
    with an error logged and a ``saver-lost`` event; the shared-memory segments are gone."""
    import logging

    import torch

    from ftkit.checkpoint import validate_dir
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from ftkit.events import EventLog, read_events
    from tests.ckpt_helpers import make_mgr

    events = EventLog(tmp_path / "events.jsonl")
    mgr = AsyncCheckpointer(make_mgr(tmp_path / "ck").config, async_config=AsyncConfig(crash_safe=True),
                            events=events)
    try:
        mgr.save(1, {"w": torch.ones(10)})
        mgr.wait()
        saver = mgr._backend.saver_pid
        os.kill(saver, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not mgr._backend._lost:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with caplog.at_level(logging.ERROR, logger="ftkit"):
            for step in (2, 3):
                mgr.save(step, {"w": torch.full((10,), float(step))})
                mgr.wait()
        assert all(validate_dir(tmp_path / "ck" / f"step-{s:08d}").valid for s in (1, 2, 3))
        assert _segments_of(os.getpid()) == []  # the saver's segments went with it
        lost = [e for e in read_events(events.path) if e["event"] == "saver-lost"]
        assert len(lost) == 1 and lost[0]["saver_pid"] == saver and "exit code -9" in lost[0]["error"]
        said = [r.getMessage() for r in caplog.records if "crash-safe saves are off" in r.getMessage()]
        assert len(said) == 1 and "persisted from a thread of the trainer" in said[0]
    finally:
        mgr.close()
    assert _segments_of(os.getpid()) == []


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_whose_saver_was_killed_trains_on_and_saves_every_checkpoint(tmp_path, ranks):
    """A crash-safe run (one process, or two torchrun ranks sharing the node's saver) whose saver
    is killed with kill -9 at step 12: training goes on to step 30 and every periodic checkpoint
    after the kill is written (20, 25, 30: valid, with step 30's model exactly the trained
    one), each rank says it lost its saver once, and nothing is left in /dev/shm."""
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager, validate_dir
    from ftkit.events import read_events
    from tests.ckpt_helpers import env, free_port

    program = str(REPO / "tests" / "programs" / "saver_lost.py")
    job = tmp_path / "job"
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "0",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    run = subprocess.run([*launcher, program, str(job)], env=env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "killed saver" in run.stdout
    root = job / "checkpoints"
    assert all(validate_dir(root / f"step-{s:08d}").valid for s in (20, 25, 30)), sorted(p.name for p in root.iterdir())
    events = list(read_events(job / "events.jsonl"))
    assert sorted(e["rank"] for e in events if e["event"] == "saver-lost") == list(range(ranks))
    leader = next(e["pid"] for e in events if e["event"] == "start" and e["rank"] == 0)
    assert _segments_of(leader) == [] and not list(SHM.glob(f"ftkit-saver-{leader}-*"))
    model = torch.nn.Linear(32, 32)
    make_manager(CheckpointConfig(root=root)).load({"model": model, "optimizer": torch.optim.Adam(
        model.parameters(), lr=1e-2)})
    final = torch.load(job / "final.pt", weights_only=True)
    assert final["step"] == 30 and all(torch.equal(v, model.state_dict()[k]) for k, v in final["model"].items())


def test_ftkit_requeue_waits_for_the_saver_rescuing_a_dead_trainer(tmp_path):
    from ftkit.checkpoint import validate_dir
    from ftkit.events import read_events
    from tests.ckpt_helpers import env

    jobdir = tmp_path / "job"
    root = jobdir / "checkpoints"
    proc = subprocess.Popen([sys.executable, __file__, "save", str(root), "400"], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    step = root / f"step-{info['step']:08d}"
    rescued_before = validate_dir(step).valid
    clean = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "ftkit", "requeue", str(jobdir), "--exit-code", "137", "--dry-run"],
                         env=clean, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 137), out.stderr
    assert not rescued_before, "the rescue finished before ftkit requeue ran; make the state bigger"
    assert validate_dir(step, checksums=True).valid  # durable by the time requeue decided
    assert not _alive(info["saver"]) and _segments_of(proc.pid) == []
    waited = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "savers-waited"]
    assert [e["pids"] for e in waited] == [[info["saver"]]] and waited[0]["still_running"] == [], waited
    assert f"after progress to step {info['step']}" in out.stdout, out.stdout  # the rescue counted


def test_saver_ignores_a_malformed_command_and_keeps_serving(tmp_path, caplog):
    from ftkit.checkpoint.crashsafe.saver import Channel, Saver

    r, w = os.pipe()
    answers: list[bytes] = []
    leader = Channel(fd=r, write=answers.append, rank=0, pid=os.getpid())
    saver = Saver({}, ranks=[0], leader=leader, root=tmp_path)
    os.write(w, b'not json\n{"op": "segment"}\n{"op": "close"}\n')
    try:
        assert saver.run() == 0
    finally:
        os.close(r)
        os.close(w)
    assert leader.state == "closed" and answers == [b'{"op": "closed"}\n']
    assert sum("malformed command" in m for m in caplog.messages) == 2


def test_segment_lock_a_read_waits_for_a_live_writer_and_a_write_for_a_read(tmp_path):
    import threading

    import torch

    from ftkit.checkpoint.background.buffers import layout_of
    from ftkit.checkpoint.crashsafe.shm import Segment, read_slot

    src = torch.arange(1000.0)
    seg = Segment(tmp_path, "t", 0, 1, layout_of([("w", src)]), 0)
    try:
        seg.begin()
        seg.buffers[0].copy_(src)
        seg.commit(1, 7, {"w": None}, src.numel() * 4)  # COMPLETE, but the write lock is still held
        got: list = []
        reader = threading.Thread(target=lambda: got.append(read_slot(seg.path, seq=1, writer_alive=lambda: True)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive(), "read_slot did not wait for the live writer's lock"
        seg.end()
        reader.join(10)
        view = got[0]
        assert view is not None and view.step == 7 and torch.equal(view.tensors[0], src)
        writer = threading.Thread(target=seg.begin)  # refilling the slot waits for the read
        writer.start()
        writer.join(0.3)
        assert writer.is_alive(), "begin() did not wait for the saver's read lock"
        view.close()
        writer.join(10)
        assert not writer.is_alive()
        # the writer is "dead" mid-write (lock held, state WRITING): skipped at once, never read torn
        began = time.monotonic()
        assert read_slot(seg.path, seq=1, writer_alive=lambda: False) is None
        assert time.monotonic() - began < 1
        seg.end()
    finally:
        seg.close()


def trainer(mode: str, root: str, mb: int) -> None:
    import torch

    from ftkit.checkpoint import CheckpointConfig
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig

    n = mb * (1 << 20) // 8
    state = {"a": torch.zeros(n), "b": torch.zeros(n), "extra": {"step": 0}}
    mgr = AsyncCheckpointer(CheckpointConfig(root=root), async_config=AsyncConfig(memory_every=1, crash_safe=True))

    def at(step: int) -> None:
        state["a"].fill_(step)
        state["b"].fill_(step)
        state["extra"]["step"] = step

    def report(step: int) -> None:
        print(json.dumps({"step": step, "saver": mgr._backend.proc.pid}), flush=True)

    if mode == "save":
        at(3)
        mgr.save(3, state)
        report(3)
    elif mode == "failed":  # the saver's persist of step 3 fails (the root's filesystem is full)
        from ftkit.errors import CheckpointError

        at(3)
        mgr.save(3, state)
        with contextlib.suppress(CheckpointError):
            mgr.wait()
        report(3)
    elif mode == "memory":
        for step in (1, 2, 3):
            at(step)
            mgr.on_step(step, state)
        report(3)
    else:  # midcopy, midwalk
        last = 1 if mode == "midcopy" else 2
        for step in range(1, last + 1):
            at(step)
            mgr.on_step(step, state)
        report(last)
        copier = mgr._backend._copier
        real = copier.batch

        def batch_that_dies_after_one_tensor():
            batch = real()
            add = batch.add

            def add_then_die(dst, src):
                add(dst, src)
                os.kill(os.getpid(), signal.SIGKILL)

            batch.add = add_then_die
            return batch

        copier.batch = batch_that_dies_after_one_tensor
        at(last + 1)
        mgr.on_step(last + 1, state)
    time.sleep(120)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    trainer(sys.argv[1], sys.argv[2], int(sys.argv[3]))


def test_a_full_shm_dir_says_how_much_is_free_and_how_much_is_kept_there(tmp_path):
    """A 6 MiB tmpfs as ``shm_dir`` and a 4 MiB state: the second snapshot slot does not fit.
    The error names the directory, what is free there, and that max_in_flight + 1 snapshots
    are kept (the user saw room for one and did not know a second was wanted); no checkpoint
    of it is left claiming to be valid."""
    import torch

    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from ftkit.errors import CheckpointError
    from tests.ckpt_helpers import make_mgr

    shm = tmp_path / "shm"
    shm.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(shm)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr.decode().strip()}")
    try:
        mgr = AsyncCheckpointer(make_mgr(tmp_path / "ck").config,
                                async_config=AsyncConfig(crash_safe=True, memory_every=1, shm_dir=str(shm)))
        try:
            state = {"w": torch.ones(1 << 20)}  # 4 MiB
            with pytest.raises(CheckpointError) as caught:
                for step in range(1, 4):
                    mgr.on_step(step, state)
                mgr.save(4, state)
                mgr.wait()
            said = str(caught.value)
            assert f"shared memory in {shm}" in said and "bytes free there now" in said, said
            assert "max_in_flight + 1 snapshots of this size" in said, said
        finally:
            with contextlib.suppress(CheckpointError):
                mgr.close()
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


# ---------------------------------------------------------------------------------------------
# Leftovers of runs whose trainer and saver were both killed: removed at the next saver's start
# (crashsafe.find.sweep_leftovers), never while something still uses them.

_SWEEP_TRAINER = """
import json, logging, os, sys, time
from pathlib import Path
import torch
import ftkit

jobdir, shm, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
config = ftkit.Config(save_every=5, async_save=ftkit.AsyncConfig(crash_safe=True, shm_dir=shm))
with ftkit.FaultTolerance(jobdir, state={"model": model, "optimizer": opt}, config=config) as ft:
    for step in ft.range(10):
        loss = model(torch.randn(4, 512)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mode == "hang" and step + 1 == 7:
            ft.checkpoints.wait()
            print(json.dumps({"pid": os.getpid(), "saver": ft.checkpoints._backend.saver_pid}), flush=True)
            time.sleep(300)
sys.exit(0 if ft.completed else 1)
"""

_HOLDERS = {
    # mapped with no fd left (Python's mmap keeps a dup of the fd open): only /proc/PID/maps shows it
    "map": "import ctypes, os, sys, time\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.mmap.restype = ctypes.c_void_p\n"
           "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
           "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
           "assert libc.mmap(None, 4096, 1, 1, fd, 0) != ctypes.c_void_p(-1).value  # PROT_READ, MAP_SHARED\n"
           "os.close(fd)\n"
           "print('ready', flush=True)\n"
           "time.sleep(120)\n",
    "fd": "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(120)",
    "listen": "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
              "print('ready', flush=True); time.sleep(120)",
    "nothing": "import time; print('ready', flush=True); time.sleep(120)",
}


@pytest.fixture
def shm_dir():
    """A directory of its own on /dev/shm (a tmpfs): other runs' files on the machine stay out of it."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="ftkit-test-sweep-", dir=SHM))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def holders():
    """Start helper processes that hold a file (``_HOLDERS``); all killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(how: str, path: Path | None = None) -> int:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDERS[how], str(path)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not os.path.exists(f"/proc/{proc.pid}")
    return proc.pid


def _fake_segment(directory: Path, leader: int, rank: int = 0, mb: int = 1) -> Path:
    path = directory / f"ftkit-snap-{leader}-cafe0123-r{rank}-s0-g1"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, mb << 20)
    finally:
        os.close(fd)
    return path


def _stale_socket(directory: Path, leader: int) -> Path:
    """A saver's socket file nobody listens on any more (its saver was killed)."""
    import socket

    path = directory / f"ftkit-saver-{leader}-cafe0123.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    return path


def test_leftovers_of_a_killed_trainer_and_saver_are_removed_when_the_next_run_starts(tmp_path, shm_dir):
    """A user's trial: a 1-process crash-safe run whose trainer and saver are killed together
    (kill -9 of the process group, as SLURM does to a hung step) left its segment in /dev/shm
    until reboot. The rerun on the same job dir removes it when it starts its saver, says so
    (files, MB, whose), and completes; nothing is left once it is done."""
    from tests.ckpt_helpers import env

    program = tmp_path / "train.py"
    program.write_text(_SWEEP_TRAINER)
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, str(program), str(job), str(shm_dir), "hang"], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, "trainer exited before reporting"
        info = json.loads(line)
        os.killpg(proc.pid, signal.SIGKILL)  # trainer and saver at once
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    _wait_gone(info["saver"], 30)
    left = sorted(p.name for p in shm_dir.glob(f"ftkit-snap-{info['pid']}-*"))
    assert left, "the kill left nothing in shm_dir (the saver cleaned up?)"
    size = sum(os.stat(shm_dir / name).st_blocks * 512 for name in left)

    rerun = subprocess.run([sys.executable, str(program), str(job), str(shm_dir), "finish"], env=env(), cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert not list(shm_dir.glob(f"ftkit-snap-{info['pid']}-*")), rerun.stderr
    said = [m for m in rerun.stderr.splitlines() if "crash-safe: removed" in m]
    assert len(said) == 1, rerun.stderr
    assert f"removed {len(left)} file(s), {size / 1e6:.1f} MB, left in {shm_dir}" in said[0], said
    assert f"leader pid(s) {info['pid']})" in said[0], said
    assert list(shm_dir.iterdir()) == []  # the rerun's own files went at its clean close


def test_a_saver_whose_trainer_died_keeps_its_segments(tmp_path, shm_dir):
    """The trainer is killed while its saver lives on (stopped here, so that it is still there:
    it would rescue the trainer's newest snapshot, and maps the segments only to read them).
    A sweep meanwhile keeps every file of that leader, though the leader pid is dead, and still
    removes a leftover of a run that is over; once continued, the saver finishes and cleans up."""
    from ftkit.checkpoint import validate_dir
    from ftkit.checkpoint.crashsafe.find import sweep_leftovers
    from tests.ckpt_helpers import env

    program = tmp_path / "train.py"
    program.write_text(_SWEEP_TRAINER)
    job = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, str(program), str(job), str(shm_dir), "hang"], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    saver = None
    try:
        info = json.loads(proc.stdout.readline())
        saver = info["saver"]
        os.kill(saver, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # a segment the trainer made but the saver has not opened yet (it opens one only to read it)
        pending = _fake_segment(shm_dir, proc.pid, rank=0)
        mine = sorted(p.name for p in shm_dir.glob(f"ftkit-snap-{proc.pid}-*"))
        assert len(mine) > 1 and not _alive(proc.pid) and _alive(saver)
        over = _fake_segment(shm_dir, _dead_pid())
        swept = sweep_leftovers(shm_dir)
        assert swept.removed == (over.name,) and not over.exists()
        assert sorted(p.name for p in shm_dir.glob(f"ftkit-snap-{proc.pid}-*")) == mine
        assert sorted(swept.kept) == mine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if saver is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(saver, signal.SIGCONT)
    _wait_gone(saver, 60)
    assert [p.name for p in shm_dir.iterdir()] == [pending.name]  # the saver unlinked the ones it knew
    assert validate_dir(job / "checkpoints" / "step-00000005", checksums=True).valid
    assert sweep_leftovers(shm_dir).removed == (pending.name,)  # its saver gone too: the run is over


@pytest.mark.parametrize("how", ["map", "fd"])
@pytest.mark.parametrize("check", ["proc", "kernel"])
def test_a_segment_a_live_process_holds_is_kept_though_its_leader_is_dead(shm_dir, holders, monkeypatch, how, check):
    """A helper process maps (or only has open) a segment whose leader pid is dead: kept, by
    the /proc pass (fd, maps) alone and by the kernel's lease check alone (which sees PID
    namespaces the /proc pass cannot); the unused one of the same dead leader is removed."""
    from ftkit.checkpoint.crashsafe import find

    if check == "proc":  # the lease check off: it would refuse as well
        def unlink(path, ino):
            os.unlink(path)
            return True

        monkeypatch.setattr(find, "_unlink_unused", unlink)
    else:  # the /proc pass sees nothing
        monkeypatch.setattr(find, "_in_use", lambda cands: (set(), set()))
    leader = _dead_pid()
    held = _fake_segment(shm_dir, leader, rank=1)
    unused = _fake_segment(shm_dir, leader, rank=0, mb=2)
    holder = holders(how, held)
    fds = [os.readlink(f"/proc/{holder}/fd/{fd}") for fd in os.listdir(f"/proc/{holder}/fd")]
    assert (str(held) in fds) == (how == "fd"), fds
    swept = find.sweep_leftovers(shm_dir)
    assert held.exists() and swept.kept == (held.name,)
    assert not unused.exists() and swept.removed == (unused.name,)
    assert swept.nbytes == 2 << 20 and swept.leaders == (leader,)


def test_a_socket_a_live_process_listens_on_is_kept_though_its_leader_is_dead(shm_dir, holders):
    from ftkit.checkpoint.crashsafe.find import sweep_leftovers

    listened = shm_dir / f"ftkit-saver-{_dead_pid()}-cafe0123.sock"
    holders("listen", listened)
    stale = _stale_socket(shm_dir, _dead_pid())
    swept = sweep_leftovers(shm_dir)
    assert listened.exists() and swept.kept == (listened.name,)
    assert not stale.exists() and swept.removed == (stale.name,)


def test_files_of_a_live_leader_or_another_user_or_not_ours_are_kept(shm_dir, holders):
    """A leader pid held by a process (the run itself, or any later process reusing the pid:
    conservative), another user's file, a name that is not ours: kept. Only the files of a
    dead leader nobody uses go, segments and socket alike."""
    from ftkit.checkpoint.crashsafe.find import sweep_leftovers

    reused = holders("nothing")  # a live process that opens nothing: the pid of a leader, or reused
    kept = [_fake_segment(shm_dir, os.getpid()), _fake_segment(shm_dir, reused), _stale_socket(shm_dir, reused)]
    dead = _dead_pid()
    foreign = (shm_dir / f"ftkit-snap-{dead}-x-r0-s0-g1.bak", shm_dir / f"ftkit-snap-{dead}", shm_dir / "other")
    for path in foreign:
        path.write_bytes(b"x")
    kept += foreign
    if os.geteuid() == 0:
        theirs = _fake_segment(shm_dir, dead, rank=7)
        os.chown(theirs, 4242, 4242)
        kept.append(theirs)
    over = [_fake_segment(shm_dir, dead), _fake_segment(shm_dir, dead, rank=1), _stale_socket(shm_dir, dead)]
    swept = sweep_leftovers(shm_dir)
    assert all(p.exists() for p in kept)
    assert not any(p.exists() for p in over) and sorted(swept.removed) == sorted(p.name for p in over)
    assert swept.leaders == (dead,) and swept.nbytes == 2 << 20


def test_no_pass_over_proc_without_a_candidate_and_no_sweep_off_a_tmpfs(tmp_path, shm_dir, monkeypatch):
    from ftkit._fs import mount_of
    from ftkit.checkpoint.crashsafe import find

    def no_pass(cands):
        raise AssertionError("/proc read without a candidate")

    monkeypatch.setattr(find, "_in_use", no_pass)
    _fake_segment(shm_dir, os.getpid())
    assert find.sweep_leftovers(shm_dir) == find.Leftovers()
    monkeypatch.undo()
    if mount_of(tmp_path).fstype in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on a tmpfs here")
    over = _fake_segment(tmp_path, _dead_pid())  # shm_dir on a disk, maybe shared: its pids may be another host's
    assert find.sweep_leftovers(tmp_path) == find.Leftovers() and over.exists()


def test_a_failing_sweep_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    import logging

    from ftkit.checkpoint.crashsafe import client

    def broken(directory):
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(client, "sweep_leftovers", broken)
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        client._sweep(tmp_path)
    assert any("could not look for the leftovers" in m and "Permission denied" in m for m in caplog.messages)


def test_a_saver_killed_on_rank_1s_node_mid_save_does_not_stall_rank_0s_commit(tmp_path):
    """Two ranks on two nodes (SLURMD_NODENAME differs: a saver each). Rank 1's saver is killed
    with kill -9 while it writes rank 1's part of step 10 (32 MB each): rank 1 tells rank 0 that
    part is lost, so rank 0's saver fails step 10's commit at once rather than waiting
    commit_timeout (600 s) for the part with the whole job stalled behind it. With
    ``on_error="warn"`` both ranks train on to step 30 (with the default ``raise``, rank 0 raises
    that failed step, as for any background failure), and the checkpoints after the kill are
    valid."""
    from ftkit.checkpoint import validate_dir
    from ftkit.events import read_events
    from tests.ckpt_helpers import collect, env, free_port

    program = str(REPO / "tests" / "programs" / "saver_lost.py")
    job = tmp_path / "job"
    port = str(free_port())
    began = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, program, str(job), "--kill-rank", "1", "--kill-at", "11", "--ballast-mb", "32",
         "--on-error", "warn"],
        env=env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, SLURMD_NODENAME=f"n{r}"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = collect(procs, 300)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert time.monotonic() - began < 200, outs  # far from commit_timeout
    root = job / "checkpoints"
    assert all(validate_dir(root / f"step-{s:08d}").valid for s in (20, 25, 30)), outs
    lost = [e for e in read_events(job / "events.jsonl") if e["event"] == "saver-lost"]
    assert [e["rank"] for e in lost] == [1], lost
    if lost[0]["lost_steps"] == [10]:  # the kill came before rank 1's part was written: rank 0 was told
        assert "died while it wrote this rank's part" in outs[0], outs
