"""Two ranks over gloo: a trigger seen by one rank gives both the same decision at the same step."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.control.agreement import AgreementConfig, Flag, decode_flags, decode_signals, encode
from ftkit.decision import Action, Request, Source
from ftkit.errors import ConfigError
from tests.conftest import wait_for
from tests.test_signals import PROGRAM, decisions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(jobdir: Path, *extra: str, world: int = 2, steps: str = "100000",
                step_seconds: str = "0.005") -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), steps, step_seconds, *extra],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    wait_for(lambda: all((jobdir / f"ready-rank{r}").exists() for r in range(world))
             or any(p.poll() is not None for p in procs), 90, what="ranks ready")
    return procs


@pytest.mark.parametrize(("signalled_rank", "every"), [(1, 1), (1, 7), (0, 5)])
def test_only_one_rank_sees_the_signal_both_decide_at_the_same_step(tmp_path: Path, signalled_rank, every) -> None:
    procs = start_ranks(tmp_path, "--every", str(every))
    try:
        # let them run a little so the decision is not at the first check
        events = tmp_path / "events.jsonl"
        wait_for(lambda: events.read_text().count('"start"') >= 2, 30, what="both ranks started")
        os.kill(procs[signalled_rank].pid, signal.SIGUSR1)
        outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    d0, d1 = decisions(tmp_path, 0), decisions(tmp_path, 1)
    assert len(d0) == len(d1) == 1, (d0, d1)
    assert d0[0]["step"] == d1[0]["step"]
    assert d0[0]["step"] % every == 0 or d0[0]["step"] <= 2  # (the first check, and the next that measures a step)
    assert d0[0]["action"] == d1[0]["action"] == "SAVE_EXIT"
    assert d0[0]["requeue"] is d1[0]["requeue"] is True
    mine, other = (d0, d1) if signalled_rank == 0 else (d1, d0)
    assert mine[0]["reasons"] == ["SIGUSR1 received"]
    assert other[0]["reasons"] == ["SIGUSR1 received by another rank"]


@pytest.mark.parametrize("max_seconds", ["2.5", "none"])
def test_slow_steps_agree_within_max_seconds_not_every_steps(tmp_path: Path, max_seconds: str) -> None:
    """Steps of 0.5 s and every=10 (10 steps: 5 s): with max_seconds=2.5 the ranks agree every
    5 steps or fewer (a trigger waits ~2.5 s, not ~5 s: SLURM's SIGKILL comes 30 s after its SIGTERM),
    at multiples of the agreed count on both ranks; with None, every 10 steps as before. A
    save-switch decides at step A; a signal sent to rank 1 right then decides at A + the count."""
    procs = start_ranks(tmp_path, "--every", "10", "--max-seconds", max_seconds, steps="100", step_seconds="0.5")
    try:
        time.sleep(1.5)  # past the first checks (the first agreement, and the next step's, which measures it)
        (tmp_path / "save-switch").touch()  # seen by both; acted on at the next agreement
        wait_for(lambda: (tmp_path / "decisions-rank0.jsonl").exists() or any(p.poll() is not None for p in procs),
                 30, what="the save decision")
        os.kill(procs[1].pid, signal.SIGUSR1)
        outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    d0, d1 = decisions(tmp_path, 0), decisions(tmp_path, 1)
    steps = [d["step"] for d in d0]
    assert steps == [d["step"] for d in d1] and [d["action"] for d in d0] == ["SAVE", "SAVE_EXIT"], (d0, d1)
    cadence = steps[1] - steps[0]  # 2.5 s / the slowest rank's step time (0.5 s + the check's, and load)
    assert cadence in ((2, 3, 4, 5) if max_seconds == "2.5" else (10,)), steps
    assert steps[0] % cadence == 0, steps


def test_flags_roundtrip_and_kill_wins_over_requeue() -> None:
    reqs = [
        Request(Action.SAVE_EXIT, Source.SIGNAL, "USR1", requeue=True),
        Request(Action.SAVE_EXIT, Source.KILL_SWITCH, "kill", requeue=False, pin=True),
    ]
    action, requeue, pin, sources = decode_flags(encode(reqs))
    assert action == Action.SAVE_EXIT and requeue is False and pin
    assert sources == {Source.SIGNAL, Source.KILL_SWITCH}
    flags = encode([Request(Action.SAVE, Source.SAVE_SWITCH, "s")], no_save=True)
    assert flags[Flag.NO_SAVE] == 1
    assert decode_flags(flags)[0] == Action.EXIT  # kill-switch at start: exit, write nothing


def test_each_signal_is_named_on_every_rank() -> None:
    """Which signals arrived travels with the flags: a rank that saw SIGTERM learns of another's
    SIGUSR1 (the requeue policy reads the name), and a signal's absence is not invented."""
    usr1 = encode([Request(Action.SAVE_EXIT, Source.SIGNAL, "u", requeue=True, signal=signal.SIGUSR1)])
    term = encode([Request(Action.SAVE_EXIT, Source.SIGNAL, "t", signal=signal.SIGTERM)])
    agreed = [max(a, b) for a, b in zip(usr1, term, strict=True)]
    assert decode_signals(agreed) == [signal.SIGUSR1, signal.SIGTERM]
    assert decode_signals(encode([Request(Action.SAVE, Source.SAVE_SWITCH, "s")])) == []
    assert decode_flags(agreed)[3] == {Source.SIGNAL}


@pytest.mark.parametrize("every", [0, -3, 2.5])
def test_bad_cadence(every) -> None:
    with pytest.raises(ConfigError, match=r"agreement\.every"):
        AgreementConfig(every=every)
