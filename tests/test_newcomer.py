"""The README's main job as a newcomer meets it: a fresh venv with only ftkit's declared
dependencies (torch pinned as in CI, no test extras), ``python -m ftkit demo`` on a real
terminal, Ctrl-C, and the same command again.

The terminal is a pseudo-terminal whose slave is the demo's controlling terminal and whose
foreground process group is the demo's, so Ctrl-C is ``\\x03`` written to the master and the
kernel's line discipline sends ``SIGINT``, exactly as when a person presses it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import ftkit
from ftkit.events import read_events
from tests.conftest import ROOT, wait_for

TORCH = "torch==2.13.0"  # the pin of .ci/run and the README
STEPS = 400


@dataclass(frozen=True)
class Venv:
    python: Path
    env: dict[str, str]


def _pip(venv: Path, *args: str) -> None:
    # --no-compile: no bytecode for torch's thousands of modules up front (about half of the
    # install's time); the few the demo imports are compiled when first imported
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                          "--disable-pip-version-check", *args],
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, f"pip install {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """``python -m venv`` (no system site-packages), torch pinned, then ftkit from a copy of
    this tree (so nothing is written into the checkout) with its declared dependencies only."""
    began = time.monotonic()
    base = tmp_path_factory.mktemp("fresh")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(venv, TORCH)
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("ftkit", "sbatch_templates"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    _pip(venv, str(src))
    home = base / "home"
    home.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    python = venv / "bin" / "python"
    # what it sees: ftkit from the venv (not this checkout), none of the test extras
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, ftkit; print(ftkit.__file__); "
         "print([m for m in ('pytest', 'hypothesis', 'transformers') if u.find_spec(m)])"],
        capture_output=True, text=True, env=env, cwd=home, timeout=120, check=True)
    where, extras = probe.stdout.split("\n")[:2]
    assert where.startswith(str(venv)) and extras == "[]", probe.stdout
    print(f"\nfresh venv with {TORCH} and ftkit built in {time.monotonic() - began:.0f} s")
    return Venv(python, env)


class Terminal:
    """A command on a pseudo-terminal that is its controlling terminal, the screen collected."""

    # become the session's controlling terminal's owner, then be the program (same pid)
    _SETUP = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")

    def __init__(self, venv: Venv, *args: str, cwd: Path) -> None:
        master, slave = os.openpty()
        self.proc = subprocess.Popen([str(venv.python), "-c", self._SETUP, *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=venv.env, cwd=cwd, start_new_session=True)
        os.close(slave)
        self.master = master
        self.raw = b""

    @property
    def screen(self) -> str:
        """What was written, without colours and cursor movements."""
        self._drain()
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", self.raw.decode(errors="replace"))

    def _drain(self) -> None:
        import select

        while self.master >= 0 and select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has gone
                return
            if not chunk:
                return
            self.raw += chunk

    def ctrl_c(self) -> None:
        # the program, not a shell, leads the foreground process group of this terminal
        assert os.tcgetpgrp(self.master) == self.proc.pid
        os.write(self.master, b"\x03")

    def wait(self, timeout: float) -> int:
        wait_for(lambda: self._drain() or self.proc.poll() is not None, timeout, interval=0.05,
                 what=f"the program to exit; screen so far:\n{self.screen[-3000:]}")
        self._drain()
        os.close(self.master)
        self.master = -1
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


def events(jobdir: Path, kind: str) -> list[dict]:
    path = jobdir / "events.jsonl"
    return [e for e in read_events(path) if e["event"] == kind] if path.exists() else []


def assert_clean(screen: str) -> None:
    """No traceback, no Python warning (UserWarning, DeprecationWarning, ...) on the screen."""
    assert "Traceback" not in screen and "Warning" not in screen, screen


def demo(venv: Venv, jobdir: Path, *extra: str) -> Terminal:
    return Terminal(venv, "-m", "ftkit", "demo", "--jobdir", str(jobdir), "--steps", str(STEPS),
                    "--save-every", "0", *extra, cwd=jobdir.parent)


def check_saved_on_sigint_then_resumes(venv: Venv, jobdir: Path, first: Terminal) -> None:
    try:
        assert first.wait(180) == 0
    finally:
        first.close()
    screen = first.screen
    assert_clean(screen)
    [save] = events(jobdir, "save")
    assert save["reason"] == "SIGINT received" and 0 < save["step"] < STEPS
    assert events(jobdir, "decision")[-1]["action"] == "SAVE_EXIT"
    assert events(jobdir, "exit")[-1]["error"] is None
    stopped = save["step"]
    assert f"stopped at step {stopped} (SIGINT received)" in screen, screen
    assert f"the checkpoint of step {stopped} is in" in screen

    again = demo(venv, jobdir, "--step-time", "0")
    try:
        assert again.wait(180) == 0
    finally:
        again.close()
    assert_clean(again.screen)
    assert f"resuming from the checkpoint of step {stopped}" in again.screen
    assert f"finished {STEPS} steps" in again.screen
    assert events(jobdir, "resume")[-1]["step"] == stopped
    assert events(jobdir, "exit")[-1]["completed"] is True


def test_ctrl_c_in_the_live_display_saves_and_the_same_command_resumes(fresh_venv: Venv, tmp_path: Path) -> None:
    jobdir = tmp_path / "demo"
    term = demo(fresh_venv, jobdir, "--step-time", "0.05")
    try:
        # the live display is up: ftkit's handlers are installed and steps are running
        wait_for(lambda: "throughput" in term.screen or term.proc.poll() is not None, 180,
                 what="the live display")
        assert term.proc.poll() is None, term.screen
        assert "Ctrl-C" in term.screen and f"kill -TERM {term.proc.pid}" in term.screen
        term.ctrl_c()
    except BaseException:
        term.close()
        raise
    check_saved_on_sigint_then_resumes(fresh_venv, jobdir, term)


def test_no_live_and_kill_int_saves_and_the_same_command_resumes(fresh_venv: Venv, tmp_path: Path) -> None:
    jobdir = tmp_path / "demo"
    term = demo(fresh_venv, jobdir, "--step-time", "0.05", "--no-live")
    try:
        wait_for(lambda: "starting from step 0" in term.screen or term.proc.poll() is not None, 180,
                 what="the first step")
        assert term.proc.poll() is None, term.screen
        os.kill(term.proc.pid, signal.SIGINT)
    except BaseException:
        term.close()
        raise
    check_saved_on_sigint_then_resumes(fresh_venv, jobdir, term)


def test_the_demo_needs_no_numpy(tmp_path: Path) -> None:
    """With numpy unimportable (torch then warns, ignored here) the demo ends as it does with it."""
    runs = {}
    for name, block in (("with", ""), ("without", "sys.modules['numpy'] = None; ")):
        jobdir = tmp_path / name
        code = (f"import sys; {block}from ftkit.cli import main; "
                f"sys.exit(main(['demo', '--no-live', '--jobdir', {str(jobdir)!r}, '--steps', '30', "
                f"'--step-time', '0', '--save-every', '10']))")
        out = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-c", code], capture_output=True,
                             text=True, timeout=300, check=False)
        assert out.returncode == 0 and "finished 30 steps" in out.stdout, out.stdout + out.stderr
        runs[name] = (jobdir / "result-rank0.json").read_text()
    assert runs["with"] == runs["without"]


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def test_checkpoint_config_without_a_root_saves_under_the_job_dir(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative root must not land in the current directory
    jobdir = tmp_path / "job"
    for config, where in ((ftkit.CheckpointConfig(keep_last=3), jobdir / "checkpoints"),
                          (ftkit.CheckpointConfig(root="ck", keep_last=3), jobdir / "ck")):
        box = Counter()
        with ftkit.FaultTolerance(jobdir, state={"n": box}, config=ftkit.Config(checkpoint=config)) as ft:
            for step in range(1, 6):
                box.value = step
                ft.save(step, reason="test")
        assert sorted(p.name for p in where.iterdir() if p.name.startswith("step-")) == [
            "step-00000003", "step-00000004", "step-00000005"]  # keep_last=3 applied there
    assert list(elsewhere.iterdir()) == []
    absolute = tmp_path / "abs"
    assert ftkit.CheckpointConfig(root=absolute).under(jobdir).root == absolute
