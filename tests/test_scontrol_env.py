"""scontrol runs with SLURM_TIME_FORMAT=standard, whatever the user's environment says."""

from __future__ import annotations

import os
import re
import subprocess
from datetime import datetime

from ftkit.slurm.env import job_end_time, job_info, run_scontrol


def test_real_scontrol_end_time_under_relative_time_format(slurm_jobs, monkeypatch):
    job = slurm_jobs.submit("sleep 60", "--time=5")
    standard = slurm_jobs.wait_state(job, {"RUNNING"}, timeout=30)["EndTime"]
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    # what the user's scontrol prints: the time of day only, which ftkit cannot read
    raw = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    assert re.search(r"\bEndTime=\d\d:\d\d:\d\d\s", raw), raw
    assert job_end_time(job) == datetime.strptime(standard, "%Y-%m-%dT%H:%M:%S").timestamp()
    assert job_info(job)["StartTime"].startswith(standard[:4] + "-")  # every time, not only EndTime
    assert os.environ["SLURM_TIME_FORMAT"] == "relative"  # the user's environment is left alone


def test_scontrol_gets_standard_time_format_and_the_rest_of_the_environment(tmp_path, monkeypatch):
    """A stand-in scontrol on PATH that prints what SLURM would for the format it is given."""
    fake = tmp_path / "scontrol"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$SLURM_TIME_FORMAT" = standard ]; then end=2024-03-01T14:00:00; else end=14:00:00; fi\n'
        'echo "JobId=7 JobState=RUNNING EndTime=$end Comment=$FTKIT_TEST_MARK"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    monkeypatch.setenv("FTKIT_TEST_MARK", "kept")
    assert job_end_time(7) == datetime(2024, 3, 1, 14).timestamp()
    assert "Comment=kept" in run_scontrol(["show", "job", "-o", "7"])
    assert os.environ["SLURM_TIME_FORMAT"] == "relative"
