"""The paths a person gives ``ftkit save|kill|request|status|ls|verify|pin``: real job dirs from
real short runs, the usual slips (the checkpoints dir, a step dir, a file, the parent of job
dirs), a checkpoint root outside the job dir, and files the command may not read.

Every command runs as a real subprocess (``python -m ftkit``), as a user would run it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ftkit
from ftkit.events import read_events
from tests.ckpt_helpers import REPO, Box, env


def cli(*args: str, cwd: Path = REPO, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "ftkit", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env(COLUMNS="400"))


def said(r: subprocess.CompletedProcess) -> str:
    """stdout + stderr, one line (rich wraps long messages)."""
    return " ".join((r.stdout + r.stderr).split())


def refused(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return said(r)


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory) -> Path:
    """A job dir left by a real run: ``checkpoints/step-00000020``, ``-40`` and the events log.
    Tests only read it (a test that writes copies it)."""
    job = tmp_path_factory.mktemp("demo") / "runs" / "x"
    r = cli("demo", "--no-live", "--jobdir", str(job), "--steps", "40", "--step-time", "0", "--save-every", "20")
    assert r.returncode == 0 and "finished 40 steps" in r.stdout, r.stdout + r.stderr
    return job


def train_with_root(job: Path, root: Path) -> None:
    """A real short training run whose checkpoints go to ``root``, outside the job dir."""
    box = Box()
    config = ftkit.Config(checkpoint=ftkit.CheckpointConfig(root=root, keep_last=None))
    with ftkit.FaultTolerance(job, state={"box": box}, config=config) as ft:
        for step in (10, 20, 30):
            box.value = step
            ft.save(step, reason="periodic")


# ---------------------------------------------------------------------------------------------
# ftkit save|kill|request


def test_triggers_refuse_a_checkpoint_root_a_step_dir_a_file_and_a_dir_inside_the_job(demo_job: Path) -> None:
    before = sorted(p.relative_to(demo_job) for p in demo_job.rglob("*"))
    checkpoints = demo_job / "checkpoints"
    wrong = {
        checkpoints: "is a checkpoint root (it holds step dirs), not a job dir",
        checkpoints / "step-00000040": "is a checkpoint (a step dir), not a job dir",
        demo_job / "events.jsonl": "is a file, not a job dir",
        demo_job / "requests": "is a directory inside a job dir, not a job dir",
        demo_job / "nowhere": "does not exist",
    }
    for path, what in wrong.items():
        for command in (["kill"], ["save"], ["request", "stop"], ["kill", "--force"]):
            if command == ["kill", "--force"] and path.name == "requests":
                continue  # --force takes a dir inside a job dir (a nested job dir): not this test
            said_ = refused(cli(*command, str(path)))
            assert f"{path} {what}" in said_ and f"pass the job dir {demo_job}" in said_, said_
            assert "touched" not in said_
    assert sorted(p.relative_to(demo_job) for p in demo_job.rglob("*")) == before  # nothing written anywhere


def test_the_parent_of_job_dirs_and_an_unrelated_dir_are_refused_unless_forced(demo_job: Path, tmp_path: Path) -> None:
    runs = demo_job.parent
    said_ = refused(cli("kill", str(runs)))
    assert f"{runs} is not a job dir but holds job dirs ({demo_job}); pass one of them" in said_, said_
    said_ = refused(cli("status", str(runs)))
    assert f"holds job dirs ({demo_job})" in said_ and "starts from scratch" not in said_, said_

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("not a job")
    said_ = refused(cli("save", str(other)))
    assert f"{other} is not a job dir: no ftkit job has written to it" in said_, said_
    assert f"or add --force if a job that has not started yet will use {other}" in said_, said_
    assert not (other / "save-switch").exists()
    forced = cli("save", "--force", str(other))
    assert forced.returncode == 0 and (other / "save-switch").is_file(), forced.stdout + forced.stderr
    assert f"no job has started in {other} yet" in said(forced)
    # a batch script's trap: the training may have written its own files before ftkit started
    # there; a request refused would lose the requeue, so it is written, with a note
    r = cli("request", "requeue", str(other))
    assert r.returncode == 0 and Path(r.stdout.strip()).parent == other / "requests", r.stdout + r.stderr
    assert f"note: no job has started in {other} yet" in r.stderr
    # a checkpoint is never a job dir, --force or not
    refused(cli("request", "stop", "--force", str(demo_job / "checkpoints" / "step-00000020")))


def test_an_empty_dir_is_a_job_that_has_not_started_and_the_kill_switch_stops_it(tmp_path: Path) -> None:
    """docs/troubleshooting.md and the sbatch template (``mkdir -p "$JOBDIR"`` before the
    training, a signal trap that may write a request first) rely on an empty job dir."""
    queued = tmp_path / "queued"
    queued.mkdir()
    r = cli("request", "requeue", str(queued), "--reason", "SIGUSR1 before the training started")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == queued / "requests"  # stdout: the path alone
    assert f"note: no job has started in {queued} yet" in said(r)
    (request,) = (queued / "requests").iterdir()
    request.unlink()

    r = cli("kill", str(queued))
    assert r.returncode == 0 and f"no job has started in {queued} yet" in said(r), r.stdout + r.stderr
    assert "exits at its first check" in said(r)
    run = cli("demo", "--no-live", "--jobdir", str(queued), "--steps", "20", "--step-time", "0")
    assert "exits at its first check" in said(run), said(run)
    assert not (queued / "checkpoints").exists() or not any((queued / "checkpoints").iterdir())
    r = cli("kill", str(queued))  # a job dir now (it has an events log), with no run in it
    assert r.returncode == 0 and "no run holds the job dir now" in said(r), said(r)
    assert "the next run started in it exits at its first check" in said(r)
    assert cli("kill", "--clear", str(queued)).returncode == 0 and not (queued / "kill-switch").exists()


# ---------------------------------------------------------------------------------------------
# ftkit status|ls|verify|pin


def test_status_ls_verify_and_pin_find_a_checkpoint_root_outside_the_job_dir(tmp_path: Path) -> None:
    job, fast = tmp_path / "job", tmp_path / "fast" / "ckpt"
    train_with_root(job, fast)
    assert not (job / "checkpoints").exists()
    recorded = f"(the job's checkpoint root, recorded in {job / 'events.jsonl'})"

    status = json.loads(cli("status", "--json", str(job)).stdout)
    assert status["newest_valid"]["step"] == 30 and "resumes from step 30" in status["verdict"]
    assert [c["step"] for c in status["checkpoints"]] == [30, 20, 10]
    assert status["checkpoint_root"]["path"] == str(fast) and status["checkpoint_root"]["exists"]
    assert "events.jsonl" in status["checkpoint_root"]["found_in"]
    human = said(cli("status", str(job)))
    assert "resumes from step 30" in human and f"checkpoints in {fast} {recorded}" in human, human

    ls = cli("ls", str(job))
    assert ls.returncode == 0 and f"checkpoints in {fast} {recorded}" in said(ls), said(ls)
    assert [row["step"] for row in json.loads(cli("ls", "--json", str(job)).stdout)] == [30, 20, 10]
    verify = cli("verify", str(job))
    assert verify.returncode == 0 and "all 3 checkpoint(s) valid" in said(verify), said(verify)
    assert cli("pin", str(job), "20").returncode == 0 and (fast / "step-00000020" / "pinned").exists()
    assert any(e["event"] == "pin" and e.get("source") == "cli" for e in read_events(job / "events.jsonl"))

    # the root is gone (or not mounted here): say so, never "starts from scratch"
    fast.rename(tmp_path / "elsewhere")
    status = json.loads(cli("status", "--json", str(job)).stdout)
    assert status["verdict"].startswith(f"cannot tell what the job resumes from: {fast} {recorded} "
                                        "does not exist here"), status["verdict"]
    verify = cli("verify", str(job))
    assert refused(verify, 4) == f"error: no checkpoints in {fast} {recorded}: it does not exist here"
    assert f"no checkpoints in {fast} {recorded}: it does not exist here" in said(cli("ls", str(job)))


def test_status_knows_a_root_outside_the_job_dir_before_the_first_save(tmp_path: Path) -> None:
    """The start event records the checkpoint root: a job that has not saved yet (its first run
    still training, or killed before a save) is shown with its own root, not JOBDIR/checkpoints."""
    job, fast = tmp_path / "job", tmp_path / "fast" / "ckpt"
    config = ftkit.Config(checkpoint=ftkit.CheckpointConfig(root=fast), save_at_end=False)
    with ftkit.FaultTolerance(job, state={"box": Box()}, config=config):
        pass
    status = json.loads(cli("status", "--json", str(job)).stdout)
    assert status["checkpoint_root"]["path"] == str(fast), status["checkpoint_root"]
    assert "no valid checkpoint yet" in status["verdict"], status["verdict"]


def test_a_copied_job_dir_shows_its_own_checkpoints(demo_job: Path, tmp_path: Path) -> None:
    """The events log keeps the absolute paths of the original: a moved or copied job dir still
    lists its own ``checkpoints/``, not the original's."""
    copy = tmp_path / "copy"
    shutil.copytree(demo_job, copy)
    shutil.rmtree(copy / "checkpoints" / "step-00000020")
    rows = json.loads(cli("ls", "--json", str(copy)).stdout)
    assert [(r["step"], r["path"]) for r in rows] == [(40, str(copy / "checkpoints" / "step-00000040"))]
    assert json.loads(cli("status", "--json", str(copy)).stdout)["checkpoint_root"]["found_in"] is None


def test_status_ls_and_pin_refuse_the_checkpoints_dir_and_a_step_dir(demo_job: Path) -> None:
    checkpoints, step = demo_job / "checkpoints", demo_job / "checkpoints" / "step-00000040"
    for path in (checkpoints, step):
        said_ = refused(cli("status", str(path)))
        assert f"pass the job dir {demo_job}" in said_ and "starts from scratch" not in said_, said_
    said_ = refused(cli("ls", str(step)))
    assert (f"{step} is a checkpoint (a step dir), not a job dir or a checkpoint root; pass {demo_job} to list "
            f"them all, or run `ftkit verify {step}` to check this one") in said_, said_
    said_ = refused(cli("pin", str(step), "40"))
    assert f"pass {demo_job} and the step" in said_, said_
    assert cli("ls", str(checkpoints)).returncode == 0  # a checkpoint root is fine for ls


def test_verify_and_ls_say_what_a_path_is(demo_job: Path, tmp_path: Path) -> None:
    # an empty step dir: a save that never finished, not "no checkpoints under"
    root = tmp_path / "ckpt"
    (root / "step-00000050").mkdir(parents=True)
    r = cli("verify", str(root / "step-00000050"))
    assert r.returncode == 3 and "incomplete" in said(r) and "no manifest.json" in said(r), said(r)
    # a file
    manifest = demo_job / "checkpoints" / "step-00000040" / "manifest.json"
    said_ = refused(cli("verify", str(manifest)))
    assert f"pass its step dir {manifest.parent} to verify that checkpoint" in said_, said_
    said_ = refused(cli("ls", str(demo_job / "events.jsonl")))
    assert f"is a file, not a job dir or a checkpoint root; pass the job dir {demo_job}" in said_, said_
    said_ = refused(cli("verify", str(tmp_path / "missing")))
    assert f"{tmp_path / 'missing'} does not exist" in said_, said_
    # an empty directory: no checkpoints, and why
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no checkpoints in" in said(cli("ls", str(empty))) and "it is empty" in said(cli("ls", str(empty)))
    said_ = refused(cli("verify", str(empty)), 4)
    assert f"no checkpoints in {empty} yet: it is empty" in said_, said_


# ---------------------------------------------------------------------------------------------
# files the command may not read


def _without_override(scratch: Path) -> tuple[str, ...]:
    """Run as root without the capabilities that read and write past a file's mode, so the
    modes count as for any user. (A real other user cannot start this interpreter: it lives
    under /root, mode 0700.) Skips where setpriv is missing or cannot drop them."""
    if os.geteuid() != 0:
        return ()  # a user already
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing: no way to run without root's file access")
    locked = scratch / "locked"
    locked.write_text("")
    locked.chmod(0o000)
    probe = subprocess.run([*prefix, "test", "-r", str(locked)], capture_output=True)
    locked.unlink()
    if probe.returncode != 1 or probe.stderr:
        pytest.skip(f"setpriv cannot drop root's file access here: {probe.stderr.decode().strip()}")
    return prefix


def test_a_file_the_cli_may_not_read_is_an_error_naming_it_not_a_traceback(demo_job: Path, tmp_path: Path) -> None:
    prefix = _without_override(tmp_path)
    job = tmp_path / "job"
    shutil.copytree(demo_job, job)

    def as_user(*args: str) -> str:
        r = cli(*args, prefix=prefix, cwd=tmp_path)
        return refused(r, 1)

    events = job / "events.jsonl"
    events.chmod(0o000)
    try:
        said_ = as_user("status", str(job))
        assert said_.startswith(f"error: {events}: Permission denied"), said_
    finally:
        events.chmod(0o644)
    checkpoints = job / "checkpoints"
    checkpoints.chmod(0o000)
    try:
        for command in ("ls", "verify", "status"):
            said_ = as_user(command, str(job))
            assert said_.startswith(f"error: {checkpoints}: Permission denied"), said_
        verbose = cli("-v", "ls", str(job), prefix=prefix)  # -v adds the traceback for a bug report
        assert verbose.returncode == 1 and "Traceback" in verbose.stderr, verbose.stderr
    finally:
        checkpoints.chmod(0o755)


def test_a_trap_s_request_reaches_a_job_dir_below_a_directory_that_looks_like_one(tmp_path: Path) -> None:
    """A job dir not started yet, below a directory that an ftkit job once used as its job dir
    (``$HOME`` with an events log, say): ``ftkit request`` (a batch script's trap) writes the
    request there, where the job will look; ``ftkit kill`` typed by a person asks for --force."""
    home = tmp_path / "home"
    (home / "runs" / "x").mkdir(parents=True)
    (home / "events.jsonl").write_text("")
    job = home / "runs" / "x"
    (job / "data.txt").write_text("the user's own file")
    assert refused(cli("kill", str(job))) and not (job / "kill-switch").exists()
    out = cli("request", "requeue", str(job), "--reason", "SIGUSR1 from SLURM")
    assert out.returncode == 0, out.stderr
    assert [p.parent for p in (job / "requests").iterdir()] == [job / "requests"]
