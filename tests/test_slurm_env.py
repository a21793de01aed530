"""The SLURM environment and `scontrol show job -o` parsing (no cluster needed)."""

from __future__ import annotations

import subprocess
from datetime import datetime

import pytest

from ftkit.errors import SlurmError
from ftkit.slurm import env as slurm_env
from ftkit.slurm.env import (
    SlurmEnv,
    job_end_time,
    job_info,
    parse_job_line,
    run_scontrol,
)

# `scontrol show job -o 4242` on SLURM 22.05: task 7 of array 4235, running, a batch
# script called with arguments (Command= has spaces and '='), a Comment with spaces.
RUNNING = (
    "JobId=4242 ArrayJobId=4235 ArrayTaskId=7 JobName=train llama UserId=alice(1001) "
    "GroupId=alice(1001) MCS_label=N/A Priority=4294901720 Nice=0 Account=proj QOS=normal "
    "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=2 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 RunTime=00:12:31 TimeLimit=04:00:00 TimeMin=N/A "
    "SubmitTime=2024-03-01T09:58:02 EligibleTime=2024-03-01T09:58:03 "
    "AccrueTime=2024-03-01T09:58:03 StartTime=2024-03-01T10:00:00 "
    "EndTime=2024-03-01T14:00:00 Deadline=N/A PreemptEligibleTime=2024-03-01T10:00:00 "
    "PreemptTime=None SuspendTime=None SecsPreSuspend=0 LastSchedEval=2024-03-01T10:00:00 "
    "Scheduler=Backfill Partition=gpu AllocNode:Sid=login1:28814 ReqNodeList=(null) "
    "ExcNodeList=(null) NodeList=gpu[01-02] BatchHost=gpu01 NumNodes=2 NumCPUs=32 "
    "NumTasks=8 CPUs/Task=4 ReqB:S:C:T=0:0:*:* TRES=cpu=32,mem=256G,node=2,billing=32,gres/gpu=8 "
    "Socks/Node=* NtasksPerN:B:S:C=4:0:*:* CoreSpec=* MinCPUsNode=16 MinMemoryNode=128G "
    "MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 "
    "Licenses=(null) Network=(null) Command=/home/alice/run.sh --config cfg/llama 7b.yaml "
    "--lr=3e-4 WorkDir=/home/alice/exp Comment=sweep 3 of 8 (lr 3e-4) "
    "StdErr=/home/alice/exp/slurm-4235_7.out StdIn=/dev/null "
    "StdOut=/home/alice/exp/slurm-4235_7.out Power= TresPerNode=gres:gpu:4 "
)
# The same array's task 8, still pending: EndTime Unknown, a Reason with spaces.
PENDING = (
    "JobId=4243 ArrayJobId=4235 ArrayTaskId=8 JobName=train llama UserId=alice(1001) "
    "GroupId=alice(1001) MCS_label=N/A Priority=4294901719 Nice=0 Account=proj QOS=normal "
    "JobState=PENDING Reason=launch failed requeued held Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=04:00:00 "
    "TimeMin=N/A SubmitTime=2024-03-01T09:58:02 EligibleTime=Unknown AccrueTime=Unknown "
    "StartTime=Unknown EndTime=Unknown Deadline=N/A Partition=gpu "
    "Command=/home/alice/run.sh --config cfg/llama 7b.yaml --lr=3e-4 WorkDir=/home/alice/exp "
    "Power= "
)


def runner_for(*lines: str):
    calls: list[list[str]] = []

    def runner(args):
        calls.append(list(args))
        return "".join(line + "\n" for line in lines)

    runner.calls = calls
    return runner


def test_parse_job_line_keeps_values_with_spaces_and_equals():
    info = parse_job_line(RUNNING)
    assert info["JobId"] == "4242"
    assert info["JobName"] == "train llama"
    assert (info["ArrayJobId"], info["ArrayTaskId"]) == ("4235", "7")
    assert info["Command"] == "/home/alice/run.sh --config cfg/llama 7b.yaml --lr=3e-4"
    assert info["Comment"] == "sweep 3 of 8 (lr 3e-4)"
    assert info["TRES"] == "cpu=32,mem=256G,node=2,billing=32,gres/gpu=8"
    assert info["AllocNode:Sid"] == "login1:28814"
    assert info["CPUs/Task"] == "4"
    assert info["NtasksPerN:B:S:C"] == "4:0:*:*"
    assert info["Power"] == ""
    assert info["TresPerNode"] == "gres:gpu:4"
    assert info["Restarts"] == "2"
    assert parse_job_line(PENDING)["Reason"] == "launch failed requeued held"


def test_job_end_time_is_local_time():
    runner = runner_for(RUNNING)
    expected = datetime(2024, 3, 1, 14, 0, 0).timestamp()  # naive = local, like scontrol
    assert job_end_time(4242, runner=runner) == expected
    assert runner.calls == [["show", "job", "-o", "4242"]]


def test_job_end_time_unknown_is_none():
    assert job_end_time("4243", runner=runner_for(PENDING)) is None


def test_array_master_id_picks_its_own_line():
    # `scontrol show job -o 4243` lists nothing else, but a master id lists every task
    runner = runner_for(PENDING, RUNNING)
    assert job_info("4242", runner=runner)["ArrayTaskId"] == "7"
    assert job_info("4235", runner=runner)["JobId"] == "4243"  # no exact line: the first


def test_no_job_in_output_is_a_slurm_error():
    with pytest.raises(SlurmError, match="printed no job"):
        job_info("1", runner=runner_for("No jobs in the system"))
    with pytest.raises(SlurmError, match="EndTime"):
        job_end_time("1", runner=runner_for("JobId=1 JobState=RUNNING"))


def test_from_env_array_task():
    env = SlurmEnv.from_env(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_ARRAY_JOB_ID": "4235",
            "SLURM_ARRAY_TASK_ID": "7",
            "SLURM_RESTART_COUNT": "2",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NAME": "train llama",
            "SLURM_SUBMIT_DIR": "/home/alice/exp",
            "SLURM_JOB_PARTITION": "gpu",
        }
    )
    assert env == SlurmEnv(
        job_id="4242",
        array_job_id="4235",
        array_task_id="7",
        restart_count=2,
        procid=5,
        localid=1,
        nodeid=1,
        ntasks=8,
        nnodes=2,
        job_name="train llama",
        submit_dir="/home/alice/exp",
        partition="gpu",
    )
    assert env.in_slurm
    assert env.requeue_target == "4235_7"


def test_from_env_plain_job_and_outside_slurm():
    env = SlurmEnv.from_env({"SLURM_JOBID": "77", "SLURM_NNODES": "1", "SLURM_PROCID": "x"})
    assert (env.job_id, env.nnodes, env.procid, env.restart_count) == ("77", 1, None, 0)
    assert env.requeue_target == "77"
    outside = SlurmEnv.from_env({})
    assert not outside.in_slurm and outside.requeue_target is None
    assert outside.restart_count == 0


def test_missing_scontrol_is_a_slurm_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(SlurmError, match="scontrol is missing") as err:
        run_scontrol(["show", "job", "-o", "1"])
    assert "scontrol show job -o 1" in str(err.value)


def test_failing_scontrol_reports_command_and_stderr(monkeypatch):
    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, "", "slurm_load_jobs error: Invalid job id specified\n"
        )

    monkeypatch.setattr(slurm_env.subprocess, "run", fake_run)
    with pytest.raises(
        SlurmError,
        match=r"`scontrol show job -o 99` failed \(exit 1\): slurm_load_jobs error: Invalid job id",
    ):
        job_info(99)


def test_scontrol_timeout_is_a_slurm_error(monkeypatch):
    def fake_run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(slurm_env.subprocess, "run", fake_run)
    with pytest.raises(SlurmError, match="did not answer within 3 s"):
        run_scontrol(["ping"], timeout=3)
