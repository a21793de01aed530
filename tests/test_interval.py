"""The checkpoint interval rule (Young/Daly, bounded) on a fake clock: the pure function, and
``save_every="auto"`` in a real FaultTolerance whose checkpoints cost known fake seconds."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ftkit
from ftkit.control.interval import (
    AutoInterval,
    History,
    IntervalConfig,
    choose_interval,
    expected_waste,
    read_history,
    young_daly,
)
from ftkit.errors import ConfigError
from ftkit.events import EventLog, read_events


def test_known_cost_and_mtbf_give_the_formula() -> None:
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=10.0, max_interval=3600.0)
    assert plan.seconds == pytest.approx(math.sqrt(2 * 10 * 18000)) == pytest.approx(600.0)
    assert plan.bound == "formula" and plan.optimum == plan.seconds
    # it is the minimum of the expected waste C/tau + tau/(2 MTBF)
    best = expected_waste(600.0, cost=10.0, mtbf=18000.0)
    assert best < expected_waste(540.0, cost=10.0, mtbf=18000.0)
    assert best < expected_waste(660.0, cost=10.0, mtbf=18000.0)


def test_bounds_hold() -> None:
    # above: the configured maximum
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=10.0, max_interval=300.0)
    assert (plan.seconds, plan.bound, plan.optimum) == (300.0, "max", pytest.approx(600.0))
    # below: a background save durable after 900 s may not be overtaken by the next one ...
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=900.0, max_interval=3600.0)
    assert (plan.seconds, plan.bound) == (900.0, "durable")
    # ... unless max_in_flight lets two persists overlap
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=900.0, max_in_flight=2, max_interval=3600.0)
    assert (plan.seconds, plan.bound) == (600.0, "formula")
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=1500.0, max_in_flight=2, max_interval=3600.0)
    assert (plan.seconds, plan.bound) == (750.0, "durable")
    # where the bounds cross, the time until durable wins over the maximum
    plan = choose_interval(cost=10.0, mtbf=18000.0, durable=900.0, max_interval=300.0)
    assert (plan.seconds, plan.bound) == (900.0, "durable")
    # never below the checkpoint's own cost
    plan = choose_interval(cost=50.0, mtbf=10.0, durable=5.0, max_interval=3600.0)
    assert plan.seconds == 50.0 and plan.bound == "durable"


def test_mtbf_from_config_history_or_assumed() -> None:
    cfg = IntervalConfig()
    assert History(failures=4, observed=4000.0).mtbf(cfg)[0] == 1000.0
    assert History(failures=0, observed=4000.0).mtbf(cfg)[0] == cfg.assumed_mtbf
    assert History(failures=0, observed=2e5).mtbf(cfg)[0] == 2e5
    assert History(failures=4, observed=4000.0).mtbf(IntervalConfig(mtbf=50.0)) == (50.0, "config")


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"interval\.mtbf"):
        IntervalConfig(mtbf=0)
    with pytest.raises(ConfigError, match=r"interval\.max_interval"):
        IntervalConfig(max_interval=-1)
    with pytest.raises(ConfigError, match="'auto'"):
        ftkit.Config(save_every="sometimes")


def test_a_change_of_cost_moves_the_interval_and_is_recorded(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    auto = AutoInterval(IntervalConfig(mtbf=18000.0, first_after=120.0), events=log, history=History())
    assert auto.schedule(0, step_time=2.0) == 60  # no cost measured yet: first_after / step time
    auto.measured(cost=10.0, durable=10.0)
    assert auto.schedule(60, step_time=2.0) == 300 and auto.next_step == 360  # 600 s / 2 s
    auto.measured(cost=10.4, durable=10.4)  # within `change` (10 %): same interval, no new record
    assert auto.schedule(360, step_time=2.0) == 303  # the median of 10 and 10.4: 10.2
    auto.measured(cost=40.0, durable=40.0)  # one slow save (a busy disk): the median does not follow it
    assert auto.schedule(663, step_time=2.0) == 306  # the median of 10, 10.4, 40: 10.4
    auto.measured(cost=40.0, durable=40.0)  # slower for good: it moves within a few saves
    assert auto.schedule(969, step_time=2.0) == 476  # the median of 10, 10.4, 40, 40: 25.2
    auto.measured(cost=40.0, durable=40.0)  # 4x the cost: twice the interval
    assert auto.schedule(1445, step_time=2.0) == 600
    records = [e for e in read_events(log.path) if e["event"] == "interval"]
    assert [r["steps"] for r in records] == [60, 300, 476, 600]
    last = records[-1]
    assert last["cost"] == 40.0 and last["mtbf"] == 18000.0 and last["mtbf_source"] == "config"
    assert last["interval_seconds"] == pytest.approx(1200.0) and last["bound"] == "formula"
    assert last["step_time"] == 2.0 and last["previous_steps"] == 476
    assert young_daly(40.0, 18000.0) == pytest.approx(1200.0)


def test_history_takes_the_median_of_the_newest_costs_and_exit_saves_where_there_is_nothing_else() -> None:
    """An earlier run's saves: a periodic one every 10 s, of which the newest happened to be quick
    (0.05 s) and one slow (0.9 s): the cost is their median, not the newest. Runs that never
    reached a periodic checkpoint (killed before ``first_after``, saved only on the way out): the
    times until durable of their exit saves stand for the cost, so the next run does not wait
    ``first_after`` once more (and again, each time it is killed before it)."""
    def events(stalls, exit_seconds):
        out = [{"event": "start", "rank": 0, "time": 0.0, "pid": 1}]
        for i, stall in enumerate(stalls):
            out.append({"event": "save", "rank": 0, "time": 10.0 * i + 1, "step": i, "seconds": stall,
                        "stall": stall, "reason": "periodic"})
        for i, seconds in enumerate(exit_seconds):
            out.append({"event": "save", "rank": 0, "time": 100.0 + i, "step": 100 + i, "seconds": seconds,
                        "stall": seconds, "exiting": True, "reason": "SIGTERM"})
        return out

    periodic = read_history(events([0.2, 0.25, 0.9, 0.2, 0.22, 0.05], []))
    assert periodic.cost == pytest.approx(0.22) and len(periodic.costs) == 5
    exits_only = read_history(events([], [0.6, 0.4, 0.5]))
    assert exits_only.cost == pytest.approx(0.5) and exits_only.durable == pytest.approx(0.5)
    auto = AutoInterval(IntervalConfig(mtbf=3600.0, first_after=300.0), events=None, history=exits_only)
    assert auto.schedule(0, step_time=0.1) == round(young_daly(0.5, 3600.0) / 0.1)  # 60 s, not 300 s


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class CostlyState:
    """A state object whose snapshot takes ``cost`` seconds of fake time."""

    def __init__(self, clock: FakeClock, cost: float) -> None:
        self.clock = clock
        self.cost = cost
        self.value = 0

    def state_dict(self) -> dict:
        self.clock.t += self.cost
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def test_auto_in_a_run_follows_the_measured_cost(tmp_path: Path) -> None:
    clock = FakeClock()
    wall = lambda: 1.7e9 + clock.t  # noqa: E731
    state = CostlyState(clock, cost=2.0)
    cfg = ftkit.Config(save_every="auto", save_at_end=False, budget=ftkit.BudgetConfig(enabled=False),
                       interval=IntervalConfig(mtbf=3600.0, first_after=50.0, max_interval=1000.0))
    with ftkit.FaultTolerance(tmp_path, state={"s": state}, config=cfg, clock=clock, wallclock=wall) as ft:
        for step in ft.range(800):
            clock.t += 1.0  # one step: 1 s of fake time
            if step + 1 == 200:
                state.cost = 8.0  # checkpoints become 4x as expensive
    records = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "interval"]
    # first: 50 s before any checkpoint was measured (1 s steps); then sqrt(2 * 2 * 3600) = 120 s;
    # once the cost went to 8 s: the median of the saves' costs follows it, from the second
    # save on (2, 2, 8, 8: 5 s, sqrt(2 * 5 * 3600) = 190 s), to sqrt(2 * 8 * 3600) = 240 s
    assert [r["steps"] for r in records] == [50, 120, 190, 240]
    assert [r["cost"] for r in records[1:]] == pytest.approx([2.0, 5.0, 8.0])
    assert records[3]["mtbf_source"] == "config" and records[3]["bound"] == "formula"
    saves = [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "save"]
    # the first step (1) + 50, every 120 steps (the one at 291, the first at 8 s, moves nothing),
    # then 190, then 240 (841 is past 800)
    assert saves == [51, 171, 291, 411, 601]
    assert [r["step"] for r in records[2:]] == [411, 601]


def test_auto_with_saves_written_outside_ftkit(tmp_path: Path) -> None:
    """An integration whose framework writes the checkpoint (Hugging Face) asks ``periodic_due``
    and reports the save with ``saved``: the interval is re-planned from that save, so the next
    periodic save comes one interval later, not at every step."""
    clock = FakeClock()
    wall = lambda: 1.7e9 + clock.t  # noqa: E731
    cfg = ftkit.Config(save_every="auto", save_at_end=False, budget=ftkit.BudgetConfig(enabled=False),
                       interval=IntervalConfig(mtbf=3600.0, first_after=50.0, max_interval=1000.0))
    saves = []
    with ftkit.FaultTolerance(tmp_path, config=cfg, clock=clock, wallclock=wall) as ft:
        ft.check(0)
        for step in range(1, 400):
            clock.t += 1.0  # one step: 1 s of fake time
            decision = ft.check(step)
            assert not decision.save
            if ft.periodic_due(step):
                clock.t += 2.0  # the framework's save: 2 s
                saves.append(step)
                ft.saved(step, seconds=2.0)
    # 50 s before any save was measured, then sqrt(2 * 2 * 3600) = 120 s of 1 s steps
    assert saves == [51, 171, 291]
    assert [e["steps"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "interval"] == [50, 120]


def test_ranks_with_different_step_times_agree_on_one_interval(tmp_path: Path) -> None:
    """Alone, rank 0 (1 s steps) would save every 120 steps and rank 1 (2 s steps) every 60;
    they agree on the larger count, so both save at the same steps (a synchronous save with
    several ranks is collective: a disagreement would hang them)."""
    program = Path(__file__).parent / "programs" / "auto_ranks.py"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        procs.append(subprocess.Popen([sys.executable, str(program), str(tmp_path), "200"], env=env))
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    saves = [json.loads((tmp_path / f"saves-rank{r}.json").read_text()) for r in range(2)]
    # first: 50 s / 1 s (rank 0's count, the larger); then sqrt(2 * 2 * 3600) = 120 s / 1 s
    assert saves == [[51, 171], [51, 171]]
    records = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "interval"]
    assert [r["steps"] for r in records] == [50, 120] and all(r["rank"] == 0 for r in records)


def test_runs_killed_before_their_first_checkpoint_get_one_within_half_their_mtbf() -> None:
    """Earlier runs, each killed hard (no exit save) after 3 minutes: no checkpoint cost was ever
    measured, and ``first_after`` (300 s) would come after every run's death. The first periodic
    checkpoint comes within half the observed MTBF (90 s) instead; with no failure seen, or with
    ``interval.mtbf`` set, ``first_after`` stands."""
    killed = History(failures=3, observed=540.0)
    auto = AutoInterval(IntervalConfig(first_after=300.0), events=None, history=killed)
    assert auto.first_after() == 90.0 and auto.schedule(0, step_time=1.0) == 90
    assert AutoInterval(IntervalConfig(first_after=300.0), events=None,
                        history=History(observed=540.0)).first_after() == 300.0
    assert AutoInterval(IntervalConfig(first_after=300.0, mtbf=60.0), events=None,
                        history=killed).first_after() == 300.0
