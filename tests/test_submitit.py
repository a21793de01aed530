"""ftkit.integrations.submitit: a submitit job saves through ftkit at a step boundary when
submitit's preemption signal arrives, is requeued by submitit's own path, resumes, and ends
with the same parameters as an uninterrupted run. Local executor and the real SLURM cluster,
with one task and with two (one process group across nodes, set up by the helper), and a
preemption that SLURM requeues itself before submitit's ``scontrol requeue`` runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import pytest
import submitit

from ftkit.errors import ConfigError, JobDirBusyError
from ftkit.events import EventLog
from ftkit.integrations.submitit import FtkitCheckpointable, submitit_signal
from ftkit.jobdir import JobDir
from ftkit.lease import Lease, LeaseConfig
from ftkit.slurm.requeue import newest_checkpoint_step
from tests.conftest import wait_for
from tests.programs import submitit_dist_job, submitit_job

cloudpickle.register_pickle_by_value(submitit_job)  # the job needs no `tests` on its path
cloudpickle.register_pickle_by_value(submitit_dist_job)

SETTINGS = submitit_job.Settings(steps=60, step_time=0.05)
DIST_SETTINGS = submitit_dist_job.Settings(steps=60, step_time=0.05)


def _wait_ready(jobdir: Path, timeout: float = 60.0) -> int:
    """Pid of the first run once it has done a step under ftkit's handlers."""
    found = wait_for(lambda: sorted(jobdir.glob("ready-*")), timeout, interval=0.05,
                     what=f"a run of the job to reach a step ({jobdir})")
    return int(found[0].name.split("-", 1)[1])


def _events(jobdir: Path) -> list[dict]:
    return [json.loads(line) for line in (jobdir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run, in this process (outside submitit the helper just runs it)."""
    return FtkitCheckpointable(submitit_job.train, jobdir=tmp_path_factory.mktemp("ref"))(SETTINGS)


def _check_interrupted_run(jobdir: Path, result: dict, reference: dict) -> None:
    assert reference["completed"] and reference["last_step"] == SETTINGS.steps
    assert result["completed"] is True
    assert result["last_step"] == SETTINGS.steps
    assert result["params_sha256"] == reference["params_sha256"]
    events = _events(jobdir)
    sig = submitit_signal().name
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions and decisions[0]["requeue"] is True and decisions[0]["sources"] == ["signal"], decisions
    assert f"{sig} received" in decisions[0]["reasons"]
    stop = decisions[0]["step"]
    assert 0 < stop < SETTINGS.steps, "the signal should land mid-training"
    requeues = [e for e in events if e["event"] == "requeue"]
    assert [(r["method"], r["step"]) for r in requeues] == [("submitit", stop)]
    resumes = [e["step"] for e in events if e["event"] == "resume"]
    assert resumes == [None, stop], "the second run must resume from the checkpoint at the signal"
    assert len([e for e in events if e["event"] == "start"]) == 2


def test_local_executor_requeue_resumes_bit_identical(tmp_path: Path, reference: dict) -> None:
    jobdir = tmp_path / "job"
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="local")
    executor.update_parameters(timeout_min=5)
    job = executor.submit(FtkitCheckpointable(submitit_job.train, jobdir=jobdir), SETTINGS)
    try:
        pid = _wait_ready(jobdir)
        os.kill(pid, submitit_signal())  # LocalJob._interrupt() signals the controller, not the task
        result = job.result()
    finally:
        if job.state == "RUNNING":
            job.cancel()
        job._process.wait(timeout=30)  # reap the controller (leak check)
    _check_interrupted_run(jobdir, result, reference)
    out = job.stdout() or ""
    assert "Requeued job" in out, out[-3000:]


@pytest.mark.slurm
def test_slurm_executor_requeue_resumes_bit_identical(tmp_path: Path, reference: dict, slurm_jobs) -> None:
    jobdir = tmp_path / "job"
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, slurm_partition="low", cpus_per_task=1, mem_gb=1)
    job = executor.submit(FtkitCheckpointable(submitit_job.train, jobdir=jobdir), SETTINGS)
    job_id = int(job.job_id)
    slurm_jobs.job_ids.append(job_id)  # cancelled at teardown if still there
    _wait_ready(jobdir)
    # Without --batch the signal goes to the job steps: srun's python, where submitit
    # (--signal=USR2@N, no B:) expects it too.
    subprocess.run(["scancel", f"--signal={submitit_signal().name}", str(job_id)], check=True, timeout=30)
    slurm_jobs.start_now(job_id)  # skip the 121 s BeginTime of a requeued job
    info = slurm_jobs.wait_state(job_id, "COMPLETED", timeout=60)
    assert info["Restarts"] == "1", info
    result = job.result()  # the result pickle is there; no sacct needed
    _check_interrupted_run(jobdir, result, reference)


def test_jobdir_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTKIT_JOBDIR", raising=False)
    with pytest.raises(ConfigError, match="FTKIT_JOBDIR"):
        FtkitCheckpointable(submitit_job.train)


def test_checkpoint_resubmits_itself_and_pickles(tmp_path: Path) -> None:
    ckpt = FtkitCheckpointable(submitit_job.train, jobdir=tmp_path)
    delayed = ckpt.checkpoint(SETTINGS)
    assert delayed.function is ckpt and delayed.args == (SETTINGS,)
    again = cloudpickle.loads(cloudpickle.dumps(delayed))
    assert again.function.jobdir == tmp_path


class FakeSubmititHandler:
    """Stands in for submitit's SignalHandler: records how it was called."""

    def __init__(self, jobdir: Path) -> None:
        self.jobdir = jobdir
        self.env = SimpleNamespace(job_id="1", global_rank=0)
        self.bypassed: list[int] = []
        self.requeues: list[tuple] = []

    def bypass(self, signum, frame=None):
        self.bypassed.append(signum)

    def checkpoint_and_try_requeue(self, signum, frame=None):
        self.requeues.append((signum, frame, newest_checkpoint_step(self.jobdir / "checkpoints")))
        raise SystemExit(144)  # what submitit's local _requeue does


@pytest.mark.parametrize(
    ("in_loop", "after_loop", "requeued"),
    [
        (["PREEMPT"], [], True),
        (["PREEMPT", "TERM"], [], True),
        (["TERM"], [], False),
        (["TERM"], ["PREEMPT"], True),  # preemption: SIGTERM, then submitit's signal
    ],
)
def test_signal_handling_in_the_job(tmp_path: Path, in_loop, after_loop, requeued) -> None:
    """submitit's handlers never run as handlers (they would save and requeue from inside the
    handler); ftkit saves at the next step boundary; submitit's requeue is called afterwards
    from ordinary code, with the checkpoint durable; handlers are restored."""
    sig = submitit_signal()
    fake = FakeSubmititHandler(tmp_path)
    names = {"PREEMPT": sig, "TERM": signal.SIGTERM}

    def train(ft, n):
        for s in in_loop:
            os.kill(os.getpid(), names[s])
        result = submitit_job.train(ft, submitit_job.Settings(steps=n, step_time=0.0))
        for s in after_loop:
            os.kill(os.getpid(), names[s])
        return result

    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, fake.bypass),
           sig: signal.signal(sig, fake.checkpoint_and_try_requeue)}
    try:
        if requeued:
            with pytest.raises(SystemExit):
                FtkitCheckpointable(train, jobdir=tmp_path)(5)
        else:
            result = FtkitCheckpointable(train, jobdir=tmp_path)(5)
            assert result["completed"] is False and result["last_step"] == 0
        assert signal.getsignal(sig) == fake.checkpoint_and_try_requeue
        assert signal.getsignal(signal.SIGTERM) == fake.bypass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert fake.bypassed == []
    assert fake.requeues == ([(sig, None, 0)] if requeued else [])
    decision = next(e for e in _events(tmp_path) if e["event"] == "decision")
    assert decision["step"] == 0  # ft.range's check before the first step, which saves step 0
    assert [e["method"] for e in _events(tmp_path) if e["event"] == "requeue"] == (["submitit"] if requeued else [])


def test_outside_submitit_a_requeue_wish_returns_the_result(tmp_path: Path) -> None:
    def train(ft, n):
        os.kill(os.getpid(), submitit_signal())
        return submitit_job.train(ft, submitit_job.Settings(steps=n, step_time=0.0))

    result = FtkitCheckpointable(train, jobdir=tmp_path)(5)
    assert result["completed"] is False and result["last_step"] == 0


def test_a_signal_while_ftkit_starts_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between swapping submitit's handler out and ftkit's start only the recorder sees it."""
    import ftkit.integrations.submitit as integration

    class LateStart(integration.FaultTolerance):
        def start(self):
            if not self._started:
                os.kill(os.getpid(), submitit_signal())
            return super().start()

    monkeypatch.setattr(integration, "FaultTolerance", LateStart)
    result = FtkitCheckpointable(submitit_job.train, jobdir=tmp_path)(submitit_job.Settings(steps=5, step_time=0))
    assert result["completed"] is False and result["last_step"] == 0
    decision = next(e for e in _events(tmp_path) if e["event"] == "decision")
    assert decision["requeue"] is True and decision["reasons"] == [f"{submitit_signal().name} received while ftkit started"]


# --------------------------------------------------------------------------------------
# several tasks: one process group, set up before ftkit starts


def _wait_ranks_ready(jobdir: Path, ranks: int, timeout: float = 90.0) -> None:
    """Until every rank of the first run has done a step under ftkit's handlers."""
    wait_for(lambda: len({p.name.split("-")[1] for p in jobdir.glob("ready-*")}) >= ranks, timeout, interval=0.05,
             what=f"all {ranks} ranks to reach a step ({jobdir})")


@pytest.fixture(scope="module")
def dist_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The data-parallel trainer's uninterrupted run in one process (no group)."""
    return FtkitCheckpointable(submitit_dist_job.train, jobdir=tmp_path_factory.mktemp("dref"))(DIST_SETTINGS)


def _check_ranks(results: list[dict], reference: dict, ranks: int) -> None:
    assert reference["completed"] and reference["world_size"] == 1
    assert [r["rank"] for r in results] == list(range(ranks))
    for r in results:
        assert (r["world_size"], r["dist_world_size"]) == (ranks, ranks), r
        assert r["completed"] is True and r["last_step"] == DIST_SETTINGS.steps, r
        assert r["params_sha256"] == reference["params_sha256"], r


def test_local_executor_two_tasks_get_one_process_group(tmp_path: Path, dist_reference: dict) -> None:
    """distributed='auto' (the default): the helper initialises gloo before ftkit starts, so
    both tasks see world size 2 and one lease; fn never initialises the group itself."""
    jobdir = tmp_path / "job"
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="local")
    executor.update_parameters(timeout_min=5, nodes=1, tasks_per_node=2)
    job = executor.submit(FtkitCheckpointable(submitit_dist_job.train, jobdir=jobdir), DIST_SETTINGS)
    try:
        results = job.results()
    finally:
        if job.state == "RUNNING":
            job.cancel()
        job._process.wait(timeout=30)
    _check_ranks(results, dist_reference, 2)
    events = _events(jobdir)
    assert not [e for e in events if e["event"] == "lease-refused"]
    assert sorted((e["rank"], e["world_size"]) for e in events if e["event"] == "start") == [(0, 2), (1, 2)]


def test_a_function_that_initialises_the_group_itself_is_told_what_to_change(tmp_path: Path) -> None:
    """fn calls init_process_group as the docs once said, after FtkitCheckpointable did: the job
    fails with what to remove or pass, not with torch's "initialize ... twice"."""
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="local")
    executor.update_parameters(timeout_min=5, nodes=1, tasks_per_node=2)
    job = executor.submit(FtkitCheckpointable(submitit_dist_job.train_initialising_the_group,
                                              jobdir=tmp_path / "job"), DIST_SETTINGS)
    try:
        with pytest.raises(Exception, match=r"remove the function's init_process_group call"):
            job.results()
    finally:
        if job.state == "RUNNING":
            job.cancel()
        job._process.wait(timeout=30)


@pytest.mark.slurm
def test_slurm_two_nodes_requeue_resumes_bit_identical(tmp_path: Path, dist_reference: dict,
                                                       slurm_multinode, slurm_jobs) -> None:
    """docs/submitit.md's recipe with nodes=2: gloo across the emulated nodes, submitit's
    signal to both ranks, one agreed save, rank 0 requeues, both ranks resume."""
    jobdir = tmp_path / "job"
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, slurm_partition="low", nodes=2, tasks_per_node=1,
                               cpus_per_task=1, mem_gb=1)
    job = executor.submit(FtkitCheckpointable(submitit_dist_job.train, jobdir=jobdir), DIST_SETTINGS)
    job_id = int(job.job_id)
    slurm_jobs.job_ids.append(job_id)
    _wait_ranks_ready(jobdir, 2)
    subprocess.run(["scancel", f"--signal={submitit_signal().name}", str(job_id)], check=True, timeout=30)
    slurm_jobs.start_now(job_id)
    info = slurm_jobs.wait_state(job_id, "COMPLETED", timeout=90)
    assert info["Restarts"] == "1" and info["NumNodes"] == "2", info
    _check_ranks(job.results(), dist_reference, 2)
    events = _events(jobdir)
    assert not [e for e in events if e["event"] == "lease-refused"]
    starts = [(e["rank"], e["world_size"], e["restart_count"]) for e in events if e["event"] == "start"]
    assert sorted(starts) == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    decisions = [e for e in events if e["event"] == "decision"]
    assert {e["step"] for e in decisions} == {decisions[0]["step"]} and decisions[0]["requeue"] is True
    requeues = [(e["rank"], e["method"], e["requeue"]) for e in events if e["event"] == "requeue"]
    # rank 0's `scontrol requeue` (submitit's) requeues the job; once in a CI run it was answered
    # "Job is pending execution", the job being requeued already, which ftkit records as SLURM's
    # requeue: either way one requeue, by rank 0, and the run below resumes from the agreed step
    assert requeues in ([(0, "submitit", True)], [(0, "slurm", True)]), requeues
    assert [e["step"] for e in events if e["event"] == "resume" and e["rank"] == 0] == [None, decisions[0]["step"]]


@pytest.fixture
def two_submitit_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process looks like rank 0 of a two-task job of submitit's local executor."""
    for key, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "2",
                       "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
                       "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)


def test_several_tasks_without_a_group_are_refused_before_the_lease(tmp_path: Path, two_submitit_tasks) -> None:
    called = []
    helper = FtkitCheckpointable(lambda ft: called.append(ft), jobdir=tmp_path / "job", distributed=None)
    with pytest.raises(ConfigError, match=r"runs 2 tasks, but torch.distributed is not initialised.*distributed='auto'"):
        helper()
    assert called == []
    assert not (tmp_path / "job" / "lease.json").exists()


@pytest.mark.parametrize("bad", ["", "  ", 2, True])
def test_distributed_must_be_a_backend_name_or_none(tmp_path: Path, bad) -> None:
    with pytest.raises(ConfigError, match=r"distributed=\.\.\.\): expected 'auto'"):
        FtkitCheckpointable(submitit_job.train, jobdir=tmp_path, distributed=bad)


_HOLDER = """
import sys
from ftkit.events import EventLog
from ftkit.jobdir import JobDir
from ftkit.lease import Lease, LeaseConfig
job = JobDir.of(sys.argv[1]).ensure()
lease = Lease(job, LeaseConfig(), events=EventLog(job.events), job_id="4242", restart_count=0)
lease.acquire()
print("held", flush=True)
sys.stdin.read()
lease.release()
"""


def test_lease_refusal_names_another_task_of_the_same_run(tmp_path: Path) -> None:
    """Two tasks of one SLURM job that both see world size 1 (no process group): the refused
    one is told it is the same run, and why, not 'in use by another run'."""
    job = JobDir.of(tmp_path / "job").ensure()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(job.root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lease = Lease(job, LeaseConfig(), events=EventLog(job.events), job_id="4242", restart_count=0)
        with pytest.raises(JobDirBusyError) as refused:
            lease.acquire()
    finally:
        holder.communicate("", timeout=30)
    message = str(refused.value)
    assert "in use by another task of this same run: SLURM job 4242 (restart 0)" in message
    assert "Both see world size 1" in message and "torch.distributed was not initialised" in message
    assert "another run" not in message
    assert holder.returncode == 0


# --------------------------------------------------------------------------------------
# SLURM requeued the job itself (preemption) before submitit's `scontrol requeue`


class RefusedRequeue(FakeSubmititHandler):
    """submitit's handler on SLURM where `scontrol requeue` fails (exit 1)."""

    def __init__(self, jobdir: Path) -> None:
        super().__init__(jobdir)
        self.env = SimpleNamespace(job_id="41", global_rank=0)
        self.exited = False

    def checkpoint_and_try_requeue(self, signum, frame=None):
        self.requeues.append((signum, frame, newest_checkpoint_step(self.jobdir / "checkpoints")))
        raise subprocess.CalledProcessError(1, ["scontrol", "requeue", "41"])

    def _exit(self):
        self.exited = True
        sys.exit(-1)


def _no_budget():
    """Config without the time budget: the fake SLURM_JOB_ID must not send it to scontrol."""
    import dataclasses

    from ftkit.control.controller import Config
    from ftkit.triggers.budget import BudgetConfig

    return dataclasses.replace(Config(), budget=BudgetConfig(enabled=False))


@pytest.mark.parametrize(
    ("job_line", "how"),
    [
        ("JobId=41 JobState=PENDING Reason=BeginTime Restarts=1", "JobState=PENDING"),
        ("JobId=41 JobState=COMPLETING Reason=None Restarts=1", "Restarts=1 > SLURM_RESTART_COUNT=0"),
        ("JobId=41 JobState=RUNNING Reason=None Restarts=0", None),
    ],
)
def test_a_refused_scontrol_requeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_line, how) -> None:
    """"Job is pending execution": SLURM requeued the job already, so it counts as requeued
    (the event says by whom); a refusal for a job SLURM did not requeue still raises."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    asked: list[list[str]] = []

    def scontrol(args, timeout=10):
        asked.append(list(args))
        return job_line + "\n"

    monkeypatch.setattr("ftkit.slurm.env.run_scontrol", scontrol)
    sig = submitit_signal()
    fake = RefusedRequeue(tmp_path)

    def train(ft, n):
        os.kill(os.getpid(), sig)
        return submitit_job.train(ft, submitit_job.Settings(steps=n, step_time=0.0))

    old = signal.signal(sig, fake.checkpoint_and_try_requeue)
    try:
        with pytest.raises(SystemExit if how else subprocess.CalledProcessError):
            FtkitCheckpointable(train, jobdir=tmp_path, config=_no_budget())(5)
    finally:
        signal.signal(sig, old)
    assert asked == [["show", "job", "-o", "41"]]
    assert fake.exited is bool(how)
    assert [r[2] for r in fake.requeues] == [0]  # asked once, with the checkpoint durable
    (event,) = [e for e in _events(tmp_path) if e["event"] == "requeue"]
    if how:
        assert (event["requeue"], event["method"]) == (True, "slurm")
        assert event["detail"] == f"`scontrol requeue` was refused, but SLURM had requeued the job already ({how})"
    else:
        assert (event["requeue"], event["method"]) == (False, "submitit")
        assert "scontrol" in event["error"] and "returned non-zero exit status 1" in event["error"]


@pytest.mark.slurm
def test_slurm_preemption_requeued_by_slurm_before_submitit(tmp_path: Path, slurm_jobs) -> None:
    """The trial's race, for real: a job in `low` is preempted by one in `high`
    (PreemptMode=REQUEUE, GraceTime, preempt_send_user_signal). SLURM signals it, and once
    the grace time is over requeues it itself, while the step still runs; ftkit saves at the
    step's end, and submitit's `scontrol requeue` is refused ("Job is pending execution").
    That counts as requeued: the job runs again and completes."""
    jobdir = tmp_path / "job"
    settings = submitit_dist_job.Settings(steps=6, step_time=0.05)
    reference = FtkitCheckpointable(submitit_dist_job.train, jobdir=tmp_path / "ref")(settings)
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, slurm_partition="low", cpus_per_task=1, mem_gb=1)
    job = executor.submit(FtkitCheckpointable(submitit_dist_job.train, jobdir=jobdir), settings)
    job_id = int(job.job_id)
    slurm_jobs.job_ids.append(job_id)
    _wait_ranks_ready(jobdir, 1)
    (jobdir / "hold").touch()  # the job stays inside its step until SLURM has requeued it
    node = slurm_jobs.job_info(job_id)["NodeList"]
    out = subprocess.run(["sbatch", "--parsable", "--partition=high", f"--nodelist={node}", "--exclusive",
                          f"--output={tmp_path / 'high.out'}", "--wrap", "sleep 1"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    slurm_jobs.job_ids.append(int(out.strip().split(";")[0]))
    def requeued_by_slurm() -> bool:  # GraceTime (20 s on the test cluster), then SLURM requeues the job itself
        info = slurm_jobs.job_info(job_id)
        return info["Restarts"] == "1" or info["JobState"] in ("PENDING", "REQUEUED")

    wait_for(requeued_by_slurm, 90, interval=0.2, what=f"SLURM to preempt and requeue job {job_id}")
    (jobdir / "hold").unlink()
    slurm_jobs.start_now(job_id)
    info = slurm_jobs.wait_state(job_id, "COMPLETED", timeout=120)
    assert info["Restarts"] == "1", info
    (result,) = job.results()
    assert result["completed"] is True and result["params_sha256"] == reference["params_sha256"]
    events = _events(jobdir)
    (decision,) = [e for e in events if e["event"] == "decision"]
    assert decision["requeue"] is True and f"{submitit_signal().name} received" in decision["reasons"]
    (requeue,) = [e for e in events if e["event"] == "requeue"]
    assert (requeue["requeue"], requeue["method"], requeue["step"]) == (True, "slurm", decision["step"]), requeue
    assert "`scontrol requeue` was refused, but SLURM had requeued the job already" in requeue["detail"]
    assert [e["step"] for e in events if e["event"] == "resume"] == [None, decision["step"]]
