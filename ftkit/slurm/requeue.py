"""The exit path: should the job go back to the queue, and put it there.

The batch script runs ``ftkit requeue JOBDIR --exit-code RC`` once the training has
exited. :func:`decide` gathers what the trainer wrote (the ``start``/``exit`` events of this
run), the job directory (kill-switch, leftover request files, checkpoints, ``runs.json``)
and SLURM's view of the job (``scontrol show job``: JobState, PreemptTime) into
:class:`~ftkit.slurm.requeue_facts.RunFacts`, and applies a :class:`RequeuePolicy` with the
pure :func:`ftkit.slurm.requeue_policy.decide`, which documents the rules. :func:`perform`
runs ``scontrol requeue`` or, where SLURM refuses, resubmits the batch script.
:func:`finish_run` does both and records them in the events log and ``runs.json``.

Exit-code contract with the batch script (``exit $?`` after ``ftkit requeue``):

* ``0``: requeued (or resubmitted, or SLURM requeues it itself), training completed, or
  stopped on purpose (kill-switch, ``stop``) or exited cleanly without asking for more;
* the training's own exit code: a crash that is not requeued, so SLURM shows FAILED;
* ``75`` (:data:`EXIT_UNFINISHED`, sysexits' EX_TEMPFAIL): the run exited cleanly and
  wanted a requeue, but none happened (requeue cap reached, SLURM refused and the
  fallback failed). Resubmit to continue;
* ``86`` (:data:`ftkit.errors.EXIT_JOBDIR_BUSY`): another run holds the job dir; this run
  changed nothing there, and neither does ``ftkit requeue`` (no ``runs.json`` record, no
  event, request files left for the run that holds the lease).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import EXIT_JOBDIR_BUSY, ConfigError, SlurmError
from ..events import EventLog, read_events
from ..jobdir import JobDir
from ..triggers.switches import remove_requests
from . import requeue_policy
from .env import Runner, SlurmEnv, job_info, run_slurm_command
from .requeue_facts import (
    gather,
    lease_refused,
    newest_checkpoint_step,
    read_runs,
    scontrol_runner,
    write_runs,
)
from .requeue_policy import EXIT_UNFINISHED, UNSET, RequeueDecision, RequeuePolicy, slurm_requeued

__all__ = [
    "EXIT_UNFINISHED",
    "RequeueAction",
    "RequeueDecision",
    "RequeuePolicy",
    "RunOutcome",
    "decide",
    "finish_run",
    "newest_checkpoint_step",
    "perform",
    "read_runs",
    "run_sbatch",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RequeueAction:
    """What :func:`perform` did: ``method`` is ``scontrol``, ``resubmit``, ``slurm`` or None."""

    method: str | None
    detail: str = ""
    new_job_id: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """The result of :func:`finish_run`: what to print and what to exit with."""

    decision: RequeueDecision
    action: RequeueAction | None
    message: str
    exit_code: int


def run_sbatch(args: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
               timeout: float = 60) -> str:
    """Run ``sbatch ARGS`` and return its stdout; SlurmError on any failure."""
    return run_slurm_command(["sbatch", *args], timeout=timeout, cwd=cwd, env=env,
                             missing="sbatch is missing (not on PATH)")


def decide(
    jobdir: str | os.PathLike[str],
    *,
    exit_code: int,
    env: SlurmEnv | None = None,
    policy: RequeuePolicy | None = None,
    runner: Runner | None = None,
    checkpoints_lookup: Callable[[Path], int | None] | None = None,
    clock: Callable[[], float] = time.time,
) -> RequeueDecision:
    """Decide whether the run that just ended with ``exit_code`` is requeued. Reads only:
    :func:`~ftkit.slurm.requeue_facts.gather`, then :func:`ftkit.slurm.requeue_policy.decide`."""
    facts = gather(jobdir, exit_code=exit_code, env=env, runner=runner, checkpoints_lookup=checkpoints_lookup,
                   clock=clock)
    return requeue_policy.decide(facts, policy if policy is not None else RequeuePolicy())


# --------------------------------------------------------------------------------------
# acting


def perform(
    decision: RequeueDecision,
    env: SlurmEnv,
    *,
    runner: Runner | None = None,
    sbatch: Callable[..., str] | None = None,
    script: str | os.PathLike[str] | None = None,
) -> RequeueAction:
    """Put the job back in the queue as ``decision`` says; SlurmError when that fails."""
    if not decision.requeue:
        return RequeueAction(method=None, detail="not requeued")
    if decision.already_requeued:
        how = slurm_requeued(decision.job, env.restart_count)
        return RequeueAction(method="slurm", detail=f"SLURM, which requeued it already ({how})")
    target = env.requeue_target
    if target is None:
        raise SlurmError("not inside a SLURM job (SLURM_JOB_ID is unset): there is nothing to requeue")
    scontrol = scontrol_runner(runner)
    try:
        scontrol(["requeue", target])
        return RequeueAction(method="scontrol", detail=f"scontrol requeue {target}")
    except SlurmError as exc:
        refused = exc
    log.warning("%s", refused)
    try:  # preemption may have requeued it first ("Job is pending execution")
        how = slurm_requeued(job_info(env.job_id or target, runner=scontrol), env.restart_count)
    except SlurmError:
        how = None
    if how:
        return RequeueAction(method="slurm", detail=f"SLURM, which requeued it already ({how})")
    if decision.fallback != "resubmit":
        raise SlurmError(f"{refused}; fallback is 'none', so the job is not requeued")
    try:
        new_id = _resubmit(decision, env, sbatch=sbatch, script=script)
    except SlurmError as exc:
        raise SlurmError(f"{refused}; resubmitting failed too: {exc}") from exc
    return RequeueAction(method="resubmit", new_job_id=new_id,
                         detail=f"resubmitted as job {new_id} (after {env.job_id} ends)")


def _resubmit(decision: RequeueDecision, env: SlurmEnv, *, sbatch: Callable[..., str] | None,
              script: str | os.PathLike[str] | None) -> str:
    info = decision.job or {}
    command = info.get("Command", "")
    path = Path(script) if script else (Path(command) if command.lower() not in UNSET else None)
    if path is None or not path.is_file():
        where = f"{path} (from scontrol's Command=)" if path and not script else str(path)
        raise SlurmError(f"cannot resubmit: the batch script {where} is not a file; pass --script PATH")
    args = ["--parsable", f"--dependency=afterany:{env.job_id}"]
    if env.job_name:
        args.append(f"--job-name={env.job_name}")
    if env.partition:
        args.append(f"--partition={env.partition}")
    if env.is_array:
        args.append(f"--array={env.array_task_id}")
    args.append(str(path))
    # The new job must not inherit this job's SLURM_* (SLURM_RESTART_COUNT above all).
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    cwd = info.get("WorkDir") or env.submit_dir
    call = sbatch if sbatch is not None else run_sbatch
    out = call(args, cwd=cwd if cwd and os.path.isdir(cwd) else None, env=child_env)
    new_id = out.strip().split(";")[0]
    if not new_id:
        raise SlurmError(f"`sbatch {' '.join(args)}` printed no job id")
    return new_id


# --------------------------------------------------------------------------------------
# the whole exit path


def finish_run(
    jobdir: str | os.PathLike[str],
    *,
    exit_code: int,
    env: SlurmEnv | None = None,
    policy: RequeuePolicy | None = None,
    dry_run: bool = False,
    script: str | os.PathLike[str] | None = None,
    runner: Runner | None = None,
    sbatch: Callable[..., str] | None = None,
    checkpoints_lookup: Callable[[Path], int | None] | None = None,
    clock: Callable[[], float] = time.time,
    saver_wait: float = 600.0,
) -> RunOutcome:
    """Wait for the job's checkpoint savers, decide, record in ``runs.json``, perform, record
    the outcome in the events log.

    A ``crash_safe`` saver still persisting a dead trainer's snapshot is waited for (up to
    ``saver_wait`` seconds, see :mod:`ftkit.checkpoint.crashsafe.find`): its checkpoint counts as progress,
    and the batch step, whose processes SLURM kills when the script ends, must outlive it.

    ``runs.json`` is written before ``scontrol requeue``, which ends this batch script.
    Request files left from the run are removed so the next run does not act on them.
    ``dry_run`` decides and reports only.
    """
    env = env if env is not None else SlurmEnv.from_env()
    from ..checkpoint.crashsafe.find import wait_for_savers

    job = JobDir.of(jobdir)
    if exit_code == EXIT_JOBDIR_BUSY or (job.root.is_dir() and lease_refused(list(read_events(job.events)), env)):
        # the savers, requests and records there belong to the run holding the lease
        decision = decide(jobdir, exit_code=exit_code, env=env, policy=policy, runner=runner,
                          checkpoints_lookup=lambda root: None, clock=clock)
        return RunOutcome(decision=decision, action=None, message=f"ftkit requeue: not requeued: {decision.reason}",
                          exit_code=decision.exit_code)
    from ..lease import live_holder

    holder = live_holder(job.root) if job.root.is_dir() and not dry_run else None
    if holder is not None:  # typed in a terminal while the job trains: it would end a run that goes on
        raise ConfigError(
            f"the run in job dir {job.root} is still training: {holder.holder} holds its lease ({job.lease}). "
            "ftkit requeue ends a run after its training exited (the batch script's last line); nothing was "
            "recorded or requeued")
    waited, running, seconds = wait_for_savers(jobdir, saver_wait)
    if waited:
        EventLog(JobDir.of(jobdir).events).emit("savers-waited", pids=waited, still_running=running,
                                                seconds=round(seconds, 3))
    decision = decide(jobdir, exit_code=exit_code, env=env, policy=policy, runner=runner,
                      checkpoints_lookup=checkpoints_lookup, clock=clock)
    if decision.cause == requeue_policy.HANDLED:  # run twice: the first recorded and did it all
        return RunOutcome(decision=decision, action=None, message=f"ftkit requeue: not requeued again: {decision.reason}",
                          exit_code=decision.exit_code)
    target = env.requeue_target or "(no job)"
    if dry_run:
        what = f"would requeue job {target}" if decision.requeue else "would not requeue"
        return RunOutcome(decision=decision, action=None, message=f"ftkit requeue (dry run): {what}: {decision.reason}",
                          exit_code=decision.exit_code)
    runs = read_runs(job.runs)
    record = dict(decision.run)
    record["method"] = ("slurm" if decision.already_requeued else "scontrol") if decision.requeue else None
    unrecorded = None  # why runs.json could not be written: the caps count what it records
    try:
        write_runs(job.runs, [*runs, record])
    except OSError as exc:
        unrecorded = (f"this run could not be recorded in {job.runs} ({exc.strerror or exc}): run `ftkit requeue` "
                      f"where the job dir {job.root} is writable")
    remove_requests(decision.spent_requests)

    error = None
    if unrecorded is not None and decision.requeue and not decision.already_requeued:
        # a requeue no cap could count could repeat without end: not one (the work is unfinished)
        action, error = None, unrecorded
    else:
        try:
            action = perform(decision, env, runner=runner, sbatch=sbatch, script=script)
        except SlurmError as exc:
            action, error = None, str(exc)
    exit_code_out = decision.exit_code
    if error is not None:
        exit_code_out = decision.training_exit_code or EXIT_UNFINISHED
        message = f"ftkit requeue: NOT requeued ({decision.reason}): {error}"
        record.update(requeue=False, method=None, error=error)
    elif decision.requeue and action is not None:
        message = f"ftkit requeue: requeued job {target} ({decision.reason}) via {action.detail}"
        record.update(method=action.method, new_job_id=action.new_job_id)
    else:
        message = f"ftkit requeue: not requeued: {decision.reason}"
    if unrecorded is not None and error != unrecorded:
        message += f"; but {unrecorded}"
    elif decision.requeue and unrecorded is None:  # what perform did (or why it failed)
        write_runs(job.runs, [*runs, record])
    EventLog(job.events).emit(
        "requeue", requeue=bool(record["requeue"]), reason=decision.reason, cause=decision.cause,
        method=record["method"], job_id=env.job_id, restart_count=env.restart_count, new_job_id=record.get("new_job_id"),
        exit_code=decision.training_exit_code, requeues=decision.requeues, step=decision.run.get("end_step"),
        error=error, spent_requests=[Path(p).name for p in decision.spent_requests],
    )
    log.info("%s", message)
    return RunOutcome(decision=decision, action=action, message=message, exit_code=exit_code_out)
