"""Jobs that span nodes, on the local multi-node cluster (``scripts/slurm-cluster up --nodes 3``).

The nodes n1..n3 are emulated: one ``slurmd -N nX`` each on this host, names resolving to
127.0.0.1, so the ranks of a 2-node job talk gloo over 127.0.0.1 exactly as on separate
machines, and killing a node's slurmd with everything under it is a node death to SLURM.
With the cluster missing these skip, or fail under FTKIT_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.slurm_fixtures import SlurmError, hostnames, node_state
from tests.test_slurm_e2e import (
    STEPS,
    assert_resumed_exactly,
    events,
    output,
    results,
    submit_template,
    wait_progress,
    wait_requeued,
)

pytestmark = pytest.mark.slurm

WORLD = 2  # 2 nodes x 1 process


def command(template: str, *extra: str, steps: int = STEPS, step_time: float = 0.02, save_every: int = 0) -> str:
    """The demo trainer; torchrun starts ``-m module args`` in each worker, srun a whole command."""
    args = (f'-m ftkit demo --no-live --jobdir "$JOBDIR" --steps {steps} --step-time {step_time} '
            f"--save-every {save_every} " + " ".join(extra)).strip()
    return args if template == "torchrun" else f'"$PYTHON" {args}'


def two_node_job(slurm_jobs, tmp_path: Path, template: str, *sbatch_args: str, cmd: str | None = None,
                 **values) -> tuple[int, Path]:
    """Submit ``template`` on 2 nodes, one training process each."""
    per_node = {"nproc_per_node": 1} if template == "torchrun" else {"ntasks_per_node": 1}
    settings = {"nodes": WORLD, "cpus_per_task": 1, "command": cmd or command(template), **per_node, **values}
    return submit_template(slurm_jobs, tmp_path, template, *sbatch_args, **settings)


def nodes_of(info: dict[str, str]) -> list[str]:
    return hostnames(info["NodeList"])


@pytest.fixture
def reference2(reference_sha) -> str:
    """Final parameters of an uninterrupted 2-rank run (no SLURM; shared with test_slurm_e2e)."""
    return reference_sha(WORLD)


def requeued_then_started(slurm_jobs, job: int, timeout: float = 120) -> None:
    """Wait until SLURM put the job back in the queue (Restarts >= 1); if it waits for its
    BeginTime (~2 min after a requeue), make it eligible now. After a preemption SLURM may
    start it again at once, before we see it PENDING."""
    # not COMPLETING: right after the requeue the job is COMPLETING with Restarts already 1
    info = slurm_jobs.wait_state(job, {"PENDING", "RUNNING", "COMPLETED"}, timeout=timeout,
                                 where=lambda i: int(i.get("Restarts", "0")) >= 1)
    if info["JobState"] == "PENDING":
        try:
            slurm_jobs.start_now(job)
        except (SlurmError, AssertionError):  # it started meanwhile
            if slurm_jobs.job_state(job) == "PENDING":
                raise


def listing(jobdir: Path) -> list[dict]:
    return json.loads(subprocess.run([sys.executable, "-m", "ftkit", "ls", "--json", str(jobdir)],
                                     check=True, capture_output=True, text=True).stdout)


TEMPLATES = ["torchrun", "srun"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_usr1_two_nodes_save_the_same_step_requeue_and_resume_bit_identical(
        slurm_multinode, slurm_jobs, tmp_path, reference2, template) -> None:
    job, jobdir = two_node_job(slurm_jobs, tmp_path, template)
    info = slurm_jobs.wait_state(job, {"RUNNING"}, timeout=60)
    assert info["NumNodes"] == "2" and len(nodes_of(info)) == 2, info
    wait_progress(tmp_path, job)
    slurm_jobs.signal(job, "USR1", batch=True)
    wait_requeued(slurm_jobs, job)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=150)
    assert info["Restarts"] == "1"
    out = output(tmp_path, job)
    assert "ftkit requeue: requeued job" in out and "training completed" in out
    exits = assert_resumed_exactly(jobdir, WORLD, reference2)  # both ranks decided SAVE_EXIT at one step
    assert all(d["requeue"] is True for d in exits)
    assert [r["requeue"] for r in events(jobdir, "requeue")] == [True, False]
    assert {e["world_size"] for e in events(jobdir, "start")} == {WORLD}
    # the report sees both runs, and the requeued one's restart cost by component
    report = json.loads(subprocess.run([sys.executable, "-m", "ftkit", "report", "--json", str(jobdir)],
                                       check=True, capture_output=True, text=True).stdout)
    first, second = report["runs"]
    assert (first["restart_count"], second["restart_count"]) == (0, 1), report["runs"]
    assert "SIGUSR1" in first["cause"] and not first["unplanned"] and second["cause"] == "completed", report["runs"]
    parts = second["restart_parts"]
    assert second["resumed_from"] == exits[0]["step"] and parts["find"] > 0 and parts["load"] > 0, second
    assert parts["before_ftkit"] > 0.05 and all(v >= 0 for v in parts.values()), parts
    assert {e["rank"] for e in events(jobdir, "resume") if e["step"] is not None} == {0, 1}


@pytest.mark.parametrize("template", TEMPLATES)
def test_scancel_of_a_two_node_job_is_not_requeued(slurm_multinode, slurm_jobs, tmp_path, template) -> None:
    """`scancel JOBID`: the trainers save and exit on SIGTERM; torchrun then exits 1, which
    must not read as a crash: the job stays cancelled, and the output and events say why."""
    job, jobdir = two_node_job(slurm_jobs, tmp_path, template, cmd=command(template, steps=100000))
    wait_progress(tmp_path, job)
    slurm_jobs.cancel(job)
    info = slurm_jobs.wait_state(job, {"CANCELLED"}, timeout=60)
    assert info["Restarts"] == "0"
    wait_for(lambda: events(jobdir, "requeue"), 30, what="ftkit requeue's event")
    (requeue,) = events(jobdir, "requeue")
    assert requeue["requeue"] is False and requeue["cause"] == "cancelled", requeue
    assert "the job was cancelled (scancel" in requeue["reason"]
    out = output(tmp_path, job)
    assert "ftkit requeue: not requeued: the job was cancelled (scancel" in out, out[-3000:]
    # both ranks saved the same step and exited cleanly before the batch script went on
    exits = events(jobdir, "exit")
    assert {e["rank"] for e in exits} == {0, 1} and not any(e["error"] for e in exits), exits
    assert len({e["step"] for e in exits}) == 1
    assert any(c["step"] == exits[0]["step"] and c["valid"] for c in listing(jobdir))
    # still cancelled a while later: nothing requeued it behind our back
    assert slurm_jobs.job_state(job) == "CANCELLED"


CRASH_SAFE = Path(__file__).parent / "programs" / "crash_safe_demo.py"


@pytest.mark.parametrize("saver", ["sync", "crash-safe"])
def test_node_death_requeues_and_resumes_from_the_newest_valid_checkpoint(
        slurm_multinode, slurm_jobs, tmp_path, reference2, node_killer, saver) -> None:
    """Kill the node that is not the batch host mid-training: SLURM requeues the job, the next
    run gets other nodes and resumes from the newest valid checkpoint; whatever the first run
    left beyond it (a step directory with one rank's part) is marked incomplete and not loaded.
    With the crash-safe saver each emulated node has its own saver (SLURMD_NODENAME): the
    dead node's dies with it, the survivor's trainer ends on gloo's error."""
    cmd = command("torchrun", save_every=40, step_time=0.03)
    if saver == "crash-safe":
        cmd = cmd.replace("-m ftkit demo", str(CRASH_SAFE))
    job, jobdir = two_node_job(slurm_jobs, tmp_path, "torchrun", cmd=cmd)
    info = slurm_jobs.wait_state(job, {"RUNNING"}, timeout=60)
    first_nodes = nodes_of(info)
    victim = next(n for n in first_nodes if n != info["BatchHost"])
    wait_progress(tmp_path, job, step=200)  # the demo prints every 100 steps
    node_killer(victim)
    # SLURM notices the silent node after SlurmdTimeout, ends the job NODE_FAIL and requeues it
    slurm_jobs.wait_state(job, {"PENDING"}, timeout=120, where=lambda i: int(i.get("Restarts", "0")) >= 1)
    assert node_state(victim).startswith("down")
    before = listing(jobdir)
    valid_before = [c["step"] for c in before if c["valid"]]
    assert valid_before, "the first run wrote no valid checkpoint"
    # whatever the first run left beyond the newest valid checkpoint is marked incomplete
    partial = [c for c in before if c["step"] > max(valid_before)]
    assert all(not c["valid"] for c in partial), partial
    slurm_jobs.start_now(job)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=180)
    assert victim not in nodes_of(info) and len(nodes_of(info)) == 2, info
    resumed = sorted({e["step"] for e in events(jobdir, "resume") if e["step"] is not None})
    assert resumed == [max(valid_before)], (resumed, valid_before)  # the newest valid one, nothing partial
    final = results(jobdir, WORLD)
    assert all(r["completed"] and r["last_step"] == STEPS for r in final), final
    assert {r["params_sha256"] for r in final} == {reference2}
    # the first run's exit path (on the surviving batch host) saw SLURM requeue the job
    first = events(jobdir, "requeue")[0]
    assert first["requeue"] is True and first["cause"] in ("requeued by SLURM", "crash"), first


def test_save_switch_reaches_ranks_on_both_nodes_by_polling(
        slurm_multinode, slurm_jobs, tmp_path, reference2) -> None:
    job, jobdir = two_node_job(slurm_jobs, tmp_path, "torchrun", cmd=command("torchrun", "--poll"))
    wait_progress(tmp_path, job)
    starts = events(jobdir, "start")
    assert {(s["rank"], s["observer"]) for s in starts} == {(0, "polling"), (1, "polling")}, starts
    subprocess.run([sys.executable, "-m", "ftkit", "save", str(jobdir)], check=True, capture_output=True)
    wait_for(lambda: not (jobdir / "save-switch").exists(), 60, what="save-switch removed once durable")
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=150)
    assert info["Restarts"] == "0"
    saves = [d for d in events(jobdir, "decision") if d["action"] == "SAVE"]
    assert {d["rank"] for d in saves} == {0, 1} and len({d["step"] for d in saves}) == 1, saves
    switch = [c for c in listing(jobdir) if "save-switch" in str(c.get("saved_for"))]
    assert switch and switch[0]["valid"] and switch[0]["step"] == saves[0]["step"]
    final = results(jobdir, WORLD)
    assert {r["params_sha256"] for r in final} == {reference2}  # saving did not disturb training


def test_preemption_of_a_two_node_job_checkpoints_in_grace_time_and_resumes(
        slurm_multinode, slurm_jobs, tmp_path, reference2) -> None:
    cpus = slurm_multinode.cpus
    job, jobdir = two_node_job(slurm_jobs, tmp_path, "torchrun", partition="low", cpus_per_task=cpus)
    info = slurm_jobs.wait_state(job, {"RUNNING"}, timeout=60)
    wait_progress(tmp_path, job)
    # the high job needs exactly the low job's (full) nodes
    high = slurm_jobs.submit("sleep 2", "-p", "high", "-N", "2", "-c", str(cpus), "-w", info["NodeList"],
                             "--job-name=mn-high")
    requeued_then_started(slurm_jobs, job, timeout=90)
    slurm_jobs.wait_state(high, {"COMPLETED"}, timeout=90)
    slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=150)
    exits = assert_resumed_exactly(jobdir, WORLD, reference2)
    first_exits = [e for e in events(jobdir, "exit") if not e["completed"]]
    assert {e["rank"] for e in first_exits} == {0, 1} and all(e["requeue"] is True for e in first_exits)
    saved = {s["step"] for s in events(jobdir, "save")}
    assert exits[0]["step"] in saved
    assert events(jobdir, "requeue")[0]["cause"] == "preemption"
