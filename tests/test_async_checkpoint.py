"""AsyncCheckpointer: two tiers, bounded in-flight saves, reused buffers, loud failures, exact resume.

``python3 tests/test_async_checkpoint.py train --mode sync|async|shm ...`` is the trainer run
as a real subprocess by the resume test (the dropout/Adam/StepLR/sampler trainer of ckpt_helpers).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cfg(root, **kw):
    from ftkit.checkpoint import CheckpointConfig

    return CheckpointConfig(root=root, **kw)


def _mgr(root, *, keep_last=None, **async_kw):
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig

    return AsyncCheckpointer(_cfg(root, keep_last=keep_last), async_config=AsyncConfig(**async_kw))


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("kw,setting", [
    ({"memory_every": 0}, "memory_every"),
    ({"persist_every": 2}, "persist_every"),
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"on_error": "ignore"}, "on_error"),
    ({"saver_timeout": -1}, "saver_timeout"),
])
def test_config_errors_name_the_setting(kw, setting):
    from ftkit.checkpoint.background.manager import AsyncConfig
    from ftkit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"async_save.{setting}"):
        AsyncConfig(**kw)


def test_several_ranks_without_a_process_group_is_refused(tmp_path):
    """world_size > 1 needs torch.distributed initialised first (construction is collective)."""
    from ftkit.checkpoint.background.manager import AsyncCheckpointer
    from ftkit.errors import ConfigError

    with pytest.raises(ConfigError, match="world_size=2"):
        AsyncCheckpointer(_cfg(tmp_path), world_size=2)


# ---------------------------------------------------------------- two tiers
@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
def test_two_tier_memory_and_persist(tmp_path, crash_safe):
    import torch

    state = {"w": torch.zeros(1000), "extra": {"value": 0}}
    with _mgr(tmp_path, memory_every=2, persist_every=3, crash_safe=crash_safe) as mgr:
        taken = []
        for step in range(1, 14):
            state["w"].fill_(step)
            state["extra"]["value"] = step
            taken.append(mgr.on_step(step, state))
        assert taken == [step % 2 == 0 for step in range(1, 14)]
        mgr.wait()
        assert sorted(i.step for i in mgr.list()) == [6, 12]  # steps that are multiples of 2 * 3
        seq = mgr._seq
        state["w"].fill_(14)
        state["extra"]["value"] = 14
        assert mgr.on_step(14, state)  # memory only
        info = mgr.save(14, state, reason="save-switch")  # the step-14 snapshot is persisted, not re-taken
        assert info.status == "pending" and mgr._seq == seq + 1
        state["w"].fill_(15)
        state["extra"]["value"] = 15
        mgr.save(15, state)  # no snapshot of step 15: taken now
        assert mgr._seq == seq + 2
        mgr.wait()
        assert sorted(i.step for i in mgr.list() if i.valid) == [6, 12, 14, 15]
        assert mgr.last_durable_step == 15
    from ftkit.checkpoint import validate_dir
    from tests.ckpt_helpers import make_mgr

    for step in (6, 12, 14, 15):
        assert validate_dir(tmp_path / f"step-{step:08d}", checksums=True).valid
        restored = {"w": torch.zeros(1000), "extra": {}}
        assert make_mgr(tmp_path).load(restored, step=step) == step
        assert torch.equal(restored["w"], torch.full((1000,), float(step))) and restored["extra"]["value"] == step


def test_nothing_due_costs_nothing(tmp_path):
    import torch

    state = {"w": torch.zeros(10)}
    with _mgr(tmp_path, memory_every=100) as mgr:
        assert not any(mgr.on_step(s, state) for s in range(1, 100))
        assert mgr._seq == 0 and mgr.buffers(0) == []


# ---------------------------------------------------------------- bound and reuse
def test_save_beyond_max_in_flight_waits_for_the_oldest(tmp_path):
    import torch

    mgr = _mgr(tmp_path, max_in_flight=1)
    gate, entered = threading.Event(), threading.Event()
    real = mgr.checkpointer.persist

    def slow(snapshot, step, **kw):
        entered.set()
        assert gate.wait(30)
        return real(snapshot, step, **kw)

    mgr.checkpointer.persist = slow
    try:
        mgr.save(1, {"w": torch.ones(10)})
        assert entered.wait(10)
        second = threading.Thread(target=mgr.save, args=(2, {"w": torch.full((10,), 2.0)}))
        second.start()
        second.join(0.3)
        assert second.is_alive(), "a second save must wait while max_in_flight=1 is in flight"
        gate.set()
        second.join(10)
        assert not second.is_alive()
        mgr.wait()
        assert sorted(i.step for i in mgr.list() if i.valid) == [1, 2]
    finally:
        gate.set()
        mgr.close()


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
def test_buffers_are_reused_across_saves(tmp_path, crash_safe):
    import psutil
    import torch

    model = torch.nn.Linear(1024, 1024 * 4)  # ~16 MB of weights, ~50 MB with Adam state
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    with _mgr(tmp_path, keep_last=1, crash_safe=crash_safe) as mgr:
        mgr.save(1, state)
        mgr.wait()
        first = [b.data_ptr() for b in mgr.buffers(0)]
        ids = [id(b) for b in mgr.buffers(0)]
        trim = ctypes.CDLL("libc.so.6").malloc_trim  # RSS of live memory, not of freed malloc arenas
        trim(0)
        rss = psutil.Process().memory_info().rss
        for step in range(2, 22):
            opt.step()
            mgr.save(step, state)
        mgr.wait()
        assert [b.data_ptr() for b in mgr.buffers(0)] == first and [id(b) for b in mgr.buffers(0)] == ids
        assert mgr.buffers(1) == []  # save-only use never needs the second slot
        if not crash_safe:
            assert mgr._backend.sets[0].allocations == len(first)
        # the buffers never grow; RSS only moves with malloc arenas (Adam's temporaries, the
        # writer's chunks), far below the 20 x 50 MB a fresh copy per save would cost
        trim(0)
        grown = psutil.Process().memory_info().rss - rss
        state_bytes = sum(b.numel() * b.element_size() for b in mgr.buffers(0))
        assert grown < state_bytes // 2, f"RSS grew by {grown >> 20} MiB over 20 saves"
        assert torch.equal(mgr.buffers(0)[0], model.weight.detach()) or torch.equal(mgr.buffers(0)[0], model.bias.detach())


class _Probe:
    """A stateful object the walk reaches after tensor ``a``: notes whether slot 0's buffers
    already held ``a``'s current value at that moment (the copy started during the walk)."""

    def __init__(self, a, mgr) -> None:
        self.a, self.mgr, self.seen, self.states = a, mgr, [], []

    def state_dict(self):
        import struct

        import torch

        from ftkit.checkpoint.crashsafe import shm as _shm

        self.seen.append(any(b.shape == self.a.shape and torch.equal(b, self.a) for b in self.mgr.buffers(0)))
        seg = getattr(self.mgr._backend, "segments", [None])[0]
        if seg is not None:  # crash-safe: the slot being overwritten says so (a rescue skips it)
            self.states.append(struct.unpack_from("<I", seg._head, _shm._STATE_AT)[0])
        return {"n": len(self.seen)}

    def load_state_dict(self, sd) -> None:
        pass


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
def test_each_tensor_is_copied_as_soon_as_the_walk_finds_it(tmp_path, crash_safe):
    import torch

    a = torch.randn(1000)
    with _mgr(tmp_path, crash_safe=crash_safe) as mgr:
        probe = _Probe(a, mgr)
        state = {"a": a, "probe": probe}
        for step in (1, 2, 3):
            a.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
    # the first save allocates the buffers after the walk; later ones copy into them during it
    assert probe.seen == [False, True, True]
    if crash_safe:
        from ftkit.checkpoint.crashsafe.shm import WRITING

        assert probe.states == [WRITING, WRITING]
    got = torch.load(tmp_path / "step-00000003" / "rank-00000.pt", weights_only=True)["state"]
    assert torch.equal(got["a"], a) and got["probe"] == {"n": 3}


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
def test_a_state_whose_layout_changes_between_saves_is_snapshotted_exactly(tmp_path, crash_safe):
    """Copies start during the walk into the buffers of the previous layout: a tensor appended
    (same prefix), one reshaped, one inserted in front (every index moves), a dtype changed."""
    import torch

    from ftkit.checkpoint import validate_dir

    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    states = [
        {"x": r(64), "y": r(3, 3)},
        {"x": r(64), "y": r(3, 3), "z": r(5)},
        {"x": r(64), "y": r(4, 3), "z": r(5)},
        {"w": r(2), "x": r(64), "y": r(4, 3), "z": r(5)},
        {"w": r(2), "x": r(64).double(), "y": r(4, 3), "z": r(5)},
        {"x": r(64)},
    ]
    with _mgr(tmp_path, crash_safe=crash_safe) as mgr:
        for step, state in enumerate(states, 1):
            mgr.save(step, state)
            mgr.wait()
            d = tmp_path / f"step-{step:08d}"
            assert validate_dir(d, checksums=True).valid
            got = torch.load(d / "rank-00000.pt", weights_only=True)["state"]
            assert got.keys() == state.keys(), step
            for k, v in state.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (step, k)


class _Broken:
    def state_dict(self):
        raise RuntimeError("state_dict failed half-way through the walk")

    def load_state_dict(self, sd) -> None:
        pass


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
def test_a_walk_failing_after_copies_started_raises_and_harms_nothing(tmp_path, crash_safe):
    import fcntl

    import torch

    a = torch.randn(1000)
    with _mgr(tmp_path, crash_safe=crash_safe) as mgr:
        mgr.save(1, {"a": a, "b": torch.zeros(3)})
        mgr.wait()
        a.add_(1.0)  # "a" is copied into slot 0 before the walk meets the broken object
        with pytest.raises(RuntimeError, match="half-way"):
            mgr.save(2, {"a": a, "b": _Broken()})
        if crash_safe:  # the slot is unlocked again: the saver could read (rescue) it
            seg = mgr._backend.segments[0]
            with open(seg.path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        mgr.save(3, {"a": a, "b": torch.ones(3)})
        mgr.wait()
    assert not (tmp_path / "step-00000002").exists()
    for step, b in ((1, torch.zeros(3)), (3, torch.ones(3))):
        got = torch.load(tmp_path / f"step-{step:08d}" / "rank-00000.pt", weights_only=True)["state"]
        assert torch.equal(got["b"], b)
    assert torch.equal(got["a"], a)


# ---------------------------------------------------------------- failures are loud
@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "shm-saver"])
@pytest.mark.parametrize("report", ["on_step", "save", "pending_error", "wait"])
def test_enospc_in_background_is_reported_and_harms_nothing(small_fs, crash_safe, report):
    import torch

    from ftkit.checkpoint import validate_dir
    from ftkit.errors import CheckpointError
    from tests.ckpt_helpers import make_mgr

    root = small_fs / "checkpoints"
    mgr = _mgr(root, keep_last=3, memory_every=1000, crash_safe=crash_safe)
    try:
        mgr.save(1, {"w": torch.ones(100_000)})
        mgr.wait()
        before = validate_dir(root / "step-00000001", checksums=True)
        assert before.valid
        assert mgr.save(2, {"w": torch.ones(1_000_000)}).status == "pending"  # 4 MB: returns, fails later
        with mgr._cond:
            mgr._wait_until(lambda: mgr._in_flight == 0)
        if report == "pending_error":
            err = mgr.pending_error()
            assert isinstance(err, CheckpointError) and mgr.pending_error() is None
        else:
            with pytest.raises(CheckpointError) as info:
                if report == "on_step":
                    mgr.on_step(3, {"w": torch.ones(10)})
                elif report == "save":
                    mgr.save(3, {"w": torch.ones(10)})
                else:
                    mgr.wait()
            err = info.value
        assert "step 2" in str(err) and "ENOSPC" in str(err)
        assert validate_dir(root / "step-00000002").status == "incomplete"
        after = validate_dir(root / "step-00000001", checksums=True)
        assert after.valid and after.files == before.files
        mgr.save(4, {"w": torch.full((100_000,), 4.0)})  # reported once; the next save works
        mgr.wait()
    finally:
        mgr.close()
    restored = {"w": torch.zeros(100_000)}
    assert make_mgr(root).load(restored) == 4 and torch.equal(restored["w"], torch.full((100_000,), 4.0))


def test_on_error_warn_logs_and_only_wait_raises(small_fs, caplog):
    import torch

    from ftkit.errors import CheckpointError

    mgr = _mgr(small_fs / "ck", on_error="warn")
    try:
        mgr.save(1, {"w": torch.ones(1_000_000)})
        with mgr._cond:
            mgr._wait_until(lambda: mgr._in_flight == 0)
        assert "background save of checkpoint step 1 failed" in caplog.text
        mgr.on_step(2, {"w": torch.ones(10)})  # no raise in warn mode
        with pytest.raises(CheckpointError, match="step 1"):
            mgr.wait()
    finally:
        mgr.close()


def test_close_waits_until_durable_and_then_refuses(tmp_path):
    import torch

    from ftkit.errors import CheckpointError

    mgr = _mgr(tmp_path)
    mgr.save(5, {"w": torch.ones(2_000_000)})
    mgr.close()
    assert [i.step for i in mgr.list() if i.valid] == [5]
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(6, {"w": torch.ones(1)})


# ---------------------------------------------------------------- exact resume, new process
def _run(*args: str) -> None:
    from tests.ckpt_helpers import env

    r = subprocess.run([sys.executable, __file__, "train", *args], env=env(), cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("mode", ["async", "shm"])
def test_exact_resume_from_async_matches_sync(tmp_path, mode):
    import torch

    from ftkit.checkpoint import validate_dir
    from tests.test_checkpoint_resume import _assert_same

    steps, stop = 20, 11
    _run("--mode", "sync", "--root", str(tmp_path / "straight"), "--steps", str(steps), "--out", str(tmp_path / "straight"))
    _run("--mode", "sync", "--root", str(tmp_path / "sync"), "--steps", str(steps), "--stop-at", str(stop),
         "--out", str(tmp_path / "sync-first"))
    _run("--mode", mode, "--root", str(tmp_path / "ck"), "--steps", str(steps), "--stop-at", str(stop),
         "--out", str(tmp_path / "first"))
    path = tmp_path / "ck" / f"step-{stop:08d}"
    assert validate_dir(path, checksums=True).valid
    a = torch.load(path / "rank-00000.pt", weights_only=True)
    b = torch.load(tmp_path / "sync" / f"step-{stop:08d}" / "rank-00000.pt", weights_only=True)
    from tests.ckpt_helpers import assert_same_values

    assert_same_values(a, b, "file")  # the async checkpoint holds exactly what the synchronous one holds
    _run("--mode", "sync", "--root", str(tmp_path / "ck"), "--steps", str(steps), "--out", str(tmp_path / "resumed"))
    load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    _assert_same(load(tmp_path / "straight.rank0"), load(tmp_path / "first.rank0"),
                 load(tmp_path / "resumed.rank0"), steps, stop)


def train_main(argv: list[str]) -> None:
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from tests.ckpt_helpers import build_state

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sync", "async", "shm"], required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--stop-at", type=int)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(0)  # the checkpoint holds Python's and numpy's RNG states too: same in every run
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    state, loader = build_state()
    cfg = CheckpointConfig(root=a.root, keep_last=2)
    if a.mode == "sync":
        mgr = make_manager(cfg)
    else:  # memory snapshots every 3 steps exercise the two tiers on the way
        mgr = AsyncCheckpointer(cfg, async_config=AsyncConfig(memory_every=3, crash_safe=a.mode == "shm"))
    step = mgr.load(state) or 0
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    losses: list[float] = []
    done = False
    while not done:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if a.mode != "sync":
                mgr.on_step(step, state)
            if step == a.stop_at:
                mgr.save(step, state, reason="test")
                done = True
                break
            if step >= a.steps:
                done = True
                break
        else:
            state["extra"]["epoch"] += 1
    mgr.close()
    if a.out:
        torch.save({"losses": losses, "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                   f"{a.out}.rank0")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1] != "train":
        raise SystemExit(f"unknown command {sys.argv[1]}")
    train_main(sys.argv[2:])
