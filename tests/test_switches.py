"""Switch files and request files: real files, real observers, real other processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftkit
from ftkit.decision import Action, Request, RequestBox, Source
from ftkit.errors import ConfigError
from ftkit.jobdir import JobDir
from ftkit.triggers.files import SwitchWatcher, WatchConfig, detect_network_fs
from ftkit.triggers.switches import touch_switch, write_request

POLL = 0.1  # polling interval used in these tests
REPO = Path(ftkit.__file__).resolve().parent.parent
OBSERVERS = ["native", "polling"]


def collect(box: RequestBox, n: int, *, timeout: float = 5.0) -> list[Request]:
    """Drain ``box`` until ``n`` requests arrived (or fail after ``timeout``)."""
    got: list[Request] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got += box.drain()
        if len(got) >= n:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {n} request(s) within {timeout} s, got {got}")
        time.sleep(0.005)
    return got


def settle(box: RequestBox, seconds: float = 2 * POLL + 0.1) -> list[Request]:
    """What else arrives in ``seconds`` (used only to prove that nothing more comes)."""
    time.sleep(seconds)
    return box.drain()


def later(path: Path, seconds: float = 2.0) -> None:
    """Touch ``path`` again as if ``seconds`` later (quicker re-touches count as one)."""
    mtime = path.stat().st_mtime_ns + int(seconds * 1e9)
    os.utime(path, ns=(mtime, mtime))


@pytest.fixture
def jd(tmp_path: Path) -> JobDir:
    return JobDir.of(tmp_path / "job").ensure()


def watcher(jd: JobDir, box: RequestBox, mode: str) -> SwitchWatcher:
    return SwitchWatcher(jd, box, WatchConfig(mode=mode, poll_interval=POLL))


def py(code: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=env, timeout=30)


# -- config -------------------------------------------------------------------------------


def test_bad_mode_names_the_setting():
    with pytest.raises(ConfigError, match=r"mode.*'inotify'.*auto, native, polling, off"):
        WatchConfig(mode="inotify")


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), "1", True])
def test_bad_poll_interval_names_the_setting(interval):
    with pytest.raises(ConfigError, match="poll_interval"):
        WatchConfig(poll_interval=interval)


# -- switches -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", OBSERVERS)
def test_save_and_kill_switch(jd, mode):
    box = RequestBox()
    with watcher(jd, box, mode) as w:
        assert w.observer_kind == mode
        touch_switch(jd, "save")
        [save] = collect(box, 1)
        touch_switch(jd, "kill")
        [kill] = collect(box, 1)
    assert save == Request(
        Action.SAVE,
        Source.SAVE_SWITCH,
        reason=f"save-switch touched ({jd.save_switch})",
        pin=True,
        origin=str(jd.save_switch),
        created=save.created,
    )
    assert kill == Request(
        Action.SAVE_EXIT,
        Source.KILL_SWITCH,
        reason=f"kill-switch touched ({jd.kill_switch})",
        requeue=False,
        pin=True,
        origin=str(jd.kill_switch),
        created=kill.created,
    )


@pytest.mark.parametrize("mode", OBSERVERS)
def test_touch_from_another_process_seen_within_the_interval(jd, mode):
    box = RequestBox()
    with watcher(jd, box, mode):
        subprocess.run(["touch", str(jd.save_switch)], check=True, timeout=10)
        touched = time.monotonic()
        [req] = collect(box, 1, timeout=POLL * 3 + 0.5)
        latency = time.monotonic() - touched
    assert req.source is Source.SAVE_SWITCH
    assert latency < POLL * 3 + 0.5


@pytest.mark.parametrize("mode", OBSERVERS)
@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_non_regular_save_switch_does_not_post(jd, mode, kind, tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.write_text("")
    box = RequestBox()
    with caplog.at_level(logging.WARNING, logger="ftkit.triggers.files"), watcher(jd, box, mode):
        if kind == "symlink":
            jd.save_switch.symlink_to(target)
        else:
            jd.save_switch.mkdir()
        time.sleep(0.01)
        os.utime(target)  # a symlink's target changing does not count either
        touch_switch(jd, "kill")  # sentinel: same directory, seen after the save-switch
        got = collect(box, 1)
        got += settle(box)
    assert [r.source for r in got] == [Source.KILL_SWITCH]
    warnings = [r for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


@pytest.mark.parametrize("mode", OBSERVERS)
def test_one_touch_posts_once_and_a_later_touch_posts_again(jd, mode):
    box = RequestBox()
    with watcher(jd, box, mode):
        # open/write/close: created, modified, closed events for one touch
        jd.save_switch.write_text("please\n")
        assert len(collect(box, 1)) == 1
        # what `touch` does after creating a file: set its times a moment later
        mtime = jd.save_switch.stat().st_mtime_ns + 1_000_000
        os.utime(jd.save_switch, ns=(mtime, mtime))
        assert settle(box) == []
        later(jd.save_switch)
        assert len(collect(box, 1)) == 1
        assert settle(box) == []


@pytest.mark.parametrize("mode", OBSERVERS)
def test_deleted_and_recreated_switch_posts_again(jd, mode):
    box = RequestBox()
    with watcher(jd, box, mode):
        touch_switch(jd, "save")
        [first] = collect(box, 1)
        Path(first.origin).unlink()  # what the controller does once the save is durable
        time.sleep(2 * POLL)  # let the polling observer see the file gone
        touch_switch(jd, "save")
        [second] = collect(box, 1)
        assert settle(box) == []
    assert second.source is Source.SAVE_SWITCH


@pytest.mark.parametrize("mode", OBSERVERS)
def test_initial_scan_picks_up_existing_files(jd, mode, caplog):
    touch_switch(jd, "save")
    touch_switch(jd, "kill")
    request = write_request(jd, "requeue", reason="queued before start")
    (jd.requests / ".partial.json").write_text("{")  # temp file: ignored silently
    (jd.requests / "garbage.json").write_text("not json")
    (jd.requests / "notes.txt").write_text("not a request")
    box = RequestBox()
    with caplog.at_level(logging.WARNING, logger="ftkit.triggers.files"), watcher(jd, box, mode):
        got = box.drain()  # the first scan runs inside start()
        got += settle(box)
    assert sorted(r.source.value for r in got) == ["kill-switch", "request", "save-switch"]
    [req] = [r for r in got if r.source is Source.REQUEST]
    assert (req.action, req.requeue, req.origin) == (Action.SAVE_EXIT, True, str(request))
    assert "queued before start" in req.reason
    bad = [r for r in caplog.records if "garbage.json" in r.getMessage()]
    assert len(bad) == 1 and bad[0].levelno == logging.WARNING
    assert ".partial" not in caplog.text


@pytest.mark.parametrize("mode", OBSERVERS)
def test_request_files_from_another_process(jd, mode):
    actions = ["save", "stop", "requeue", "save-exit", "exit"]
    box = RequestBox()
    with watcher(jd, box, mode):
        py(
            "import sys\n"
            "from ftkit.triggers.switches import write_request\n"
            "for a in sys.argv[2:]: write_request(sys.argv[1], a, reason='by ' + a)\n",
            str(jd.root),
            *actions,
        )
        got = collect(box, len(actions))
        got += settle(box)
    by_reason = {r.reason.split(": ")[-1].split(" (")[0]: r for r in got}
    assert sorted(by_reason) == sorted(f"by {a}" for a in actions)
    expected = {
        "save": (Action.SAVE, None),
        "stop": (Action.SAVE_EXIT, False),
        "requeue": (Action.SAVE_EXIT, True),
        "save-exit": (Action.SAVE_EXIT, None),
        "exit": (Action.EXIT, None),
    }
    for a, (action, requeue) in expected.items():
        r = by_reason[f"by {a}"]
        assert (r.action, r.requeue, r.source) == (action, requeue, Source.REQUEST)
        assert Path(r.origin).parent == jd.requests and Path(r.origin).exists()


@pytest.mark.parametrize("mode", OBSERVERS)
def test_request_file_written_in_place_posts_once_without_warning(jd, mode, caplog):
    box = RequestBox()
    path = jd.requests / "by-hand.json"
    with caplog.at_level(logging.WARNING, logger="ftkit.triggers.files"), watcher(jd, box, mode):
        with open(path, "w") as f:  # created empty first, like `echo ... > file`
            f.flush()
            time.sleep(0.01)
            f.write('{"action": "stop", "reason": "by hand"}')
        [req] = collect(box, 1)
        assert settle(box) == []
    assert (req.action, req.requeue, req.origin) == (Action.SAVE_EXIT, False, str(path))
    assert caplog.records == []


def test_handler_exception_is_logged_and_the_observer_keeps_going(jd, caplog):
    class FlakyBox(RequestBox):
        def post(self, request):
            if not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("boom")
            super().post(request)

    box = FlakyBox()
    with caplog.at_level(logging.ERROR, logger="ftkit.triggers.files"), watcher(jd, box, "native"):
        touch_switch(jd, "save")
        deadline = time.monotonic() + 5
        while "boom" not in caplog.text:
            assert time.monotonic() < deadline, "the handler's exception was not logged"
            time.sleep(0.005)
        later(jd.save_switch)
        assert len(collect(box, 1)) == 1


def test_off_mode_watches_nothing(jd):
    touch_switch(jd, "kill")
    box = RequestBox()
    with watcher(jd, box, "off") as w:
        assert w.observer_kind == "off"
        assert box.drain() == []


# -- writers ------------------------------------------------------------------------------


def test_write_request_is_atomic_and_named(jd):
    path = write_request(jd.root, "Requeue", reason="maintenance")
    assert path.parent == jd.requests
    assert path.stem.split("-", 1)[0].isdigit()
    assert path.stem.endswith(f"-{os.getpid()}-requeue")
    data = json.loads(path.read_text())
    assert data["action"] == "requeue" and data["reason"] == "maintenance"
    assert data["pid"] == os.getpid() and isinstance(data["created"], float)
    assert [p.name for p in jd.requests.iterdir()] == [path.name]  # no temp file left


def test_write_request_rejects_bad_action_and_missing_dir(tmp_path):
    with pytest.raises(ConfigError, match="unknown action 'pause'"):
        write_request(tmp_path, "pause")
    with pytest.raises(ConfigError, match="does not exist"):
        write_request(tmp_path / "typo", "save")


def test_touch_switch_refuses_a_symlink(jd, tmp_path):
    jd.kill_switch.symlink_to(tmp_path / "target")
    with pytest.raises(ConfigError, match="kill-switch"):
        touch_switch(jd, "kill")
    with pytest.raises(ConfigError, match="which"):
        touch_switch(jd, "pause")


def test_touch_switch_always_moves_mtime_forward(jd):
    first = touch_switch(jd, "save").stat().st_mtime_ns
    second = touch_switch(jd, "save").stat().st_mtime_ns
    assert second > first


# -- network filesystems ------------------------------------------------------------------

MOUNTS = r"""/dev/vda1 / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
fs1:/export/home /home nfs4 rw,vers=4.2 0 0
10.0.0.1@o2ib:/scratch /scratch lustre rw,flock 0 0
/dev/nvme0n1 /scratch/local ext4 rw 0 0
nas:/my\040share /mnt/my\040share nfs rw 0 0
/dev/sdc1 /mnt/my ext4 rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/home/alice/job", "nfs4"),
        ("/home", "nfs4"),
        ("/scratch/proj/job", "lustre"),
        ("/scratch/local/job", None),  # longest prefix wins
        ("/scratch/localx/job", "lustre"),  # prefixes match whole components
        ("/mnt/my share/job", "nfs"),  # \040 is a space
        ("/mnt/my/job", None),
        ("/tmp/job", None),
    ],
)
def test_detect_network_fs(tmp_path, path, fstype):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert detect_network_fs(path, mounts=mounts) == fstype


def test_detect_network_fs_without_a_mount_table(tmp_path):
    assert detect_network_fs("/home/x", mounts=tmp_path / "missing") is None


def test_auto_mode_polls_on_a_network_filesystem(jd, tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda1 / ext4 rw 0 0\nfs:/x {os.path.realpath(jd.root)} nfs4 rw 0 0\n")
    w = SwitchWatcher(jd, RequestBox(), WatchConfig(), mounts=mounts)
    assert (w.observer_kind, w.network_fs) == ("polling", "nfs4")
    local = tmp_path / "local-mounts"
    local.write_text("/dev/vda1 / ext4 rw 0 0\n")
    w = SwitchWatcher(jd, RequestBox(), WatchConfig(), mounts=local)
    assert (w.observer_kind, w.network_fs) == ("native", None)


# -- a signal trap's request is its own run's -----------------------------------------------

def _slurm_env(job: str, restart: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart)}


def test_ftkit_request_this_run_stamps_the_slurm_job_and_needs_one(jd):
    """``ftkit request --this-run`` (the sbatch templates' traps) writes the SLURM job id and
    restart count into the request; outside a SLURM job it refuses, saying what to do."""
    out = subprocess.run([sys.executable, "-m", "ftkit", "request", "save-exit", str(jd.root), "--this-run",
                          "--reason", "SIGTERM from SLURM"], env=_slurm_env("1414", 2), capture_output=True,
                         text=True, timeout=60, check=True)
    data = json.loads(Path(out.stdout.strip()).read_text())
    assert (data["action"], data["job_id"], data["restart_count"]) == ("save-exit", "1414", 2)
    bare = {k: v for k, v in _slurm_env("1", 0).items() if not k.startswith("SLURM_")}
    refused = subprocess.run([sys.executable, "-m", "ftkit", "request", "stop", str(jd.root), "--this-run"],
                             env=bare, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "SLURM_JOB_ID is not set" in refused.stderr
    assert len(list(jd.requests.glob("*.json"))) == 1


@pytest.mark.parametrize("mode", OBSERVERS)
def test_a_trap_request_of_another_run_is_removed_not_acted_on(jd, mode, caplog):
    """Job 1414's trap asked to save and exit, then its batch script was SIGKILLed before
    ``ftkit requeue`` removed the file. The next job (1421) on the job dir, and the same job's
    next run after a requeue (restart 1), remove it with a warning and act on nothing; this
    run's own trap request and a person's request (no job) are acted on."""
    own = write_request(jd, "save-exit", reason="this run's trap", run=("1414", 1))
    other_job = write_request(jd, "save-exit", reason="job 1413's trap", run=("1413", 1))
    earlier = write_request(jd, "requeue", reason="restart 0's trap", run=("1414", 0))
    person = write_request(jd, "save", reason="by hand")
    box = RequestBox()
    w = SwitchWatcher(jd, box, WatchConfig(mode=mode, poll_interval=POLL), run=("1414", 1))
    with caplog.at_level(logging.WARNING, logger="ftkit.triggers.files"), w:
        got = collect(box, 2) + settle(box)
    assert sorted(r.reason.split(": ", 1)[1].split(" (")[0] for r in got) == ["by hand", "this run's trap"]
    assert own.exists() and person.exists() and not other_job.exists() and not earlier.exists()
    said = [r.getMessage() for r in caplog.records if "ignoring and removing request file" in r.getMessage()]
    assert len(said) == 2 and any("written for SLURM job 1413 (restart 1)" in m for m in said)
    assert any("not for this run (job 1414, restart 1)" in m and "job 1414 (restart 0)" in m for m in said)


def test_a_run_after_a_killed_batch_script_trains_and_status_names_the_left_over(tmp_path):
    """The user trial's case end to end: a request left by the killed job 1414's trap, then job
    1421 runs on the job dir. ``ftkit status`` first says the request is left over (not
    pending); the run trains all its steps (it did not exit at step 0) and removes it."""
    job = tmp_path / "job"
    write_request(JobDir.of(job).ensure(), "save-exit", reason="SIGTERM from SLURM", run=("1414", 0))
    status = subprocess.run([sys.executable, "-m", "ftkit", "status", str(job)], env=_slurm_env("1421", 0),
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert "left-over request save-exit" in status and "written for SLURM job 1414" in status, status
    code = ("import ftkit, torch, sys\n"
            "m = torch.nn.Linear(2, 2)\n"
            "cfg = ftkit.Config(budget=ftkit.BudgetConfig(enabled=False))  # job 1421 is not a real job\n"
            "with ftkit.FaultTolerance(sys.argv[1], state={'model': m}, config=cfg) as ft:\n"
            "    n = sum(1 for _ in ft.range(30))\n"
            "print('steps', n, 'completed', ft.completed)\n")
    out = subprocess.run([sys.executable, "-c", code, str(job)], env=_slurm_env("1421", 0), capture_output=True,
                         text=True, timeout=120, check=True)
    assert "steps 30 completed True" in out.stdout, out.stdout + out.stderr
    assert "ignoring and removing request file" in out.stderr
    assert list((job / "requests").glob("*.json")) == []
