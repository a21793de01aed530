"""`ftkit demo` driven like a person would (a pseudo-terminal, switches, a rerun) and
`ftkit status --json` on a job dir with valid, incomplete and corrupt checkpoints."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import ftkit
from ftkit.events import read_events
from tests.ckpt_helpers import Box
from tests.conftest import wait_for

STEPS = 300


def ftkit_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftkit", *args], capture_output=True, text=True,
                          timeout=120, check=check)


class PtyProcess:
    """A command on a real pseudo-terminal, its screen output collected."""

    def __init__(self, *argv: str) -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.master = master
        self.screen = b""

    def read(self) -> str:
        while self.master >= 0 and select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.screen += chunk
        return self.screen.decode(errors="replace")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read()
            time.sleep(0.05)
        self.read()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"demo did not exit in {timeout} s:\n{self.read()[-2000:]}")
        os.close(self.master)
        self.master = -1
        return self.proc.returncode


def events(jobdir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == kind]


def test_demo_in_a_terminal_save_switch_kill_switch_and_exact_resume(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    ftkit_cli("demo", "--no-live", "--jobdir", str(reference), "--steps", str(STEPS), "--step-time", "0",
              "--save-every", "0")
    expected = json.loads((reference / "result-rank0.json").read_text())["params_sha256"]

    jobdir = tmp_path / "job"
    demo = PtyProcess(sys.executable, "-m", "ftkit", "demo", "--jobdir", str(jobdir), "--steps", str(STEPS),
                      "--step-time", "0.03", "--save-every", "0")
    wait_for(lambda: "throughput" in demo.read(), 60, what="the live display")
    screen = demo.read()
    assert "ftkit save" in screen and "ftkit kill" in screen  # the instructions are on screen
    ftkit_cli("save", str(jobdir))
    wait_for(lambda: events(jobdir, "save"), 30, what="save-switch checkpoint")
    wait_for(lambda: not (jobdir / "save-switch").exists(), 30, what="save-switch removed")
    wait_for(lambda: "last valid checkpoint" in demo.read() and "step " in demo.read(), 10, what="display update")
    assert demo.proc.poll() is None  # the save-switch does not stop training
    ftkit_cli("kill", str(jobdir))
    assert demo.wait(60) == 0
    assert "stopped" in demo.read()
    killed = events(jobdir, "decision")[-1]
    assert killed["action"] == "SAVE_EXIT" and killed["requeue"] is False

    # while the kill-switch is there, a rerun saves nothing and exits at once
    again = ftkit_cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", str(STEPS), "--step-time", "0",
                      "--save-every", "0")
    assert "stopped" in again.stdout
    assert len(events(jobdir, "save")) == 2
    assert events(jobdir, "decision")[-1]["action"] == "EXIT"

    # cleared, a rerun resumes from the kill-switch checkpoint and ends where a straight run ends
    ftkit_cli("kill", "--clear", str(jobdir))
    done = ftkit_cli("demo", "--no-live", "--jobdir", str(jobdir), "--steps", str(STEPS), "--step-time", "0",
                     "--save-every", "0")
    assert "finished" in done.stdout
    assert events(jobdir, "resume")[-1]["step"] == killed["step"]
    assert json.loads((jobdir / "result-rank0.json").read_text())["params_sha256"] == expected


def test_status_json_with_valid_incomplete_and_corrupt_checkpoints(tmp_path: Path) -> None:
    box = Box()
    cfg = ftkit.Config(checkpoint=ftkit.CheckpointConfig(root=tmp_path / "checkpoints", keep_last=None))
    with ftkit.FaultTolerance(tmp_path, state={"box": box}, config=cfg) as ft:
        for step in (10, 20, 30, 40):
            box.value = step
            ft.save(step, reason="periodic")
    root = tmp_path / "checkpoints"
    # step 40: a save that never finished; step 30: a data file cut short
    (root / "step-00000040" / "checkpoint-is-incomplete").write_text("")
    data = next(p for p in (root / "step-00000030").iterdir() if p.name not in ("manifest.json",))
    data.write_bytes(data.read_bytes()[:-7])
    ftkit_cli("save", str(tmp_path))

    out = ftkit_cli("status", "--json", str(tmp_path))
    status = json.loads(out.stdout)
    by_step = {c["step"]: c for c in status["checkpoints"]}
    assert [c["step"] for c in status["checkpoints"]] == [40, 30, 20, 10]  # newest first
    assert by_step[40]["status"] == "incomplete" and not by_step[40]["valid"]
    assert by_step[30]["status"] == "corrupt" and "size" in by_step[30]["reason"]
    assert by_step[20]["valid"] and by_step[10]["valid"]
    assert status["newest_valid"]["step"] == 20
    assert {p["step"] for p in status["problems"]} == {30, 40}
    assert status["save_switch"] is True and status["kill_switch"] is False
    assert status["running"] is False
    assert "resumes from step 20" in status["verdict"]
    assert status["save_estimate"] is not None and status["save_estimate"] >= 0
    assert [e["event"] for e in status["events"]][-1] == "exit"
    human = ftkit_cli("status", str(tmp_path)).stdout
    assert "resumes from step 20" in human and "incomplete" in human and "corrupt" in human


def test_status_names_broken_request_files_and_a_fresh_start(tmp_path: Path) -> None:
    with ftkit.FaultTolerance(tmp_path, state={"box": Box()}) as ft:
        assert ft.resume() == 0  # nothing to resume from: a fresh start
    requests = tmp_path / "requests"
    requests.mkdir(exist_ok=True)
    (requests / "1-cut.json").write_text('{"action": "sa')
    (requests / "2-list.json").write_text("[1, 2]")
    (requests / "3-unknown.json").write_text('{"action": "explode"}')
    (requests / "4-empty.json").write_text("")
    ftkit_cli("request", "save-exit", str(tmp_path), "--reason", "maintenance")

    status = json.loads(ftkit_cli("status", "--json", str(tmp_path)).stdout)
    by_name = {Path(r["path"]).name: r for r in status["requests"]}
    assert by_name["1-cut.json"]["error"].startswith("not valid JSON")
    assert by_name["2-list.json"]["error"] == "not a JSON object but list"
    assert "unknown action 'explode'" in by_name["3-unknown.json"]["error"]
    assert by_name["4-empty.json"]["error"].startswith("empty")
    [good] = [r for name, r in by_name.items() if name.endswith("-save-exit.json")]
    assert "error" not in good and good["action"] == "save-exit" and good["reason"] == "maintenance"

    wide = subprocess.run([sys.executable, "-m", "ftkit", "status", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=True, env={**os.environ, "COLUMNS": "250"})
    human = " ".join(wide.stdout.split())
    for name in ("1-cut.json", "2-list.json", "3-unknown.json", "4-empty.json"):
        assert f"broken request file {name}: " in human
    assert "request save-exit: maintenance" in human
    assert "request: ?" not in human and "None" not in human
    assert "fresh start: no valid checkpoint to resume from" in human
