"""The hang watchdog: real hung processes (a deadlocked step, a SIGSTOPped gloo rank, a frozen
job-dir filesystem), what they leave behind (stack file, ``hang`` event, exit code 87, an
intact checkpoint), no firing on slow saves and slow first steps, and the allowance and
culprit rules on a fake clock."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ftkit
from ftkit.control.hangs import Heartbeat, culprit, describe, last_incident
from ftkit.control.watchdog import Watchdog, WatchdogConfig
from ftkit.errors import EXIT_HANG, ConfigError
from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import env, free_port
from tests.conftest import wait_for

PROGRAM = Path(__file__).parent / "programs" / "hang_train.py"
FREEZE_PROGRAM = Path(__file__).parent / "programs" / "freeze_train.py"
TIMEOUT = 2.0  # FTKIT_HANG_TIMEOUT for the process tests
SLACK = 10.0  # the watchdog polls every TIMEOUT/20 s; generous for a loaded machine


def hang_events(jobdir: Path) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "hang"]


def start(jobdir: Path, *args: str, rank: int | None = None, world: int = 1, port: str = "",
          timeout: float = TIMEOUT, **extra: str) -> subprocess.Popen:
    dist = {} if rank is None else {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": port}
    return subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), *args],
                            env=env(FTKIT_HANG_TIMEOUT=str(timeout), **dist, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def heartbeat_step(jobdir: Path, rank: int) -> int:
    try:
        return json.loads((jobdir / "heartbeats" / f"rank{rank}.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


# -- real processes -------------------------------------------------------------------------


def test_a_step_that_blocks_forever_is_dumped_logged_and_ended_with_87(tmp_path: Path) -> None:
    proc = start(tmp_path, "--steps", "40", "--save-every", "5", FTKIT_TEST_HANG_STEP="13")  # after warm-up
    out = finish([proc])[0]
    assert proc.returncode == EXIT_HANG, out
    [hang] = hang_events(tmp_path)
    assert hang["step"] == 12 and hang["rank"] == 0 and hang["threshold"] == TIMEOUT
    assert TIMEOUT <= hang["seconds"] < TIMEOUT + SLACK
    assert hang["frame"].endswith("in _deadlock") and hang["waiting"] is False
    stacks = Path(hang["file"]).read_text()
    assert Path(hang["file"]).name.startswith(f"hang-rank0-{hang['host']}-")
    # the blocking frames, innermost first, under the main thread
    assert 'hang_train.py", line' in stacks and "in _deadlock" in stacks and "in block_forever_in_step" in stacks
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds[-1] == "hang"  # ended hard: no exit event after it
    found = culprit(read_events(tmp_path / "events.jsonl"))
    assert found["rank"] == 0 and found["step"] == 12 and found["file"] == hang["file"]
    assert "rank 0" in describe(found) and "_deadlock" in describe(found)
    # the last checkpoint is intact, and the next run resumes from it and completes
    verify = subprocess.run([sys.executable, "-m", "ftkit", "verify", str(tmp_path)], capture_output=True,
                            text=True, env=env(), timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rerun = start(tmp_path, "--steps", "40", "--save-every", "5")
    out = finish([rerun])[0]
    assert rerun.returncode == 0, out
    resume = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "resume"]
    assert resume[-1]["step"] == 10
    assert json.loads((tmp_path / "result-rank0.json").read_text())["completed"] is True
    assert not (tmp_path / "heartbeats" / "rank0.json").exists()  # a clean close removes it


def test_a_hang_in_a_warm_up_step_after_a_resume_is_found_as_soon_as_the_environment_allows(tmp_path: Path) -> None:
    """A requeued run that hangs right after its resume (the same bad batch) waits out the
    warm-up allowance, 30 min by default: FTKIT_HANG_WARMUP_TIMEOUT shortens it for one job."""
    first = start(tmp_path, "--steps", "40", "--save-every", "5", FTKIT_TEST_HANG_STEP="12")
    assert finish([first])[0] and first.returncode == EXIT_HANG
    again = start(tmp_path, "--steps", "40", "--save-every", "5", FTKIT_TEST_HANG_STEP="12",
                  FTKIT_HANG_WARMUP_TIMEOUT=str(2 * TIMEOUT))  # steps 11-13: warm-up after resuming at 10
    out = finish([again])[0]
    assert again.returncode == EXIT_HANG, out
    hang = hang_events(tmp_path)[-1]
    assert hang["step"] == 11 and hang["threshold"] == 2 * TIMEOUT and hang["why"].startswith("warm-up step 2 of 3")
    assert 2 * TIMEOUT <= hang["seconds"] < 2 * TIMEOUT + SLACK


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is optional and not on PATH")
def test_native_frames_when_py_spy_is_on_path(tmp_path: Path) -> None:
    proc = start(tmp_path, "--steps", "20", FTKIT_TEST_HANG_STEP="6")
    out = finish([proc])[0]
    assert proc.returncode == EXIT_HANG, out
    [hang] = hang_events(tmp_path)
    stacks = Path(hang["file"]).read_text().split("dump --native", 1)
    assert hang["native"] is True and len(stacks) == 2
    assert "_deadlock (hang_train.py" in stacks[1] and "PyThread_acquire_lock" in stacks[1]


def test_slow_saves_and_a_slow_first_step_do_not_fire(tmp_path: Path) -> None:
    """Each save and the first step take twice the timeout: their own allowances cover them."""
    slow = str(2 * TIMEOUT)
    proc = start(tmp_path, "--steps", "6", "--save-every", "5", FTKIT_TEST_SLOW_SAVE=slow, FTKIT_TEST_SLOW_FIRST=slow)
    out = finish([proc])[0]
    assert proc.returncode == 0, out
    assert hang_events(tmp_path) == []
    events = list(read_events(tmp_path / "events.jsonl"))
    resume, *saves = [e for e in events if e["event"] in ("resume", "save")]
    assert [e["step"] for e in saves] == [5, 6]
    # lower bounds from the sleeps: the first step and each save took longer than the timeout
    times = [resume["time"], *(e["time"] for e in saves)]
    assert times[1] - times[0] >= 2 * float(slow) and all(b - a >= float(slow) for a, b in itertools.pairwise(times[1:]))
    assert json.loads((tmp_path / "result-rank0.json").read_text())["completed"] is True


def test_sigstopped_rank_is_named_first_to_stop_by_the_rank_waiting_for_it(tmp_path: Path) -> None:
    port = str(free_port())
    procs = [start(tmp_path, "--steps", "100000", "--step-time", "0.01", rank=r, world=2, port=port)
             for r in range(2)]
    try:
        wait_for(lambda: heartbeat_step(tmp_path, 1) >= 10 or any(p.poll() is not None for p in procs), 120,
                 what="rank 1 past its warm-up")
        os.kill(procs[1].pid, signal.SIGSTOP)
        out0 = finish(procs[:1])[0]
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process too
        finish(procs[1:])
    assert procs[0].returncode == EXIT_HANG, out0
    [hang] = hang_events(tmp_path)  # a stopped process writes nothing
    assert hang["rank"] == 0 and hang["waiting"] is True  # rank 0 was blocked in a collective
    assert "all_reduce" in Path(hang["file"]).read_text() or "backward" in Path(hang["file"]).read_text()
    [peer] = hang["peers"]
    assert peer["rank"] == 1 and peer["running"] is False
    found = culprit(read_events(tmp_path / "events.jsonl"))
    assert found["rank"] == 1 and found["declared_by"] == 0 and found["running"] is False
    assert found["step"] <= hang["step"]
    assert "not running" in found["evidence"] and describe(found).startswith("hang: rank 1 ")


def test_a_rank_stuck_outside_collectives_is_named_though_every_rank_fires(tmp_path: Path) -> None:
    """Rank 1 deadlocks in Python (alive, like a stuck data loader); rank 0 waits in DDP's
    all-reduce. Both watchdogs fire; the one not inside a collective is the culprit, though
    the other fired first. Rank 0's timeout is the shorter so that it fires first: with equal
    ones, a rank 1 that exits first ends rank 0's all-reduce with gloo's error (exit 1)
    before rank 0's watchdog fires, which is right for a job but not what this test checks."""
    port = str(free_port())
    procs = [start(tmp_path, "--steps", "100000", "--step-time", "0.01", rank=r, world=2, port=port,
                   timeout=TIMEOUT + 3 * r, FTKIT_TEST_HANG_STEP="25", FTKIT_TEST_HANG_RANK="1")
             for r in range(2)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [EXIT_HANG, EXIT_HANG], outs
    hangs = {e["rank"]: e for e in hang_events(tmp_path)}
    assert set(hangs) == {0, 1}
    assert hangs[1]["step"] == 24 and hangs[1]["waiting"] is False and hangs[1]["frame"].endswith("_deadlock")
    assert hangs[0]["waiting"] is True
    # only the first to declare read its peers' heartbeats (N reads, not N squared)
    assert hangs[0]["peers"] is not None and hangs[1]["peers"] is None
    assert (tmp_path / "hangs" / "declared").read_text().strip() == "0"
    found = culprit(read_events(tmp_path / "events.jsonl"))
    assert found["rank"] == 1 and found["step"] == 24 and found["file"] == hangs[1]["file"]
    assert "not inside a collective" in found["evidence"]


OWN_LOOP = """
import sys, time, ftkit
with ftkit.FaultTolerance(sys.argv[1], state={}) as ft:
    for step in range(8):  # a loop of your own (steps the watchdog's polls each see)
        time.sleep(0.3)
        ft.step(step + 1)
    if sys.argv[2] == "disarm":
        ft.watchdog.disarm()
    time.sleep(6 * float(sys.argv[3]))  # a final evaluation, an upload
print("done", flush=True)
"""


@pytest.mark.parametrize("disarm", [True, False])
def test_the_code_after_a_loop_of_your_own_is_a_step_until_disarm(tmp_path: Path, disarm: bool) -> None:
    """docs/hangs.md: a check()/step() loop has no end the watchdog sees; ft.watchdog.disarm()
    after it keeps the work after it from being ended as a hang."""
    proc = subprocess.run([sys.executable, "-c", OWN_LOOP, str(tmp_path), "disarm" if disarm else "no", str(TIMEOUT)],
                          env=env(FTKIT_HANG_TIMEOUT=str(TIMEOUT)), capture_output=True, text=True, timeout=120)
    if disarm:
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout + proc.stderr
        assert hang_events(tmp_path) == []
    else:
        assert proc.returncode == EXIT_HANG, proc.stdout + proc.stderr
        assert [e["step"] for e in hang_events(tmp_path)] == [8]


def test_off_from_the_environment_starts_no_thread_and_writes_no_heartbeat(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FTKIT_HANG_TIMEOUT", "off")
    with ftkit.FaultTolerance(tmp_path) as ft:
        ft.check(1)
        assert not ft.watchdog.enabled
        assert not (tmp_path / "heartbeats").exists()


def test_close_stops_the_thread_and_removes_the_heartbeat(tmp_path: Path) -> None:
    cfg = ftkit.Config(watchdog=ftkit.WatchdogConfig(timeout=600), save_at_end=False)
    with ftkit.FaultTolerance(tmp_path, config=cfg) as ft:
        for step in ft.range(3, start=0):
            assert ft.watchdog.last == (step, ft.watchdog.last[1])  # the store at each boundary
        assert ft.watchdog.last is None  # after the loop: disarmed
        beat = json.loads((tmp_path / "heartbeats" / "rank0.json").read_text())
        assert beat["rank"] == 0 and beat["pid"] == os.getpid()
    assert not (tmp_path / "heartbeats" / "rank0.json").exists()
    # no_leaks fails this test if the thread outlives close()


# -- a hung job-dir filesystem ---------------------------------------------------------------


@pytest.fixture
def freezable_fs(tmp_path: Path):
    """A 16 MiB ext4 on a loop device, and a function that freezes it (``fsfreeze -f``): every
    write to it then blocks in the kernel, uninterruptibly, until the thaw. Needs root.

    The fixture thaws it whatever the test did: a frozen filesystem left behind blocks every
    later writer. Should this process be killed before that, a detached process (not our
    child: ``setsid -f``) thaws it after two minutes."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("mkfs.ext4", "fsfreeze", "mount", "setsid")):
        pytest.skip("needs root, mkfs.ext4, fsfreeze and setsid (freezes a loop-mounted ext4)")
    image, mnt = tmp_path / "ext4.img", tmp_path / "mnt"
    mnt.mkdir()
    with image.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True, timeout=60)
    if mounted.returncode:
        pytest.skip(f"cannot loop-mount an ext4 here: {mounted.stderr.strip()}")

    def freeze() -> None:
        subprocess.run(["setsid", "-f", "sh", "-c", 'sleep 120; fsfreeze -u "$0" 2>/dev/null', str(mnt)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        subprocess.run(["fsfreeze", "-f", str(mnt)], check=True, timeout=60)

    try:
        yield mnt, freeze
    finally:
        thaw(mnt)
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=60)


def thaw(mnt: Path) -> None:
    subprocess.run(["fsfreeze", "-u", str(mnt)], check=False, capture_output=True, timeout=60)


def progress(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("heartbeat", [None, 1000.0], ids=["heartbeats-block-too", "no-heartbeat-due"])
def test_a_frozen_job_dir_filesystem_is_found_logged_and_ended(freezable_fs, tmp_path: Path,
                                                                heartbeat: float | None) -> None:
    """A user trial: with the job dir's filesystem frozen, the save blocked in the kernel and
    so did the watchdog's heartbeat write, before its check: it never fired. Now the save's
    allowance runs out, the hang is logged with every stack (the stack file cannot be
    written), and the process ends with 87 (once thawed: it sleeps uninterruptibly till then).
    With heartbeats due only every 1000 s, only the dump blocks."""
    mnt, freeze = freezable_fs
    save_timeout, grace = 4.0, 3.0
    done, log = tmp_path / "progress", tmp_path / "log.txt"
    args = [sys.executable, str(FREEZE_PROGRAM), str(mnt / "job"), str(done), "--timeout", "2",
            "--save-timeout", str(save_timeout), "--grace", str(grace), "--save-every", "5"]
    with log.open("w") as out:  # on the unfrozen filesystem: the log must get through
        proc = subprocess.Popen([*args, *(["--heartbeat", str(heartbeat)] if heartbeat else [])], env=env(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: progress(done) >= 8 or proc.poll() is not None, 120, what="a few steps and a save")
        assert proc.poll() is None, log.read_text()
        freeze()
        frozen = time.monotonic()
        # the next save (within 5 steps) blocks; its allowance runs out; the dump cannot be written
        wait_for(lambda: "the stacks follow here instead" in log.read_text() or proc.poll() is not None,
                 save_timeout + grace + SLACK, what="the hang logged with its stacks")
        fired_after = time.monotonic() - frozen
        text = log.read_text()
    finally:
        thaw(mnt)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == EXIT_HANG, text
    assert "completed no step for" in text and "checkpoint save" in text and "exiting with code 87" in text, text
    assert fired_after < save_timeout + grace + SLACK
    stacks = text.split("the stacks follow here instead", 1)[1]
    assert "completed no step for" in stacks and "freeze_train.py" in stacks and "in main" in stacks, text
    if heartbeat is None:  # the blocked heartbeat is said, not waited on
        assert "the job dir's filesystem has not answered for" in text and "heartbeats are skipped" in text, text


# -- the allowance, on a fake clock ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dog(tmp_path: Path):
    clock, exits = Clock(), []
    events = EventLog(tmp_path / "events.jsonl", clock=lambda: clock.now)
    cfg = WatchdogConfig(timeout=10, multiple=5, warmup_steps=2, warmup_timeout=100, save_timeout=50, native=False)
    wd = Watchdog(cfg, job_root=tmp_path, events=events, clock=clock, wallclock=lambda: clock.now, exit=exits.append)
    return wd, clock, exits


def steps(wd: Watchdog, clock: Clock, first: int, last: int, seconds: float) -> None:
    for s in range(first, last + 1):
        clock.now += seconds
        wd.last = (s, clock.now)
        wd.tick()


def test_warmup_then_floor_then_multiple_of_the_slowest_step(dog, tmp_path: Path) -> None:
    wd, clock, exits = dog
    wd.tick()
    clock.now += 10_000
    wd.tick()
    assert exits == []  # not armed before the first step boundary (start-up, resume, load)
    wd.last = (0, clock.now)
    wd.tick()
    clock.now += 90  # a warm-up step may take warmup_timeout
    wd.tick()
    assert exits == []
    steps(wd, clock, 1, 1, 90)  # the first (compiling) warm-up step is slow, the next one is not
    steps(wd, clock, 2, 2, 1)
    assert wd.overdue(clock.now, wd.last, None)[1:] == (10.0, "timeout 10 s")
    clock.now += 10.5
    wd.tick()
    assert exits == [EXIT_HANG]
    [hang] = hang_events(tmp_path)
    assert hang["step"] == 2 and hang["seconds"] == 10.5 and hang["threshold"] == 10.0 and hang["why"] == "timeout 10 s"
    assert "completed no step for 10.5 s" in Path(hang["file"]).read_text()


def test_the_warmup_counts_from_the_loops_first_step_even_when_the_thread_missed_it(dog) -> None:
    wd, clock, _exits = dog
    wd.arm(0)
    for s in range(3):  # fast steps the thread never saw
        clock.now += 0.01
        wd.last = (s, clock.now)
    assert wd.overdue(clock.now, wd.last, None)[2] == "timeout 10 s"
    wd.arm(7)  # e.g. a second loop: without a hint the first step seen starts the warm-up
    wd.disarm()
    wd.last = (9, clock.now)
    assert wd.overdue(clock.now, wd.last, None)[2] == "warm-up step 1 of 2"


def test_a_slower_step_raises_the_allowance(dog) -> None:
    wd, clock, exits = dog
    steps(wd, clock, 0, 2, 1)  # warm-up
    steps(wd, clock, 3, 6, 4)  # 4 s steps: 5 x 4 = 20 s > the 10 s floor
    waited, allowance, why = wd.overdue(clock.now + 15, wd.last, None)
    assert (waited, allowance) == (15, 20) and "slowest recent step (4 s)" in why
    clock.now += 15
    wd.tick()
    assert exits == []


def test_steps_longer_than_the_floor_are_no_hang_right_after_the_warm_up(dog) -> None:
    """Every step takes 4 s, the floor is 10 s and 5 x 4 s = 20 s is the allowance: the first
    step after the warm-up has no measurement of its own yet, and got the bare floor (a healthy
    job declared hung at that step, in every run). The quickest warm-up step stands for it."""
    wd, clock, exits = dog
    steps(wd, clock, 0, 2, 4)  # steps 1 and 2: the warm-up
    waited, allowance, why = wd.overdue(clock.now + 15, wd.last, None)
    assert (waited, allowance) == (15, 20) and "slowest warm-up step (none after it measured yet) (4 s)" in why
    clock.now += 15
    wd.tick()
    assert exits == []
    steps(wd, clock, 3, 4, 1)  # measured after the warm-up (step 3 took 16 s): the steps' own again
    assert wd.overdue(clock.now, wd.last, None)[1:] == (80.0, "5 x the slowest recent step (16 s)")


def test_saves_and_allow_blocks_get_their_own_allowance(dog) -> None:
    wd, clock, exits = dog
    steps(wd, clock, 0, 3, 1)
    wd.begin_save()
    clock.now += 45  # longer than the 10 s step allowance, within save_timeout
    wd.tick()
    wd.end_save()
    assert exits == [] and wd.last == (3, clock.now)  # the next step is timed from the save's end
    with wd.allow(30, "evaluation"):
        clock.now += 25
        wd.tick()
    assert exits == []
    with wd.allow(30, "evaluation"):
        clock.now += 31
        wd.tick()
    assert exits == [EXIT_HANG]


def test_progress_restarts_the_step_clock(dog) -> None:
    wd, clock, exits = dog
    steps(wd, clock, 0, 3, 1)
    for _ in range(5):  # an evaluation of 5 x 8 s batches: 40 s, each within the 10 s allowance
        clock.now += 8
        wd.progress()
        wd.tick()
    assert exits == [] and wd.last == (3, clock.now)
    clock.now += 11
    wd.tick()
    assert exits == [EXIT_HANG]


def test_a_hung_save_fires_after_the_save_allowance(dog, tmp_path: Path) -> None:
    wd, clock, exits = dog
    steps(wd, clock, 0, 3, 1)
    wd.begin_save()
    clock.now += 51
    wd.tick()
    assert exits == [EXIT_HANG]
    assert hang_events(tmp_path)[0]["phase"] == "checkpoint save"


def test_blocked_job_dir_writes_neither_delay_the_check_nor_hold_the_exit(tmp_path: Path, monkeypatch,
                                                                          caplog) -> None:
    """The frozen-filesystem test above without a filesystem to freeze: the heartbeat and the
    stack file writes never return. The check still fires on time, the blocked heartbeat is
    logged (not waited on), and the stacks go to the log."""
    clock, exits, release = Clock(), [], threading.Event()
    monkeypatch.setattr("ftkit.control.watchdog.write_heartbeat", lambda path, beat: release.wait())
    monkeypatch.setattr("ftkit.control.watchdog.write_stacks", lambda path, text: release.wait())
    cfg = WatchdogConfig(timeout=10, warmup_steps=0, heartbeat=0.1, native=False)
    wd = Watchdog(cfg, job_root=tmp_path, events=EventLog(tmp_path / "events.jsonl", clock=clock),
                  clock=clock, wallclock=clock, exit=exits.append)
    try:
        wd.last = (5, clock.now)

        def beat() -> bool:  # progress on the fake clock; the writer is blocked in real time
            clock.now += 1
            wd.progress()
            wd.tick()
            return "the job dir's filesystem has not answered for 1 s" in caplog.text

        wait_for(beat, 10, interval=0.05, what="the blocked heartbeat logged")
        assert exits == []
        clock.now += 10.5
        wd.tick()  # within the check: not waiting for the stack file either
        assert exits == [EXIT_HANG]
        assert "completed no step for 10 s" in caplog.text and "the stacks follow here instead" in caplog.text
        assert "in test_blocked_job_dir_writes_neither_delay_the_check_nor_hold_the_exit" in caplog.text
    finally:
        release.set()


def test_disarmed_after_the_loop(dog) -> None:
    wd, clock, exits = dog
    steps(wd, clock, 0, 5, 1)
    wd.disarm()
    clock.now += 10_000
    wd.tick()
    assert exits == []


def test_config_errors_name_the_setting(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"watchdog\.timeout"):
        WatchdogConfig(timeout=0)
    with pytest.raises(ConfigError, match=r"watchdog\.warmup_steps"):
        WatchdogConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match="FTKIT_HANG_TIMEOUT='soon'"):
        WatchdogConfig().resolve_timeout({"FTKIT_HANG_TIMEOUT": "soon"})
    assert WatchdogConfig().resolve_timeout({}) == 300.0
    assert WatchdogConfig().resolve_timeout({"FTKIT_HANG_TIMEOUT": "42"}) == 42.0
    for off in ("off", "0", "0.0", "0e0", "false"):  # 0 written as a float is 0 too
        assert WatchdogConfig().resolve_timeout({"FTKIT_HANG_TIMEOUT": off}) is None, off
    assert WatchdogConfig(timeout=7).resolve_timeout({"FTKIT_HANG_TIMEOUT": "42"}) == 7.0  # config wins
    assert WatchdogConfig(enabled=False).resolve_timeout({}) is None
    assert WatchdogConfig().resolve_warmup({}) == 1800.0
    assert WatchdogConfig().resolve_warmup({"FTKIT_HANG_WARMUP_TIMEOUT": "120"}) == 120.0
    assert WatchdogConfig(warmup_timeout=60).resolve_warmup({"FTKIT_HANG_WARMUP_TIMEOUT": "120"}) == 60.0
    with pytest.raises(ConfigError, match="FTKIT_HANG_WARMUP_TIMEOUT='-1'"):
        WatchdogConfig().resolve_warmup({"FTKIT_HANG_WARMUP_TIMEOUT": "-1"})
    with pytest.raises(ConfigError, match=r"watchdog\.warmup_timeout"):
        WatchdogConfig(warmup_timeout=0)


# -- the culprit rule -----------------------------------------------------------------------


def hang(rank: int, step: int, wall: float, *, time: float = 100.0, waiting: bool = True,
         peers: list[Heartbeat] = (), world: int = 3) -> dict:
    return {"event": "hang", "time": time, "rank": rank, "host": f"n{rank}", "step": step,
            "last_step_wall": wall, "frame": f"f{rank}", "waiting": waiting, "file": f"hang-{rank}.txt",
            "world_size": world, "peers": [p.to_json() for p in peers]}


def beat(rank: int, step: int, wall: float, *, age: float = 0.1, interval: float = 1.0, **kw) -> Heartbeat:
    return Heartbeat(rank=rank, host=f"n{rank}", step=step, last_step_wall=wall, written=100.0 - age,
                     interval=interval, **kw).seen(100.0)


def test_culprit_prefers_a_rank_that_was_not_running() -> None:
    events = [hang(0, 10, 50.0, peers=[beat(1, 10, 49.0), beat(2, 9, 48.0, age=30)])]
    found = culprit(events)
    assert found["rank"] == 2 and found["file"] is None and "not running" in found["evidence"]
    assert found["declared_by"] == 0 and {o["rank"] for o in found["others"]} == {0, 1}


def test_culprit_a_rank_with_no_trace_at_all_exited() -> None:
    found = culprit([hang(0, 10, 50.0, peers=[beat(1, 10, 49.0)])])
    assert found["rank"] == 2 and "never reached" in found["evidence"]


def test_culprit_the_rank_behind_when_all_run() -> None:
    events = [hang(0, 11, 40.0, peers=[beat(1, 10, 50.0), beat(2, 11, 41.0)])]
    assert culprit(events)["rank"] == 1


def test_culprit_the_rank_outside_a_collective_at_the_same_step() -> None:
    events = [hang(0, 10, 40.0, time=100.0), hang(2, 10, 45.0, time=100.5, waiting=False),
              hang(1, 10, 41.0, time=101.0)]
    found = culprit(events)
    assert found["rank"] == 2 and found["declared_by"] == 0 and found["frame"] == "f2"


def test_culprit_weak_fallback_says_so() -> None:
    events = [hang(0, 10, 40.0, world=2), hang(1, 10, 39.0, world=2)]
    found = culprit(events)
    assert found["rank"] == 1 and found["evidence"].startswith("weak evidence")


def test_only_the_newest_runs_hangs_count() -> None:
    old = hang(0, 5, 1.0, world=1)
    new = hang(0, 9, 2.0, world=1)
    start = {"event": "start", "rank": 0, "time": 50.0}
    assert last_incident([start, old, start, new, start]) == [new]
    assert culprit([start, old, start])["step"] == 5
    assert culprit([start]) is None and describe(None) == "no hang recorded"
