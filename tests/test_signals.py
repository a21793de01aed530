"""Signals: real processes, real signals, acted on at the next step boundary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.decision import Action, RequestBox, Source
from ftkit.errors import ConfigError
from ftkit.events import read_events
from ftkit.triggers.signals import SignalConfig, SignalTrigger, parse_signal
from tests.conftest import wait_for

PROGRAM = Path(__file__).parent / "programs" / "check_loop.py"


def start_loop(jobdir: Path, steps: int = 2000, step_seconds: float = 0.01, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), str(steps), str(step_seconds), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (jobdir / "ready-rank0").exists() or proc.poll() is not None, 60, what="loop ready")
    assert proc.poll() is None, proc.stdout.read().decode()
    return proc


def decisions(jobdir: Path, rank: int = 0) -> list[dict]:
    path = jobdir / f"decisions-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    ("sig", "action", "requeue"),
    [(signal.SIGUSR1, "SAVE_EXIT", True), (signal.SIGTERM, "SAVE_EXIT", None)],
)
def test_real_signal_is_acted_on_at_next_step(tmp_path: Path, sig: signal.Signals, action: str, requeue) -> None:
    proc = start_loop(tmp_path)
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()
    got = decisions(tmp_path)
    assert len(got) == 1, got
    assert got[0]["action"] == action and got[0]["requeue"] is requeue
    assert got[0]["reasons"] == [f"{sig.name} received"]
    assert got[0]["step"] < 2000  # it stopped early, at a step boundary
    events = list(read_events(tmp_path / "events.jsonl"))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and "trigger" in kinds and "decision" in kinds and kinds[-1] == "exit"
    decision_event = next(e for e in events if e["event"] == "decision")
    assert decision_event["step"] == got[0]["step"] and decision_event["sources"] == ["signal"]


def test_signal_burst_changes_only_the_log(tmp_path: Path) -> None:
    """Ten USR2 (mapped to save) in a burst give one save decision, not ten."""
    box = RequestBox()
    trig = SignalTrigger(SignalConfig(actions={"USR2": "save"}), box).start()
    try:
        for _ in range(10):
            os.kill(os.getpid(), signal.SIGUSR2)
        requests = box.drain()
    finally:
        trig.close()
    assert len(requests) == 10
    assert {(r.action, r.source) for r in requests} == {(Action.SAVE, Source.SIGNAL)}

    from ftkit.control.agreement import decode_flags, encode

    action, requeue, _, sources = decode_flags(encode(requests))
    assert action == Action.SAVE and requeue is None and sources == {Source.SIGNAL}


def test_handlers_chain_and_restore() -> None:
    seen: list[int] = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR2, previous)
    try:
        box = RequestBox()
        with SignalTrigger(SignalConfig(actions={"SIGUSR2": "save"}), box):
            assert signal.getsignal(signal.SIGUSR2) is not previous
            os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2] and len(box.drain()) == 1
        assert signal.getsignal(signal.SIGUSR2) is previous  # restored on close
    finally:
        signal.signal(signal.SIGUSR2, old)


@pytest.mark.parametrize("value", ["USR1", "sigusr1", "SIGUSR1", 10, "10"])
def test_signal_names_and_numbers(value) -> None:
    assert parse_signal(value) == signal.SIGUSR1


@pytest.mark.parametrize("bad", ["USR3", "SIGFOO", "", "999"])
def test_bad_signal_name_gives_clear_error(bad) -> None:
    with pytest.raises(ConfigError, match=r"signals\[.*is not a signal"):
        SignalConfig(actions={bad: "save"})


def test_uncatchable_signal_and_bad_action_are_refused() -> None:
    with pytest.raises(ConfigError, match="SIGKILL cannot be caught"):
        SignalConfig(actions={"KILL": "save"})
    with pytest.raises(ConfigError, match="unknown action 'explode'"):
        SignalConfig(actions={"USR1": "explode"})
