"""The exit path: should the job go back to the queue, and put it there.

The batch script runs ``ftkit requeue JOBDIR --exit-code RC`` once the training has
exited. :func:`decide` reads what the trainer wrote (the ``start``/``exit`` events of this
run), the job directory (kill-switch, leftover request files, checkpoints, ``runs.json``)
and SLURM's view of the job (``scontrol show job``: JobState, PreemptTime), and applies a
:class:`RequeuePolicy`. :func:`perform` runs ``scontrol requeue`` or, where SLURM refuses,
resubmits the batch script. :func:`finish_run` does both and records them in the events
log and ``runs.json``.

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

The launcher's exit code is only one of the facts: a launcher such as torchrun exits 1
when SLURM's SIGTERM reaches it although every rank saved and exited cleanly, so the
trainer's own ``exit`` events (one per rank) and SLURM's job state come first. A job the
user cancelled (``scancel``) is never requeued: while its batch script still runs, SLURM
22.05 shows ``JobState=COMPLETING`` (not CANCELLED) with no time limit, preemption or
requeue behind it, and the script has ``KillWait`` seconds left.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._fs import atomic_write
from ..errors import EXIT_HANG, EXIT_JOBDIR_BUSY, ConfigError, SlurmError
from ..events import EventLog, read_events
from ..jobdir import JobDir
from . import env as _env
from .env import SlurmEnv, job_info, run_slurm_command

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

EXIT_UNFINISHED = 75
_FALLBACKS = ("resubmit", "none")
_UNSET = frozenset({"", "none", "unknown", "(null)", "n/a"})
Runner = Callable[[Sequence[str]], str]


@dataclass(kw_only=True, slots=True)
class RequeuePolicy:
    """When a finished run goes back to the queue."""

    max_requeues: int = 20
    """Cap on requeues in a row: the larger of SLURM_RESTART_COUNT and the requeues that
    ``runs.json`` records since the last run that was not requeued (resubmissions start
    SLURM's count at 0 again). Env FTKIT_MAX_REQUEUES, CLI ``--max-requeues``."""

    max_no_progress: int = 2
    """Crashes in a row that are still requeued although no newer valid checkpoint was
    written. Env FTKIT_MAX_NO_PROGRESS, CLI ``--max-no-progress``."""

    requeue_on_crash: bool = True
    """Requeue a run that exited non-zero without an ftkit exit decision (subject to
    ``max_no_progress``). Env FTKIT_REQUEUE_ON_CRASH, CLI ``--no-requeue-on-crash``."""

    fallback: str = "resubmit"
    """When ``scontrol requeue`` fails or scontrol is missing: ``resubmit`` submits the
    batch script again with ``sbatch --dependency=afterany:JOBID`` (it starts only once this
    job has ended, so two runs never share the job directory); ``none`` gives up.
    Env FTKIT_REQUEUE_FALLBACK, CLI ``--fallback``."""

    def __post_init__(self) -> None:
        for name in ("max_requeues", "max_no_progress"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"requeue.{name}: must be a whole number >= 0, got {value!r}")
        if not isinstance(self.requeue_on_crash, bool):
            raise ConfigError(f"requeue.requeue_on_crash: must be True or False, got {self.requeue_on_crash!r}")
        if self.fallback not in _FALLBACKS:
            raise ConfigError(f"requeue.fallback: got {self.fallback!r}; use one of {', '.join(_FALLBACKS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RequeuePolicy:
        """Defaults, then ``FTKIT_*`` variables, then ``overrides`` (None values are skipped)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in (("max_requeues", "FTKIT_MAX_REQUEUES"), ("max_no_progress", "FTKIT_MAX_NO_PROGRESS")):
            if environ.get(var, "").strip():
                try:
                    values[name] = int(environ[var])
                except ValueError:
                    raise ConfigError(f"{var}={environ[var]!r}: give a whole number >= 0") from None
        flag = environ.get("FTKIT_REQUEUE_ON_CRASH", "").strip().lower()
        if flag:
            if flag not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"FTKIT_REQUEUE_ON_CRASH={flag!r}: use 1 or 0")
            values["requeue_on_crash"] = flag in ("1", "true", "yes")
        if environ.get("FTKIT_REQUEUE_FALLBACK", "").strip():
            values["fallback"] = environ["FTKIT_REQUEUE_FALLBACK"].strip()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class RequeueDecision:
    """What :func:`decide` concluded about the run that just ended."""

    requeue: bool
    reason: str
    """One sentence for the job's .out file and the events log."""
    exit_code: int
    """What the batch script exits with if nothing goes wrong while performing it."""
    cause: str = ""
    """``time limit``, ``preemption``, ``requested (...)``, ``requeued by SLURM``, ``crash``, ``hang``,
    ``completed``, ``stopped``, ``cancelled``, ``finished`` or ``lease refused``."""
    training_exit_code: int = 0
    requeues: int = 0
    """Requeues in a row before this one."""
    max_requeues: int = 20
    fallback: str = "resubmit"
    already_requeued: bool = False
    """SLURM already put the job back in the queue (JobState PENDING/REQUEUE*): nothing to do."""
    slurm_state: str | None = None
    job: Mapping[str, str] | None = field(default=None, repr=False)
    """``scontrol show job`` of this job, when it could be read."""
    run: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """The record this run adds to ``runs.json``."""
    spent_requests: tuple[str, ...] = ()
    """Request files left from this run, removed by :func:`finish_run`."""


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


# --------------------------------------------------------------------------------------
# call points (tests patch these)


def _scontrol(runner: Runner | None) -> Runner:
    return runner if runner is not None else (lambda args: _env.run_scontrol(args))


def run_sbatch(args: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
               timeout: float = 60) -> str:
    """Run ``sbatch ARGS`` and return its stdout; SlurmError on any failure."""
    return run_slurm_command(["sbatch", *args], timeout=timeout, cwd=cwd, env=env,
                             missing="sbatch is missing (not on PATH)")


# --------------------------------------------------------------------------------------
# what the job directory says


def newest_checkpoint_step(root: str | os.PathLike[str]) -> int | None:
    """Step of the newest valid checkpoint under ``root`` (``JOBDIR/checkpoints``), or None.

    Uses ftkit's checkpoint manager (which validates manifests); if that cannot be imported,
    a step directory counts when it has ``manifest.json`` and no ``checkpoint-is-incomplete``.
    """
    try:
        from ..checkpoint import CheckpointConfig, make_manager
    except ImportError:
        return _scan_checkpoints(Path(root))
    manager = make_manager(CheckpointConfig(root=Path(root)), events=None, rank=0, world_size=1)
    steps = [int(info.step) for info in manager.list() if info.valid]
    return max(steps, default=None)


def _scan_checkpoints(root: Path) -> int | None:
    best = None
    try:
        entries = list(os.scandir(root))
    except OSError:
        return None
    for entry in entries:
        name = entry.name
        if not name.startswith("step-") or not name[5:].isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if (path / "manifest.json").is_file() and not (path / "checkpoint-is-incomplete").exists():
            best = max(best if best is not None else -1, int(name[5:]))
    return best


def read_runs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The run records of ``runs.json``; a missing or unreadable file gives ``[]``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def _write_runs(path: Path, runs: list[dict[str, Any]]) -> None:
    atomic_write(path, (json.dumps({"version": 1, "runs": runs}, indent=1, default=str) + "\n").encode())


def _this_run(events: list[dict[str, Any]], env: SlurmEnv) -> list[dict[str, Any]]:
    """The events of the run that just ended: after the last ``requeue`` event (the end of
    the previous run), from the first ``start`` of this job id and restart count on."""
    last_end = max((i for i, e in enumerate(events) if e.get("event") == "requeue"), default=-1)
    block = events[last_end + 1 :]
    for i, e in enumerate(block):
        if (e.get("event") == "start" and e.get("job_id") == env.job_id
                and int(e.get("restart_count") or 0) == env.restart_count):
            return block[i:]
    return []


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    found = [e for e in events if e.get("event") == kind]
    rank0 = [e for e in found if e.get("rank", 0) == 0]
    return (rank0 or found)[-1] if found else None


def _pending_requests(job: JobDir) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(job.requests.glob("*.json")) if job.requests.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        out.append((path, data if isinstance(data, dict) else {}))
    return out


def _streak(runs: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool]) -> int:
    n = 0
    for record in reversed(runs):
        if not match(record):
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------
# deciding


def _requeued_already(info: Mapping[str, str] | None, env: SlurmEnv) -> str | None:
    """How SLURM shows it has requeued the job itself (preemption), else None.

    Right after a preemption kill SLURM 22.05 shows ``JobState=COMPLETING`` with
    ``Restarts`` already one higher than this run's SLURM_RESTART_COUNT; later PENDING.
    """
    if not info:
        return None
    state = info.get("JobState", "").upper()
    if state == "PENDING" or state.startswith("REQUEUE"):
        return f"JobState={state}"
    restarts = info.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > env.restart_count:
        return f"Restarts={restarts} > SLURM_RESTART_COUNT={env.restart_count}"
    return None


def _slurm_cause(info: Mapping[str, str] | None, env: SlurmEnv) -> str | None:
    """Why SLURM is ending the job, from its own state; never guessed from the clock.

    During a preemption's GraceTime the job is still RUNNING but has a PreemptTime; once
    the time limit hits, SLURM 22.05 shows COMPLETING with Reason=TimeLimit.
    """
    if not info:
        return None
    state = info.get("JobState", "").upper()
    if state == "PREEMPTED" or info.get("PreemptTime", "").strip().lower() not in _UNSET:
        return "preemption"
    if state in ("TIMEOUT", "DEADLINE") or info.get("Reason") in ("TimeLimit", "DeadLine"):
        return "time limit"
    if _requeued_already(info, env):
        return "requeued by SLURM"
    return None


def _cancelled(info: Mapping[str, str] | None, env: SlurmEnv) -> str | None:
    """How SLURM shows the job was cancelled (scancel), else None.

    After ``scancel JOBID`` SLURM 22.05 signals every process of the job and shows
    ``JobState=COMPLETING Reason=None`` while the batch script still runs (CANCELLED only
    once it is gone). A job that is COMPLETING while its batch script still runs was ended by
    SLURM: with no time limit, deadline, preemption or requeue behind it, by a cancel.
    """
    if not info:
        return None
    state = info.get("JobState", "").upper()
    if state == "CANCELLED":
        return "JobState=CANCELLED"
    if state != "COMPLETING" or _slurm_cause(info, env) is not None:
        return None
    reason = info.get("Reason", "").strip()
    if reason.lower() not in _UNSET:
        return None
    return "JobState=COMPLETING while the batch script still runs, with no time limit, preemption or requeue"


def _lease_refused(events: list[dict[str, Any]], env: SlurmEnv) -> dict[str, Any] | None:
    """The ``lease-refused`` event this run wrote (the job dir was held by another run), else None.

    The refusal comes before any ``start`` event, so the whole log is searched, by job id and
    restart count (outside SLURM: the newest refusal after the last ``requeue`` event).
    """
    last_end = max((i for i, e in enumerate(events) if e.get("event") == "requeue"), default=-1)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.get("event") != "lease-refused":
            continue
        if env.job_id is None:
            return e if i > last_end else None
        if str(e.get("job_id")) == env.job_id and int(e.get("restart_count") or 0) == env.restart_count:
            return e
    return None


def _clean_exit(run_events: list[dict[str, Any]], start: dict[str, Any] | None) -> bool:
    """Every rank of this run wrote an ``exit`` event without an error (from its ``start`` event's
    world size): whatever the launcher's exit code, the trainers ended on purpose."""
    if start is None:
        return False
    world = start.get("world_size")
    world = world if isinstance(world, int) and world > 0 else 1
    clean = {e.get("rank", 0) for e in run_events if e.get("event") == "exit" and not e.get("error")}
    return clean >= set(range(world))


def _hang_text(hang: dict[str, Any] | None) -> str:
    if hang is None:
        return f"the hang watchdog ended it (exit code {EXIT_HANG}, no hang event)"
    seconds = hang.get("seconds")
    waited = f" for {seconds:.0f} s" if isinstance(seconds, (int, float)) else ""
    where = f"rank {hang.get('rank', '?')} on {hang.get('host', '?')}"
    text = f"the hang watchdog found {where} completed no step{waited} after step {hang.get('step')}"
    return text + (f" (stacks in {hang['file']})" if hang.get("file") else "")


def decide(
    jobdir: str | os.PathLike[str],
    *,
    exit_code: int,
    env: SlurmEnv | None = None,
    policy: RequeuePolicy | None = None,
    runner: Runner | None = None,
    checkpoints_lookup: Callable[[Path], int | None] = newest_checkpoint_step,
    clock: Callable[[], float] = time.time,
) -> RequeueDecision:
    """Decide whether the run that just ended with ``exit_code`` is requeued. Reads only."""
    job = JobDir.of(jobdir)
    if not job.root.is_dir():
        raise ConfigError(f"job dir {job.root} does not exist; pass the JOBDIR the batch script uses")
    env = env if env is not None else SlurmEnv.from_env()
    policy = policy if policy is not None else RequeuePolicy()
    rc = int(exit_code)

    info: dict[str, str] | None = None
    if env.job_id is not None:
        try:
            info = job_info(env.job_id, runner=_scontrol(runner))
        except SlurmError as exc:
            log.warning("cannot ask SLURM about job %s, deciding without it: %s", env.job_id, exc)
    state = info.get("JobState", "").upper() if info else None

    all_events = list(read_events(job.events))
    run_events = _this_run(all_events, env)
    start, exit_ = _last(run_events, "start"), _last(run_events, "exit")
    resumed = _last(run_events, "resume")
    hang = _last(run_events, "hang")
    refused = _lease_refused(all_events, env)
    # torchrun and srun may exit non-zero for a signal that reached them after every rank
    # had saved and exited cleanly: that is not a crash
    clean = _clean_exit(run_events, start)
    trc = 0 if clean else rc
    runs = read_runs(job.runs)
    requests = _pending_requests(job)
    end_step = checkpoints_lookup(job.checkpoints)
    # the step this run started from: what the previous run left, else what it resumed
    start_step = runs[-1].get("end_step") if runs else (resumed.get("step") if resumed else None)
    progress = end_step is not None and (start_step is None or end_step > start_step)
    requeues = max(env.restart_count, _streak(runs, lambda r: bool(r.get("requeue"))))
    record: dict[str, Any] = {
        "job_id": env.job_id, "requeue_target": env.requeue_target, "restart_count": env.restart_count,
        "start_time": start.get("time") if start else None, "end_time": round(clock(), 3),
        "exit_code": rc, "start_step": start_step, "end_step": end_step, "progress": progress,
        "hang_step": hang.get("step") if hang else None,
        "slurm_state": state,
    }

    def verdict(requeue: bool, cause: str, reason: str, code: int | None = None) -> RequeueDecision:
        if code is None:
            code = 0 if requeue else trc
        return RequeueDecision(
            requeue=requeue, reason=reason, exit_code=code, cause=cause, training_exit_code=rc,
            requeues=requeues, max_requeues=policy.max_requeues, fallback=policy.fallback,
            already_requeued=requeue and _requeued_already(info, env) is not None,
            slurm_state=state, job=info, run={**record, "cause": cause, "requeue": requeue, "reason": reason},
            spent_requests=tuple(str(p) for p, _ in requests),
        )

    # 0. this run never had the job dir: it must not touch the run that has it
    if refused is not None and refused.get("idle"):
        return verdict(False, "stopped", f"kill-switch {job.kill_switch} is present; another run held the job dir, "
                       "this one did nothing (remove the kill-switch with `ftkit kill --clear` to let the job "
                       "run again)")
    if refused is not None or rc == EXIT_JOBDIR_BUSY:
        holder = (refused or {}).get("holder") or {}
        who = holder.get("holder") if isinstance(holder, dict) else None
        return verdict(False, "lease refused", f"another run holds the job dir {job.root}"
                       + (f" ({who})" if who else "") + f": this run exited with code {EXIT_JOBDIR_BUSY} "
                       "without touching it (lease-refused); not requeued. Wait for that run to end, end it, "
                       f"or give this job another job dir; `ftkit status {job.root}` shows the holder",
                       EXIT_JOBDIR_BUSY)

    # 1. stopped for good
    if job.kill_switch.exists():
        return verdict(False, "stopped", f"kill-switch {job.kill_switch} is present "
                       "(remove it with `ftkit kill --clear` to let the job run again)")
    stop = [d for _, d in requests if str(d.get("action", "")).lower() == "stop"]
    if stop:
        return verdict(False, "stopped", f"a stop request is pending ({stop[-1].get('reason') or 'ftkit request stop'})")
    reasons = "; ".join(exit_.get("reasons") or []) if exit_ else ""
    if exit_ is not None and exit_.get("requeue") is False:
        return verdict(False, "stopped", "the trainer stopped for good" + (f": {reasons}" if reasons else ""))
    if exit_ is not None and exit_.get("completed"):
        return verdict(False, "completed", f"training completed (step {exit_.get('step')})")
    cancelled = _cancelled(info, env)
    if cancelled is not None:
        saved = f"; the trainer saved step {exit_.get('step')} and exited" if exit_ is not None and clean else ""
        return verdict(False, "cancelled", f"the job was cancelled (scancel: {cancelled}){saved}; "
                       "a cancelled job is never requeued (resubmit it to continue)", trc)

    # 2. why did it end?
    slurm_cause = _slurm_cause(info, env)
    usr1 = [d for _, d in requests if str(d.get("action", "")).lower() == "requeue"]
    if exit_ is not None and exit_.get("requeue") is True:
        if slurm_cause:
            cause = slurm_cause
        elif "USR1" in reasons:
            cause = "requested (SIGUSR1)"
        else:
            cause = f"requested ({reasons or 'by the trainer'})"
    elif slurm_cause:
        cause = slurm_cause
    elif usr1:
        cause = "requested (SIGUSR1)" if "SIGUSR1" in str(usr1[-1].get("reason")) else "requested"
    elif hang is not None or rc == EXIT_HANG:
        cause = "hang"
    elif trc != 0:
        cause = "crash"
    elif exit_ is not None:
        return verdict(False, "finished", "the trainer exited without asking for a requeue"
                       + (f": {reasons}" if reasons else ""))
    else:
        return verdict(False, "finished", "the program exited with code 0 and left no ftkit exit record")

    # 3. limits
    unfinished = trc if trc != 0 else EXIT_UNFINISHED
    if requeues >= policy.max_requeues:
        return verdict(False, cause, f"requeue cap reached: {requeues} requeues (FTKIT_MAX_REQUEUES / "
                       f"--max-requeues = {policy.max_requeues}); not requeued after {cause}", unfinished)
    if cause in ("crash", "hang"):
        what = f"crashed with exit code {rc}" if cause == "crash" else f"hung: {_hang_text(hang)}"
        if not policy.requeue_on_crash:
            return verdict(False, cause, f"{what}; requeue_on_crash is off "
                           "(FTKIT_REQUEUE_ON_CRASH / --no-requeue-on-crash)")
        if not progress:
            previous = runs[-1] if runs else {}
            if cause == "hang" and previous.get("cause") == "hang" and previous.get("hang_step") == record["hang_step"]:
                return verdict(False, cause, f"hung again at step {record['hang_step']} without a newer checkpoint "
                               f"(newest step {end_step}); the previous run hung at the same step, so a requeue "
                               f"would hang there again: {what}")
            streak = 1 + _streak(runs, lambda r: r.get("cause") in ("crash", "hang") and not r.get("progress"))
            if streak > policy.max_no_progress:
                return verdict(False, cause, f"{what} without a newer checkpoint "
                               f"{streak} times in a row (newest step {end_step}); max_no_progress is "
                               f"{policy.max_no_progress} (FTKIT_MAX_NO_PROGRESS / --max-no-progress)")
            why = f"{what}, no newer checkpoint ({streak} of {policy.max_no_progress} allowed)"
        else:
            why = f"{what} after progress to step {end_step}"
    else:
        why = cause
    return verdict(True, cause, f"{why}; requeue {requeues + 1} of at most {policy.max_requeues}")


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
        how = _requeued_already(decision.job, env)
        return RequeueAction(method="slurm", detail=f"SLURM, which requeued it already ({how})")
    target = env.requeue_target
    if target is None:
        raise SlurmError("not inside a SLURM job (SLURM_JOB_ID is unset): there is nothing to requeue")
    scontrol = _scontrol(runner)
    try:
        scontrol(["requeue", target])
        return RequeueAction(method="scontrol", detail=f"scontrol requeue {target}")
    except SlurmError as exc:
        refused = exc
    log.warning("%s", refused)
    try:  # preemption may have requeued it first ("Job is pending execution")
        how = _requeued_already(job_info(env.job_id or target, runner=scontrol), env)
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
    path = Path(script) if script else (Path(command) if command.lower() not in _UNSET else None)
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
    checkpoints_lookup: Callable[[Path], int | None] = newest_checkpoint_step,
    clock: Callable[[], float] = time.time,
    saver_wait: float = 600.0,
) -> RunOutcome:
    """Wait for the job's checkpoint savers, decide, record in ``runs.json``, perform, record
    the outcome in the events log.

    A ``crash_safe`` saver still persisting a dead trainer's snapshot is waited for (up to
    ``saver_wait`` seconds, see :mod:`ftkit.slurm.savers`): its checkpoint counts as progress,
    and the batch step, whose processes SLURM kills when the script ends, must outlive it.

    ``runs.json`` is written before ``scontrol requeue``, which ends this batch script.
    Request files left from the run are removed so the next run does not act on them.
    ``dry_run`` decides and reports only.
    """
    env = env if env is not None else SlurmEnv.from_env()
    from .savers import wait_for_savers

    job = JobDir.of(jobdir)
    if exit_code == EXIT_JOBDIR_BUSY or (job.root.is_dir() and _lease_refused(list(read_events(job.events)), env)):
        # the savers, requests and records there belong to the run holding the lease
        decision = decide(jobdir, exit_code=exit_code, env=env, policy=policy, runner=runner,
                          checkpoints_lookup=lambda root: None, clock=clock)
        return RunOutcome(decision=decision, action=None, message=f"ftkit requeue: not requeued: {decision.reason}",
                          exit_code=decision.exit_code)
    waited, running, seconds = wait_for_savers(jobdir, saver_wait)
    if waited:
        EventLog(JobDir.of(jobdir).events).emit("savers-waited", pids=waited, still_running=running,
                                                seconds=round(seconds, 3))
    decision = decide(jobdir, exit_code=exit_code, env=env, policy=policy, runner=runner,
                      checkpoints_lookup=checkpoints_lookup, clock=clock)
    target = env.requeue_target or "(no job)"
    if dry_run:
        what = f"would requeue job {target}" if decision.requeue else "would not requeue"
        return RunOutcome(decision=decision, action=None, message=f"ftkit requeue (dry run): {what}: {decision.reason}",
                          exit_code=decision.exit_code)
    runs = read_runs(job.runs)
    record = dict(decision.run)
    record["method"] = ("slurm" if decision.already_requeued else "scontrol") if decision.requeue else None
    _write_runs(job.runs, [*runs, record])
    for name in decision.spent_requests:
        Path(name).unlink(missing_ok=True)

    error = None
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
    if decision.requeue:  # what perform did (or why it failed)
        _write_runs(job.runs, [*runs, record])
    EventLog(job.events).emit(
        "requeue", requeue=bool(record["requeue"]), reason=decision.reason, cause=decision.cause,
        method=record["method"], job_id=env.job_id, new_job_id=record.get("new_job_id"),
        exit_code=decision.training_exit_code, requeues=decision.requeues, step=decision.run.get("end_step"),
        error=error, spent_requests=[Path(p).name for p in decision.spent_requests],
    )
    log.info("%s", message)
    return RunOutcome(decision=decision, action=action, message=message, exit_code=exit_code_out)
