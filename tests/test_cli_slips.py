"""What a person sees after a slip with the CLI or the demo: output piped to a file, a second
demo started on a busy job dir, ``--steps`` at or below the checkpoint, a job dir that is a file,
``ftkit requeue`` and ``ftkit kill --clear`` where the job dir is read-only, a switch touched
when no run is there. Each message must name what to fix; none may be a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ftkit
from tests.conftest import wait_for


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # wide: rich folds a path longer than the line inside it (pytest-xdist's tmp paths are long)
    return subprocess.run([sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "1000"})


def said(r: subprocess.CompletedProcess) -> str:
    return " ".join((r.stdout + r.stderr).split())  # rich wraps long lines


@pytest.fixture
def read_only(small_fs: Path) -> Path:
    """A directory on a real tmpfs that the test remounts read-only (:func:`remount_ro`)."""
    return small_fs


def remount_ro(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def test_the_demo_piped_to_a_file_prints_its_progress_as_it_goes(tmp_path: Path) -> None:
    """Without a terminal (``> log``, ``| tee``) there is no live display to redraw: the run
    prints plain lines as it trains, and the last line is a line of its own."""
    log = tmp_path / "demo.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ftkit", "demo", "--jobdir", str(tmp_path / "job"),
                                 "--steps", "400", "--step-time", "0.01"], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "step 100 loss" in log.read_text(), 60, what="a progress line before the end")
            assert proc.poll() is None, log.read_text()  # it is there while the run trains
        finally:
            rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 0, text
    assert "Poke it from another terminal" in text
    last = text.rstrip("\n").splitlines()[-1]
    assert last.startswith("finished 400 steps"), text[-500:]


def test_a_second_demo_on_a_busy_job_dir_says_so_once_and_offers_nothing_to_poke(tmp_path: Path) -> None:
    jobdir = tmp_path / "job"
    first = subprocess.Popen([sys.executable, "-m", "ftkit", "demo", "--no-live", "--jobdir", str(jobdir),
                              "--steps", "100000", "--step-time", "0.01", "--save-every", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (jobdir / "lease.json").exists() and (jobdir / "events.jsonl").exists(), 60,
                 what="the first demo holding the job dir")
        second = cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", "10")
    finally:
        first.terminate()
        first.wait(timeout=60)
    assert second.returncode == ftkit.JobDirBusyError.exit_code, said(second)
    text = said(second)
    assert text.count("is in use by another run") == 1, text  # logged once, not again as `error:`
    assert "Poke it" not in text and "kill -TERM" not in text, text  # not this run's to poke
    assert "lease.json" in text


def test_the_demo_with_nothing_to_train_says_why(tmp_path: Path) -> None:
    fresh = cli("demo", "--no-live", "--jobdir", str(tmp_path / "zero"), "--steps", "0")
    assert fresh.returncode == 0, said(fresh)
    assert "nothing to train: --steps 0" in said(fresh), said(fresh)
    assert "finished before" not in said(fresh)

    jobdir = tmp_path / "job"
    done = cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", "30", "--step-time", "0")
    assert done.returncode == 0 and "finished 30 steps" in said(done), said(done)
    fewer = cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", "10", "--step-time", "0")
    assert fewer.returncode == 0, said(fewer)
    assert "nothing to train: the newest checkpoint" in said(fewer) and "is at step 30, at or past --steps 10" \
        in said(fewer), said(fewer)
    assert "finished 30 steps" not in said(fewer)


def test_a_job_dir_that_is_a_file_is_named_as_one(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a job dir\n")
    for jobdir, what in ((afile, f"job dir {afile}: the job dir is a file, not a directory"),
                         (afile / "sub", f"{afile}, on the job dir's path, is a file, not a directory")):
        with pytest.raises(ftkit.ConfigError, match="is a file, not a directory") as caught:
            ftkit.FaultTolerance(jobdir, state={}).__enter__()
        assert what in str(caught.value)
        demo = cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", "3")
        assert demo.returncode == 2 and what in said(demo) and "Traceback" not in said(demo), said(demo)
    requeue = cli("requeue", str(afile), "--exit-code", "0")
    assert requeue.returncode == 2, said(requeue)
    assert f"job dir {afile} is a file, not a job dir" in said(requeue)
    assert afile.read_text() == "not a job dir\n"


def test_requeue_and_kill_clear_where_the_job_dir_is_read_only(read_only: Path) -> None:
    """``ftkit requeue`` must record a run before it may requeue it (its caps count runs.json):
    where it cannot, it says so naming runs.json and requeues nothing; the batch script still
    ends with the code it would (0 for a run with nothing to requeue, a crash's own). ``kill --clear`` with
    no kill-switch there has nothing to do; with one it names the read-only filesystem."""
    jobdir = read_only / "job"
    jobdir.mkdir()
    (jobdir / "kill-switch").touch()
    (read_only / "job2").mkdir()
    remount_ro(read_only)

    plain = read_only / "job2"
    unrecorded = (f"this run could not be recorded in {plain / 'runs.json'} (Read-only file system): run "
                  f"`ftkit requeue` where the job dir {plain} is writable")
    r = cli("requeue", str(plain), "--exit-code", "0")  # nothing to requeue: the batch script ends 0
    assert r.returncode == 0, said(r)
    assert f"ftkit requeue: not requeued: the program exited with code 0 and left no ftkit exit record; but " \
           f"{unrecorded}" in said(r), said(r)
    assert "Traceback" not in said(r) and ".tmp" not in said(r)
    r = cli("requeue", str(plain), "--exit-code", "137")  # a crash it would requeue: no requeue it cannot count
    assert r.returncode == 137, said(r)
    assert "ftkit requeue: NOT requeued (crashed with exit code 137" in said(r) and unrecorded in said(r), said(r)

    r = cli("kill", "--clear", str(read_only / "job2"))
    assert r.returncode == 0 and f"no kill-switch in {read_only / 'job2'}" in said(r), said(r)
    r = cli("kill", "--clear", str(jobdir))
    assert r.returncode == 2, said(r)
    assert f"{jobdir / 'kill-switch'}: cannot remove the kill switch (Read-only file system)" in said(r)
    assert "mounted writable" in said(r)


def test_status_refuses_a_negative_number_of_events(tmp_path: Path) -> None:
    with ftkit.FaultTolerance(tmp_path, state={}) as ft:
        for _ in ft.range(1):
            pass
    r = cli("status", "--events", "-3", str(tmp_path))
    assert r.returncode == 2 and "--events: a number of events >= 0" in said(r), said(r)


def test_status_of_a_job_dir_taken_over_by_a_restart_says_running(tmp_path: Path) -> None:
    """Split brain: restart 0's trainer ran on after SLURM took its node for lost; it wrote its
    exit (lease lost) after restart 1 started. The restart that trains now is running."""
    import json

    from ftkit.events import EventLog

    log = EventLog(tmp_path / "events.jsonl")
    log.emit("start", world_size=1, job_id="37", restart_count=0, pid=11)
    log.emit("start", world_size=1, job_id="37", restart_count=1, pid=22)
    log.emit("exit", step=60, completed=False, requeue=None, reasons=[], pid=11, error="LeaseLostError")
    r = cli("status", "--json", str(tmp_path))
    assert r.returncode == 0, said(r)
    assert json.loads(r.stdout)["running"] is True
    log.emit("exit", step=95, completed=False, requeue=True, reasons=["SIGUSR1 received"], pid=22)
    assert json.loads(cli("status", "--json", str(tmp_path)).stdout)["running"] is False
