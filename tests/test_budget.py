"""The time budget, on a fake clock (no sleeping)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import pytest

from ftkit.decision import Action, Source
from ftkit.errors import ConfigError, SlurmError
from ftkit.slurm import env as slurm_env
from ftkit.triggers.budget import BudgetConfig, TimeBudget

END = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


def budget(clock: Clock, **config) -> TimeBudget:
    config.setdefault("deadline", END)
    return TimeBudget(BudgetConfig(**config), clock=clock, environ={})


def test_fires_exactly_when_time_left_drops_below_step_save_margin():
    clock = Clock(END - 3600)
    b = budget(clock, margin=30, save_estimate=10)
    b.record_step(2.0)
    assert not b.due()
    clock.now = END - 42  # 42 s left == 2 + 10 + 30: still enough
    assert not b.due()
    assert b.time_left() == 42
    clock.now = END - 41.9
    assert b.due()
    assert b.fired
    req = b.request()
    assert (req.action, req.source, req.requeue) == (Action.SAVE_EXIT, Source.TIME_BUDGET, True)
    assert req.reason == "time budget: 41.9 s left < step 2 s + save 10 s + margin 30 s"
    clock.now = END - 1
    assert not b.due()  # one-shot


def test_a_short_step_is_said_as_measured_not_rounded_to_nothing():
    """Steps of 0.04 s, saves of 0.3 s: the reason gives them as they are (not "step 0.0 s"), so
    its sum is the one compared with the time left."""
    clock = Clock(END - 3600)
    b = budget(clock, margin=30, save_estimate=0.3)
    b.record_step(0.0412)
    clock.now = END - 30.3
    assert b.due()
    assert b.request().reason == "time budget: 30.3 s left < step 0.0412 s + save 0.3 s + margin 30 s"


def test_steady_state_check_is_one_clock_read():
    clock = Clock(END - 3600)
    b = budget(clock)
    b.record_step(1.0)
    b.due()  # starts
    clock.calls = 0
    for _ in range(100):
        assert not b.due()
    assert clock.calls == 100
    assert not b.due(END - 3600)  # an explicit `now` reads no clock at all
    assert clock.calls == 100


def test_step_estimate_is_conservative():
    clock = Clock(END - 3600)
    b = budget(clock, margin=0, save_estimate=0)
    for _ in range(10):
        b.record_step(1.0)
    assert b.step_estimate == 1.0
    b.record_step(5.0)  # a slow step counts in full at once
    assert b.step_estimate == 5.0
    b.record_step(1.0)  # and is forgotten slowly
    assert 1.0 < b.step_estimate < 5.0
    assert b.step_estimate == pytest.approx(1.64)  # EMA 0.2: 1.8 after the 5 s step, then 1.64
    b.record_step(float("nan"))
    b.record_step(-1.0)
    assert b.step_estimate == pytest.approx(1.64)  # garbage is ignored
    # and the threshold follows: due once less than the estimate is left
    assert not b.due(END - 1.65)
    assert b.due(END - 1.63)


def test_save_estimate_is_the_slowest_recent_save():
    clock = Clock(END - 3600)
    b = budget(clock, margin=30, save_estimate=30)
    assert b.save_estimate == 30  # configured guess until a save is measured
    b.record_save(12.0)
    assert b.save_estimate == 12.0  # measured replaces the guess
    b.record_save(3.0)
    assert b.save_estimate == 12.0
    for _ in range(5):
        b.record_save(4.0)
    assert b.save_estimate == 4.0  # the 12 s save left the window
    assert not b.due(END - 34.1)
    assert b.due(END - 33.9)


def test_no_deadline_is_never_due(caplog):
    clock = Clock(END)
    lookups = []
    b = TimeBudget(
        BudgetConfig(use_slurm=False),
        clock=clock,
        environ={},
        end_time_lookup=lambda: lookups.append(1),
    )
    with caplog.at_level(logging.INFO, logger="ftkit.triggers.budget"):
        assert not b.due()
    assert b.end_time is None and b.time_left() is None
    assert "never fire" in caplog.text
    assert not b.due(END + 10**9) and not b.fired
    assert lookups == []  # use_slurm=False: not asked


def test_disabled_budget_ignores_the_deadline():
    b = budget(Clock(END), enabled=False)
    assert not b.due(END + 100)
    assert b.end_time is None and b.source.startswith("disabled")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1700000000", 1_700_000_000.0),
        (" 1700000000.5 ", 1_700_000_000.5),
        ("2023-11-14T22:13:20+00:00", 1_700_000_000.0),
        ("2023-11-14T22:13:20Z", 1_700_000_000.0),
        ("2023-11-14T23:13:20+01:00", 1_700_000_000.0),
        ("2024-03-01T14:00:00", datetime(2024, 3, 1, 14).timestamp()),  # no offset: local
    ],
)
def test_deadline_from_env_var(value, expected):
    b = TimeBudget(BudgetConfig(), clock=Clock(0), environ={"FTKIT_DEADLINE": value}).start()
    assert b.end_time == expected
    assert b.source == "$FTKIT_DEADLINE"


@pytest.mark.parametrize("value", ["tomorrow", "2024-13-01T00:00:00", "nan", "inf", "1e30", "-5", "1700000000000"])
def test_bad_env_var_names_the_variable(value):
    b = TimeBudget(
        BudgetConfig(env_var="MY_DEADLINE"), clock=Clock(0), environ={"MY_DEADLINE": value}
    )
    with pytest.raises(ConfigError, match="MY_DEADLINE") as caught:
        b.start()
    assert ("if those are milliseconds" in str(caught.value)) == (value == "1700000000000")


@pytest.mark.parametrize("value", [1e30, -5.0, 1_700_000_000_000])
def test_a_deadline_setting_out_of_range_is_refused_when_built(value):
    with pytest.raises(ConfigError, match=r"budget.deadline: .* is not a UNIX time in seconds"):
        BudgetConfig(deadline=value)


def test_an_explicit_deadline_already_past_is_refused_at_start():
    """Stale (a variable left from an earlier job): no run can use it, and saving and asking
    for a requeue at once would repeat in every requeued run until the cap."""
    b = TimeBudget(BudgetConfig(), clock=Clock(5000), environ={"FTKIT_DEADLINE": "4000"})
    with pytest.raises(ConfigError, match=r"environment variable FTKIT_DEADLINE: the deadline .* is 1000 s in the past"):
        b.start()
    with pytest.raises(ConfigError, match=r"budget.deadline: the deadline .* is 1 s in the past"):
        TimeBudget(BudgetConfig(deadline=4999), clock=Clock(5000)).start()


def test_explicit_beats_env_beats_lookup():
    env = {"FTKIT_DEADLINE": "2000"}
    b = TimeBudget(
        BudgetConfig(deadline=1000), clock=Clock(0), environ=env, end_time_lookup=lambda: 3000.0
    )
    assert (b.start().end_time, b.source) == (1000, "budget.deadline")
    b = TimeBudget(BudgetConfig(), clock=Clock(0), environ=env, end_time_lookup=lambda: 3000.0)
    assert (b.start().end_time, b.source) == (2000, "$FTKIT_DEADLINE")
    b = TimeBudget(BudgetConfig(), clock=Clock(0), environ={}, end_time_lookup=lambda: 3000.0)
    assert (b.start().end_time, b.source) == (3000, "end_time_lookup")


def test_end_time_from_slurm(monkeypatch):
    calls = []

    def fake_scontrol(args, **kwargs):
        calls.append(list(args))
        return "JobId=55 JobState=RUNNING EndTime=2024-03-01T14:00:00 Partition=gpu\n"

    monkeypatch.setattr(slurm_env, "run_scontrol", fake_scontrol)
    b = TimeBudget(BudgetConfig(), clock=Clock(0), environ={"SLURM_JOB_ID": "55"}).start()
    assert b.end_time == datetime(2024, 3, 1, 14).timestamp()
    assert b.source == "SLURM EndTime"
    assert calls == [["show", "job", "-o", "55"]]
    # outside SLURM nothing is asked
    b = TimeBudget(BudgetConfig(), clock=Clock(0), environ={}).start()
    assert b.end_time is None and len(calls) == 1


def test_slurm_failure_means_no_deadline_with_a_warning(monkeypatch, caplog):
    def broken(args, **kwargs):
        raise SlurmError("`scontrol show job -o 55`: scontrol is missing")

    monkeypatch.setattr(slurm_env, "run_scontrol", broken)
    with caplog.at_level(logging.WARNING, logger="ftkit.triggers.budget"):
        b = TimeBudget(BudgetConfig(), clock=Clock(0), environ={"SLURM_JOB_ID": "55"}).start()
    assert b.end_time is None and not b.due(10**10)
    assert "scontrol is missing" in caplog.text


def test_utc_iso_matches_unix():
    # sanity for the table above: 1_700_000_000 is 2023-11-14T22:13:20Z
    assert datetime.fromtimestamp(END, timezone.utc).isoformat() == "2023-11-14T22:13:20+00:00"


@pytest.mark.parametrize(
    ("field", "value"),
    [("margin", -1), ("save_estimate", float("inf")), ("deadline", "soon"), ("env_var", "")],
)
def test_bad_config_names_the_setting(field, value):
    with pytest.raises(ConfigError, match=f"budget.{field}"):
        BudgetConfig(**{field: value})
