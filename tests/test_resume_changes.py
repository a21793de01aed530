"""What a user changes in the training script between runs, and what the resume says of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import make_mgr


def _saved(root: Path, *, scheduler: bool = True, wd: float = 0.01) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=wd)
    state: dict = {"model": model, "optimizer": opt}
    if scheduler:
        state["scheduler"] = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if scheduler:
        state["scheduler"].step()
    make_mgr(root).save(1, state)


@pytest.mark.parametrize("changed", [True, False])
def test_optimizer_settings_the_checkpoint_replaces_are_named(tmp_path, caplog, changed):
    """The script now sets weight_decay 0.05 and a base learning rate of 0.1 (a scheduler's
    ``initial_lr``): torch's ``load_state_dict`` puts the saved param groups back, so the run
    goes on with 0.01 and 0.01. The load says which settings were replaced, in a warning and
    a ``settings-replaced`` event; unchanged settings (and the scheduled learning rate, which
    differs from the script's at every resume) say nothing."""
    root = tmp_path / "ck"
    _saved(root)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    lr, wd = (0.1, 0.05) if changed else (0.01, 0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    events = EventLog(tmp_path / "events.jsonl")
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        assert make_mgr(root, events=events).load({"model": model, "optimizer": opt, "scheduler": sched}) == 1
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[0]["initial_lr"] == 0.01
    said = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "settings-replaced"]
    warned = [r.getMessage() for r in caplog.records if "replace the script's" in r.getMessage()]
    if not changed:
        assert said == [] and warned == []
        return
    expect = "state['optimizer'] param group 0: initial_lr 0.1 -> 0.01, weight_decay 0.05 -> 0.01"
    assert [e["settings"] for e in said] == [[expect]] and said[0]["step"] == 1
    assert len(warned) == 1 and expect in warned[0] and "step-00000001" in warned[0], warned


def test_a_state_key_removed_from_the_script_is_said_not_restored(tmp_path, caplog):
    """The checkpoint has a scheduler, the script's state no longer does: the load goes on
    (nothing of the state is missing), saying the scheduler's state was not restored, in a
    warning and an ``unused-state`` event."""
    root = tmp_path / "ck"
    _saved(root)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    events = EventLog(tmp_path / "events.jsonl")
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        assert make_mgr(root, events=events).load({"model": model, "optimizer": opt}) == 1
    unused = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "unused-state"]
    assert [(e["step"], e["keys"]) for e in unused] == [(1, ["scheduler"])]
    assert any("has state['scheduler'], which this run's state has no key for: not restored" in r.getMessage()
               for r in caplog.records)


def _train(job: Path, total: int, *, background: bool = False) -> tuple[torch.nn.Module, bool]:
    """A deterministic run under ``FaultTolerance`` (each step's batch from its step number)."""
    import ftkit

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = ftkit.Config(save_every=5, checkpoint=ftkit.CheckpointConfig(keep_last=3),
                          async_save=ftkit.AsyncConfig() if background else None)
    with ftkit.FaultTolerance(job, state={"model": model, "optimizer": opt}, config=config) as ft:
        for step in ft.range(total):
            g = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 64, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, ft.completed


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["pickle", "tensor"])
def test_a_run_that_fell_back_past_corrupt_checkpoints_replaces_them_and_keeps_the_good_one(tmp_path, background, where):
    """Steps 15 and 20 of a job dir are corrupt (a byte flipped in their state files' pickle or
    tensor bytes; sizes unchanged, so they look complete). The next run falls back to step 10
    and trains on to 25: its saves of 15 and 20 are its own (the broken ones were set aside,
    not taken for them: "already exists and is valid"), retention counts them, not the broken
    ones, so step 10 is not deleted for their sake, every checkpoint left verifies, and a
    resume takes step 25, whose state is exactly an uninterrupted run's."""
    job = tmp_path / "job"
    _train(job, 20, background=background)
    root = job / "checkpoints"
    for step in (15, 20):
        state_file = root / f"step-{step:08d}" / "rank-00000.pt"
        _flip(state_file, 300 if where == "pickle" else state_file.stat().st_size // 2)
    model, completed = _train(job, 25, background=background)
    assert completed
    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps == ["step-00000015", "step-00000020", "step-00000025"], steps
    aside = list(root.glob("set-aside-*-after-step-00000010"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-00000015", "step-00000020"]
    from ftkit.checkpoint import validate_dir

    assert all(validate_dir(root / name, checksums=True).valid for name in steps)
    events = [e for e in read_events(job / "events.jsonl") if e["event"] in ("skip", "set-aside")]
    assert [(e["event"], e["step"]) for e in events] == [("skip", 20), ("skip", 15), ("set-aside", 10)]
    straight, _ = _train(tmp_path / "straight", 25)
    assert torch.equal(model.weight, straight.weight) and torch.equal(model.bias, straight.bias)
    again = torch.nn.Linear(64, 64)
    assert make_mgr(root).load({"model": again, "optimizer": torch.optim.Adam(again.parameters())}) == 25
    assert torch.equal(again.weight, straight.weight)


def test_status_does_not_promise_a_checkpoint_a_resume_found_broken(tmp_path):
    """After a resume fell back past corrupt steps 15 and 20 and saved nothing yet (it ended
    at once), ``ftkit status`` says the job resumes from step 10, not 20, and names why 15 and
    20 are not taken: their sizes are right, only the events log knows."""
    import json
    import subprocess
    import sys

    job = tmp_path / "job"
    _train(job, 20)
    for step in (15, 20):
        _flip(job / "checkpoints" / f"step-{step:08d}" / "rank-00000.pt", 300)
    _train(job, 10)
    out = subprocess.run([sys.executable, "-m", "ftkit", "status", str(job), "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["verdict"] == "if the job dies now, it resumes from step 10"
    by_step = {c["step"]: c for c in status["checkpoints"]}
    for step in (15, 20):
        assert by_step[step]["status"] == "corrupt" and by_step[step]["reason"].startswith("a resume skipped it: "), by_step
    assert by_step[10]["status"] == "valid"
    # a skip for a read the system failed (a stale NFS handle) does not make a checkpoint broken
    EventLog(job / "events.jsonl").emit("skip", step=10, path=str(job / "checkpoints" / "step-00000010"),
                                        reason="[Errno 116] Stale file handle: 'rank-00000.pt'")
    # nor does a skip whose status says it is not known bad (a Hugging Face resume's event)
    EventLog(job / "events.jsonl").emit("skip", step=10, path=str(job / "checkpoints" / "step-00000010"),
                                        status="incomplete", reason="checkpoint-is-incomplete present")
    out = subprocess.run([sys.executable, "-m", "ftkit", "status", str(job), "--json"], capture_output=True,
                         text=True, timeout=60)
    status = json.loads(out.stdout)
    assert status["verdict"] == "if the job dies now, it resumes from step 10", status["verdict"]


def _steps_10_and_20(root: Path) -> torch.nn.Linear:
    """Checkpoints of steps 10 and 20 of one small model in ``root``; the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for step in (10, 20):
        make_mgr(root).save(step, {"model": model})
    return model


def test_a_checkpoint_skipped_for_a_failed_read_is_not_set_aside(tmp_path, monkeypatch):
    """A read of the newest checkpoint fails for the system's sake (a stale NFS handle): the
    load falls back to the older one, but the newest is not known broken, so the run's first
    save leaves it where it is (a later resume may take it), unlike a corrupt one."""
    import errno

    from ftkit.checkpoint import manager as _manager

    root = tmp_path / "ck"
    model = _steps_10_and_20(root)
    real = _manager.read_state_into
    failed = []

    def stale_once(path, *args, **kwargs):
        if path.name == "step-00000020" and not failed:
            failed.append(path)
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_manager, "read_state_into", stale_once)
    mgr = make_mgr(root)
    assert mgr.load({"model": torch.nn.Linear(4, 2)}) == 10 and failed
    mgr.save(11, {"model": model})
    assert sorted(p.name for p in root.iterdir() if p.name != "latest") == [
        "step-00000010", "step-00000011", "step-00000020"]


def test_memory_running_out_while_parsing_a_state_file_is_not_a_corrupt_checkpoint(tmp_path, monkeypatch):
    """Parsing the newest state file runs out of memory: the load raises it, rather than take
    the checkpoint for a corrupt one and resume from the older (whose first save would set the
    newest aside)."""
    from ftkit.checkpoint.io import statefile as _statefile

    root = tmp_path / "ck"
    model = _steps_10_and_20(root)
    real = _statefile._parse

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(_statefile, "_parse", out_of_memory)
    with pytest.raises(MemoryError):
        make_mgr(root).load({"model": torch.nn.Linear(4, 2)})
    monkeypatch.setattr(_statefile, "_parse", real)
    again = torch.nn.Linear(4, 2)
    assert make_mgr(root).load({"model": again}) == 20 and torch.equal(again.weight, model.weight)


def test_a_scheduler_class_of_the_users_own_resumes_from_its_own_checkpoint(tmp_path):
    """A scheduler that leaves a constructor argument out of its ``state_dict`` (a callable:
    weights-only pickling cannot hold it), or that gained an argument since the save: the same
    class, not another kind; it loads."""
    from torch.optim.lr_scheduler import LRScheduler

    class Warmup(LRScheduler):
        def __init__(self, optimizer, warmup, shape=None, last_epoch=-1):
            self.warmup, self.shape = warmup, shape or (lambda x: x)
            super().__init__(optimizer, last_epoch)

        def get_lr(self):
            return [base * min(1.0, self.shape((self.last_epoch + 1) / self.warmup)) for base in self.base_lrs]

        def state_dict(self):
            return {k: v for k, v in super().state_dict().items() if k != "shape"}

    class Grown(LRScheduler):  # the same class, with an argument added since the save
        def __init__(self, optimizer, warmup, floor=0.0, last_epoch=-1):
            self.warmup, self.floor = warmup, floor
            super().__init__(optimizer, last_epoch)

        def get_lr(self):
            return [max(self.floor, base * min(1.0, (self.last_epoch + 1) / self.warmup)) for base in self.base_lrs]

    for kind in (Warmup, Grown):
        root = tmp_path / kind.__name__
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = kind(opt, 5)
        opt.step()
        sched.step()
        saved = {k: v for k, v in sched.state_dict().items() if k != "floor"}  # saved before "floor" existed
        make_mgr(root).save(1, {"model": model, "optimizer": opt, "scheduler": saved if kind is Grown else sched})
        again = kind(torch.optim.SGD(model.parameters(), lr=0.1), 5)
        state = {"model": model, "optimizer": again.optimizer, "scheduler": again}
        assert make_mgr(root).load(state) == 1, kind
        assert again.last_epoch == 1, kind


def test_range_after_the_scripts_own_resume_loads_nothing_again(tmp_path):
    """docs/getting-started.md: to go on with another learning rate, the script calls
    ``ft.resume()``, sets it, then loops with ``ft.range``. The range loaded the checkpoint a
    second time, over the script's learning rate (and read it twice)."""
    import ftkit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ftkit.FaultTolerance(tmp_path, state={"model": model, "optimizer": opt}) as ft:
        for _ in ft.range(5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    trained = model.weight.detach().clone()

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with ftkit.FaultTolerance(tmp_path, state={"model": model, "optimizer": opt}) as ft:
        assert ft.resume() == 5 and opt.param_groups[0]["lr"] == 0.01  # the checkpoint's
        opt.param_groups[0]["lr"] = 0.001
        with torch.no_grad():
            model.weight.add_(1.0)  # anything the script sets after its resume stays
        steps = list(ft.range(8))
    assert steps == [5, 6, 7]
    assert opt.param_groups[0]["lr"] == 0.001
    assert torch.equal(model.weight, trained + 1.0)
    loads = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "load"]
    assert [e["step"] for e in loads] == [5], loads  # one load, by the script's resume()


def test_a_second_range_or_a_second_with_block_resumes_anew(tmp_path):
    """The resume() that range() skips is the script's own, right before it, once: a second
    range() in the block (or the object entered again) goes on from where the first ended,
    not from the first one's resume point."""
    import ftkit

    model = torch.nn.Linear(2, 2)
    with ftkit.FaultTolerance(tmp_path / "a", state={"model": model}) as ft:
        assert list(ft.range(5)) == [0, 1, 2, 3, 4]
        assert list(ft.range(10)) == [5, 6, 7, 8, 9]
    ft = ftkit.FaultTolerance(tmp_path / "b", state={"model": model})
    with ft:
        assert list(ft.range(5)) == [0, 1, 2, 3, 4]
    with ft:
        assert list(ft.range(10)) == [5, 6, 7, 8, 9]
    with ftkit.FaultTolerance(tmp_path / "c", state={"model": model}) as ft:
        assert ft.resume() == 0
        for step in range(3):  # the script's own loop, then a range() for the rest
            ft.step(step + 1)
        ft.save(3)
        assert list(ft.range(6)) == [3, 4, 5]
