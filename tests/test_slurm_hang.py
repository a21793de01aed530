"""The hang watchdog under SLURM: a trainer that hangs is ended (exit 87), and ``ftkit requeue``
treats the hang like a crash: requeued after progress, not when it hangs again at the same step.

The trainer is ``tests/programs/hang_train.py`` run by the ``single`` template; environment
variables make it block forever inside a chosen step (see that program's docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftkit.errors import EXIT_HANG
from tests.test_slurm_e2e import events, output, results, submit_template, wait_requeued

pytestmark = pytest.mark.slurm

PROGRAM = Path(__file__).resolve().parent / "programs" / "hang_train.py"
STEPS, SAVE_EVERY, HANG_STEP = 60, 10, 25  # saves at 10 and 20, then step 25 blocks forever


def hang_job(slurm_jobs, tmp_path: Path, **env: str) -> tuple[int, Path]:
    command = (f'"$PYTHON" {PROGRAM} "$JOBDIR" --steps {STEPS} --step-time 0.05 '
               f"--save-every {SAVE_EVERY}")
    return submit_template(slurm_jobs, tmp_path, "single", command=command, env={
        "FTKIT_HANG_TIMEOUT": "3", "FTKIT_TEST_HANG_STEP": str(HANG_STEP), **env})


def test_a_job_that_hangs_once_is_requeued_and_completes(slurm_jobs, tmp_path) -> None:
    job, jobdir = hang_job(slurm_jobs, tmp_path, FTKIT_TEST_HANG_ONCE="1")
    wait_requeued(slurm_jobs, job)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=180)
    assert info["Restarts"] == "1"
    (hang,) = events(jobdir, "hang")
    assert hang["step"] == HANG_STEP - 1 and hang["rank"] == 0
    assert "_deadlock" in Path(hang["file"]).read_text()  # the blocking frame is in the stack dump
    first, last = events(jobdir, "requeue")
    assert first["requeue"] is True and first["cause"] == "hang", first
    assert last["requeue"] is False
    out = output(tmp_path, job)
    assert "hung: the hang watchdog found rank 0 on" in out and f"after step {HANG_STEP - 1}" in out, out[-3000:]
    # the second run resumed from the newest checkpoint before the hang and finished
    assert [e["step"] for e in events(jobdir, "resume")] == [None, 20]
    assert results(jobdir, 1)[0] == {"rank": 0, "last_step": STEPS, "completed": True}


def test_a_job_that_hangs_at_the_same_step_twice_stops_requeueing(slurm_jobs, tmp_path) -> None:
    job, jobdir = hang_job(slurm_jobs, tmp_path)  # every run blocks in step 25
    wait_requeued(slurm_jobs, job)
    info = slurm_jobs.wait_state(job, {"FAILED", "COMPLETED"}, timeout=180)
    assert info["Restarts"] == "1" and info["ExitCode"].startswith(f"{EXIT_HANG}:"), info
    assert [h["step"] for h in events(jobdir, "hang")] == [HANG_STEP - 1, HANG_STEP - 1]
    first, second = events(jobdir, "requeue")
    assert first["requeue"] is True and first["cause"] == "hang"
    assert second["requeue"] is False and second["cause"] == "hang", second
    assert f"hung again at step {HANG_STEP - 1} without a newer checkpoint" in second["reason"]
    out = output(tmp_path, job)
    assert f"not requeued: hung again at step {HANG_STEP - 1}" in out, out[-3000:]
