"""The between-steps decision with real files and real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftkit
from ftkit.decision import Action, Source
from ftkit.events import read_events
from tests.conftest import fill_up, wait_for
from tests.test_signals import decisions, start_loop


def ftkit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("polling", [False, True])
@pytest.mark.parametrize(("switch", "action", "requeue"), [("save", "SAVE", None), ("kill", "SAVE_EXIT", False)])
def test_switch_touched_by_cli_reaches_running_loop(tmp_path: Path, polling, switch, action, requeue) -> None:
    proc = start_loop(tmp_path, 3000, 0.01, *(["--polling"] if polling else []))
    try:
        out = ftkit_cli(switch, str(tmp_path))
        assert out.returncode == 0, out.stderr
        wait_for(lambda: decisions(tmp_path), 20, what=f"{switch}-switch decision")
    finally:
        proc.kill() if switch == "save" else None
        proc.communicate(timeout=60)
    got = decisions(tmp_path)
    assert got[0]["action"] == action and got[0]["requeue"] is requeue
    assert got[0]["sources"] == [f"{switch}-switch"]


def test_kill_switch_present_at_start_exits_at_once_without_saving(tmp_path: Path) -> None:
    ftkit_cli("kill", str(tmp_path))
    proc = start_loop(tmp_path, 3000, 0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    got = decisions(tmp_path)
    assert got[0]["step"] == 1 and got[0]["action"] == "EXIT" and got[0]["requeue"] is False
    assert "present at start" in got[0]["reasons"][0]
    assert len(got[0]["reasons"]) == 1, got[0]["reasons"]  # said once, not again as "kill-switch touched"
    assert (tmp_path / "kill-switch").exists()  # the kill-switch stays
    assert not (tmp_path / "checkpoints").exists()  # nothing new was saved
    assert ftkit_cli("kill", "--clear", str(tmp_path)).returncode == 0
    assert not (tmp_path / "kill-switch").exists()


@pytest.mark.parametrize(("action", "expect", "requeue"),
                         [("requeue", "SAVE_EXIT", True), ("stop", "SAVE_EXIT", False), ("save", "SAVE", None)])
def test_request_file_from_another_process(tmp_path: Path, action, expect, requeue) -> None:
    proc = start_loop(tmp_path, 3000, 0.01)
    try:
        out = ftkit_cli("request", action, str(tmp_path), "--reason", "batch script trap")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: decisions(tmp_path), 20, what="request decision")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
    got = decisions(tmp_path)[0]
    assert got["action"] == expect and got["requeue"] is requeue and got["sources"] == ["request"]
    assert "batch script trap" in got["reasons"][0]


BUDGETED = """
import sys, time, torch, ftkit
config = ftkit.Config(save_every=int(sys.argv[2]) or None, budget=ftkit.BudgetConfig(margin=2))
with ftkit.FaultTolerance(sys.argv[1], state={"model": torch.nn.Linear(4, 4)}, config=config) as ft:
    for step in ft.range(100000 if sys.argv[2] == "0" else 20):
        time.sleep(0.02)
"""


def test_a_requeued_runs_time_budget_starts_from_the_saves_earlier_runs_measured(tmp_path: Path) -> None:
    """Saves here take milliseconds: the next run's budget stops it a margin before the end,
    not the 30 s that ``budget.save_estimate`` guesses before a save is measured (with 10 s
    left that guess would stop it after its first step)."""
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    first = subprocess.run([sys.executable, "-c", BUDGETED, str(tmp_path), "5"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    began = time.time()
    second = subprocess.run([sys.executable, "-c", BUDGETED, str(tmp_path), "0"], capture_output=True, text=True,
                            timeout=120, env={**env, "FTKIT_DEADLINE": str(int(began) + 12)})
    assert second.returncode == 0, second.stderr
    [decision] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "decision"]
    said = re.search(r"\+ save ([\d.]+) s \+ margin 2 s", decision["reasons"][0])
    assert decision["sources"] == ["time-budget"] and said and float(said[1]) < 5, decision  # measured, not 30 s
    assert decision["time"] >= int(began) + 12 - 3 and decision["step"] > 20 + 50  # a margin before the end
    assert "only" not in second.stderr  # no "only N s left at start" warning


BUDGETED_RANKS = """
import sys, time, torch, torch.distributed as dist, ftkit
dist.init_process_group("gloo")
config = ftkit.Config(save_every=None, budget=ftkit.BudgetConfig(margin=2), agreement=ftkit.AgreementConfig(every=1))
with ftkit.FaultTolerance(sys.argv[1], state={"model": torch.nn.Linear(4, 4)}, config=config) as ft:
    for step in ft.range(100000):
        time.sleep(0.02)
dist.destroy_process_group()
"""


def test_every_rank_of_a_requeued_run_with_a_given_deadline_starts_from_the_measured_saves(tmp_path: Path) -> None:
    """``FTKIT_DEADLINE`` reaches every rank, and each fires its budget on it: rank 1 too must
    start from the saves earlier runs measured. It started from the 30 s guess, so a 2-rank
    requeued run stopped ~30 s before its end, every time (rank 0 alone was seeded)."""
    from tests.ckpt_helpers import env, free_port

    first = subprocess.run([sys.executable, "-c", BUDGETED, str(tmp_path), "5"], env=env(), capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    began = time.time()
    extra = {"FTKIT_DEADLINE": str(int(began) + 20), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", BUDGETED_RANKS, str(tmp_path)], env=env(**extra, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    decisions = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "decision"]
    assert sorted(d["rank"] for d in decisions) == [0, 1] and len({d["step"] for d in decisions}) == 1, decisions
    for decision in decisions:  # one per rank, at one step
        assert decision["sources"] == ["time-budget"], decision
        assert "save 30 s" not in " ".join(decision["reasons"]), decision  # no rank fired on the guess
        assert decision["time"] >= int(began) + 20 - 5, (decision["time"] - began, decision)  # a margin before the end


def test_time_budget_from_env_deadline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FTKIT_DEADLINE", str(time.time() + 33.0))  # margin 30 s + step + save estimate
    proc = start_loop(tmp_path, 100000, 0.01)
    proc.communicate(timeout=60)
    got = decisions(tmp_path)
    assert got and got[0]["action"] == "SAVE_EXIT" and got[0]["requeue"] is True
    assert got[0]["sources"] == ["time-budget"] and got[0]["reasons"][0].startswith("time budget:")


@pytest.mark.parametrize(("deadline", "said"), [
    ("ms", r"environment variable FTKIT_DEADLINE: '\d+' is not a UNIX time in seconds \(\d+ s, if those are milliseconds\)"),
    ("past", r"environment variable FTKIT_DEADLINE: the deadline \S+ is \d+ s in the past"),
])
def test_a_start_that_fails_on_its_deadline_names_it_and_leaves_nothing_behind(tmp_path: Path, monkeypatch,
                                                                                deadline, said) -> None:
    """A deadline in milliseconds (``date +%s%3N``) or one already past fails ``start`` with a
    ConfigError naming the variable, not a traceback from deep in the budget; and what the
    start set up before is taken down: the process's SIGTERM handler is its own again, no
    thread of the run stays, the lease is released, and the same job dir starts at once with
    the variable fixed."""
    import signal
    import threading

    from ftkit.errors import ConfigError

    now = time.time()
    monkeypatch.setenv("FTKIT_DEADLINE", str(int(now * 1000) + 3_600_000) if deadline == "ms" else str(int(now) - 60))
    before = signal.getsignal(signal.SIGTERM)
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError, match=said), ftkit.FaultTolerance(tmp_path, state={"x": {"a": 1}}):
        pytest.fail("started")
    assert signal.getsignal(signal.SIGTERM) is before
    assert not [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert json.loads((tmp_path / "lease.json").read_text())["released"] is not None
    monkeypatch.setenv("FTKIT_DEADLINE", str(int(now) + 3600))
    with ftkit.FaultTolerance(tmp_path, state={"x": {"a": 1}}) as ft:
        assert ft.budget.end_time == int(now) + 3600
        assert signal.getsignal(signal.SIGTERM) is not before


def test_a_run_resumed_past_its_total_trains_nothing_and_writes_no_mislabelled_checkpoint(tmp_path: Path) -> None:
    """Trained to step 6 before, run again with ``range(5)`` (the total lowered by mistake):
    no step runs, and no checkpoint of step 5 is written (it would hold step 6's state), so
    retention drops none of the real ones; the run says so."""
    import torch

    model = torch.nn.Linear(2, 2)
    cfg = ftkit.Config(save_every=2, checkpoint=ftkit.CheckpointConfig(keep_last=3))
    with ftkit.FaultTolerance(tmp_path, state={"model": model}, config=cfg) as ft:
        for _ in ft.range(6):
            with torch.no_grad():
                model.weight.add_(1.0)
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert steps[-3:] == ["step-00000002", "step-00000004", "step-00000006"], steps
    ran = []
    with ftkit.FaultTolerance(tmp_path, state={"model": model}, config=cfg) as ft:
        ran = list(ft.range(5))
    assert ran == [] and ft.completed
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == steps
    ends = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "exit"]
    assert ends[-1]["completed"] is True


def test_a_signal_at_the_last_step_completes_the_run(tmp_path: Path) -> None:
    """SIGUSR1 (save, exit, requeue) during the last step of ``range(5)``: the checkpoint of
    step 5 is written and the run is complete; its exit event says so, so the requeue helper
    does not send back a job with nothing left to train."""
    import os
    import signal
    import subprocess
    import sys

    import torch

    model = torch.nn.Linear(2, 2)
    cfg = ftkit.Config(watch=ftkit.WatchConfig(mode="off"), budget=ftkit.BudgetConfig(enabled=False))
    with ftkit.FaultTolerance(tmp_path, state={"model": model}, config=cfg) as ft:
        for step in ft.range(5):
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
    assert ft.completed
    end = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "exit"][-1]
    assert end["completed"] is True and end["step"] == 5 and end["requeue"] is True, end
    assert (tmp_path / "checkpoints" / "step-00000005").is_dir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "SLURM_"))}
    said = subprocess.run([sys.executable, "-m", "ftkit", "requeue", "--dry-run", str(tmp_path), "--exit-code", "0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert "training completed (step 5)" in said.stdout + said.stderr, said.stdout + said.stderr


def test_burst_while_saving_changes_only_the_log(tmp_path: Path) -> None:
    """Save requests that arrive before a save has finished are covered by it."""

    class SlowState:
        def state_dict(self):
            return {"x": 1}

        def load_state_dict(self, sd):
            pass

    with ftkit.FaultTolerance(tmp_path, state={"s": SlowState()}) as ft:
        ft.request("save", reason="first")
        d = ft.step(1)
        assert d.save and d.reasons == ("first",)
        ft.box.post(ftkit.decision.Request(Action.SAVE, Source.SIGNAL, "late", created=0.0))  # created before the save ended
        assert not ft.check(2)
        ft.request("save", reason="after")
        assert ft.check(3).save
    events = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "trigger"]
    assert [(e["reason"], e["ignored"] is not None) for e in events] == [
        ("first", False), ("late", True), ("after", False)]


def test_status_json_shows_pending_switches_and_events(tmp_path: Path) -> None:
    ftkit_cli("save", str(tmp_path))
    ftkit_cli("request", "stop", str(tmp_path))
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1.0, "event": "start", "rank": 0}) + "\n")
    out = ftkit_cli("status", "--json", str(tmp_path))
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["save_switch"] is True and status["kill_switch"] is False
    assert [r["action"] for r in status["requests"]] == ["stop"]
    assert status["events"][0]["event"] == "start"


def test_status_of_a_running_job_with_a_deadline_shows_the_time_left_before_any_save(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setenv("FTKIT_DEADLINE", str(int(time.time()) + 3600))
    proc = start_loop(tmp_path, 100000, 0.01)
    try:
        status = json.loads(ftkit_cli("status", "--json", str(tmp_path)).stdout)
    finally:
        proc.kill()
        proc.communicate()
    assert status["save_estimate"] is None and status["time_left"] > 3500, status
    assert status["verdict"].endswith(f"; {status['time_left']:.0f} s left, no save measured yet"), status["verdict"]


def test_status_on_missing_jobdir_names_it(tmp_path: Path) -> None:
    out = ftkit_cli("status", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr and "does not exist" in out.stderr


def test_request_files_seen_after_an_exit_are_removed_at_close(tmp_path: Path) -> None:
    """The trap's request file arriving after the forwarded signal must not stop the next run."""
    from ftkit.triggers.switches import write_request

    with ftkit.FaultTolerance(tmp_path) as ft:
        ft.request("exit", reason="signal got there first")
        assert ft.check(1).exit
        path = write_request(tmp_path, "requeue", reason="late trap")
        wait_for(lambda: ft.box.pending, 10, what="request file seen")
        assert ft.check(2).reasons == ("signal got there first",)
    assert not path.exists()
    with ftkit.FaultTolerance(tmp_path) as ft:
        assert not ft.check(1)


def test_a_crash_in_the_loop_is_recorded_in_the_exit_event(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), ftkit.FaultTolerance(tmp_path) as ft:
        ft.check(1)
        raise RuntimeError("boom")
    exit_event = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "exit"][-1]
    assert exit_event["error"] == "RuntimeError: boom" and exit_event["completed"] is False


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_events_seconds_count_the_state_capture(tmp_path: Path, background) -> None:
    """A state whose ``state_dict()`` takes 0.4 s (an FSDP gather, say): the ``save`` event's
    ``seconds``, which ``ftkit status`` and a pod's grace period are sized from, count it, not
    only the write."""

    from tests.ckpt_helpers import SlowState

    config = ftkit.Config(async_save=ftkit.AsyncConfig() if background else None)
    with ftkit.FaultTolerance(tmp_path, state={"slow": SlowState(0.4)}, config=config) as ft:
        ft.save(1)
    saves = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "save"]
    assert [e["step"] for e in saves] == [1] and saves[0]["seconds"] >= 0.4, saves


def test_a_symlinked_job_dir_retargeted_during_the_run_keeps_the_run_in_one_directory(tmp_path: Path) -> None:
    """``cur -> realA`` at start, ``cur -> realB`` after step 2 (a person reuses the link for a
    new experiment): the run's later checkpoints, events and lease stay in realA, and realB
    is free for the run that is started in it."""
    import torch

    (tmp_path / "realA").mkdir()
    (tmp_path / "realB").mkdir()
    cur = tmp_path / "cur"
    cur.symlink_to("realA")
    model = torch.nn.Linear(2, 2)
    cfg = ftkit.Config(save_every=2, watch=ftkit.WatchConfig(mode="off"), budget=ftkit.BudgetConfig(enabled=False))
    with ftkit.FaultTolerance(cur, state={"model": model}, config=cfg) as ft:
        for step in ft.range(4):
            if step == 2:
                cur.unlink()
                cur.symlink_to("realB")
                with ftkit.FaultTolerance(cur, config=cfg) as other:  # not refused: realB is not this run's
                    assert other.job.root == (tmp_path / "realB").resolve()
    assert ft.job.root == (tmp_path / "realA").resolve()
    assert sorted(p.name for p in (tmp_path / "realA" / "checkpoints").glob("step-*")) == [
        "step-00000002", "step-00000004"]
    assert not (tmp_path / "realB" / "checkpoints").exists()
    ends = [e for e in read_events(tmp_path / "realA" / "events.jsonl") if e["event"] == "exit"]
    assert ends[-1]["completed"] is True and ends[-1]["step"] == 4


def test_a_read_only_or_full_job_dir_is_refused_naming_the_file_and_the_fix(small_fs: Path) -> None:
    """A job dir on a filesystem remounted read-only, and on one that is full: the run stops at
    start with a ConfigError naming the file it could not write and what to do, not a raw
    OSError traceback."""
    import subprocess

    cfg = ftkit.Config(watch=ftkit.WatchConfig(mode="off"), budget=ftkit.BudgetConfig(enabled=False))
    (small_fs / "job").mkdir()
    fill_up(small_fs / "filler")
    with pytest.raises(ftkit.ConfigError, match=r"cannot use job dir .*job: No space left on device on .*lease.*"
                                                r"the filesystem is full"):
        ftkit.FaultTolerance(small_fs / "job", config=cfg).start()
    ro = small_fs.parent / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(ftkit.ConfigError, match=r"cannot use job dir .*other: Read-only file system on .*other.*"
                                                    r"read-only: give a job dir on a writable one"):
            ftkit.FaultTolerance(ro / "other", config=cfg)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_saves_that_keep_failing_stop_the_run(small_fs: Path, tmp_path: Path, caplog) -> None:
    """The checkpoint root's filesystem is full: each periodic save fails with a warning that
    counts, and the third in a row stops the run (max_failed_saves=3) with the last error,
    rather than training on with nothing saved; None trains on."""
    import torch

    fill_up(small_fs / "filler")
    model = torch.nn.Linear(64, 64)

    def config(most):
        return ftkit.Config(save_every=2, max_failed_saves=most, watch=ftkit.WatchConfig(mode="off"),
                            budget=ftkit.BudgetConfig(enabled=False), save_at_end=False,
                            checkpoint=ftkit.CheckpointConfig(root=small_fs / "checkpoints"))

    done = []
    stops = r"3 saves in a row failed \(max_failed_saves=3\); stopping rather than train on with nothing saved since its start"
    with (pytest.raises(ftkit.CheckpointError, match=stops),
          ftkit.FaultTolerance(tmp_path / "a", state={"model": model}, config=config(3)) as ft):
        for step in ft.range(20):
            done.append(step)
    assert done[-1] == 5, done  # saves at 2, 4 (warned) and 6 (the third: stops)
    assert any("(2 of 3 in a row: then the run stops)" in r.getMessage() for r in caplog.records)
    end = [e for e in read_events(tmp_path / "a" / "events.jsonl") if e["event"] == "exit"][-1]
    assert "max_failed_saves=3" in end["error"] and end["completed"] is False and end["saves_failed"] == 3
    # the requeue helper does not send back a run whose saves would fail the same way
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "SLURM_"))}
    said = subprocess.run([sys.executable, "-m", "ftkit", "requeue", "--dry-run", str(tmp_path / "a"),
                           "--exit-code", "1"], capture_output=True, text=True, timeout=60, env=env)
    out = said.stdout + said.stderr
    assert "would not requeue" in out and "after 3 saves in a row failed" in out and "fix the checkpoint dir" in out, out
    with ftkit.FaultTolerance(tmp_path / "b", state={"model": model}, config=config(None)) as ft:
        assert list(ft.range(8)) == list(range(8))
    with pytest.raises(ftkit.ConfigError, match="max_failed_saves"):
        ftkit.Config(max_failed_saves=0)


def test_a_save_switch_whose_save_failed_is_tried_again(small_fs: Path, tmp_path: Path) -> None:
    """The save a save-switch asks for fails (the checkpoint root is full); space comes back:
    the switch, still there, is answered by the next try, pinned, and removed (it stayed,
    shown as pending, with no save coming)."""
    import torch

    filler = fill_up(small_fs / "filler")
    model = torch.nn.Linear(64, 64)
    cfg = ftkit.Config(watch=ftkit.WatchConfig(mode="polling", poll_interval=0.02), save_at_end=False,
                       budget=ftkit.BudgetConfig(enabled=False),
                       checkpoint=ftkit.CheckpointConfig(root=small_fs / "checkpoints"))
    job = tmp_path / "job"
    with ftkit.FaultTolerance(job, state={"model": model}, config=cfg) as ft:
        for step in ft.range(20):
            if step == 3:
                job.joinpath("save-switch").touch()
                wait_for(lambda: ft.box.pending, timeout=10, what="the save-switch to be seen")
            if filler.exists() and any(e["event"] == "save-failed" for e in read_events(job / "events.jsonl")):
                filler.unlink()  # the space comes back after the first try failed
    events = list(read_events(job / "events.jsonl"))
    failed = [e["step"] for e in events if e["event"] == "save-failed"]
    saved = [e["step"] for e in events if e["event"] == "save"]
    assert len(failed) == 1 and saved == [failed[0] + 1], (failed, saved)
    assert (small_fs / "checkpoints" / f"step-{saved[0]:08d}" / "pinned").exists()
    assert not job.joinpath("save-switch").exists()
