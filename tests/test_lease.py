"""One run per job dir: the lease, with real processes, real ``kill -9`` and a 2-rank gloo run.

"Another node" is a process in its own UTS namespace (``unshare --uts``) with another host
name: it shares this machine's kernel, so its fcntl lock is still dropped when it dies, which
is what a file server does once it has reclaimed a lost node's locks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftkit
from ftkit.errors import EXIT_JOBDIR_BUSY, ConfigError
from ftkit.events import read_events
from ftkit.lease import (
    JobDirBusyError,
    LeaseConfig,
    LeaseRecord,
    describe_lease,
    judge,
    lease_status,
)
from tests.ckpt_helpers import env, free_port
from tests.conftest import wait_for

PROGRAM = Path(__file__).parent / "programs" / "lease_train.py"
STEPS = 12

needs_unshare = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                   reason="another host name needs root and unshare(1)")


def launch(jobdir: Path, control: Path, *args: str, host: str | None = None, world: int = 1,
           **extra: str) -> list[subprocess.Popen]:
    """Start the training program on ``world`` ranks (optionally as host ``host``)."""
    control.mkdir(exist_ok=True)
    cmd = [sys.executable, str(PROGRAM), str(jobdir), str(control), "--steps", str(STEPS), *args]
    if host is not None:
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd]
    dist = {}
    if world > 1:
        dist = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [subprocess.Popen(cmd, env=env(**extra, **dist, **({"RANK": str(r)} if world > 1 else {})),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """(exit code, stderr) of every rank; a run that does not end within ``timeout`` fails the test."""
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def holding(control: Path, world: int = 1) -> list[int]:
    wait_for(lambda: all((control / f"holding-rank{r}").exists() for r in range(world)), 120, what="run holding")
    return [int((control / f"holding-rank{r}").read_text()) for r in range(world)]


def events(jobdir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if kind is None or e["event"] == kind]


def snapshot(jobdir: Path) -> dict[str, tuple[int, int] | None]:
    """Every path in the job dir but the events log and the lease record: (size, mtime_ns).

    The holder's hang-watchdog heartbeats (``heartbeats/rank*.json``) are rewritten every few
    seconds by the holder itself (each a rename into ``heartbeats/``, which changes that
    directory's mtime too), so only their presence counts: another run must neither create nor
    delete them (a slow machine can take longer than one beat between snapshots). The
    temporaries those rewrites rename from (``.lease.json.tmp-PID``, ``heartbeats/.NAME.tmp-PID``)
    come and go with each beat and are not counted at all."""
    skip = {"events.jsonl", "lease.json"}
    beats = jobdir / "heartbeats"

    def transient(p: Path) -> bool:
        return p.name in skip or p.name.startswith(".lease.json.tmp-") or (p.parent == beats and p.name.startswith("."))

    return {str(p.relative_to(jobdir)): None if beats in (p, p.parent) else (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(jobdir.rglob("*")) if not transient(p)}


def assert_all_checkpoints_valid(jobdir: Path, newest: int = STEPS) -> None:
    from ftkit.checkpoint import validate_dir

    steps = sorted((jobdir / "checkpoints").glob("step-*"))
    assert steps, "no checkpoints"
    for path in steps:
        info = validate_dir(path, checksums=True)
        assert info.valid, f"{path}: {info.reason}"
    assert int(steps[-1].name[5:]) == newest
    assert events(jobdir, "save-failed") == []


def assert_refused(rc: int, err: str, jobdir: Path) -> None:
    assert rc == EXIT_JOBDIR_BUSY, err
    assert "is in use by another run" in err and str(jobdir) in err, err
    assert "Traceback" not in err, err


# -- two runs at once ----------------------------------------------------------------------


def test_second_run_is_refused_and_the_first_completes_clean(tmp_path: Path) -> None:
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    first = launch(jobdir, control, "--hold-at", "5")
    try:
        (pid,) = holding(control)
        before = snapshot(jobdir)
        assert (jobdir / "checkpoints").is_dir() and before  # it has saved already
        # the second run does not wait for the first (which holds until released)
        ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl2"), timeout=120)
        assert_refused(rc, err, jobdir)
        assert f"pid {pid} on " in err  # names the holder
        assert snapshot(jobdir) == before  # touched nothing but the events log
        refused = events(jobdir, "lease-refused")
        assert len(refused) == 1 and refused[0]["holder"]["pid"] == pid
        assert refused[0]["exit_code"] == EXIT_JOBDIR_BUSY
        assert {e["event"] for e in events(jobdir) if e["pid"] == refused[0]["pid"]} == {"lease-refused"}
        assert "held by a run outside SLURM" in describe_lease(jobdir)
    finally:
        (control / "release").touch()
        ((rc, err),) = finish(first)
    assert rc == 0, err
    assert (control / "done-rank0").read_text() == "True"
    assert_all_checkpoints_valid(jobdir)
    assert lease_status(jobdir)["state"] == "released"


def test_a_copy_of_a_job_dir_in_use_runs_and_leaves_the_original_alone(tmp_path: Path) -> None:
    """``cp -a`` of a job dir whose run holds its lease (to try a variant from its checkpoints):
    the copy's lease record names that run, on this host, alive, but the copy's lease.lock is
    another file that nobody locks. ``ftkit status`` says the copy is not held, and a run there
    takes its lease at once (it was refused for 10 minutes, naming the original's heartbeat),
    while the original goes on holding its own."""
    original, copy = tmp_path / "job", tmp_path / "copy"
    first = launch(original, tmp_path / "ctl", "--hold-at", "5")
    try:
        (pid,) = holding(tmp_path / "ctl")
        subprocess.run(["cp", "-a", str(original), str(copy)], check=True)
        status = subprocess.run([sys.executable, "-m", "ftkit", "status", "--json", str(copy)],
                                capture_output=True, text=True, timeout=60)
        said = json.loads(status.stdout)
        assert said["running"] is False and said["lease"]["state"] == "dead", said["lease"]
        assert f"pid {pid} on" in said["lease"]["description"], said["lease"]
        assert f"the record names another job dir, {original.resolve()}" in said["lease"]["description"]
        assert lease_status(original)["state"] == "held"
        ((rc, err),) = finish(launch(copy, tmp_path / "ctl2"))
        assert rc == 0, err
        (takeover,) = events(copy, "lease-takeover")
        assert takeover["previous"]["pid"] == pid and "the record names another job dir" in takeover["reason"]
        assert_all_checkpoints_valid(copy)
        assert lease_status(original)["state"] == "held" and lease_status(original)["pid"] == pid
        assert events(original, "lease-takeover") == [] and events(original, "lease-lost") == []
    finally:
        (tmp_path / "ctl" / "release").touch()
        ((rc, err),) = finish(first)
    assert rc == 0, err
    assert_all_checkpoints_valid(original)


def test_a_second_job_dir_on_the_same_checkpoint_root_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """Two job dirs whose scripts name one absolute checkpoint root (a job dir copied, a script
    reused): each job dir's lease is free, but the second run is refused (exit 86, naming the
    root and the other job dir) while the first runs, and changes nothing; once the first has
    ended, the second runs there, saying whose checkpoints it takes over."""
    root, first_dir, second_dir = tmp_path / "scratch" / "ckpt", tmp_path / "a", tmp_path / "b"
    first = launch(first_dir, tmp_path / "ctl", "--hold-at", "5", "--root", str(root))
    try:
        holding(tmp_path / "ctl")
        before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
        assert (root / "job-dir").read_text().strip() == str(first_dir.resolve())
        ((rc, err),) = finish(launch(second_dir, tmp_path / "ctl2", "--root", str(root)), timeout=120)
        assert rc == EXIT_JOBDIR_BUSY, err
        assert f"checkpoint root {root} is in use by the run of another job dir, {first_dir.resolve()}" in err, err
        assert "Traceback" not in err, err
        assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
        assert lease_status(second_dir)["state"] == "released"
    finally:
        (tmp_path / "ctl" / "release").touch()
        ((rc, err),) = finish(first)
    assert rc == 0, err
    ((rc, err),) = finish(launch(second_dir, tmp_path / "ctl3", "--root", str(root)), timeout=120)
    assert rc == 0, err
    assert (root / "job-dir").read_text().strip() == str(second_dir.resolve())
    # taken over, with a word: it resumes from the other job dir's checkpoints and deletes them
    assert (f"checkpoint root {root} was last used by another job dir, {first_dir.resolve()}" in " ".join(err.split())
            and "takes it over" in err), err

    # the job dir moved, a link left at its old path: still the same job dir, never refused
    moved = tmp_path / "b-moved"
    second_dir.rename(moved)
    second_dir.symlink_to(moved)
    ((rc, err),) = finish(launch(moved, tmp_path / "ctl4", "--root", str(root)), timeout=120)
    assert rc == 0, err


def test_in_process_second_controller_is_refused_without_dropping_the_lock(tmp_path: Path) -> None:
    """fcntl locks belong to the process: a second FaultTolerance in it must not close the file."""
    cfg = ftkit.Config(lease=LeaseConfig(heartbeat=0.05, stale_after=1.0))
    with ftkit.FaultTolerance(tmp_path, config=cfg):
        with pytest.raises(JobDirBusyError) as info:
            ftkit.FaultTolerance(tmp_path, config=cfg).start()
        assert info.value.code == EXIT_JOBDIR_BUSY and isinstance(info.value, ftkit.FtkitError)
        # another process still finds the lock held
        probe = subprocess.run(
            [sys.executable, "-c", "import fcntl,os,sys; fd=os.open(sys.argv[1], os.O_RDWR)\n"
             "try: fcntl.lockf(fd, fcntl.LOCK_EX|fcntl.LOCK_NB, 1, 0)\nexcept OSError: sys.exit(7)",
             str(tmp_path / "lease.lock")], env=env(), timeout=60)
        assert probe.returncode == 7
        wait_for(lambda: lease_status(tmp_path)["heartbeat_age"] < 0.5 and
                 LeaseRecord.read(tmp_path / "lease.json").heartbeat > LeaseRecord.read(tmp_path / "lease.json").started,
                 10, what="a heartbeat")
    assert lease_status(tmp_path)["state"] == "released"
    with ftkit.FaultTolerance(tmp_path, config=cfg):  # free again
        pass


# -- a holder killed with kill -9 -----------------------------------------------------------


def test_killed_run_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    (first,) = launch(jobdir, control, "--hold-at", "5")
    (pid,) = holding(control)
    first.send_signal(signal.SIGKILL)
    finish([first])
    # ftkit status says so at once: not running, its holder gone (it said "running, heartbeat 0 s ago")
    status = subprocess.run([sys.executable, "-m", "ftkit", "status", "--json", str(jobdir)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    said = json.loads(status.stdout)
    assert said["running"] is False and said["lease"]["state"] == "dead", said["lease"]
    assert f"pid {pid} on" in said["lease"]["description"] and "process is gone" in said["lease"]["description"]
    ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl2"))  # stale_after is 600 s
    assert rc == 0, err
    (takeover,) = events(jobdir, "lease-takeover")
    assert takeover["previous"]["pid"] == pid and "is gone" in takeover["reason"]
    assert_all_checkpoints_valid(jobdir)


@needs_unshare
def test_killed_run_is_taken_over_at_once_by_its_own_requeue_only(tmp_path: Path) -> None:
    """A holder on another node, killed: another job is refused; the same job's restart is not."""
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    (first,) = launch(jobdir, control, "--hold-at", "5", host="other-node",
                      SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    (pid,) = holding(control)
    first.send_signal(signal.SIGKILL)
    finish([first])
    assert LeaseRecord.read(jobdir / "lease.json").host == "other-node"

    ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl2", SLURM_JOB_ID="5555"))
    assert_refused(rc, err, jobdir)
    assert "SLURM job 4242 (restart 0)" in err and "other-node" in err

    ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl3", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1"))
    assert rc == 0, err
    (takeover,) = events(jobdir, "lease-takeover")
    assert takeover["previous"]["pid"] == pid and takeover["job_id"] == "4242" and takeover["restart_count"] == 1
    assert "restart 0 of this SLURM job 4242" in takeover["reason"]
    assert_all_checkpoints_valid(jobdir)


@needs_unshare
def test_killed_run_on_another_node_is_taken_over_by_another_job_once_stale(tmp_path: Path) -> None:
    """The holder's heartbeat goes stale after its ``stale_after`` (1 s here); a claimant uses
    the larger of its own and the holder's, so one that is more patient (600 s) is still refused."""
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    (first,) = launch(jobdir, control, "--hold-at", "5", "--heartbeat", "0.2", "--stale-after", "1",
                      host="other-node", SLURM_JOB_ID="100")
    (pid,) = holding(control)
    first.send_signal(signal.SIGKILL)
    finish([first])

    ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl2", "--stale-after", "600", SLURM_JOB_ID="200"))
    assert_refused(rc, err, jobdir)
    assert "taken over after 600 s" in err

    wait_for(lambda: lease_status(jobdir)["state"] == "stale", 30, what="the dead holder's lease going stale")
    assert "STALE" in describe_lease(jobdir)
    ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl3", "--heartbeat", "0.2", "--stale-after", "1",
                                 SLURM_JOB_ID="200"))
    assert rc == 0, err
    (takeover,) = events(jobdir, "lease-takeover")
    assert takeover["previous"]["pid"] == pid and "no heartbeat for" in takeover["reason"]
    assert_all_checkpoints_valid(jobdir)


# -- several ranks ---------------------------------------------------------------------------


def test_two_rank_run_holds_one_lease_and_a_second_fails_on_every_rank(tmp_path: Path) -> None:
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    first = launch(jobdir, control, "--hold-at", "5", world=2)
    try:
        pids = holding(control, world=2)
        record = LeaseRecord.read(jobdir / "lease.json")
        assert record.pid == pids[0] and record.world_size == 2 and record.released is None
        assert sorted(p.name for p in jobdir.glob("lease*")) == ["lease.json", "lease.lock"]
        before = snapshot(jobdir)
        results = finish(launch(jobdir, tmp_path / "ctl2", world=2))  # hangs (and fails) if a rank waits
        for rc, err in results:
            assert_refused(rc, err, jobdir)
        assert snapshot(jobdir) == before
        assert [e["rank"] for e in events(jobdir, "lease-refused")] == [0]
    finally:
        (control / "release").touch()
        results = finish(first)
    assert [rc for rc, _ in results] == [0, 0], results
    assert_all_checkpoints_valid(jobdir)


def test_a_later_run_on_a_killed_job_dir_is_not_refused_but_does_nothing(tmp_path: Path) -> None:
    """The kill switch is on while a run still holds the job dir (it exits at its next check):
    a later job on the job dir (an array task, a requeue) must not fail with 86 but end like
    any run on a killed job dir: code 0 on every rank, nothing saved, not requeued."""
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    first = launch(jobdir, control, "--hold-at", "5", world=2)
    try:
        holding(control, world=2)
        subprocess.run([sys.executable, "-m", "ftkit", "kill", str(jobdir)], check=True, capture_output=True,
                       env=env())
        before = snapshot(jobdir)
        results = finish(launch(jobdir, tmp_path / "ctl2", world=2))
        assert [rc for rc, _ in results] == [0, 0], results
        assert all("Traceback" not in err for _, err in results), results
        assert "kill-switch" in results[0][1] and "saves nothing" in results[0][1]
        assert [(tmp_path / "ctl2" / f"done-rank{r}").read_text() for r in range(2)] == ["False", "False"]
        assert snapshot(jobdir) == before  # saved nothing, removed nothing
        (refused,) = events(jobdir, "lease-refused")
        assert refused["idle"] is True and refused["exit_code"] == 0
        later = [e for e in events(jobdir, "start") if e["pid"] in {refused["pid"]}]
        assert len(later) == 1 and later[0]["kill_switch"] is True
        assert LeaseRecord.read(jobdir / "lease.json").pid != refused["pid"]  # still the first run's
        decided = subprocess.run([sys.executable, "-m", "ftkit", "requeue", str(jobdir), "--exit-code", "0",
                                  "--dry-run"], capture_output=True, text=True, env=env())
        assert decided.returncode == 0, decided.stderr
        assert "not requeued: kill-switch" in decided.stdout and "did nothing" in decided.stdout
    finally:
        (control / "release").touch()
        results = finish(first)
    assert [rc for rc, _ in results] == [0, 0], results  # the holder stops at its next check
    assert LeaseRecord.read(jobdir / "lease.json").released is not None


# -- the rules -------------------------------------------------------------------------------


def _rec(**kw) -> LeaseRecord:
    base = dict(job_id=None, restart_count=0, host="a", pid=10, started=0.0, heartbeat=100.0,
                heartbeat_every=30.0, stale_after=300.0, boot_id="k1")
    return LeaseRecord(**{**base, **kw})


@pytest.mark.parametrize(("held", "me", "lock_free", "alive", "kind", "why"), [
    (None, {}, True, True, "free", ""),
    ({"released": 150.0}, {}, True, True, "free", ""),
    ({"released": 150.0}, {}, False, True, "busy", "wrote no current record"),
    ({}, {"pid": 11}, True, True, "takeover", "does not hold"),                     # same host, copied or pid reused
    ({"boot_id": None}, {"pid": 11}, True, True, "busy", "last heartbeat"),       # an older record: no kernel known
    ({"boot_id": "k2"}, {"pid": 11}, True, True, "busy", "last heartbeat"),       # one host name, two machines
    ({"boot_id": "k2"}, {"pid": 11}, True, False, "busy", "last heartbeat"),      # ... its pid is not ours to see
    ({"boot_id": None}, {"pid": 11}, True, False, "takeover", "is gone"),         # an older record, pid gone
    ({}, {}, True, True, "busy", "last heartbeat"),                                # this very process (another path)
    ({}, {"pid": 11}, True, False, "takeover", "is gone"),                          # same host, pid gone
    ({"heartbeat": 0.0}, {"pid": 11}, False, True, "busy", "it is running on this host"),  # alive: never stale
    ({"host": "b"}, {}, True, False, "busy", "taken over after 300 s"),            # other node: only when stale
    ({"host": "b", "heartbeat": -150.0}, {}, True, True, "takeover", "no heartbeat for 350 s"),
    ({"host": "b", "heartbeat": -150.0}, {}, False, True, "takeover", "no heartbeat"),  # lost node's lock
    ({"host": "b", "heartbeat": -150.0, "stale_after": 600.0}, {}, True, True, "busy", "after 600 s"),
    ({"host": "b", "job_id": "7"}, {"job_id": "7", "restart_count": 1}, False, True, "takeover", "restart 0"),
    ({"host": "b", "job_id": "7", "restart_count": 1}, {"job_id": "7", "restart_count": 1}, True, True, "busy", ""),
    ({"host": "b", "job_id": "7"}, {"job_id": "8", "restart_count": 1}, True, True, "busy", ""),
    ({"job_id": "7"}, {"job_id": "7", "restart_count": 1, "pid": 11}, False, True, "busy", "on this host"),
    ({"host": "b", "job_id": "7", "attempt": 1}, {"job_id": "7", "attempt": 2}, False, True, "takeover", "torchrun"),
    ({"host": "b", "job_id": "7", "attempt": 2}, {"job_id": "7", "restart_count": 1}, False, True, "takeover", "restart 0"),
    ({"host": "b", "job_id": "7", "attempt": 2, "restart_count": 1}, {"job_id": "7", "attempt": 3}, True, True, "busy", ""),
    ({"host": "b", "attempt": 1}, {"attempt": 2}, True, True, "busy", "remove lease.json"),  # no job id: no identity
])
def test_judge(held, me, lock_free, alive, kind, why) -> None:
    verdict = judge(None if held is None else _rec(**held), _rec(**me), lock_free=lock_free, now=200.0,
                    stale_after=300.0, pid_alive=lambda pid: alive)
    assert verdict.kind == kind and why in verdict.reason


def test_lease_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"lease\.stale_after"):
        LeaseConfig(heartbeat=10, stale_after=20)
    with pytest.raises(ConfigError, match=r"lease\.heartbeat"):
        LeaseConfig(heartbeat=0)


def test_disabled_lease_writes_no_lease_files(tmp_path: Path) -> None:
    with ftkit.FaultTolerance(tmp_path, config=ftkit.Config(lease=LeaseConfig(enabled=False))):
        pass
    assert not list(tmp_path.glob("lease*")) and describe_lease(tmp_path) is None


def test_record_roundtrip_and_garbage(tmp_path: Path) -> None:
    rec = _rec(job_id="9", released=time.time())
    assert LeaseRecord.from_json(rec.to_json()) == rec
    (tmp_path / "lease.json").write_text("{not json")
    assert LeaseRecord.read(tmp_path / "lease.json") is None


def stopped(pid: int) -> bool:
    """The process is stopped (state ``T`` in ``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@needs_unshare
@pytest.mark.parametrize("where", ["anywhere", "in-its-heartbeat-write"])
def test_a_holder_cut_off_past_the_stale_time_loses_the_lease_and_stops_without_saving(tmp_path: Path,
                                                                                       where: str) -> None:
    """SIGSTOP stands for a node cut off from the file server: alive, lock still held, no
    heartbeat. The next run breaks the lock (a new lease.lock) and trains; once the old holder
    runs again it finds the lease gone and exits at its next check without saving.

    ``in-its-heartbeat-write``: the holder is stopped just as its heartbeat begins to write
    ``lease.json`` (the write, with its fsync, is where a heartbeat spends its time). Resumed
    after the next run has come and gone, it must not put its own record back over that run's."""
    jobdir, control = tmp_path / "job", tmp_path / "ctl"
    stop_inside = ("--stop-in-heartbeat-write",) if where == "in-its-heartbeat-write" else ()
    (first,) = launch(jobdir, control, "--hold-at", "5", "--heartbeat", "0.2", "--stale-after", "1", *stop_inside,
                      host="other-node", SLURM_JOB_ID="100")
    try:
        (pid,) = holding(control)
        old_lock = (jobdir / "lease.lock").stat().st_ino
        if stop_inside:
            wait_for(lambda: (control / "stopping").exists() and stopped(pid), 30, what="the holder stopping itself")
        else:
            first.send_signal(signal.SIGSTOP)
        wait_for(lambda: lease_status(jobdir)["state"] == "stale", 30, what="the stopped holder going stale")
        ((rc, err),) = finish(launch(jobdir, tmp_path / "ctl2", "--heartbeat", "0.2", "--stale-after", "1",
                                     SLURM_JOB_ID="200"))
        assert rc == 0, err
        (takeover,) = events(jobdir, "lease-takeover")
        assert takeover["previous"]["pid"] == pid and "no heartbeat for" in takeover["reason"]
        assert (jobdir / "lease.lock").stat().st_ino != old_lock  # the held lock was broken, not shared
        assert_all_checkpoints_valid(jobdir)
        saved_by_second = {e["step"] for e in events(jobdir, "save")}
        first.send_signal(signal.SIGCONT)
        (lost,) = wait_for(lambda: events(jobdir, "lease-lost"), 60, what="lease-lost from the old holder")
        assert lost["pid"] == pid
        (control / "release").touch()
        ((rc, err),) = finish([first])
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            (control / "release").touch()
            finish([first])
    assert rc == 0, err
    assert (control / "done-rank0").read_text() == "False"
    (exit_event,) = [e for e in events(jobdir, "exit") if e["pid"] == pid]
    assert exit_event["requeue"] is False and "lost the lease" in exit_event["reasons"][0]
    assert {e["step"] for e in events(jobdir, "save")} == saved_by_second  # the old holder saved nothing more
    assert_all_checkpoints_valid(jobdir)
    assert lease_status(jobdir)["state"] == "released" and lease_status(jobdir)["job_id"] == "200"


@needs_unshare
def test_a_holder_resumed_mid_heartbeat_while_the_next_run_holds_stops_and_leaves_that_run_alone(
        tmp_path: Path) -> None:
    """The cut-off holder comes back (SIGCONT) in the middle of its heartbeat write while the run
    that took over is still training: it must stop without saving and without touching
    ``lease.json``, and the new holder must keep its lease and finish. A late write of the old
    record would make the new holder read someone else's lease and stop too: both runs lost."""
    jobdir, control, control2 = tmp_path / "job", tmp_path / "ctl", tmp_path / "ctl2"
    (first,) = launch(jobdir, control, "--hold-at", "5", "--heartbeat", "0.2", "--stale-after", "1",
                      "--stop-in-heartbeat-write", host="other-node", SLURM_JOB_ID="100")
    second: list[subprocess.Popen] = []
    try:
        (pid,) = holding(control)
        wait_for(lambda: (control / "stopping").exists() and stopped(pid), 30, what="the holder stopping itself")
        wait_for(lambda: lease_status(jobdir)["state"] == "stale", 30, what="the stopped holder going stale")
        second = launch(jobdir, control2, "--hold-at", "7", "--heartbeat", "0.2", "--stale-after", "1",
                        SLURM_JOB_ID="200")
        (pid2,) = holding(control2)
        first.send_signal(signal.SIGCONT)
        (lost,) = wait_for(lambda: events(jobdir, "lease-lost"), 60, what="lease-lost from the old holder")
        assert lost["pid"] == pid
        (control / "release").touch()
        ((rc, err),) = finish([first])
        assert rc == 0, err
        beat = lease_status(jobdir)["heartbeat"]  # five more of the new holder's beats, each reading lease.json
        wait_for(lambda: lease_status(jobdir)["heartbeat"] >= beat + 1.0, 30, what="the new holder beating on")
        status = lease_status(jobdir)
        assert status["state"] == "held" and status["job_id"] == "200" and status["pid"] == pid2
        (control2 / "release").touch()
        ((rc2, err2),) = finish(second)
    finally:
        for p, ctl in ((first, control), *((p, control2) for p in second)):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                (ctl / "release").touch()
                finish([p])
    assert rc2 == 0, err2
    assert (control2 / "done-rank0").read_text() == "True" and (control / "done-rank0").read_text() == "False"
    assert [e["pid"] for e in events(jobdir, "lease-lost")] == [pid]
    assert_all_checkpoints_valid(jobdir)
    assert lease_status(jobdir)["state"] == "released" and lease_status(jobdir)["job_id"] == "200"


def test_a_copy_made_on_another_node_of_a_job_dir_in_use_is_taken_over(tmp_path: Path) -> None:
    """``cp -a`` of a job dir whose run holds it on another node: the copy's lease.json names
    that run, with a fresh heartbeat, and this node cannot see its lock. It was refused (exit
    86, advising to end the healthy original's run); the record names the original job dir,
    which exists and is not this one, so the copy's lease is free (found by a user trial)."""
    from dataclasses import replace

    from ftkit.lease import LeaseRecord

    original, copy = tmp_path / "job", tmp_path / "copy"
    original.mkdir()
    now = time.time()
    held = LeaseRecord(job_id="38", restart_count=0, host="n-elsewhere", pid=4242, started=now - 60, heartbeat=now,
                       boot_id="another-kernel", job_dir=str(original.resolve()))
    (original / "lease.json").write_bytes(held.to_json())
    shutil.copytree(original, copy)
    status = subprocess.run([sys.executable, "-m", "ftkit", "status", "--json", str(copy)], capture_output=True,
                            text=True, timeout=60)
    said = json.loads(status.stdout)
    assert said["running"] is False and said["lease"]["state"] == "dead", said["lease"]
    with ftkit.FaultTolerance(copy, state={}) as ft:
        assert list(ft.range(2)) == [0, 1]
    (takeover,) = [e for e in read_events(copy / "events.jsonl") if e["event"] == "lease-takeover"]
    assert "the record names another job dir" in takeover["reason"], takeover
    assert LeaseRecord.read(original / "lease.json") == held  # the original's is its own
    # a job dir moved away (nothing at the record's path): not taken for a copy
    (tmp_path / "moved").mkdir()
    gone = replace(held, job_dir=str(tmp_path / "was-here"))
    (tmp_path / "moved" / "lease.json").write_bytes(gone.to_json())
    with pytest.raises(ftkit.JobDirBusyError):
        ftkit.FaultTolerance(tmp_path / "moved", state={}).__enter__()


def test_ftkit_requeue_typed_while_the_job_trains_changes_nothing(tmp_path: Path) -> None:
    """`ftkit requeue JOBDIR --exit-code 1` typed in a terminal (or `srun --overlap`) while the
    run trains on this node: it recorded a crash in runs.json and requeued the healthy job
    (found by a user trial). The run's trainer holds the lease here, which is certain: refused,
    naming the holder; nothing recorded. Once the run has exited, it decides as usual."""
    jobdir = tmp_path / "job"
    run = launch(jobdir, tmp_path / "ctl", "--hold-at", "5")
    try:
        (pid,) = holding(tmp_path / "ctl")
        typed = subprocess.run([sys.executable, "-m", "ftkit", "requeue", str(jobdir), "--exit-code", "1"],
                               capture_output=True, text=True, timeout=120, env=env())
        said = " ".join((typed.stdout + typed.stderr).split())
        assert typed.returncode == 2, said
        assert f"the run in job dir {jobdir} is still training: a run outside SLURM, pid {pid} on" in said, said
        assert not (jobdir / "runs.json").exists() and events(jobdir, "requeue") == []
        dry = subprocess.run([sys.executable, "-m", "ftkit", "requeue", str(jobdir), "--exit-code", "1", "--dry-run"],
                             capture_output=True, text=True, timeout=120, env=env())
        assert dry.returncode in (0, 1) and "dry run" in dry.stdout, dry.stdout + dry.stderr  # decides, writes nothing
    finally:
        (tmp_path / "ctl" / "release").touch()
        ((rc, err),) = finish(run)
    assert rc == 0, err
    after = subprocess.run([sys.executable, "-m", "ftkit", "requeue", str(jobdir), "--exit-code", "0"],
                           capture_output=True, text=True, timeout=120, env=env())
    assert after.returncode == 0 and "still training" not in after.stdout + after.stderr, after.stderr
    assert len(events(jobdir, "requeue")) == 1
