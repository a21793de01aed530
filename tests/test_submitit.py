"""ftkit.integrations.submitit: a submitit job saves through ftkit at a step boundary when
submitit's preemption signal arrives, is requeued by submitit's own path, resumes, and ends
with the same parameters as an uninterrupted run. Local executor and the real SLURM cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import pytest
import submitit

from ftkit.errors import ConfigError
from ftkit.integrations.submitit import FtkitCheckpointable, submitit_signal
from ftkit.slurm.requeue import newest_checkpoint_step
from tests.programs import submitit_job

cloudpickle.register_pickle_by_value(submitit_job)  # the job needs no `tests` on its path

SETTINGS = submitit_job.Settings(steps=60, step_time=0.05)


def _wait_ready(jobdir: Path, timeout: float = 60.0) -> int:
    """Pid of the first run once it has done a step under ftkit's handlers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(jobdir.glob("ready-*"))
        if found:
            return int(found[0].name.split("-", 1)[1])
        time.sleep(0.05)
    raise AssertionError(f"no run of the job reached a step within {timeout:.0f} s ({jobdir})")


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
