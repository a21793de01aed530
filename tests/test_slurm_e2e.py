"""SLURM end to end on the real local cluster: signal -> agreed save -> requeue -> resume.

Each test renders a template from sbatch_templates/, runs the real `ftkit demo` trainer in
it, and compares the final parameters with an uninterrupted run outside SLURM, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.events import read_events
from ftkit.slurm.templates import render
from tests.conftest import wait_for
from tests.test_agreement import free_port

pytestmark = pytest.mark.slurm

STEPS = 400


def demo_command(steps: int = STEPS, step_time: float = 0.02) -> str:
    return (f'"$PYTHON" -m ftkit demo --no-live --jobdir "$JOBDIR" --steps {steps} '
            f"--step-time {step_time} --save-every 0")


def reference(tmp_path_factory, world: int) -> str:
    """SHA-256 of the final parameters of an uninterrupted demo run with ``world`` ranks."""
    jobdir = tmp_path_factory.mktemp(f"reference{world}")
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ftkit", "demo", "--no-live", "--jobdir", str(jobdir),
             "--steps", str(STEPS), "--step-time", "0", "--save-every", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out.decode()
    results = [json.loads((jobdir / f"result-rank{r}.json").read_text()) for r in range(world)]
    assert all(r["completed"] for r in results)
    assert len({r["params_sha256"] for r in results}) == 1
    return results[0]["params_sha256"]


# reference_sha (tests/slurm_fixtures.py, session scope): reference(world), run once per world


def submit_template(slurm_jobs, tmp_path: Path, template: str, *sbatch_args: str, env=None, **values) -> tuple[int, Path]:
    jobdir = tmp_path / "job"
    settings = {"job_name": f"e2e-{template}", "jobdir": str(jobdir), "python": sys.executable,
                "time": "10", "lead_time": "60", "output": str(tmp_path / "job-%j.out"),
                "error": str(tmp_path / "job-%j.out"), "command": demo_command()}
    settings.update({k: str(v) for k, v in values.items()})
    script = tmp_path / f"{template}.sbatch"
    script.write_text(render(template, settings))
    return slurm_jobs.submit(script, *sbatch_args, env=env), jobdir


def output(tmp_path: Path, job: int) -> str:
    path = tmp_path / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def wait_progress(tmp_path: Path, job: int, step: int = 100, timeout: float = 90) -> None:
    wait_for(lambda: f"step {step} " in output(tmp_path, job), timeout, interval=0.1,
             what=f"job {job} to reach step {step}")


def wait_requeued(slurm_jobs, job: int, restarts: int = 1) -> None:
    """The job went back to the queue; skip the ~2 min BeginTime delay."""
    slurm_jobs.wait_state(job, {"PENDING"}, timeout=90,
                          where=lambda i: int(i.get("Restarts", "0")) >= restarts)
    slurm_jobs.start_now(job)


def events(jobdir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if kind is None or e["event"] == kind]


def results(jobdir: Path, world: int) -> list[dict]:
    return [json.loads((jobdir / f"result-rank{r}.json").read_text()) for r in range(world)]


def assert_resumed_exactly(jobdir: Path, world: int, sha: str, *, runs: int = 2, requeued: bool = True) -> list[dict]:
    """Every rank finished with the reference parameters; the events show the chain of runs."""
    final = results(jobdir, world)
    assert all(r["completed"] and r["last_step"] == STEPS for r in final), final
    assert {r["params_sha256"] for r in final} == {sha}
    starts = events(jobdir, "start")
    assert len(starts) == runs * world, starts
    if requeued:  # the same job ran again: SLURM counts the restarts
        assert sorted({s["restart_count"] for s in starts}) == list(range(runs))
    else:  # resubmitted: a new job each run
        assert len({s["job_id"] for s in starts}) == runs
    decisions = [e for e in events(jobdir, "decision") if "SAVE" in e["action"]]
    exits = [d for d in decisions if d["action"] == "SAVE_EXIT"]
    # all ranks decided at the same step, saved it, and the next run resumed from it
    by_run: dict[int, set[int]] = {}
    for d in exits:
        by_run.setdefault(d["step"], set()).add(d["rank"])
    assert all(ranks == set(range(world)) for ranks in by_run.values()), exits
    resumed = sorted({e["step"] for e in events(jobdir, "resume") if e["step"] is not None})
    assert resumed == sorted(by_run), (resumed, by_run)
    return exits


@pytest.mark.parametrize(("template", "world"), [("single", 1), ("srun", 2)])
def test_usr1_saves_requeues_and_resumes_bit_identical(slurm_jobs, tmp_path, reference_sha, template, world) -> None:
    sha = reference_sha(world)
    extra = {"ntasks_per_node": world, "cpus_per_task": 1} if template == "srun" else {}
    job, jobdir = submit_template(slurm_jobs, tmp_path, template, **extra)
    wait_progress(tmp_path, job)
    slurm_jobs.signal(job, "USR1", batch=True)
    wait_requeued(slurm_jobs, job)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=120)
    assert info["Restarts"] == "1"
    out = output(tmp_path, job)
    assert "ftkit requeue: requeued job" in out and "training completed" in out
    exits = assert_resumed_exactly(jobdir, world, sha)
    assert all(d["requeue"] is True for d in exits)
    requeues = events(jobdir, "requeue")
    assert [r["requeue"] for r in requeues] == [True, False]


def test_time_limit_signal_path_without_manual_signal(slurm_jobs, tmp_path, reference_sha) -> None:
    """--time=2 with --signal=B:USR1@40: SLURM itself warns the job (or ftkit's time budget,
    fed by SLURM's EndTime, acts first); it saves, requeues and resumes."""
    sha = reference_sha(1)
    # 0.25 s a step: a 2-minute run cannot finish 400 steps, so the limit must interrupt it.
    # SLURM checks limits every ~30-60 s, so USR1 comes 40-100 s before the end.
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single", time="2", lead_time="40",
                                  command=demo_command(step_time=0.25))
    slurm_jobs.wait_state(job, {"PENDING"}, timeout=150, where=lambda i: int(i.get("Restarts", "0")) >= 1)
    slurm_jobs.start_now(job)
    # the second run has the same limit; it may need a third
    info = slurm_jobs.wait_state(job, {"COMPLETED", "PENDING"}, timeout=150,
                                 where=lambda i: i["JobState"] == "COMPLETED" or int(i["Restarts"]) >= 2)
    runs = 2
    while info["JobState"] != "COMPLETED":
        slurm_jobs.start_now(job)
        runs += 1
        info = slurm_jobs.wait_state(job, {"COMPLETED", "PENDING"}, timeout=120,
                                     where=lambda i, n=runs: i["JobState"] == "COMPLETED" or int(i["Restarts"]) >= n)
        assert runs <= 4, "the time-limit path made no progress"
    exits = assert_resumed_exactly(jobdir, 1, sha, runs=runs)
    assert all(set(d["sources"]) & {"signal", "request", "time-budget"} for d in exits)
    causes = [r["cause"] for r in events(jobdir, "requeue") if r["requeue"]]
    assert causes and all(c in ("time limit", "requested (SIGUSR1)") or c.startswith("requested") for c in causes), causes


def test_preemption_checkpoints_in_grace_time_and_resumes(slurm_jobs, tmp_path, reference_sha, slurm_cluster) -> None:
    sha = reference_sha(1)
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single", partition="low",
                                  cpus_per_task=slurm_cluster.cpus)
    wait_progress(tmp_path, job)
    node = slurm_jobs.job_info(job)["NodeList"]  # on a multi-node cluster the others are free
    high = slurm_jobs.submit("sleep 2", "-p", "high", "-c", str(slurm_cluster.cpus), "-w", node,
                             "--job-name=e2e-high")
    info = slurm_jobs.wait_state(job, {"PENDING"}, timeout=90,
                                 where=lambda i: int(i.get("Restarts", "0")) >= 1)
    slurm_jobs.wait_state(high, {"COMPLETED"}, timeout=90)
    slurm_jobs.start_now(job)
    slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=120)
    exits = assert_resumed_exactly(jobdir, 1, sha)
    saved = events(jobdir, "save")
    assert any(s["step"] == exits[0]["step"] for s in saved)
    # the checkpoint was durable before SLURM's grace time ran out: the trainer exited cleanly
    first_exit = events(jobdir, "exit")[0]
    assert first_exit["requeue"] is True and not first_exit["completed"]
    assert "preempt" in output(tmp_path, job).lower() or info["Restarts"] == "1"


def test_save_switch_from_outside_keeps_job_running(slurm_jobs, tmp_path, reference_sha) -> None:
    sha = reference_sha(1)
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single")
    wait_progress(tmp_path, job)
    subprocess.run([sys.executable, "-m", "ftkit", "save", str(jobdir)], check=True, capture_output=True)
    wait_for(lambda: events(jobdir, "save"), 30, what="save-switch checkpoint")
    wait_for(lambda: not (jobdir / "save-switch").exists(), 30, what="save-switch removed once durable")
    assert slurm_jobs.job_state(job) in {"RUNNING", "COMPLETING", "COMPLETED"}
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=120)
    assert info["Restarts"] == "0"
    final = results(jobdir, 1)[0]
    assert final["completed"] and final["params_sha256"] == sha  # saving did not disturb training
    listing = json.loads(subprocess.run([sys.executable, "-m", "ftkit", "ls", "--json", str(jobdir)],
                                        check=True, capture_output=True, text=True).stdout)
    switch_ckpt = [c for c in listing if "save-switch" in str(c.get("saved_for"))]
    assert switch_ckpt and switch_ckpt[0]["valid"] and switch_ckpt[0]["pinned"]


def test_kill_switch_stops_for_good_and_later_jobs_exit_at_once(slurm_jobs, tmp_path) -> None:
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single")
    wait_progress(tmp_path, job)
    subprocess.run([sys.executable, "-m", "ftkit", "kill", str(jobdir)], check=True, capture_output=True)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=90)
    assert info["Restarts"] == "0" and info["ExitCode"] == "0:0"
    out = output(tmp_path, job)
    assert "ftkit requeue: not requeued: kill-switch" in out
    checkpoints = sorted(p.name for p in (jobdir / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1
    killed_at = results(jobdir, 1)[0]["last_step"]

    # a later array job (or a requeued one) on the same job dir starts, saves nothing, exits at once
    array = slurm_jobs.submit(tmp_path / "single.sbatch", "--array=0-1")
    for task in ("0", "1"):
        slurm_jobs.wait_state(f"{array}_{task}", {"COMPLETED"}, timeout=90)
    assert sorted(p.name for p in (jobdir / "checkpoints").glob("step-*")) == checkpoints
    later = [e for e in events(jobdir, "start")][1:]
    assert len(later) == 2 and all(e["kill_switch"] for e in later)
    decisions = events(jobdir, "decision")[1:]
    assert [d["action"] for d in decisions] == ["EXIT", "EXIT"]
    later_result = results(jobdir, 1)[0]
    assert later_result["stopping"] and later_result["last_step"] == 0  # trained nothing
    assert killed_at > 0


def test_requeue_cap_stops_with_a_clear_message(slurm_jobs, tmp_path) -> None:
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single", max_requeues=1,
                                  command=demo_command(steps=100000))
    wait_progress(tmp_path, job)
    slurm_jobs.signal(job, "USR1", batch=True)
    wait_requeued(slurm_jobs, job)
    slurm_jobs.wait_state(job, {"RUNNING"}, timeout=60)
    wait_for(lambda: len(events(jobdir, "resume")) >= 2, 60, what="second run resumed")
    slurm_jobs.signal(job, "USR1", batch=True)
    info = slurm_jobs.wait_state(job, {"FAILED", "COMPLETED"}, timeout=90)
    assert info["Restarts"] == "1"
    out = output(tmp_path, job)
    assert "requeue cap reached: 1 requeues" in out and "--max-requeues = 1" in out
    last = events(jobdir, "requeue")[-1]
    assert last["requeue"] is False and "requeue cap reached" in last["reason"]


def test_crash_without_progress_stops_requeueing(slurm_jobs, tmp_path) -> None:
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single",
                                  command="\"$PYTHON\" -c 'import sys; sys.exit(3)'")
    for restarts in (1, 2):
        wait_requeued(slurm_jobs, job, restarts)
    info = slurm_jobs.wait_state(job, {"FAILED"}, timeout=90)
    assert info["Restarts"] == "2" and info["ExitCode"].startswith("3:")
    out = output(tmp_path, job)
    assert "without a newer checkpoint 3 times in a row" in out
    assert [r["requeue"] for r in events(jobdir, "requeue")] == [True, True, False]


def test_scontrol_unavailable_falls_back_to_resubmission(slurm_jobs, tmp_path, reference_sha) -> None:
    sha = reference_sha(1)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "scontrol"
    fake.write_text("#!/bin/bash\necho 'scontrol: error: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    job, jobdir = submit_template(slurm_jobs, tmp_path, "single", env=env)
    wait_progress(tmp_path, job)
    slurm_jobs.signal(job, "USR1", batch=True)
    slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=90)
    requeue = wait_for(lambda: events(jobdir, "requeue"), 30, what="requeue event")[0]
    assert requeue["requeue"] is True and requeue["method"] == "resubmit", requeue
    new_job = int(requeue["new_job_id"])
    slurm_jobs.job_ids.append(new_job)
    slurm_jobs.wait_state(new_job, {"COMPLETED"}, timeout=120)
    assert "resubmitted as job" in output(tmp_path, job)
    assert_resumed_exactly(jobdir, 1, sha, requeued=False)


def test_demo_slurm_submits_the_one_node_template(slurm_jobs, tmp_path) -> None:
    """`ftkit demo --slurm` renders the single template into the job dir and submits it."""
    jobdir = tmp_path / "demo"
    out = subprocess.run([sys.executable, "-m", "ftkit", "demo", "--slurm", "--jobdir", str(jobdir),
                          "--steps", "60", "--step-time", "0", "--save-every", "20"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, check=True).stdout
    job = int(out.split("submitted job ")[1].split()[0])
    slurm_jobs.job_ids.append(job)
    info = slurm_jobs.wait_state(job, {"COMPLETED"}, timeout=120)
    assert info["Restarts"] == "0"
    assert (jobdir / "demo.sbatch").exists()
    result = results(jobdir, 1)[0]
    assert result["completed"] and result["last_step"] == 60
    assert [e["step"] for e in events(jobdir, "save")] == [20, 40, 60]
    assert events(jobdir, "requeue")[-1]["reason"].startswith("training completed")
