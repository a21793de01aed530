"""Signals: real processes, real signals, acted on at the next step boundary."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.decision import Action, RequestBox, Source
from ftkit.errors import ConfigError
from ftkit.events import read_events
from ftkit.triggers.signals import SignalConfig, SignalTrigger, parse_signal
from tests.conftest import wait_for

PROGRAM = Path(__file__).parent / "programs" / "check_loop.py"
TRAIN = Path(__file__).parent / "programs" / "goodput_loop.py"


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
        with SignalTrigger(SignalConfig(actions={"SIGUSR2": "save"}, chain=True), box):
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


# -- what chaining keeps: a mapped signal is ftkit's ---------------------------------------

def test_ctrl_c_handler_installed_before_is_not_called() -> None:
    """Python's own SIGINT handler raises KeyboardInterrupt; ftkit never passes SIGINT on to it."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        box = RequestBox()
        with SignalTrigger(SignalConfig(actions={"INT": "save-exit"}), box):
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here
        [request] = box.drain()
        assert (request.action, request.reason) == (Action.SAVE_EXIT, "SIGINT received")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on close
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_raising_handler_installed_before_is_not_called_for_an_owned_signal() -> None:
    """By default a mapped signal is ftkit's alone: a previous handler that would exit is not
    called, the request is recorded and the handler is put back on close."""
    seen: list[int] = []

    def exits(signum, frame):
        seen.append(signum)
        raise SystemExit(9)

    old = signal.signal(signal.SIGTERM, exits)
    try:
        box = RequestBox()
        with SignalTrigger(SignalConfig(actions={"TERM": "save-exit"}), box):
            signal.raise_signal(signal.SIGTERM)  # no SystemExit here
        assert seen == [] and [r.reason for r in box.drain()] == ["SIGTERM received"]
        assert signal.getsignal(signal.SIGTERM) is exits
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_raising_handler_chained_on_request_cannot_end_the_step() -> None:
    """chain=True: a previous Python handler still sees its signal; what it raises is held back
    and named in the request, so the step goes on to the save."""
    seen: list[int] = []

    def exits(signum, frame):
        seen.append(signum)
        raise SystemExit(9)

    old = signal.signal(signal.SIGTERM, exits)
    try:
        box = RequestBox()
        with SignalTrigger(SignalConfig(actions={"TERM": "save-exit"}, chain=True), box):
            signal.raise_signal(signal.SIGTERM)
        [request] = box.drain()
        assert seen == [signal.SIGTERM]
        assert request.reason.startswith("SIGTERM received (the handler installed before ftkit's raised "
                                         "SystemExit: 9; held back")
    finally:
        signal.signal(signal.SIGTERM, old)


def test_chain_off_explicitly_the_handler_installed_before_is_not_called() -> None:
    seen: list[int] = []

    def raises(signum, frame):
        seen.append(signum)
        raise RuntimeError("must not run")

    old = signal.signal(signal.SIGUSR2, raises)
    try:
        box = RequestBox()
        with SignalTrigger(SignalConfig(actions={"USR2": "save"}, chain=False), box):
            signal.raise_signal(signal.SIGUSR2)
        assert seen == [] and [r.reason for r in box.drain()] == ["SIGUSR2 received"]
        assert signal.getsignal(signal.SIGUSR2) is raises
    finally:
        signal.signal(signal.SIGUSR2, old)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ctrl_c_twice_within_the_window_interrupts_at_once() -> None:
    clock = FakeClock()
    box = RequestBox()
    with SignalTrigger(SignalConfig(actions={"INT": "save-exit"}), box, clock=clock):
        signal.raise_signal(signal.SIGINT)
        assert len(box.drain()) == 1  # the first asks for save-exit
        clock.now += 1.5
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the second, 1.5 s later: out now
        assert box.drain() == []
        clock.now += 10
        signal.raise_signal(signal.SIGINT)  # long after: a request again
        assert len(box.drain()) == 1
    quiet = RequestBox()
    with SignalTrigger(SignalConfig(actions={"INT": "save-exit"}, interrupt_window=None), quiet, clock=clock):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # same instant: still only asks
    assert len(quiet.drain()) == 2


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_bad_interrupt_window_is_refused(bad) -> None:
    with pytest.raises(ConfigError, match=r"signals\.interrupt_window: must be seconds > 0 or None"):
        SignalConfig(interrupt_window=bad)


LOOP_WITH_HANDLERS = '''
import json, signal, sys, time
from pathlib import Path
import ftkit

jobdir = Path(sys.argv[1])
def exits(signum, frame):  # a handler that exits, and leaves a mark if it is ever called
    (jobdir / "previous-handler-called").write_text("")
    sys.exit(9)

signal.signal(signal.SIGTERM, exits)
signal.signal(signal.SIGINT, signal.default_int_handler)          # Python's: KeyboardInterrupt

class Counter:
    value = 0
    def state_dict(self): return {"value": self.value}
    def load_state_dict(self, sd): self.value = sd["value"]

box = Counter()
config = ftkit.Config(signals=ftkit.SignalConfig(actions={"TERM": "save-exit", "INT": "save-exit"}))
with ftkit.FaultTolerance(jobdir, state={"box": box}, config=config) as ft:
    for step in ft.range(100000):
        if step == 1:
            (jobdir / "ready").write_text("")
        box.value = step
        time.sleep(0.01)
print(json.dumps({"completed": ft.completed, "saved": ft.last_saved_step}))
'''


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_real_signal_with_a_raising_handler_installed_before_saves_and_exits_cleanly(
        tmp_path: Path, sig: signal.Signals) -> None:
    program = tmp_path / "loop.py"
    program.write_text(LOOP_WITH_HANDLERS)
    jobdir = tmp_path / "job"
    proc = subprocess.Popen([sys.executable, str(program), str(jobdir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (jobdir / "ready").exists() or proc.poll() is not None, 120, what="loop ready")
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in out, out
    result = json.loads(out.strip().splitlines()[-1])
    [save] = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "save"]
    assert result == {"completed": False, "saved": save["step"]}
    # the signal is ftkit's: the previous handler (which would exit) is never called
    assert save["reason"] == f"{sig.name} received"
    assert not (jobdir / "previous-handler-called").exists()


def _writing(proc: subprocess.Popen, root: Path, since: float) -> bool:
    """``proc`` ended, or a checkpoint is being written that was begun after ``since`` (the
    sentinel of an earlier run's interrupted one may still be there)."""
    sentinels = (d / "checkpoint-is-incomplete" for d in root.iterdir())
    return proc.poll() is not None or any(s.exists() and s.stat().st_mtime > since for s in sentinels)


def test_ctrl_c_twice_while_a_checkpoint_is_written_ends_the_process_as_interrupted_not_aborted(tmp_path) -> None:
    """The second Ctrl-C lands while the first one's checkpoint is being written (its sentinel
    there: torch.save is calling ftkit's writer). KeyboardInterrupt ends the process as an
    interrupt, exit -SIGINT, not SIGABRT from a C++ destructor (torch's zip writer, left
    unended, ended itself as it was freed, through a writer that had given up), and the next
    run resumes from the newest valid checkpoint, past the one left incomplete."""
    from ftkit.checkpoint import validate_dir

    jobdir, root = tmp_path / "job", tmp_path / "job" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(TRAIN), str(jobdir), "1000000", "0.002", "0", "--state-mb", "192"],
                                env=env, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: proc.poll() is not None or any(
            line.split()[0] == str(proc.pid) for line in (jobdir / "steps.log").read_text().splitlines()[-3:])
            if (jobdir / "steps.log").exists() else proc.poll() is not None, 60, what="training steps")
        return proc

    def valid() -> list[int]:
        return sorted(int(d.name.split("-")[1]) for d in root.iterdir() if validate_dir(d).valid)

    proc = start()
    proc.send_signal(signal.SIGINT)  # once: save and exit
    assert proc.communicate(timeout=120)[1] is not None and proc.returncode == 0
    [saved] = valid()
    for _ in range(3):
        began = time.time()
        proc = start()
        proc.send_signal(signal.SIGINT)
        wait_for(functools.partial(_writing, proc, root, began), 60, interval=0.0005, what="the checkpoint being written")
        proc.send_signal(signal.SIGINT)  # twice: out at once
        err = proc.communicate(timeout=120)[1]
        rc = proc.returncode
        assert "terminate called" not in err and rc == -signal.SIGINT, (rc, err[-3000:])
        assert "KeyboardInterrupt" in err
        saved = max(valid())
    proc = start()  # resumes from the newest valid checkpoint, the interrupted one skipped
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err
    resumes = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "resume"]
    assert resumes[-1]["step"] == saved, resumes


UNMAPPED = """
import sys, time, torch, ftkit
model = torch.nn.Linear(4, 4)
with ftkit.FaultTolerance(sys.argv[1], state={"model": model}, config=ftkit.Config(save_every=5)) as ft:
    for step in ft.range(100000):
        time.sleep(0.01)
        if step == 12:
            print("past a checkpoint", flush=True)
"""


def test_ctrl_c_where_sigint_is_not_mapped_says_what_was_lost_and_how_to_map_it(tmp_path) -> None:
    """The default config maps USR1 and TERM only: Ctrl-C raises KeyboardInterrupt as always,
    and rank 0 says the run ended without a save, the setting that makes Ctrl-C save, and
    where the next run resumes."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", UNMAPPED, str(tmp_path / "job")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "past a checkpoint\n"
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGINT, err
    [said] = [line for line in err.splitlines() if "SIGINT is not mapped" in line]
    reached = int(said.split("ended the run at step ")[1].split()[0])
    saved = max(e["step"] for e in read_events(tmp_path / "job" / "events.jsonl") if e["event"] == "save")
    assert reached >= saved >= 10 and f"The next run resumes from step {saved}." in said, said
    assert "'INT': 'save-exit'" in said and "FTKIT_SIGNALS=USR1=requeue,TERM=save-exit,INT=save-exit" in said
