"""`ftkit report`: a job dir driven through real runs (kill -9, resume, SIGUSR1, completion)
is accounted for in time buckets that add up to the measured wall time; an events log
written by the previous release (tests/data/previous-release-events.jsonl) still reports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.events import read_events
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "goodput_loop.py"
DATA = ROOT / "tests" / "data"
STEP = 0.03
SAVE_EVERY = 100
TOTAL = 330


def ftkit_cli(*args: str, columns: int = 250) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, timeout=120,
                          check=True, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)})


def steps_log(jobdir: Path) -> list[tuple[int, int, float]]:
    try:
        lines = (jobdir / "steps.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(int(p), int(s), float(t)) for p, s, t in (line.split() for line in lines if line.count(" ") == 2)]


class Run:
    """One training process, timed from outside: from Popen to its last statement (the time it
    writes into ended-PID), or to the return of kill -9. The interpreter's teardown after the
    last statement is not counted: no record of the process can see it (docs/goodput.md)."""

    def __init__(self, jobdir: Path, restart: int) -> None:
        self.jobdir = jobdir
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restart),
               "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "1"}
        self.began = time.time()
        self.proc = subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), str(TOTAL), str(STEP),
                                      str(SAVE_EVERY), "--progress", "0.1"], env=env)
        self.ended: float | None = None

    def wait(self) -> int:
        rc = self.proc.wait(timeout=120)
        self.ended = time.time()
        marker = self.jobdir / f"ended-{self.proc.pid}"
        if marker.exists():
            self.ended = float(marker.read_text())
        return rc

    @property
    def wall(self) -> float:
        assert self.ended is not None
        return self.ended - self.began


def progress_count(jobdir: Path) -> int:
    return sum(1 for e in read_events(jobdir / "events.jsonl") if e["event"] == "progress")


def test_report_buckets_add_up_across_kill9_usr1_and_completion(tmp_path: Path) -> None:
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    runs: list[Run] = []

    # run 0: killed with kill -9 right after a progress record, well past the checkpoint at 100
    run = Run(jobdir, 0)
    runs.append(run)
    wait_for(lambda: any(s >= 170 for _, s, _ in steps_log(jobdir)), 90, what="run 0 past step 170")
    seen = progress_count(jobdir)
    wait_for(lambda: progress_count(jobdir) > seen, 10, interval=0.005, what="a fresh progress record")
    run.proc.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    killed_at = max(s for p, s, _ in steps_log(jobdir) if p == run.proc.pid)
    time.sleep(0.5)  # "in the queue"

    # run 1: resumes from 100, stopped by SIGUSR1 (save, exit, ask for a requeue) past step 250
    run = Run(jobdir, 1)
    runs.append(run)
    wait_for(lambda: any(p == run.proc.pid and s >= 250 for p, s, _ in steps_log(jobdir)), 90, what="run 1 at 250")
    run.proc.send_signal(signal.SIGUSR1)
    assert run.wait() == 0
    time.sleep(0.5)

    # run 2: completes
    run = Run(jobdir, 2)
    runs.append(run)
    assert run.wait() == 0

    report = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)
    rows = report["runs"]
    assert [r["restart_count"] for r in rows] == [0, 1, 2] and [r["job_id"] for r in rows] == ["4242"] * 3
    assert rows[0]["cause"] == "killed (no exit record)" and rows[0]["unplanned"] and not rows[0]["end_known"]
    assert rows[1]["cause"].startswith("requeue: SIGUSR1") and not rows[1]["unplanned"]
    assert rows[2]["cause"] == "completed"
    assert rows[1]["resumed_from"] == 100 and rows[2]["resumed_from"] == rows[1]["last_step"]
    assert rows[0]["resumed_from"] is None and rows[0]["last_durable"] == 100
    assert rows[2]["last_step"] == TOTAL and rows[2]["gpus"] == 4

    # the buckets add up to the wall time of every run, measured from outside, within 2 %
    buckets = report["buckets"]
    measured = sum(r.wall for r in runs)
    assert sum(buckets.values()) == pytest.approx(report["wall"], rel=1e-9)
    assert report["wall"] == pytest.approx(measured, rel=0.02), (report["wall"], measured, buckets)
    for row, run in zip(rows, runs, strict=True):
        assert sum(row["buckets"].values()) == pytest.approx(row["wall"], rel=1e-9)
        assert row["wall"] == pytest.approx(run.wall, rel=0.05, abs=0.15)

    # re-done work: the steps run 0 computed after its checkpoint at 100, which run 1 computed
    # again, times the step time measured from the steps' own timestamps
    times = {s: t for p, s, t in steps_log(jobdir) if p == runs[0].proc.pid}
    step_time = (times[killed_at] - times[101]) / (killed_at - 101)  # run 0's own pace after its save
    redone_steps = killed_at - 100
    assert rows[0]["redone_steps"] == pytest.approx(redone_steps, abs=3)
    assert buckets["redone"] == pytest.approx(redone_steps * step_time, rel=0.10), (buckets, step_time)
    assert rows[1]["redone_steps"] == 0 and rows[1]["buckets"]["redone"] == 0.0  # it saved on the way out

    # restart cost: every run pays interpreter + imports; runs 1 and 2 found and loaded a checkpoint
    for row in rows:
        parts = row["restart_parts"]
        assert parts["before_ftkit"] > 0.05  # python + torch import, measured from /proc/self/stat
        assert all(v >= 0 for v in parts.values()), parts  # each part a real stretch of the run's time
        assert row["buckets"]["restart"] == pytest.approx(sum(parts.values()))
    assert rows[1]["restart_parts"]["find"] > 0 and rows[1]["restart_parts"]["load"] > 0
    # the records behind them, in the order a restart goes: process start, ftkit start, the
    # checkpoint found and loaded (the load call inside resume), the first step after it
    starts = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "start"]
    for start, run in zip(starts, runs, strict=True):
        later = [e for e in read_events(jobdir / "events.jsonl") if e.get("pid") == run.proc.pid]
        first = {name: next(e for e in later if e["event"] == name) for name in ("start", "resume", "first-step")}
        assert run.began - 0.5 <= start["process_start"] <= start["ftkit_start"] <= first["resume"]["time"]
        assert first["resume"]["time"] <= first["first-step"]["time"] <= run.ended
        if run is not runs[0]:
            load = next(e for e in later if e["event"] == "load")
            assert 0 < load["find_seconds"] <= first["resume"]["seconds"]
            assert 0 < load["read_seconds"] <= first["resume"]["seconds"] - load["find_seconds"] + 1e-3
    assert report["between_runs"] >= 1.0  # the two pauses "in the queue"

    # goodput from the buckets
    assert report["goodput"] == pytest.approx(buckets["productive"] / report["wall"])
    assert report["goodput_with_queue"] == pytest.approx(
        buckets["productive"] / (report["wall"] + report["between_runs"]))
    assert report["lost_gpu_hours"] == pytest.approx(4 * (report["wall"] - buckets["productive"]) / 3600)
    assert report["interval"]["failures"] == 1 and report["interval"]["recommended"] > 0

    # progress records are timed, not per step: at most one per 0.1 s of each run
    records = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "progress" and "stall" not in e]
    assert 0 < len(records) <= sum(r.wall for r in runs) / 0.1 + 3 * len(runs)

    # the human-readable report says the same
    text = ftkit_cli("report", str(jobdir), "--gpus-per-node", "8").stdout
    assert "goodput" in text and "re-done work" in text and "GPU-hours lost" in text
    assert "killed (no exit record)" in text
    # each run's restart cost by component: all of them where each run gets lines of its own
    narrow = ftkit_cli("report", str(jobdir), columns=80).stdout
    costs = [line.strip() for line in narrow.splitlines() if line.strip().startswith("restart cost ")]
    assert len(costs) == 3 and all("start " in c for c in costs), narrow
    assert "find " in costs[1] and "load " in costs[1], costs


def test_report_on_a_previous_release_log_says_what_it_cannot_know(tmp_path: Path) -> None:
    """tests/data/previous-release-events.jsonl: three `ftkit demo` runs of main at 122984e (the
    release before this report), made by tests/data/previous-release-events.sh: SLURM job 1001,
    run 0 killed with kill -9 after its checkpoint at 200, run 1 resumed and stopped by SIGUSR1
    at 402, run 2 completed 600 steps."""
    jobdir = tmp_path / "old"
    jobdir.mkdir()
    shutil.copy(DATA / "previous-release-events.jsonl", jobdir / "events.jsonl")
    report = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)
    rows = report["runs"]
    assert [r["restart_count"] for r in rows] == [0, 1, 2]
    assert [r["cause"] for r in rows] == ["killed (no exit record)", "requeue: SIGUSR1 received", "completed"]
    assert [r["resumed_from"] for r in rows] == [None, 200, 402]
    assert [r["last_step"] for r in rows] == [200, 402, 600]
    assert all(r["process_start"] is None and r["first_step"] is None for r in rows)
    assert sum(report["buckets"].values()) == pytest.approx(report["wall"])
    assert report["restart_parts"]["before_ftkit"] == 0.0
    assert report["lost_gpu_hours"] is None
    assert any("written before ftkit recorded timing facts" in n for n in report["notes"])
    assert any("GPUs per node unknown" in n for n in report["notes"])
    text = ftkit_cli("report", str(jobdir)).stdout
    assert "note: written before ftkit recorded timing facts" in text


def test_a_run_stopped_by_the_kill_switch_at_start_is_not_reported_as_a_fresh_start(tmp_path: Path) -> None:
    """A run that finds the kill-switch at start exits without looking for a checkpoint: the
    report says it did not load one, not that it started over, and the next run resumes."""
    jobdir = tmp_path / "job"

    def run(*extra: str) -> int:
        return subprocess.run([sys.executable, str(PROGRAM), str(jobdir), "1000", "0.01", "5", *extra],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120).returncode

    assert run("--die-after", "0.3") == -signal.SIGKILL  # fresh start, checkpoints, then killed
    ftkit_cli("kill", str(jobdir))
    assert run() == 0
    ftkit_cli("kill", "--clear", str(jobdir))
    assert run("--die-after", "0.1") == -signal.SIGKILL
    rows = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)["runs"]
    assert [r["resumed"] for r in rows] == [True, False, True], rows
    assert rows[0]["resumed_from"] is None and rows[1]["resumed_from"] is None
    assert rows[2]["resumed_from"] == rows[0]["last_durable"] > 0, rows
    narrow = ftkit_cli("report", str(jobdir), columns=80).stdout  # a few lines per run
    shown = re.findall(r"resumed from (.+), last durable", narrow)
    assert shown == ["fresh", "not loaded", str(rows[0]["last_durable"])], narrow


def test_report_in_a_narrow_terminal_cuts_nothing_short(tmp_path: Path) -> None:
    """In an 80-column terminal the runs table does not fit: each run is then printed on a few
    lines, every exit cause and time whole; a wide terminal gets the table, one line per run."""
    jobdir = tmp_path / "old"
    jobdir.mkdir()
    shutil.copy(DATA / "previous-release-events.jsonl", jobdir / "events.jsonl")
    report = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)
    clock = [time.strftime("%m-%d %H:%M:%S", time.localtime(r["start"])) for r in report["runs"]]
    narrow = ftkit_cli("report", str(jobdir), columns=80).stdout
    assert "\u2026" not in narrow  # rich's ellipsis: nothing cut short
    for r, start in zip(report["runs"], clock, strict=True):
        assert f"run {r['run']}: exit {r['cause']}" in narrow
        assert f"start {start}," in narrow
        assert f"steps {r['steps']} (to {r['last_step']})" in narrow
    wide = ftkit_cli("report", str(jobdir), columns=250).stdout
    rows = [line for line in wide.splitlines() if "requeue: SIGUSR1 received" in line]
    assert len(rows) == 1 and clock[1] in rows[0] and rows[0].startswith("\u2502 1 ")  # one table row


def test_report_lists_the_newest_runs_and_counts_them_all(tmp_path: Path) -> None:
    """A job dir of many runs (a long job requeued for weeks): the report lists the newest
    ``--runs`` (a screenful, not thousands of lines), says which are not listed, and its totals
    are every run's; ``--runs 0`` lists them all, ``--json`` always does."""
    jobdir = tmp_path / "old"
    jobdir.mkdir()
    shutil.copy(DATA / "previous-release-events.jsonl", jobdir / "events.jsonl")
    full = ftkit_cli("report", str(jobdir), "--runs", "0").stdout
    newest = ftkit_cli("report", str(jobdir), "--runs", "1").stdout
    assert "not listed" not in full and all(f"\u2502 {i} " in full for i in range(3))
    assert "runs 0-1 not listed: the newest 1 are (--runs 0 lists every run" in newest
    assert "\u2502 2 " in newest and "\u2502 0 " not in newest and "\u2502 1 " not in newest
    totals = [line for line in full.splitlines() if "wall time of all runs" in line or "goodput" in line]
    assert totals and all(line in newest for line in totals)  # the totals count every run either way
    assert len(json.loads(ftkit_cli("report", str(jobdir), "--json", "--runs", "1").stdout)["runs"]) == 3
    wrong = subprocess.run([sys.executable, "-m", "ftkit", "report", str(jobdir), "--runs", "-1"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert wrong.returncode == 2 and "--runs" in wrong.stderr


def test_report_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    jobdir = tmp_path / "old"
    jobdir.mkdir()
    shutil.copy(DATA / "previous-release-events.jsonl", jobdir / "events.jsonl")
    out = tmp_path / "timeline.png"
    ftkit_cli("report", str(jobdir), "--plot", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_report_errors_name_the_problem(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, "-m", "ftkit", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    empty = subprocess.run([sys.executable, "-m", "ftkit", "report", str(tmp_path)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert empty.returncode != 0 and "no run" in empty.stderr


def test_report_cli_help_stays_light() -> None:
    code = ("import sys\nfrom ftkit.cli import main\ntry:\n    main(['report', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('HEAVY' if {'torch', 'matplotlib'} & set(sys.modules) else 'LIGHT')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "--plot" in out and out.strip().endswith("LIGHT")


def _records(*runs: list[tuple[str, dict]]) -> list[dict]:
    out, t = [], 1000.0
    for pid, run in enumerate(runs, start=1):
        for kind, fields in run:
            t += 10.0
            out.append({"time": t, "event": kind, "rank": 0, "pid": pid, **fields})
    return out


def test_unplanned_interruptions_are_crashes_kills_and_hangs_not_time_limits() -> None:
    from ftkit.report import parse_runs

    start = ("start", {"process_start": 0.0})
    log = _records(
        [start, ("exit", {"step": 5, "requeue": True, "reasons": ["time budget"]}),
         ("requeue", {"cause": "time limit", "requeue": True})],
        [start, ("exit", {"step": 9, "error": "RuntimeError: boom"})],
        [start, ("progress", {"step": 12})],
        [start, ("hang", {"step": 15}), ("requeue", {"cause": "crash", "requeue": True})],
        [start, ("exit", {"step": 20, "requeue": True, "reasons": ["SIGUSR1 received"]})],
        [start, ("exit", {"step": 30, "completed": True})],
        # a node lost: SLURM requeues the job, the trainer's peers crash (or it is killed)
        [start, ("exit", {"step": 31, "error": "RuntimeError: Connection reset by peer"}),
         ("requeue", {"cause": "requeued by SLURM", "requeue": True})],
        [start, ("progress", {"step": 33}), ("requeue", {"cause": "requeued by SLURM", "requeue": True})],
        # an admin's `scontrol requeue`: SIGTERM, a save and a clean exit
        [start, ("exit", {"step": 35, "reasons": ["SIGTERM received"]}),
         ("requeue", {"cause": "requeued by SLURM", "requeue": True})],
    )
    runs = parse_runs(log)
    assert [r.cause for r in runs] == ["time limit", "crash: RuntimeError: boom", "killed (no exit record)",
                                       "hang (watchdog)",
                                       "requeue: SIGUSR1 received", "completed",
                                       "requeued by SLURM after a crash (a node lost?): RuntimeError: Connection "
                                       "reset by peer",
                                       "requeued by SLURM, its trainer killed without an exit record (a node lost?)",
                                       "requeued by SLURM"]
    assert [r.unplanned for r in runs] == [False, True, True, True, False, False, True, True, False]
    assert runs[2].end == runs[2].events[-1]["time"] and runs[2].last_step == 12


def test_a_checkpoint_the_saver_persisted_after_the_trainer_died_counts_as_steps_done() -> None:
    """The crash-safe saver (a process of its own) persists the trainer's last snapshot, of a
    step past the trainer's last progress record: the run got that far."""
    from ftkit.report import parse_runs

    log = _records([("start", {"process_start": 0.0}), ("progress", {"step": 30})],
                   [("start", {"process_start": 0.0}), ("resume", {"step": 33}), ("progress", {"step": 40})])
    log.insert(2, {"time": log[1]["time"] + 1, "event": "save", "rank": 0, "pid": 99, "step": 33,
                   "reason": "trainer died"})
    first, second = parse_runs(log)
    assert (first.last_step, first.last_durable, first.cause) == (33, 33, "killed (no exit record)")
    assert second.resume_step == 33 and second.last_step == 40


RESCUED = """
import sys, time, torch, ftkit
config = ftkit.Config(save_every=None, async_save=ftkit.AsyncConfig(crash_safe=True, memory_every=5))
with ftkit.FaultTolerance(sys.argv[1], state={"model": torch.nn.Linear(8, 8)}, config=config) as ft:
    for step in ft.range(100000):
        time.sleep(0.1)
        print(step + 1, flush=True)
"""


def test_a_killed_run_whose_saver_rescued_its_snapshot_trained_until_that_snapshot(tmp_path: Path) -> None:
    """kill -9 of a crash-safe run after ~4 s of training and no progress record of its own
    (``progress_every`` is a minute): the saver's rescue of step 40 is the run's last record.
    The report gave the run 0.1 s of training for its 40 steps (it ended at the first step)."""
    from ftkit.report import parse_runs

    proc = subprocess.Popen([sys.executable, "-c", RESCUED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in proc.stdout:
            if int(line) >= 42:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    wait_for(lambda: [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "save"], 60,
             what="the saver's rescue")
    events = list(read_events(tmp_path / "events.jsonl"))
    (rescue,) = [e for e in events if e["event"] == "save"]
    assert rescue["pid"] != proc.pid and rescue["step"] == 40, rescue
    (run,) = parse_runs(events)
    assert run.last_step == 40 and run.end == float(rescue["time"]) - rescue["seconds"], (run.end, rescue)
    assert run.loop_end - run.loop_start >= 3.5, (run.loop_start, run.loop_end)  # 40 steps of 0.1 s
    assert any("persist of its last snapshot" in note for note in run.notes), run.notes


def test_a_run_still_going_is_reported_as_running_not_killed(tmp_path: Path) -> None:
    jobdir = tmp_path / "live"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), "100000", "0.01", "50", "--progress", "0.1"],
                            env=env)
    try:
        wait_for(lambda: progress_count(jobdir) >= 2, 90, what="progress records of the live run")
        row = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)["runs"][-1]
        assert row["cause"] == "running (no exit record yet)" and not row["unplanned"]
    finally:
        proc.kill()
        proc.wait()
    row = json.loads(ftkit_cli("report", str(jobdir), "--json").stdout)["runs"][-1]
    assert row["cause"] == "killed (no exit record)" and row["unplanned"]


def test_memory_snapshots_are_counted_as_the_loop_stall_they_are(tmp_path: Path) -> None:
    """A background save with a memory snapshot every step (``memory_every=1``), whose state
    takes 50 ms to capture: the loop stalls ~50 ms a step for it, without a save. The report
    counts those stalls (in ``progress`` records: one per ``progress_every``, not one per
    snapshot), where it counted them as productive time."""
    import time

    import ftkit
    from ftkit.events import read_events
    from ftkit.report import analyse
    from tests.ckpt_helpers import SlowState

    config = ftkit.Config(async_save=ftkit.AsyncConfig(memory_every=1), save_at_end=False,
                          timing=ftkit.control.runclock.TimingConfig(progress_every=0.2))
    with ftkit.FaultTolerance(tmp_path, state={"slow": SlowState(0.05)}, config=config) as ft:
        for _ in ft.range(20):
            time.sleep(0.01)
    events = list(read_events(tmp_path / "events.jsonl"))
    assert not [e for e in events if e["event"] == "save"]  # snapshots only
    report = analyse(events)
    stall = report["buckets"]["stall"]
    assert stall >= 19 * 0.05 * 0.9, report["buckets"]
    assert report["buckets"]["productive"] < 20 * 0.01 * 2 + 0.5, report["buckets"]
    assert len([e for e in events if e["event"] == "progress"]) < 15  # not one per snapshot


def test_a_hang_is_lost_time_and_its_steps_are_redone() -> None:
    """Run 0 saved step 20 at t=100, did steps up to 25 by t=105, then hung until the watchdog
    ended it at t=130 (its ``hang`` record: last step 25, done at 105, waited 25 s); run 1
    resumed from 20. The 25 s of the hang are no training (exit_wait), and the 5 s from step
    20 to 25 are redone by run 1, where the report took the hang for 30 s of productive loop."""
    from ftkit.report import analyse

    t0 = 1000.0
    log = [
        {"time": t0, "event": "start", "rank": 0, "pid": 1, "process_start": t0, "ftkit_start": t0,
         "setup_seconds": 0.0},
        {"time": t0, "event": "resume", "rank": 0, "pid": 1, "step": None, "seconds": 0.0, "manager_seconds": 0.0},
        {"time": t0 + 100, "event": "save", "rank": 0, "pid": 1, "step": 20, "seconds": 0.0},
        {"time": t0 + 100, "event": "progress", "rank": 0, "pid": 1, "step": 20, "stall": 0.0, "save_step": 20},
        {"time": t0 + 130, "event": "hang", "rank": 1, "pid": 2, "step": 25, "seconds": 25.0,
         "last_step_wall": t0 + 105},
        {"time": t0 + 140, "event": "start", "rank": 0, "pid": 3, "process_start": t0 + 140, "ftkit_start": t0 + 140,
         "setup_seconds": 0.0},
        {"time": t0 + 140, "event": "resume", "rank": 0, "pid": 3, "step": 20, "seconds": 0.0, "manager_seconds": 0.0},
        {"time": t0 + 160, "event": "exit", "rank": 0, "pid": 3, "step": 40, "completed": True, "last_step": 40},
    ]
    report = analyse(log)
    first = report["runs"][0]
    assert first["cause"] == "hang (watchdog)", first
    assert first["redone_steps"] == 5 and first["buckets"]["redone"] == pytest.approx(5.0), first
    assert first["buckets"]["exit_wait"] == pytest.approx(25.0), first
    assert first["buckets"]["productive"] == pytest.approx(100.0), first
    assert sum(first["buckets"].values()) == pytest.approx(first["wall"])


def test_a_multi_rank_crash_names_the_rank_that_failed_first() -> None:
    """Rank 1 raises; rank 0 ends 0.6 s later with gloo's echo of it: the run's cause is rank
    1's error, named, not rank 0's "Connection closed by peer"."""
    from ftkit.report import parse_runs

    log = _records([("start", {"process_start": 0.0, "world_size": 2}), ("progress", {"step": 20})])
    t = log[-1]["time"]
    log += [{"time": t + 1.0, "event": "exit", "rank": 1, "pid": 77, "step": None, "error": "RuntimeError: boom at step 25"},
            {"time": t + 1.6, "event": "exit", "rank": 0, "pid": 1, "step": None,
             "error": "RuntimeError: [gloo] Connection closed by peer"}]
    [run] = parse_runs(log)
    assert run.cause == "crash: RuntimeError: boom at step 25 (rank 1, the first rank to fail)", run.cause
    assert run.unplanned
