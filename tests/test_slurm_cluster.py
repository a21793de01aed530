"""The local SLURM cluster behaves the way ftkit relies on (scripts/slurm-cluster).

These run real jobs: with the cluster down they skip, or fail under FTKIT_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slurm

# Wait in short slices so bash runs traps promptly (a trap fires when the
# foreground command returns).
LOOP = "for i in $(seq 1 300); do sleep 1 & wait $!; done"


def test_job_runs_and_completes(slurm_jobs):
    job = slurm_jobs.submit(
        'echo "hello from $SLURM_JOB_ID on $SLURM_JOB_PARTITION"',
        "-o",
        "out-%j.txt",
        "-J",
        "ftkit-smoke",
    )
    info = slurm_jobs.wait_state(job, "COMPLETED", timeout=30)
    assert info["ExitCode"] == "0:0"
    assert info["Partition"] == "low"  # the default partition
    out = slurm_jobs.workdir / f"out-{job}.txt"
    assert out.read_text().strip() == f"hello from {job} on low"


def test_usr1_to_batch_shell_reaches_trap(slurm_jobs):
    script = f"""
trap 'echo "got USR1"; exit 0' USR1
echo ready
{LOOP}
echo "no signal"
exit 3
"""
    job = slurm_jobs.submit(script, "-o", "sig-%j.txt")
    out = slurm_jobs.workdir / f"sig-{job}.txt"
    slurm_jobs.wait_state(job, "RUNNING", timeout=30)
    slurm_jobs.wait_file_contains(out, "ready", timeout=15)  # trap is installed
    slurm_jobs.signal(job, "USR1", batch=True)
    slurm_jobs.wait_file_contains(out, "got USR1", timeout=15)
    info = slurm_jobs.wait_state(job, "COMPLETED", timeout=20)
    assert info["ExitCode"] == "0:0"


def test_requeue_then_start_now_reruns_job(slurm_jobs):
    script = f"""
echo "run restart=${{SLURM_RESTART_COUNT:-0}}"
{LOOP}
"""
    job = slurm_jobs.submit(script, "--requeue", "--open-mode=append", "-o", "rq-%j.txt")
    out = slurm_jobs.workdir / f"rq-{job}.txt"
    slurm_jobs.wait_state(job, "RUNNING", timeout=30)
    slurm_jobs.wait_file_contains(out, "run restart=0", timeout=15)

    slurm_jobs.requeue(job)
    info = slurm_jobs.wait_state(job, "PENDING", timeout=20)
    assert info["Restarts"] == "1"
    slurm_jobs.start_now(job)  # else BeginTime is ~2 minutes away
    slurm_jobs.wait_state(job, "RUNNING", timeout=20)
    text = slurm_jobs.wait_file_contains(out, "run restart=1", timeout=15)
    assert text.count("run restart=") == 2


def test_high_partition_preempts_low_with_user_signal(slurm_cluster, slurm_jobs):
    # The low job is told by its --signal (sent at preemption time because of
    # preempt_send_user_signal) and requeues itself, as ftkit's handler does.
    low_script = f"""
trap 'echo "got USR1"; scontrol requeue $SLURM_JOB_ID; exit 0' USR1
echo "low restart=${{SLURM_RESTART_COUNT:-0}}"
{LOOP}
"""
    low = slurm_jobs.submit(
        low_script,
        "-p",
        "low",
        "--requeue",
        "--signal=B:USR1@10",
        "--open-mode=append",
        "-o",
        "low-%j.txt",
    )
    low_out = slurm_jobs.workdir / f"low-{low}.txt"
    info = slurm_jobs.wait_state(low, "RUNNING", timeout=30)
    slurm_jobs.wait_file_contains(low_out, "low restart=0", timeout=15)

    # all CPUs of the low job's node (on a multi-node cluster the others are free)
    high = slurm_jobs.submit(
        "echo high ran", "-p", "high", "-N", "1", "-n", str(slurm_cluster.cpus), "-w", info["NodeList"],
        "-o", "high-%j.txt"
    )
    slurm_jobs.wait_file_contains(low_out, "got USR1", timeout=20)
    # Normally a few seconds; a foreign job running in `low` that does not
    # requeue itself holds the node for GraceTime (20 s) rounded up to
    # slurmctld's 30 s time-limit sweep, plus KillWait.
    info = slurm_jobs.wait_state(high, "COMPLETED", timeout=75)
    assert info["ExitCode"] == "0:0"
    info = slurm_jobs.wait_state(low, "PENDING", timeout=20)
    assert info["Restarts"] == "1"
    slurm_jobs.start_now(low)
    slurm_jobs.wait_file_contains(low_out, "low restart=1", timeout=20)


def test_srun_spans_emulated_nodes_that_resolve_locally(slurm_multinode, slurm_jobs):
    """`up --nodes 3`: one task per node, each started by that node's slurmd, and the
    first node's name (MASTER_ADDR in the templates) resolves to this host."""
    script = """
MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "master $MASTER $(getent hosts "$MASTER" | awk '{print $1}')"
srun --ntasks-per-node=1 bash -c 'echo "task $SLURM_PROCID on $SLURMD_NODENAME"'
"""
    job = slurm_jobs.submit(script, "-N", "3", "-o", "span-%j.txt")
    info = slurm_jobs.wait_state(job, "COMPLETED", timeout=60)
    assert info["NodeList"] == "n[1-3]" and info["ExitCode"] == "0:0"
    lines = (slurm_jobs.workdir / f"span-{job}.txt").read_text().splitlines()
    assert "master n1 127.0.0.1" in lines
    assert sorted(ln for ln in lines if ln.startswith("task")) == [
        "task 0 on n1", "task 1 on n2", "task 2 on n3"]
