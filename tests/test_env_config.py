"""FTKIT_* environment variables -> ftkit.Config; bad values name the variable."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ftkit.envvars import config_from_env, jobdir_from_env
from ftkit.errors import ConfigError


def test_unset_keeps_the_defaults():
    cfg = config_from_env({})
    assert cfg.signals.enabled and set(cfg.signals.resolved) == {signal.SIGUSR1, signal.SIGTERM}
    assert cfg.watch.mode == "auto" and cfg.agreement.every == 10 and cfg.save_every is None
    assert cfg.budget.deadline is None and cfg.checkpoint is None
    assert jobdir_from_env({}) is None and jobdir_from_env({"FTKIT_JOBDIR": "  "}) is None


def test_every_variable(tmp_path):
    cfg = config_from_env({
        "FTKIT_JOBDIR": str(tmp_path),
        "FTKIT_SIGNALS": "usr2=save, SIGTERM=requeue,10=stop",
        "FTKIT_WATCH": "Polling",
        "FTKIT_POLL_INTERVAL": "0.25",
        "FTKIT_AGREE_EVERY": "5",
        "FTKIT_AGREE_SECONDS": "2.5",
        "FTKIT_DEADLINE": "2030-01-01T00:00:00Z",
        "FTKIT_BUDGET_MARGIN": "0",
        "FTKIT_SAVE_EVERY": "100",
        "FTKIT_KEEP_LAST": "2",
    })
    assert {s.name: a for s, (a, _r) in cfg.signals.resolved.items()} == {
        "SIGUSR2": 1, "SIGTERM": 3, "SIGUSR1": 3}
    assert cfg.signals.resolved[signal.SIGUSR1][1] is False  # 10 = USR1 on Linux, "stop"
    assert cfg.watch.mode == "polling" and cfg.watch.poll_interval == 0.25
    assert cfg.agreement.every == 5 and cfg.agreement.max_seconds == 2.5
    assert cfg.budget.deadline == 1893456000.0 and cfg.budget.margin == 0
    assert cfg.save_every == 100
    assert cfg.checkpoint.keep_last == 2 and cfg.checkpoint.root == tmp_path / "checkpoints"
    assert jobdir_from_env({"FTKIT_JOBDIR": str(tmp_path)}) == tmp_path


def test_off_values(tmp_path):
    cfg = config_from_env({"FTKIT_SIGNALS": "off", "FTKIT_WATCH": "off", "FTKIT_SAVE_EVERY": "off",
                           "FTKIT_KEEP_LAST": "all"}, jobdir=tmp_path)
    assert not cfg.signals.enabled and cfg.watch.mode == "off" and cfg.save_every is None
    assert cfg.checkpoint.keep_last is None
    assert config_from_env({"FTKIT_DEADLINE": "1893456000"}).budget.deadline == 1893456000.0
    assert config_from_env({"FTKIT_SAVE_EVERY": " Auto "}).save_every == "auto"


@pytest.mark.parametrize(
    ("name", "value", "hint"),
    [
        ("FTKIT_SIGNALS", "USR1", "SIGNAL=ACTION"),
        ("FTKIT_SIGNALS", "USR1=explode", "unknown action"),
        ("FTKIT_SIGNALS", "NOPE=save", "not a signal"),
        ("FTKIT_SIGNALS", "KILL=save", "cannot be caught"),
        ("FTKIT_SIGNALS", ",", "no SIGNAL=ACTION"),
        ("FTKIT_WATCH", "inotify", "auto"),
        ("FTKIT_POLL_INTERVAL", "0", "> 0"),
        ("FTKIT_POLL_INTERVAL", "fast", "cannot read"),
        ("FTKIT_POLL_INTERVAL", "nan", "seconds"),
        ("FTKIT_AGREE_EVERY", "0", ">= 1"),
        ("FTKIT_AGREE_EVERY", "2.5", "whole number"),
        ("FTKIT_AGREE_SECONDS", "0", "> 0"),
        ("FTKIT_DEADLINE", "tomorrow", "ISO-8601"),
        ("FTKIT_DEADLINE", "1700000000", "s in the past (a value left from an earlier job?)"),
        ("FTKIT_BUDGET_MARGIN", "-1", ">= 0"),
        ("FTKIT_SAVE_EVERY", "-3", ">= 1, e.g. 10, or auto (the measured interval), or off"),
        ("FTKIT_SAVE_EVERY", "abc", "cannot read 'abc'; give a whole number >= 1, e.g. 10, or auto"),
        ("FTKIT_KEEP_LAST", "0", ">= 1, e.g. 10, or all"),
        ("FTKIT_KEEP_LAST", "3", "FTKIT_JOBDIR"),
    ],
)
def test_bad_values_name_the_variable(name, value, hint):
    with pytest.raises(ConfigError) as err:
        config_from_env({name: value})
    assert str(err.value).startswith(f"{name}:") and hint in str(err.value)


def test_os_environ_is_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("FTKIT_AGREE_EVERY", "7")
    monkeypatch.setenv("FTKIT_JOBDIR", str(tmp_path / "job"))
    assert config_from_env().agreement.every == 7
    assert jobdir_from_env() == Path(tmp_path / "job")


@pytest.mark.parametrize(("settings", "said"), [
    ({"async_save": True}, r"async_save: expected an AsyncConfig\(...\) or None, got True"),
    ({"checkpoint": {"keep_last": 5}}, r"checkpoint: expected a CheckpointConfig\(...\) or None, got \{'keep_last': 5\} "
                                       r"\(a dict: pass its settings as keywords, CheckpointConfig\(\*\*settings\)\)"),
    ({"signals": {"TERM": "save-exit"}}, r"signals: expected a SignalConfig\(...\), got"),
    ({"budget": None}, r"budget: expected a BudgetConfig\(...\), got None"),
    ({"save_every": True}, r"save_every: must be a whole number of steps >= 1"),
    ({"save_at_end": "no"}, r"save_at_end: expected True or False, got 'no'"),
])
def test_a_config_part_of_the_wrong_kind_is_refused_when_built(settings, said):
    """Refused by ``Config(...)`` naming the setting, not an AttributeError at ``with``."""
    import ftkit
    from ftkit.errors import ConfigError

    with pytest.raises(ConfigError, match=said):
        ftkit.Config(**settings)
