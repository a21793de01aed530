"""The time budget reads SLURM's end time again: a fake clock and an injected lookup, then the
real thing (a job whose TimeLimit the test changes with ``scontrol update``)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from itertools import pairwise

import pytest

from ftkit.errors import ConfigError, SlurmError
from ftkit.slurm import env as slurm_env
from ftkit.triggers.budget import BudgetConfig, TimeBudget
from tests.conftest import ROOT
from tests.test_budget import Clock

END = 1_700_000_000.0
START = END - 3600
# step 1 s + save 10 s + margin 30 s: the budget fires once 41 s or less are left
FIRE_BEFORE = 41.0


class Slurm:
    """Stands in for ``scontrol show job``: answers ``end``, counts the calls, may fail."""

    def __init__(self, end: float | None) -> None:
        self.end = end
        self.calls = 0
        self.error: str | None = None

    def __call__(self) -> float | None:
        self.calls += 1
        if self.error is not None:
            raise SlurmError(self.error)
        return self.end


def budget(clock: Clock, slurm: Slurm, **config) -> TimeBudget:
    config.setdefault("margin", 30)
    config.setdefault("save_estimate", 10)
    config.setdefault("refresh_every", 60)
    b = TimeBudget(BudgetConfig(**config), clock=clock, environ={}, end_time_lookup=slurm).start()
    b.record_step(1.0)
    return b


def test_extended_limit_does_not_fire_at_the_old_end_but_at_the_new(caplog):
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm)
    assert (b.end_time, b.source, slurm.calls) == (END, "end_time_lookup", 1)
    slurm.end = END + 600  # scontrol update jobid=N TimeLimit=...: ten minutes more
    clock.now = END - 30  # past the old threshold; the re-reads every 60 s have seen it
    with caplog.at_level(logging.INFO, logger="ftkit.triggers.budget"):
        assert not b.due()
    assert b.end_time == END + 600 and not b.fired
    old, new = (datetime.fromtimestamp(t).isoformat(timespec="seconds") for t in (END, END + 600))
    assert f"time budget: the job's end time moved from {old} to {new} (+600 s)" in caplog.text
    assert b.time_left() == 630
    assert not b.due(END + 600 - FIRE_BEFORE)
    assert b.due(END + 600 - FIRE_BEFORE + 0.1)


def test_extension_seen_by_the_last_look_before_firing():
    """With re-reads far apart, the look right before firing still catches an extension."""
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=86400)
    slurm.end = END + 600
    assert not b.due(END - FIRE_BEFORE)  # not past the threshold: nothing asked
    assert slurm.calls == 1
    assert not b.due(END - FIRE_BEFORE + 0.1)  # would fire: asks first, and the limit moved
    assert (slurm.calls, b.end_time, b.fired) == (2, END + 600, False)
    assert not b.due(END + 500)
    assert slurm.calls == 2  # below the new threshold: one comparison, no lookup
    assert b.due(END + 600 - FIRE_BEFORE + 0.1)  # asks once more (unchanged), fires
    assert slurm.calls == 3 and b.fired
    assert not b.due(END + 10**6) and slurm.calls == 3  # one-shot: nothing asked after firing


def test_shortened_limit_fires_before_the_new_end():
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=60)
    new_end = START + 600
    slurm.end = new_end  # shortened to ten minutes from the start
    clock.now = START + 60
    assert not b.due() and slurm.calls == 1  # the next re-read is after START + 60
    clock.now = START + 60.1
    assert not b.due() and b.end_time == new_end and slurm.calls == 2
    assert not b.due(new_end - FIRE_BEFORE)
    calls = slurm.calls
    assert b.due(new_end - FIRE_BEFORE + 0.1)  # long before the old end time
    assert slurm.calls == calls + 1  # the look before firing
    req = b.request(new_end - FIRE_BEFORE + 0.1)
    assert req.reason.startswith("time budget: 40.9 s left")


def test_shortened_into_the_threshold_fires_at_the_next_re_read():
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=60)
    slurm.end = START + 90  # 30 s after the next re-read: less than step + save + margin
    clock.now = START + 60.1
    assert b.due() and b.end_time == START + 90


def test_failing_lookup_keeps_the_last_end_time_and_warns_once(caplog):
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=60)
    slurm.error = "`scontrol show job -o 55` did not answer within 5 s"
    calls_at = []
    with caplog.at_level(logging.INFO, logger="ftkit.triggers.budget"):
        while clock.now < END - 600:  # a step a second for ~49 minutes
            clock.now += 1.0
            before = slurm.calls
            assert not b.due()
            if slurm.calls != before:
                calls_at.append(clock.now - START)
        assert b.end_time == END
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, caplog.text
        assert "cannot read the job's end time again" in warnings[0].getMessage()
        assert "did not answer within 5 s" in warnings[0].getMessage()
        # failing re-reads space out: 60 s, then 2x, 4x, 8x (the cap) refresh_every (each at
        # the first step past its time)
        gaps = [y - x for x, y in pairwise([0.0, *calls_at])]
        assert gaps[:5] == pytest.approx([60.5, 120.5, 240.5, 480.5, 480.5], abs=0.5)
        slurm.error = None
        slurm.end = END + 60
        while slurm.calls == 1 + len(calls_at):
            clock.now += 1.0
            assert not b.due()
        assert "reading the job's end time works again" in caplog.text
    assert b.end_time == END + 60
    # working again: back to every 60 s
    at = clock.now
    while clock.now < at + 125:
        clock.now += 1.0
        b.due()
    assert slurm.calls == 1 + len(calls_at) + 1 + 2


def test_failing_last_look_fires_on_the_last_known_end():
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=86400)
    slurm.error = "scontrol is missing"
    assert b.due(END - FIRE_BEFORE + 0.1)
    assert slurm.calls == 2 and b.end_time == END


def test_lookup_is_not_called_on_every_due():
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm, refresh_every=60)
    clock.calls = 0
    for _ in range(10_000):  # 10 000 steps of 10 ms: 100 s
        clock.now += 0.01
        assert not b.due()
    assert slurm.calls == 2  # at start, and once at START + 60
    assert clock.calls == 10_000  # still one clock read per due()


def test_initial_failure_is_retried_and_the_budget_comes_alive(caplog):
    clock, slurm = Clock(START), Slurm(END)
    slurm.error = "slurm_load_jobs error: Socket timed out"
    with caplog.at_level(logging.INFO, logger="ftkit.triggers.budget"):
        b = budget(clock, slurm)
        assert b.end_time is None and b.source == "SLURM lookup failed"
        assert "reading it again every 60 s" in caplog.text
        assert "Socket timed out" in caplog.text  # start() warns
        caplog.clear()
        clock.now += 60.1
        assert not b.due()  # fails again: start() warned already, nothing more
        assert slurm.calls == 2 and caplog.text == ""
        slurm.error = None
        clock.now += 239  # backed off: 2 x 2 x 60 s
        assert not b.due() and slurm.calls == 2
        clock.now += 1.1
        assert not b.due()
    assert b.end_time == END and slurm.calls == 3
    assert "moved from no end time to" in caplog.text
    assert b.due(END - FIRE_BEFORE + 0.1)


def test_limit_made_unlimited_stops_the_budget():
    clock, slurm = Clock(START), Slurm(END)
    b = budget(clock, slurm)
    slurm.end = None  # scontrol update TimeLimit=UNLIMITED: EndTime=Unknown
    clock.now = START + 60.1
    assert not b.due()
    assert b.end_time is None and b.time_left() is None
    assert not b.due(END + 10**6) and not b.fired


@pytest.mark.parametrize(
    ("config", "environ"),
    [({"deadline": END}, {}), ({}, {"FTKIT_DEADLINE": str(END)}), ({"refresh_every": 0}, {})],
    ids=["deadline", "env-var", "refresh-off"],
)
def test_end_time_read_once_when_not_from_slurm_or_refresh_off(config, environ):
    clock, slurm = Clock(START), Slurm(END)
    b = TimeBudget(BudgetConfig(**{"margin": 30, "save_estimate": 10, "refresh_every": 60, **config}), clock=clock,
                   environ=environ, end_time_lookup=slurm).start()
    b.record_step(1.0)
    slurm.end = END + 600
    for minute in range(1, 60):
        clock.now = START + 60 * minute
        assert not b.due()
    assert b.due(END - FIRE_BEFORE + 0.1)  # at the first end time, not the extended one
    assert slurm.calls == (1 if config == {"refresh_every": 0} else 0)


def test_re_read_from_slurm_uses_a_short_timeout(monkeypatch):
    calls = []
    line = "JobId=55 JobState=RUNNING EndTime={} Partition=gpu\n"
    ends = ["2024-03-01T14:00:00", "2024-03-01T15:00:00"]

    def fake_scontrol(args, **kwargs):
        calls.append((list(args), kwargs))
        return line.format(ends[min(len(calls), 2) - 1])

    monkeypatch.setattr(slurm_env, "run_scontrol", fake_scontrol)
    first = datetime(2024, 3, 1, 14).timestamp()
    clock = Clock(first - 7200)
    b = TimeBudget(BudgetConfig(refresh_every=60), clock=clock, environ={"SLURM_JOB_ID": "55"}).start()
    assert (b.end_time, b.source) == (first, "SLURM EndTime")
    clock.now += 60.1
    assert not b.due()
    assert b.end_time == datetime(2024, 3, 1, 15).timestamp()
    assert calls == [(["show", "job", "-o", "55"], {}),  # at start: scontrol's usual timeout
                     (["show", "job", "-o", "55"], {"timeout": 5.0})]


def test_outside_slurm_nothing_is_re_read(monkeypatch):
    def fail(args, **kwargs):
        raise AssertionError("scontrol called outside SLURM")

    monkeypatch.setattr(slurm_env, "run_scontrol", fail)
    clock = Clock(START)
    b = TimeBudget(BudgetConfig(), clock=clock, environ={}).start()
    assert b.end_time is None and "not in a SLURM job" in b.source
    clock.now += 86400
    assert not b.due()


@pytest.mark.parametrize("value", [-1, float("nan"), "60"])
def test_bad_refresh_every_names_the_setting(value):
    with pytest.raises(ConfigError, match=r"budget\.refresh_every"):
        BudgetConfig(refresh_every=value)


# ---------------------------------------------------------------------------- real SLURM

JOB = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    from ftkit.triggers.budget import BudgetConfig, TimeBudget

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    here = Path(sys.argv[1])

    def wait(name):
        deadline = time.monotonic() + 30
        while not (here / name).exists():
            assert time.monotonic() < deadline, name
            time.sleep(0.05)

    def changes(b, old):
        deadline = time.monotonic() + 20
        while b.end_time == old:
            assert time.monotonic() < deadline, "end time never moved"
            assert not b.due()
            time.sleep(0.05)
        return b.end_time

    config = {"margin": 30, "save_estimate": 30}
    last_look = TimeBudget(BudgetConfig(refresh_every=86400, **config)).start()
    periodic = TimeBudget(BudgetConfig(refresh_every=0.2, **config)).start()
    start = last_look.end_time
    print("start", os.environ.get("SLURM_TIME_FORMAT"), start, periodic.end_time, flush=True)
    wait("extended")
    extended = changes(periodic, start)
    print("periodic", extended, flush=True)
    due_at_old = last_look.due(start - 30)  # past the first end time's threshold
    print("last-look", due_at_old, last_look.end_time, last_look.due(last_look.end_time - 61),
          last_look.due(last_look.end_time - 59), flush=True)
    wait("shortened")
    shortened = changes(periodic, extended)
    print("shortened", shortened, periodic.due(shortened - 61), periodic.due(shortened - 59), flush=True)
""")


def update(job: int, setting: str) -> None:
    subprocess.run(["scontrol", "update", f"jobid={job}", setting], check=True, timeout=30)


def end_time(slurm_jobs, job: int) -> float:
    return datetime.strptime(slurm_jobs.job_info(job)["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def test_real_time_limit_changes_move_the_budget(slurm_jobs, tmp_path):
    """A job (with the user's SLURM_TIME_FORMAT=relative) whose TimeLimit the test extends, then
    shortens, with ``scontrol update``: the budget in the job follows SLURM's EndTime."""
    (tmp_path / "job.py").write_text(JOB)
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this checkout
    job = slurm_jobs.submit(f'exec "{sys.executable}" job.py "{tmp_path}"\n', "--time=3",
                            "--output", str(tmp_path / "out.txt"),
                            env={"SLURM_TIME_FORMAT": "relative", "PYTHONPATH": pythonpath})
    out = tmp_path / "out.txt"
    text = slurm_jobs.wait_file_contains(out, "\nstart ", timeout=30)
    start_line = re.search(r"^start (\S+) (\S+) (\S+)$", text, re.M)
    assert start_line, text
    assert start_line.group(1) == "relative"  # the job runs with the user's format
    first = end_time(slurm_jobs, job)
    assert float(start_line.group(2)) == float(start_line.group(3)) == first

    update(job, "TimeLimit=10")
    extended = end_time(slurm_jobs, job)
    assert extended == first + 7 * 60
    (tmp_path / "extended").touch()
    text = slurm_jobs.wait_file_contains(out, "\nlast-look ", timeout=30)
    assert f"\nperiodic {extended}\n" in text, text
    # the last look before firing saw the extension: no fire at the old end, fires at the new
    assert f"\nlast-look False {extended} False True\n" in text, text

    update(job, "TimeLimit=2")
    shortened = end_time(slurm_jobs, job)
    assert shortened == first - 60
    (tmp_path / "shortened").touch()
    text = slurm_jobs.wait_file_contains(out, "\nshortened ", timeout=30)
    assert f"\nshortened {shortened} False True\n" in text, text
    moved = [line for line in text.splitlines() if "the job's end time moved from" in line]
    assert len(moved) == 3, text  # periodic: extended, shortened; last look: extended
    slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=30)


# Two gloo ranks under a stand-in scontrol that logs who called it and answers the end time in
# the file END_FILE; each rank prints the step it stopped at and what stopped it.
RANKS = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed as dist
    import ftkit

    dist.init_process_group("gloo")
    config = ftkit.Config(save_every=None, save_at_end=False,
                          budget=ftkit.BudgetConfig(refresh_every=0.5, margin=3, save_estimate=0.5))
    stopped = None
    with ftkit.FaultTolerance(sys.argv[1], state={"w": torch.zeros(4)}, config=config) as ft:
        for step in ft.range(100_000):
            time.sleep(0.02)
            stopped = step
        decision = ft.final_decision
    sources = ",".join(sorted(s.value for s in decision.sources)) if decision else "-"
    print("stopped", stopped, decision.step if decision else "-", sources, ft.budget.end_time, flush=True)
    dist.destroy_process_group()
""")


def test_only_rank_0_asks_slurm_and_both_ranks_stop_at_its_budget(tmp_path):
    """Two ranks of a SLURM job: ``scontrol show job`` runs on rank 0 only, at start and per
    re-read (it ran on every rank at each, a burst on slurmctld from every rank of a big job);
    an end time moved closer is seen by rank 0's re-read, and both ranks stop at the same step
    for the time budget."""
    from tests.ckpt_helpers import env, free_port

    bin_dir, calls, end_file = tmp_path / "bin", tmp_path / "calls", tmp_path / "end"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "rank=$RANK $*" >> {calls}
        echo "JobId=4242 JobName=t JobState=RUNNING EndTime=$(date -d @$(cat {end_file}) +%Y-%m-%dT%H:%M:%S)"
    """))
    (bin_dir / "scontrol").chmod(0o755)
    end_file.write_text(f"{int(datetime.now().timestamp()) + 3600}\n")
    extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", RANKS, str(tmp_path / "job")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(**extra, RANK=str(r)))
             for r in range(2)]
    try:
        deadline = datetime.now().timestamp() + 60
        while len([c for c in (calls.read_text().splitlines() if calls.exists() else []) if "show job" in c]) < 3:
            assert datetime.now().timestamp() < deadline, "rank 0 never read the end time again"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.1)
        end_file.write_text(f"{int(datetime.now().timestamp()) + 8}\n")  # the job's limit shortened
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    lines = calls.read_text().splitlines()
    assert lines and all(line.startswith("rank=0 show job -o 4242") for line in lines), lines
    stops = [re.search(r"^stopped (\d+) (\d+) (\S+) (\S+)$", out, re.M) for out, _ in outs]
    assert all(stops), outs
    assert stops[0].group(2) == stops[1].group(2)  # decided at the same step on both ranks
    assert all(m.group(3) == "time-budget" for m in stops), outs
    assert float(stops[0].group(4)) > 0 and stops[1].group(4) == "None"  # rank 1 never had an end time
