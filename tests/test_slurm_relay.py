"""A real sbatch job using ftkit: `scancel --signal=USR1 --batch` reaches the training
process through the batch script's relay, and the events log shows the decision."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ftkit.events import read_events
from tests.conftest import wait_for

PROGRAM = Path(__file__).parent / "programs" / "check_loop.py"

# The relay a batch script needs: the step runs in the background (bash runs traps only
# between foreground commands), the USR1 trap writes a request file in the shared job dir
# (reaches every rank on every node, whatever the launcher) and, where it is faster, also
# forwards the signal to the child directly.
RELAY = """#!/bin/bash
#SBATCH --job-name=ftkit-relay
#SBATCH --output={jobdir}/slurm-%j.out
#SBATCH --time=5
JOBDIR={jobdir}
{python} {program} "$JOBDIR" 100000 0.01 &
PID=$!
relay() {{
    {direct}
    {python} -m ftkit request requeue "$JOBDIR" --reason "SIGUSR1 relayed by the batch script"
}}
trap relay USR1
while kill -0 $PID 2>/dev/null; do wait $PID; done  # a trap interrupts wait: wait again
wait $PID; rc=$?
echo "trainer exited with $rc"
exit $rc
"""


@pytest.mark.slurm
@pytest.mark.parametrize("direct", [False, True], ids=["request-file", "request-file+kill"])
def test_scancel_usr1_batch_reaches_trainer_through_relay(slurm_jobs, tmp_path: Path, direct: bool) -> None:
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    script = RELAY.format(jobdir=jobdir, python=sys.executable, program=PROGRAM,
                          direct='kill -USR1 "$PID"' if direct else ":")
    job = slurm_jobs.submit(script)
    slurm_jobs.wait_state(job, {"RUNNING"}, timeout=60)
    wait_for(lambda: (jobdir / "ready-rank0").exists(), 60, what="trainer ready inside the job")
    slurm_jobs.signal(job, "USR1", batch=True)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=60)
    assert info["ExitCode"] == "0:0"
    out = (jobdir / f"slurm-{job}.out").read_text()
    assert "trainer exited with 0" in out

    decisions = [json.loads(line) for line in (jobdir / "decisions-rank0.jsonl").read_text().splitlines()]
    assert len(decisions) == 1
    d = decisions[0]
    assert d["action"] == "SAVE_EXIT" and d["requeue"] is True
    events = list(read_events(jobdir / "events.jsonl"))
    start = next(e for e in events if e["event"] == "start")
    assert start["job_id"] == str(job)
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["step"] == d["step"]
    if direct:  # the direct signal is faster than the request file; either way one decision
        assert "signal" in decision["sources"] and set(decision["sources"]) <= {"request", "signal"}
    else:
        assert decision["sources"] == ["request"]
        assert any("relayed by the batch script" in r for r in decision["reasons"])
