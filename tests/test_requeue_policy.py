"""The requeue policy and the exit path, with the scontrol and sbatch call points patched.

The ``scontrol show job -o`` lines are trimmed recordings from SLURM 22.05.8 (the local
cluster of scripts/slurm-cluster): a running job, a job in a preemption's GraceTime
(still RUNNING, PreemptTime set), a time-limited job being killed (COMPLETING,
Reason=TimeLimit), and the states after a preemption kill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.cli import main
from ftkit.errors import ConfigError, SlurmError
from ftkit.events import EventLog, read_events
from ftkit.slurm import env as slurm_env
from ftkit.slurm import requeue as rq
from ftkit.slurm.env import SlurmEnv
from ftkit.slurm.requeue import EXIT_UNFINISHED, RequeuePolicy, decide, finish_run, perform

_TAIL = ("Partition=low NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 "
         "TRES=cpu=1,mem=2885M,node=1,billing=1 Command={cmd} WorkDir={wd} StdOut={wd}/train-100.out")


def job_line(state: str = "RUNNING", *, reason: str = "None", restarts: int = 0, preempt: str = "None",
             cmd: str = "/tmp/train.sbatch", wd: str = "/tmp") -> str:
    return (f"JobId=100 JobName=train UserId=root(0) GroupId=root(0) Priority=4294901724 Nice=0 "
            f"Account=(null) QOS=(null) JobState={state} Reason={reason} Dependency=(null) Requeue=1 "
            f"Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:10:00 TimeLimit=01:00:00 "
            f"StartTime=2026-11-22T16:50:18 EndTime=2026-11-22T17:50:18 PreemptTime={preempt} "
            + _TAIL.format(cmd=cmd, wd=wd) + "\n")


RUNNING = job_line()
GRACE = job_line(preempt="2026-11-22T16:50:36")
TIMELIMIT = job_line("COMPLETING", reason="TimeLimit")
TIMEOUT = job_line("TIMEOUT", reason="TimeLimit")
PREEMPTED = job_line("PREEMPTED")
REQUEUED = job_line("COMPLETING", restarts=1)  # preemption kill: SLURM requeued it already
PENDING = job_line("PENDING", reason="BeginTime", restarts=1)


class FakeScontrol:
    """Stands in for run_scontrol: answers ``show job`` from a script of lines, records calls."""

    def __init__(self, *shows: str, requeue_error: str | None = None, jobdir: Path | None = None) -> None:
        self.shows = list(shows)
        self.requeue_error = requeue_error
        self.calls: list[list[str]] = []
        self.jobdir = jobdir
        self.runs_at_requeue: list[dict] | None = None

    def __call__(self, args, **_):
        args = list(args)
        self.calls.append(args)
        if args[0] == "show":
            if not self.shows:
                raise SlurmError("`scontrol show job` failed (exit 1): Invalid job id specified")
            return self.shows.pop(0) if len(self.shows) > 1 else self.shows[0]
        if args[0] == "requeue":
            if self.jobdir is not None:
                self.runs_at_requeue = rq.read_runs(self.jobdir / "runs.json")
            if self.requeue_error:
                raise SlurmError(self.requeue_error)
            return ""
        raise AssertionError(f"unexpected scontrol {args}")

    @property
    def requeued(self) -> list[str]:
        return [a[1] for a in self.calls if a[0] == "requeue"]


class Missing(FakeScontrol):
    def __call__(self, args, **_):
        self.calls.append(list(args))
        raise SlurmError(f"`scontrol {' '.join(args)}`: scontrol is missing (not on PATH)")


@pytest.fixture
def jobdir(tmp_path: Path) -> Path:
    d = tmp_path / "job"
    (d / "requests").mkdir(parents=True)
    return d


@pytest.fixture
def env(tmp_path: Path) -> SlurmEnv:
    return SlurmEnv(job_id="100", restart_count=0, job_name="train", partition="low", submit_dir=str(tmp_path))


def trainer_run(jobdir: Path, *, restart: int = 0, job_id: str = "100", exit: dict | None = None,
                rank: int = 0) -> None:
    """What the controller writes: a start event and, unless it died hard, an exit event."""
    log = EventLog(jobdir / "events.jsonl", rank=rank)
    log.emit("start", world_size=1, job_id=job_id, restart_count=restart)
    if exit is not None:
        log.emit("exit", **{"step": 10, "completed": False, "requeue": None, "reasons": [], **exit})


def prior_runs(jobdir: Path, *records: dict) -> None:
    (jobdir / "runs.json").write_text(json.dumps({"version": 1, "runs": list(records)}))


def steps(value):
    return lambda root: value


def run_decide(jobdir, env, fake, *, rc=0, policy=None, step=None):
    return decide(jobdir, exit_code=rc, env=env, policy=policy or RequeuePolicy(), runner=fake,
                  checkpoints_lookup=steps(step))


# --------------------------------------------------------------------------------------
# policy config


def test_policy_validation_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"requeue\.max_requeues"):
        RequeuePolicy(max_requeues=-1)
    with pytest.raises(ConfigError, match=r"requeue\.max_no_progress"):
        RequeuePolicy(max_no_progress=True)
    with pytest.raises(ConfigError, match=r"requeue\.fallback: got 'retry'; use one of resubmit, none"):
        RequeuePolicy(fallback="retry")
    with pytest.raises(ConfigError, match="FTKIT_MAX_REQUEUES='lots'"):
        RequeuePolicy.from_env({"FTKIT_MAX_REQUEUES": "lots"})
    p = RequeuePolicy.from_env({"FTKIT_MAX_REQUEUES": "7", "FTKIT_REQUEUE_ON_CRASH": "0"}, max_requeues=3,
                               fallback=None)
    assert (p.max_requeues, p.requeue_on_crash, p.fallback) == (3, False, "resubmit")


# --------------------------------------------------------------------------------------
# decide: each branch


def test_completed_is_not_requeued(jobdir, env) -> None:
    trainer_run(jobdir, exit={"completed": True, "step": 1000})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), step=1000)
    assert (d.requeue, d.cause, d.exit_code) == (False, "completed", 0)
    assert "training completed (step 1000)" in d.reason


def test_trainer_requested_requeue_on_sigusr1(jobdir, env) -> None:
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), step=10)
    assert (d.requeue, d.cause, d.exit_code) == (True, "requested (SIGUSR1)", 0)
    assert d.reason == "requested (SIGUSR1); requeue 1 of at most 20"


@pytest.mark.parametrize(("line", "rc", "cause"), [
    (GRACE, 0, "preemption"),          # trainer saved and exited inside the GraceTime
    (PREEMPTED, 143, "preemption"),
    (TIMELIMIT, 0, "time limit"),     # SIGTERM at the limit: COMPLETING, Reason=TimeLimit
    (TIMEOUT, 137, "time limit"),
    (REQUEUED, 143, "requeued by SLURM"),
])
def test_slurm_state_says_why_it_ended(jobdir, env, line, rc, cause) -> None:
    trainer_run(jobdir, exit={"reasons": ["TERM received"]} if rc == 0 else None)
    d = run_decide(jobdir, env, FakeScontrol(line), rc=rc, step=10)
    assert (d.requeue, d.cause, d.exit_code) == (True, cause, 0)
    assert d.already_requeued == (line is REQUEUED)


def test_clean_exit_without_requeue_wish_is_finished(jobdir, env) -> None:
    trainer_run(jobdir, exit={"reasons": ["save-exit requested"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), step=10)
    assert (d.requeue, d.cause, d.exit_code) == (False, "finished", 0)


@pytest.mark.parametrize("how", ["kill-switch", "stop-request", "trainer-stop"])
def test_stopped_for_good_is_never_requeued(jobdir, env, how) -> None:
    if how == "kill-switch":
        (jobdir / "kill-switch").touch()
        trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    elif how == "stop-request":
        (jobdir / "requests" / "1-h-1-stop.json").write_text(json.dumps({"action": "stop", "reason": "done"}))
        trainer_run(jobdir)
    else:
        trainer_run(jobdir, exit={"requeue": False, "reasons": ["kill-switch touched"]})
    d = run_decide(jobdir, env, FakeScontrol(PREEMPTED), rc=0, step=10)  # even when preempted
    assert (d.requeue, d.cause, d.exit_code) == (False, "stopped", 0)


def test_cancelled_job_is_not_requeued(jobdir, env) -> None:
    trainer_run(jobdir, exit={"reasons": ["TERM received"]})
    d = run_decide(jobdir, env, FakeScontrol(job_line("CANCELLED")), rc=0, step=10)
    assert (d.requeue, d.cause) == (False, "cancelled") and "cancelled" in d.reason


# What the batch script sees after `scancel JOBID` (recorded on SLURM 22.05.8): the job is
# COMPLETING with Reason=None while the script still runs, CANCELLED only once it is gone.
SCANCELLED = job_line("COMPLETING")


def two_rank_run(jobdir: Path, *, exit: dict | None, ranks=(0, 1)) -> None:
    for rank in (0, 1):
        EventLog(jobdir / "events.jsonl", rank=rank).emit("start", world_size=2, job_id="100", restart_count=0)
    for rank in ranks:
        EventLog(jobdir / "events.jsonl", rank=rank).emit(
            "exit", **{"step": 10, "completed": False, "requeue": None, "reasons": [], "error": None, **(exit or {})})


@pytest.mark.parametrize("rc", [0, 1, 143])
def test_scancel_of_a_running_job_is_never_requeued(jobdir, env, rc) -> None:
    """torchrun exits 1 when SLURM's SIGTERM reaches it after the ranks saved and exited:
    the job state says cancelled, and no launcher exit code turns that into a crash."""
    two_rank_run(jobdir, exit={"reasons": ["save-exit requested: SIGTERM from SLURM (scancel, ...)"]})
    d = run_decide(jobdir, env, FakeScontrol(SCANCELLED), rc=rc, step=10)
    assert (d.requeue, d.cause, d.exit_code) == (False, "cancelled", 0)
    assert "the job was cancelled (scancel: JobState=COMPLETING" in d.reason
    assert "the trainer saved step 10 and exited" in d.reason


def test_scancel_of_a_crashed_run_keeps_its_exit_code(jobdir, env) -> None:
    trainer_run(jobdir)  # no exit event: killed
    d = run_decide(jobdir, env, FakeScontrol(SCANCELLED), rc=137, step=10)
    assert (d.requeue, d.cause, d.exit_code) == (False, "cancelled", 137)


@pytest.mark.parametrize("line", [TIMELIMIT, REQUEUED, job_line("COMPLETING", preempt="2026-11-22T16:50:36"),
                                  job_line("COMPLETING", reason="NodeDown")],
                         ids=["time-limit", "requeued", "preempted", "node-down"])
def test_completing_for_another_reason_is_not_a_cancel(jobdir, env, line) -> None:
    two_rank_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    d = run_decide(jobdir, env, FakeScontrol(line), rc=1, step=10)
    assert d.cause != "cancelled" and d.requeue


def test_launcher_exit_code_after_every_rank_exited_cleanly_is_not_a_crash(jobdir, env) -> None:
    """`scancel --signal=TERM` (signal only, the job goes on): torchrun exits 1, but both ranks
    saved and exited; the trainers asked for no requeue, so the run is finished, not crashed."""
    two_rank_run(jobdir, exit={"reasons": ["save-exit requested"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=10)
    assert (d.requeue, d.cause, d.exit_code) == (False, "finished", 0)
    assert d.run["exit_code"] == 1  # the launcher's code is still recorded


@pytest.mark.parametrize("ranks", [(0,), (1,)])
def test_one_rank_without_a_clean_exit_is_a_crash(jobdir, env, ranks) -> None:
    two_rank_run(jobdir, exit={"reasons": ["save-exit requested"]}, ranks=ranks)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=10)
    assert (d.requeue, d.cause) == (True, "crash")


def test_a_rank_exit_with_an_error_is_a_crash(jobdir, env) -> None:
    two_rank_run(jobdir, exit={"error": "RuntimeError: gloo connection closed"}, ranks=(0, 1))
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=10)
    assert (d.requeue, d.cause) == (True, "crash")


# --------------------------------------------------------------------------------------
# issue 15: a run refused by the job dir's lease; issue 19: the hang watchdog


def lease_refused(jobdir: Path, *, job_id: str = "100", restart: int = 0) -> None:
    EventLog(jobdir / "events.jsonl", rank=0).emit(
        "lease-refused", job_id=job_id, restart_count=restart, exit_code=86,
        holder={"holder": "job 99 (restart 0) on n1 pid 4242"}, reason="job dir in use")


@pytest.mark.parametrize("how", ["exit-code", "event"])
def test_lease_refused_is_never_requeued(jobdir, env, how) -> None:
    if how == "event":
        lease_refused(jobdir)
    rc = 86 if how == "exit-code" else 1  # torchrun replaces the code: the event decides
    d = run_decide(jobdir, env, FakeScontrol(PREEMPTED), rc=rc, step=10)  # even when preempted
    assert (d.requeue, d.cause, d.exit_code) == (False, "lease refused", 86)
    assert d.reason.startswith(f"another run holds the job dir {jobdir}")
    if how == "event":
        assert "job 99 (restart 0) on n1 pid 4242" in d.reason
    # the code the launcher gave: torchrun's 1 is not called 86
    said = "exited with code 86" if how == "exit-code" else "its launcher exited with code 1"
    assert said in d.reason and ("code 86" in d.reason) == (how == "exit-code"), d.reason


def test_lease_refused_of_another_job_does_not_count(jobdir, env) -> None:
    lease_refused(jobdir, job_id="99")
    lease_refused(jobdir, restart=1)
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=0, step=10)
    assert (d.requeue, d.cause) == (True, "requested (SIGUSR1)")


def test_finish_run_after_lease_refusal_touches_nothing(jobdir, env) -> None:
    """The job dir belongs to the run holding the lease: its requests, runs.json and events
    log (a `requeue` event would end its run there) stay as they are; nothing is waited for."""
    trainer_run(jobdir, job_id="99")  # the holder, still running
    (jobdir / "requests" / "1-h-1-save.json").write_text(json.dumps({"action": "save"}))
    lease_refused(jobdir)
    before = (jobdir / "events.jsonl").read_bytes()
    fake = FakeScontrol(RUNNING)
    out = finish_run(jobdir, exit_code=1, env=env, runner=fake, checkpoints_lookup=steps(10), saver_wait=0)
    assert (out.exit_code, out.action) == (86, None) and not out.decision.requeue
    assert out.message.startswith("ftkit requeue: not requeued: another run holds the job dir")
    assert (jobdir / "events.jsonl").read_bytes() == before
    assert not (jobdir / "runs.json").exists()
    assert (jobdir / "requests" / "1-h-1-save.json").exists()
    assert fake.requeued == []


def hang_run(jobdir: Path, *, step: int, restart: int = 0) -> None:
    """Rank 1 (on n2) stops inside a step; rank 0 waits for it in a collective. Both watchdogs
    fire, rank 0's event last: the one the rule names is rank 1, not the last event written."""
    trainer_run(jobdir, restart=restart)
    EventLog(jobdir / "events.jsonl", rank=1).emit("hang", step=step, seconds=612.4, host="n2", world_size=2,
                                                   waiting=False, frame="train.py:40 in load_batch",
                                                   file=str(jobdir / "hangs" / "hang-rank1-n2.txt"))
    EventLog(jobdir / "events.jsonl", rank=0).emit("hang", step=step, seconds=613.0, host="n1", world_size=2,
                                                   waiting=True, frame="distributed_c10d.py:2800 in all_reduce",
                                                   file=str(jobdir / "hangs" / "hang-rank0-n1.txt"))


def test_hang_after_progress_is_requeued(jobdir, env) -> None:
    prior_runs(jobdir, {"requeue": True, "cause": "time limit", "end_step": 100})
    hang_run(jobdir, step=170)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=150)  # torchrun: 1, not 87
    assert (d.requeue, d.cause, d.exit_code) == (True, "hang", 0)
    assert "hung: the hang watchdog found rank 1 on n2 completed no step for 612 s after step 170" in d.reason
    assert "hang-rank1-n2.txt" in d.reason and "after progress to step 150" in d.reason
    assert d.run["hang_step"] == 170


def test_a_hang_whose_culprit_wrote_no_event_names_it_all_the_same(jobdir, env) -> None:
    """Rank 1 was stopped (no heartbeat since, no event of its own): rank 0, which fired, is
    not the one named."""
    trainer_run(jobdir)
    EventLog(jobdir / "events.jsonl", rank=0).emit("hang", step=40, seconds=300.0, host="n1", world_size=2,
                                                   waiting=True, file=str(jobdir / "hangs" / "hang-rank0-n1.txt"))
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, step=30)
    assert d.cause == "hang" and "the hang watchdog found rank 1 on ? completed no step" in d.reason, d.reason
    assert "rank 0" not in d.reason and "hang-rank0-n1.txt" not in d.reason and d.run["hang_step"] is None


def test_exit_code_87_alone_is_a_hang(jobdir, env) -> None:
    trainer_run(jobdir)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, step=10)
    assert (d.requeue, d.cause) == (True, "hang") and "exit code 87, no hang event" in d.reason


def test_hang_again_at_the_same_step_without_progress_stops(jobdir, env) -> None:
    policy = RequeuePolicy(max_no_progress=5)  # the hang rule, not the no-progress cap, stops it
    prior_runs(jobdir, {"requeue": True, "cause": "time limit", "end_step": 100, "progress": True})
    hang_run(jobdir, step=130)
    first = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, policy=policy, step=100)
    assert first.requeue and "no newer checkpoint (1 of 5 allowed)" in first.reason
    prior_runs(jobdir, {"requeue": True, "cause": "time limit", "end_step": 100, "progress": True}, dict(first.run))
    env1 = SlurmEnv(job_id="100", restart_count=1)
    hang_run(jobdir, step=130, restart=1)
    d = run_decide(jobdir, env1, FakeScontrol(RUNNING), rc=87, policy=policy, step=100)
    assert (d.requeue, d.cause, d.exit_code) == (False, "hang", 87)
    assert d.reason.startswith("hung again at step 130 without a newer checkpoint (newest step 100)")
    assert "the hang watchdog found rank 1 on n2" in d.reason
    # a hang at another step is not "the same hang": the no-progress cap applies as for crashes
    hang_run(jobdir, step=140, restart=1)
    assert run_decide(jobdir, env1, FakeScontrol(RUNNING), rc=87, policy=policy, step=100).requeue


def test_hangs_and_crashes_share_the_no_progress_cap(jobdir, env) -> None:
    prior_runs(jobdir, {"cause": "crash", "progress": False, "requeue": True, "end_step": 100},
               {"cause": "hang", "progress": False, "requeue": True, "end_step": 100, "hang_step": 120})
    hang_run(jobdir, step=110)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, step=100)
    assert not d.requeue and "3 times in a row" in d.reason and "FTKIT_MAX_NO_PROGRESS" in d.reason


def test_hang_respects_requeue_on_crash_and_the_cap(jobdir) -> None:
    hang_run(jobdir, step=50)
    env = SlurmEnv(job_id="100", restart_count=0)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, policy=RequeuePolicy(requeue_on_crash=False), step=60)
    assert not d.requeue and "requeue_on_crash is off" in d.reason and d.exit_code == 87
    env = SlurmEnv(job_id="100", restart_count=3)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=87, policy=RequeuePolicy(max_requeues=3), step=60)
    assert not d.requeue and "requeue cap reached" in d.reason


def test_requeue_cap_from_slurm_restart_count(jobdir, env) -> None:
    env = SlurmEnv(job_id="100", restart_count=20)
    trainer_run(jobdir, restart=20, exit={"requeue": True, "reasons": ["USR1 received"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), step=10)
    assert (d.requeue, d.exit_code) == (False, EXIT_UNFINISHED)
    assert d.reason.startswith("requeue cap reached: 20 requeues (FTKIT_MAX_REQUEUES / --max-requeues = 20)")


def test_requeue_cap_counts_resubmissions_in_runs_json(jobdir, env) -> None:
    # resubmitted jobs start SLURM_RESTART_COUNT at 0 again; runs.json remembers
    prior_runs(jobdir, {"requeue": False, "cause": "completed"},
               *[{"requeue": True, "cause": "time limit", "end_step": i} for i in range(3)])
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), policy=RequeuePolicy(max_requeues=3), step=10)
    assert not d.requeue and d.requeues == 3 and "requeue cap reached: 3 requeues" in d.reason
    assert run_decide(jobdir, env, FakeScontrol(RUNNING), policy=RequeuePolicy(max_requeues=4), step=10).requeue


def test_cap_keeps_a_crash_exit_code(jobdir, env) -> None:
    env = SlurmEnv(job_id="100", restart_count=2)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, policy=RequeuePolicy(max_requeues=2), step=5)
    assert (d.requeue, d.exit_code) == (False, 1)


def test_crash_with_progress_is_requeued(jobdir, env) -> None:
    prior_runs(jobdir, {"requeue": True, "cause": "time limit", "end_step": 100})
    trainer_run(jobdir)  # died hard: no exit event
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=137, step=150)
    assert (d.requeue, d.cause, d.exit_code) == (True, "crash", 0)
    assert d.run["progress"] and d.run["start_step"] == 100 and d.run["end_step"] == 150


def test_crash_without_progress_is_requeued_up_to_max_no_progress(jobdir, env) -> None:
    policy = RequeuePolicy(max_no_progress=2)
    history = [{"requeue": True, "cause": "time limit", "end_step": 100, "progress": True}]
    outcomes = []
    for _ in range(3):
        prior_runs(jobdir, *history)
        d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, policy=policy, step=100)
        outcomes.append(d.requeue)
        history.append(dict(d.run))
    assert outcomes == [True, True, False]
    assert "without a newer checkpoint 3 times in a row" in d.reason and "FTKIT_MAX_NO_PROGRESS" in d.reason
    assert d.exit_code == 1


def test_progress_resets_the_no_progress_streak(jobdir, env) -> None:
    prior_runs(jobdir, {"cause": "crash", "progress": False, "requeue": True, "end_step": 100},
               {"cause": "crash", "progress": False, "requeue": True, "end_step": 100})
    assert not run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=100).requeue
    assert run_decide(jobdir, env, FakeScontrol(RUNNING), rc=1, step=120).requeue


def test_requeue_on_crash_off(jobdir, env) -> None:
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=3, policy=RequeuePolicy(requeue_on_crash=False), step=9)
    assert (d.requeue, d.exit_code) == (False, 3) and "requeue_on_crash is off" in d.reason


def test_exit_event_of_an_earlier_run_is_ignored(jobdir) -> None:
    trainer_run(jobdir, restart=0, exit={"completed": True})
    env = SlurmEnv(job_id="100", restart_count=1)
    trainer_run(jobdir, restart=1)  # this run died without an exit event
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=139, step=10)
    assert (d.requeue, d.cause) == (True, "crash")


def test_sigusr1_request_counts_for_a_program_without_ftkit(jobdir, env) -> None:
    from ftkit.triggers.switches import write_request

    write_request(jobdir, "requeue", reason="SIGUSR1 from SLURM (time limit or preemption)")
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=138, step=None)
    assert (d.requeue, d.cause) == (True, "requested (SIGUSR1)")
    assert len(d.spent_requests) == 1


def test_decides_without_slurm(jobdir) -> None:
    d = run_decide(jobdir, SlurmEnv(), Missing(), rc=0)
    assert not d.requeue and d.slurm_state is None
    with pytest.raises(ConfigError, match="does not exist"):
        run_decide(jobdir / "nope", SlurmEnv(), Missing())


# --------------------------------------------------------------------------------------
# perform and finish_run


def test_finish_run_requeues_records_and_spends_requests(jobdir, env) -> None:
    (jobdir / "requests" / "1-h-1-requeue.json").write_text('{"action": "requeue", "reason": "SIGUSR1 from SLURM"}')
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    fake = FakeScontrol(RUNNING, jobdir=jobdir)
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(10), clock=lambda: 5.0)
    assert fake.requeued == ["100"]
    assert out.exit_code == 0 and out.action.method == "scontrol"
    assert out.message == ("ftkit requeue: requeued job 100 (requested (SIGUSR1); requeue 1 of at most 20) "
                           "via scontrol requeue 100")
    # runs.json is durable before scontrol requeue, which ends the batch script
    assert fake.runs_at_requeue and fake.runs_at_requeue[-1]["method"] == "scontrol"
    (run,) = rq.read_runs(jobdir / "runs.json")
    assert run | {"start_time": None} == run | {
        "job_id": "100", "restart_count": 0, "end_time": 5.0, "exit_code": 0, "end_step": 10,
        "requeue": True, "method": "scontrol", "cause": "requested (SIGUSR1)", "start_time": None}
    event = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "requeue"][-1]
    assert event["requeue"] is True and event["method"] == "scontrol" and event["job_id"] == "100"
    assert event["reason"] == "requested (SIGUSR1); requeue 1 of at most 20"
    assert event["spent_requests"] == ["1-h-1-requeue.json"]
    assert list((jobdir / "requests").iterdir()) == []


def test_array_task_is_requeued_by_array_id(jobdir) -> None:
    env = SlurmEnv(job_id="107", array_job_id="100", array_task_id="7")
    trainer_run(jobdir, job_id="107", exit={"requeue": True, "reasons": ["USR1 received"]})
    fake = FakeScontrol(RUNNING)
    finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(1))
    assert fake.requeued == ["100_7"]


def test_already_requeued_by_slurm_calls_nothing(jobdir, env) -> None:
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    fake = FakeScontrol(REQUEUED)
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(1),
                     sbatch=lambda *a, **k: pytest.fail("must not resubmit"))
    assert fake.requeued == [] and out.action.method == "slurm" and out.exit_code == 0


def test_refused_requeue_after_preemption_requeued_it(jobdir, env) -> None:
    # SLURM requeued the job between our look and our scontrol requeue
    fake = FakeScontrol(GRACE, PENDING, requeue_error="Job is pending execution for job 100")
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(1),
                     sbatch=lambda *a, **k: pytest.fail("must not resubmit"))
    assert out.action.method == "slurm" and out.exit_code == 0


def test_scontrol_missing_falls_back_to_resubmit(jobdir, env, tmp_path, monkeypatch) -> None:
    script = tmp_path / "train.sbatch"
    script.write_text("#!/bin/bash\n")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    calls = []

    def fake_sbatch(args, *, cwd=None, env=None):
        calls.append((list(args), cwd, env))
        return "201;cluster\n"

    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    out = finish_run(jobdir, exit_code=0, env=env, runner=Missing(), sbatch=fake_sbatch, script=script,
                     checkpoints_lookup=steps(10))
    (args, cwd, child_env), = calls
    assert args == ["--parsable", "--dependency=afterany:100", "--job-name=train", "--partition=low", str(script)]
    assert cwd == str(tmp_path)
    assert "SLURM_RESTART_COUNT" not in child_env and child_env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert out.exit_code == 0 and out.action.method == "resubmit" and out.action.new_job_id == "201"
    assert "resubmitted as job 201" in out.message
    (run,) = rq.read_runs(jobdir / "runs.json")
    assert run["method"] == "resubmit" and run["new_job_id"] == "201"
    event = [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "requeue"][-1]
    assert event["method"] == "resubmit" and event["new_job_id"] == "201"


def test_refused_requeue_resubmits_the_script_from_scontrol(jobdir, tmp_path) -> None:
    script = tmp_path / "train.sbatch"
    script.write_text("#!/bin/bash\n")
    env = SlurmEnv(job_id="107", array_job_id="100", array_task_id="7", job_name="train")
    fake = FakeScontrol(job_line(cmd=str(script), wd=str(tmp_path)),
                        requeue_error="`scontrol requeue 100_7` failed (exit 1): Requested operation is presently disabled")
    trainer_run(jobdir, job_id="107", exit={"requeue": True, "reasons": ["USR1 received"]})
    seen = []
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(1),
                     sbatch=lambda args, **kw: seen.append((args, kw["cwd"])) or "300\n")
    assert seen == [(["--parsable", "--dependency=afterany:107", "--job-name=train", "--array=7", str(script)],
                     str(tmp_path))]
    assert out.action.method == "resubmit" and fake.requeued == ["100_7"]


def test_fallback_none_reports_failure(jobdir, env) -> None:
    fake = FakeScontrol(RUNNING, requeue_error="`scontrol requeue 100` failed (exit 1): Access/permission denied")
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, policy=RequeuePolicy(fallback="none"),
                     checkpoints_lookup=steps(1))
    assert out.exit_code == EXIT_UNFINISHED and out.action is None
    assert out.message.startswith("ftkit requeue: NOT requeued") and "permission denied" in out.message
    (run,) = rq.read_runs(jobdir / "runs.json")
    assert run["requeue"] is False and "fallback is 'none'" in run["error"]


def test_resubmit_without_a_script_fails_clearly(jobdir, env) -> None:
    decision = run_decide(jobdir, env, Missing(), rc=1, step=1)
    with pytest.raises(SlurmError, match=r"cannot resubmit.*pass --script PATH"):
        perform(decision, env, runner=Missing())


def test_dry_run_changes_nothing(jobdir, env) -> None:
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    fake = FakeScontrol(RUNNING)
    out = finish_run(jobdir, exit_code=0, env=env, runner=fake, dry_run=True, checkpoints_lookup=steps(1))
    assert out.message.startswith("ftkit requeue (dry run): would requeue job 100")
    assert fake.requeued == [] and not (jobdir / "runs.json").exists()


def test_scontrol_call_point_is_patchable(jobdir, env, monkeypatch) -> None:
    fake = FakeScontrol(RUNNING)
    monkeypatch.setattr(slurm_env, "run_scontrol", fake)
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["USR1 received"]})
    finish_run(jobdir, exit_code=0, env=env, checkpoints_lookup=steps(1))
    assert fake.calls == [["show", "job", "-o", "100"], ["requeue", "100"]]


def test_cli_requeue(jobdir, monkeypatch, capsys) -> None:
    import signal

    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer_run(jobdir, job_id=None, exit={"completed": True})
        assert main(["requeue", str(jobdir), "--exit-code", "0", "--max-requeues", "3"]) == 0
        assert capsys.readouterr().out.strip() == "ftkit requeue: not requeued: training completed (step 10)"
        assert main(["requeue", str(jobdir), "--exit-code", "0", "--max-requeues", "-1"]) == 2
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.parametrize("job_id", [None, "100"], ids=["no-slurm", "one-slurm-job"])
def test_a_crash_after_an_earlier_runs_clean_exit_is_a_crash(jobdir, job_id) -> None:
    """Two runs of one job dir under the same job id (outside SLURM: none; under SLURM, a batch
    script that starts training twice) and no ``requeue`` event between them (``ftkit requeue``
    was not run, or only with ``--dry-run``): the first exited cleanly on SIGTERM, the second
    was killed with kill -9 after progress. The verdict is the second run's: a crash, requeued,
    not "exited without asking for a requeue" from the first run's exit event."""
    trainer_run(jobdir, job_id=job_id, exit={"reasons": ["SIGTERM received"]})
    trainer_run(jobdir, job_id=job_id)  # killed: no exit event
    env = SlurmEnv(job_id=job_id, restart_count=0)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING) if job_id else Missing(), rc=137, step=20)
    assert (d.requeue, d.cause) == (True, "crash"), d


def test_a_trap_request_left_by_another_run_decides_nothing_and_is_spent(jobdir, env) -> None:
    """A ``requeue`` request written for job 100's restart 0 by its trap (``--this-run``) is still
    there when restart 1 crashes: it does not make this run "requested (SIGUSR1)", nor would a
    stale stop stop it; the crash decides, and the files are spent with it."""
    from ftkit.triggers.switches import write_request

    old = write_request(jobdir, "requeue", reason="SIGUSR1 from SLURM", run=("100", 0))
    stop = write_request(jobdir, "stop", reason="an old trap's", run=("99", 0))
    mine = SlurmEnv(job_id="100", restart_count=1)
    trainer_run(jobdir, restart=1)  # killed: no exit event
    d = run_decide(jobdir, mine, FakeScontrol(RUNNING), rc=137, step=20)
    assert (d.requeue, d.cause) == (True, "crash"), d
    assert set(d.spent_requests) == {str(old), str(stop)}


@pytest.mark.parametrize(("line", "rc", "requeued", "code"), [
    (RUNNING, 1, [], 1),  # a crash it would requeue: no requeue the caps cannot count
    (REQUEUED, 143, [], 0),  # SLURM requeued it already: said, not denied
    (RUNNING, 0, [], 0),  # nothing to requeue: the script ends as it would
])
def test_a_run_that_cannot_be_recorded_is_never_requeued_by_ftkit(jobdir, env, line, rc, requeued, code) -> None:
    """runs.json unwritable (here a directory in its place; a read-only mount in
    tests/test_cli_slips.py): the caps count what it records, so ftkit requeues nothing it
    cannot record; the message names the file, the requests are spent all the same and the
    exit code is what the batch script would have ended with otherwise (75 or the crash's
    own where a requeue was wanted)."""
    trainer_run(jobdir, exit={"error": "RuntimeError: boom"} if rc == 1 else
                {"requeue": True, "reasons": ["SIGTERM"]} if rc == 143 else {"completed": True})
    (jobdir / "runs.json").mkdir()
    (jobdir / "requests" / "requeue-1.json").write_text('{"action": "requeue"}')
    fake = FakeScontrol(line)
    out = finish_run(jobdir, exit_code=rc, env=env, runner=fake, checkpoints_lookup=steps(10), saver_wait=0)
    assert fake.requeued == requeued
    assert f"could not be recorded in {jobdir / 'runs.json'}" in out.message, out.message
    assert out.exit_code == code, out.message
    if line is REQUEUED:
        assert "nothing was requeued" not in out.message and out.message.startswith("ftkit requeue: requeued job")
    assert not list((jobdir / "requests").iterdir())
    assert [e["event"] for e in read_events(jobdir / "events.jsonl")][-1] == "requeue"


def test_a_displaced_restarts_requeue_does_not_end_the_live_restart(jobdir) -> None:
    """Split brain: SLURM took restart 0's node for lost and started restart 1 elsewhere; restart
    0's trainer ran on, lost the lease, wrote its exit and its batch script's `ftkit requeue`
    wrote a `requeue` event, all after restart 1 started. Restart 1's own requeue (SIGUSR1,
    asked for) found no run after that event: "left no ftkit exit record", not requeued, and
    the job ended COMPLETED unfinished (found by a user trial)."""
    log = EventLog(jobdir / "events.jsonl")
    log.emit("start", world_size=1, job_id="100", restart_count=0, pid=11)
    log.emit("start", world_size=1, job_id="100", restart_count=1, pid=22)
    log.emit("exit", step=60, completed=False, requeue=None, reasons=[], pid=11,
             error="LeaseLostError: another run took over the job dir's lease")
    log.emit("requeue", requeue=False, reason="the trainer stopped for good", job_id="100", restart_count=0)
    log.emit("exit", step=95, completed=False, requeue=True, reasons=["SIGUSR1 received"], pid=22)
    env = SlurmEnv(job_id="100", restart_count=1, job_name="train", partition="low")
    d = run_decide(jobdir, env, FakeScontrol(job_line(restarts=1)), rc=0, step=95)
    assert d.requeue and "SIGUSR1" in d.reason, d.reason


def test_an_ftkit_requeue_typed_while_the_run_trains_is_not_its_end(jobdir, env) -> None:
    log = EventLog(jobdir / "events.jsonl")
    log.emit("start", world_size=1, job_id="100", restart_count=0, pid=11)
    log.emit("requeue", requeue=False, reason="the program exited with code 0 and left no ftkit exit record",
             job_id="100", restart_count=0)  # typed by hand (srun --overlap) while the run trained
    log.emit("progress", step=40, pid=11)
    log.emit("exit", step=41, completed=False, requeue=True, reasons=["SIGUSR1 received"], pid=11)
    d = run_decide(jobdir, env, FakeScontrol(RUNNING), rc=0, step=40)
    assert d.requeue and "SIGUSR1" in d.reason, d.reason


def test_ftkit_requeue_run_twice_for_one_run_does_nothing_the_second_time(jobdir, env) -> None:
    trainer_run(jobdir, exit={"requeue": True, "reasons": ["SIGUSR1 received"]})
    fake = FakeScontrol(RUNNING)
    first = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(10), saver_wait=0)
    assert first.decision.requeue and fake.requeued == ["100"]
    again = finish_run(jobdir, exit_code=0, env=env, runner=fake, checkpoints_lookup=steps(10), saver_wait=0)
    assert not again.decision.requeue and fake.requeued == ["100"], again.message
    assert again.message.startswith("ftkit requeue: not requeued again: this run was handled already"), again.message
    assert again.exit_code == 0
    assert len(rq.read_runs(jobdir / "runs.json")) == 1
