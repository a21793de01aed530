"""The requeue policy: from the facts about a finished run to a decision. Pure: no I/O, no clock.

:func:`decide` takes a :class:`~ftkit.slurm.requeue_facts.RunFacts` and a
:class:`RequeuePolicy` and returns a :class:`RequeueDecision`, checking in this order:

0. this run never had the job dir (``lease-refused``): it must not touch the run that has it;
1. stopped for good: the kill-switch, a ``stop`` request, the trainer's own ``requeue=False``,
   training completed, or the job was cancelled (``scancel``);
2. why it ended: SLURM's own state (time limit, preemption, requeued by SLURM), the trainer's
   or a request's wish, a hang, a crash; a clean exit that asked for nothing is finished;
3. the limits: the requeue cap, ``requeue_on_crash``, and for crashes and hangs without a
   newer checkpoint, ``max_no_progress`` (and never a second hang at the same step).

The launcher's exit code is only one of the facts: a launcher such as torchrun exits 1
when SLURM's SIGTERM reaches it although every rank saved and exited cleanly, so the
trainer's own ``exit`` events (one per rank) and SLURM's job state come first. A job the
user cancelled (``scancel``) is never requeued: while its batch script still runs, SLURM
22.05 shows ``JobState=COMPLETING`` (not CANCELLED) with no time limit, preemption or
requeue behind it, and the script has ``KillWait`` seconds left.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..envvars import requeue_settings
from ..errors import EXIT_HANG, EXIT_JOBDIR_BUSY, ConfigError
from .requeue_facts import RunFacts, streak

__all__ = [
    "EXIT_UNFINISHED",
    "RequeueDecision",
    "RequeuePolicy",
    "decide",
    "slurm_requeued",
]

EXIT_UNFINISHED = 75
HANDLED = "handled already"
"""The cause of a second ``ftkit requeue`` for one run: nothing is recorded or done again."""
"""sysexits' EX_TEMPFAIL: the run exited cleanly and wanted a requeue, but none happened."""

_FALLBACKS = ("resubmit", "none")
UNSET = frozenset({"", "none", "unknown", "(null)", "n/a"})
"""How ``scontrol show job`` writes a field that has no value."""


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
        """Defaults, then ``FTKIT_*`` variables (:func:`ftkit.envvars.requeue_settings`), then
        ``overrides`` (None values are skipped)."""
        values = requeue_settings(environ)
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
    """Request files left from this run, removed by :func:`ftkit.slurm.requeue.finish_run`."""


# --------------------------------------------------------------------------------------
# what SLURM's view of the job says


def slurm_requeued(info: Mapping[str, str] | None, restart_count: int) -> str | None:
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
    if restarts.isdigit() and int(restarts) > restart_count:
        return f"Restarts={restarts} > SLURM_RESTART_COUNT={restart_count}"
    return None


def _slurm_cause(info: Mapping[str, str] | None, restart_count: int) -> str | None:
    """Why SLURM is ending the job, from its own state; never guessed from the clock.

    During a preemption's GraceTime the job is still RUNNING but has a PreemptTime; once
    the time limit hits, SLURM 22.05 shows COMPLETING with Reason=TimeLimit.
    """
    if not info:
        return None
    state = info.get("JobState", "").upper()
    if state == "PREEMPTED" or info.get("PreemptTime", "").strip().lower() not in UNSET:
        return "preemption"
    if state in ("TIMEOUT", "DEADLINE") or info.get("Reason") in ("TimeLimit", "DeadLine"):
        return "time limit"
    if slurm_requeued(info, restart_count):
        return "requeued by SLURM"
    return None


def _cancelled(info: Mapping[str, str] | None, restart_count: int) -> str | None:
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
    if state != "COMPLETING" or _slurm_cause(info, restart_count) is not None:
        return None
    reason = info.get("Reason", "").strip()
    if reason.lower() not in UNSET:
        return None
    return "JobState=COMPLETING while the batch script still runs, with no time limit, preemption or requeue"


def _hang_text(hang: Mapping[str, Any] | None) -> str:
    if hang is None:
        return f"the hang watchdog ended it (exit code {EXIT_HANG}, no hang event)"
    seconds = hang.get("seconds")
    waited = f" for {seconds:.0f} s" if isinstance(seconds, (int, float)) else ""
    rank, host, step = hang.get("rank"), hang.get("host") or "?", hang.get("step")
    where = f"rank {'?' if rank is None else rank} on {host}"
    after = "" if step is None else f" after step {step}"
    if "step_exact" in hang and not hang["step_exact"] and hang.get("step_max") is not None:
        # known only from a heartbeat, bounded by the ranks that waited for it: say the range
        from ..control.hangs import step_range

        after = f" after step {step_range(hang)} (the ranks waiting for it completed step {hang['step_max']})"
    text = f"the hang watchdog found {where} completed no step{waited}{after}"
    return text + (f" (stacks in {hang['file']})" if hang.get("file") else "")


# --------------------------------------------------------------------------------------
# deciding


def decide(facts: RunFacts, policy: RequeuePolicy) -> RequeueDecision:
    """Whether the run ``facts`` describe goes back to the queue, and why."""
    verdict = _Verdict(facts, policy)
    handled = facts.handled
    if handled is not None:  # `ftkit requeue` run twice for one run: the second changes nothing
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(handled.get("time", 0.0))))
        did = "requeued" if handled.get("requeue") else "not requeued"
        return verdict(False, HANDLED, f"this run was handled already by an ftkit requeue at {when} ({did}: "
                       f"{handled.get('reason')}); nothing more to do", code=0 if handled.get("requeue") else None)
    done = _never_had_the_job_dir(facts, verdict)
    if done is None:
        done = _stopped_for_good(facts, verdict)
    if done is not None:
        return done
    cause = _cause(facts)
    if cause is None:
        return _finished(facts, verdict)
    return _limits(facts, policy, verdict, cause)


class _Verdict:
    """Builds the :class:`RequeueDecision` for one outcome; the rest comes from the facts."""

    __slots__ = ("facts", "policy", "record")

    def __init__(self, facts: RunFacts, policy: RequeuePolicy) -> None:
        self.facts, self.policy, self.record = facts, policy, facts.record()

    def __call__(self, requeue: bool, cause: str, reason: str, code: int | None = None) -> RequeueDecision:
        facts = self.facts
        if code is None:
            code = 0 if requeue else facts.training_exit_code
        return RequeueDecision(
            requeue=requeue, reason=reason, exit_code=code, cause=cause, training_exit_code=facts.exit_code,
            requeues=facts.requeues, max_requeues=self.policy.max_requeues, fallback=self.policy.fallback,
            already_requeued=requeue and slurm_requeued(facts.slurm_job, facts.env.restart_count) is not None,
            slurm_state=facts.slurm_state, job=facts.slurm_job,
            run={**self.record, "cause": cause, "requeue": requeue, "reason": reason},
            spent_requests=tuple(path for path, _ in facts.requests),
        )


def _never_had_the_job_dir(facts: RunFacts, verdict: _Verdict) -> RequeueDecision | None:
    """0. this run never had the job dir: it must not touch the run that has it."""
    job, refused = facts.jobdir, facts.refused
    if refused is not None and refused.get("idle"):
        return verdict(False, "stopped", f"kill-switch {job.kill_switch} is present; another run held the job dir, "
                       "this one did nothing (remove the kill-switch with `ftkit kill --clear` to let the job "
                       "run again)")
    if refused is not None or facts.exit_code == EXIT_JOBDIR_BUSY:
        holder = (refused or {}).get("holder") or {}
        who = holder.get("holder") if isinstance(holder, dict) else None
        how = f"exited with code {EXIT_JOBDIR_BUSY}" if facts.exit_code == EXIT_JOBDIR_BUSY else \
            f"was refused it (lease-refused; its launcher exited with code {facts.exit_code})"
        return verdict(False, "lease refused", f"another run holds the job dir {job.root}"
                       + (f" ({who})" if who else "") + f": this run {how} "
                       "without touching it; not requeued. Wait for that run to end, end it, "
                       f"or give this job another job dir; `ftkit status {job.root}` shows the holder",
                       EXIT_JOBDIR_BUSY)
    return None


def _reasons(facts: RunFacts) -> str:
    return "; ".join(facts.exit.get("reasons") or []) if facts.exit else ""


def _asked(facts: RunFacts, action: str) -> list[Mapping[str, Any]]:
    """The leftover request files of this run that ask for ``action`` (not those written for
    another run by its signal trap: ``ftkit request --this-run``; spent all the same)."""
    from ..triggers.switches import stale_request

    env = facts.env
    return [d for _, d in facts.requests if str(d.get("action", "")).lower() == action
            and stale_request(d, env.job_id, env.restart_count) is None]


def _stopped_for_good(facts: RunFacts, verdict: _Verdict) -> RequeueDecision | None:
    """1. stopped for good."""
    if facts.kill_switch:
        return verdict(False, "stopped", f"kill-switch {facts.jobdir.kill_switch} is present "
                       "(remove it with `ftkit kill --clear` to let the job run again)")
    stop = _asked(facts, "stop")
    if stop:
        return verdict(False, "stopped", f"a stop request is pending ({stop[-1].get('reason') or 'ftkit request stop'})")
    exit_, reasons = facts.exit, _reasons(facts)
    if exit_ is not None and exit_.get("requeue") is False:
        return verdict(False, "stopped", "the trainer stopped for good" + (f": {reasons}" if reasons else ""))
    if exit_ is not None and exit_.get("completed"):
        return verdict(False, "completed", f"training completed (step {exit_.get('step')})")
    if exit_ is not None and exit_.get("saves_failed"):  # max_failed_saves: the next run's saves fail alike
        return verdict(False, "saves failing", f"the trainer stopped after {exit_['saves_failed']} saves in a row "
                       f"failed ({exit_.get('error')}); a requeued run would fail to save the same way: fix the "
                       "checkpoint dir (space, permissions, a read-only mount), then resubmit", EXIT_UNFINISHED)
    cancelled = _cancelled(facts.slurm_job, facts.env.restart_count)
    if cancelled is not None:
        saved = f"; the trainer saved step {exit_.get('step')} and exited" if exit_ is not None and facts.clean else ""
        return verdict(False, "cancelled", f"the job was cancelled (scancel: {cancelled}){saved}; "
                       "a cancelled job is never requeued (resubmit it to continue)", facts.training_exit_code)
    return None


def _cause(facts: RunFacts) -> str | None:
    """2. why did it end? None: it exited cleanly and asked for nothing (:func:`_finished`)."""
    exit_, reasons = facts.exit, _reasons(facts)
    slurm_cause = _slurm_cause(facts.slurm_job, facts.env.restart_count)
    usr1 = _asked(facts, "requeue")
    if exit_ is not None and exit_.get("requeue") is True:
        if slurm_cause:
            return slurm_cause
        if "USR1" in reasons:
            return "requested (SIGUSR1)"
        return f"requested ({reasons or 'by the trainer'})"
    if slurm_cause:
        return slurm_cause
    if usr1:
        return "requested (SIGUSR1)" if "SIGUSR1" in str(usr1[-1].get("reason")) else "requested"
    if facts.hang is not None or facts.exit_code == EXIT_HANG:
        return "hang"
    if facts.training_exit_code != 0:
        return "crash"
    return None


def _finished(facts: RunFacts, verdict: _Verdict) -> RequeueDecision:
    """A clean exit that asked for no requeue."""
    if facts.exit is not None:
        reasons = _reasons(facts)
        return verdict(False, "finished", "the trainer exited without asking for a requeue"
                       + (f": {reasons}" if reasons else ""))
    return verdict(False, "finished", "the program exited with code 0 and left no ftkit exit record")


def _limits(facts: RunFacts, policy: RequeuePolicy, verdict: _Verdict, cause: str) -> RequeueDecision:
    """3. limits: the requeue cap, then for crashes and hangs ``requeue_on_crash`` and progress."""
    rc, requeues, end_step = facts.exit_code, facts.requeues, facts.end_step
    trc = facts.training_exit_code
    unfinished = trc if trc != 0 else EXIT_UNFINISHED
    if requeues >= policy.max_requeues:
        return verdict(False, cause, f"requeue cap reached: {requeues} requeues (FTKIT_MAX_REQUEUES / "
                       f"--max-requeues = {policy.max_requeues}); not requeued after {cause}", unfinished)
    if cause in ("crash", "hang"):
        what = f"crashed with exit code {rc}" if cause == "crash" else f"hung: {_hang_text(facts.hang)}"
        if not policy.requeue_on_crash:
            return verdict(False, cause, f"{what}; requeue_on_crash is off "
                           "(FTKIT_REQUEUE_ON_CRASH / --no-requeue-on-crash)")
        if not facts.progress:
            previous = facts.runs[-1] if facts.runs else {}
            # exact (the culprit's own record, or the step of the ranks that waited for it), never
            # a stale heartbeat's: jitter in the heartbeats' timing must not hide the same hang
            hang_step = verdict.record["hang_step"]
            if cause == "hang" and previous.get("cause") == "hang" and previous.get("hang_step") == hang_step:
                return verdict(False, cause, f"hung again at step {hang_step} without a newer checkpoint "
                               f"(newest step {end_step}); the previous run hung at the same step, so a requeue "
                               f"would hang there again: {what}")
            n = 1 + streak(facts.runs, lambda r: r.get("cause") in ("crash", "hang") and not r.get("progress"))
            if n > policy.max_no_progress:
                return verdict(False, cause, f"{what} without a newer checkpoint "
                               f"{n} times in a row (newest step {end_step}); max_no_progress is "
                               f"{policy.max_no_progress} (FTKIT_MAX_NO_PROGRESS / --max-no-progress)")
            why = f"{what}, no newer checkpoint ({n} of {policy.max_no_progress} allowed)"
        else:
            why = f"{what} after progress to step {end_step}"
    else:
        why = cause
    return verdict(True, cause, f"{why}; requeue {requeues + 1} of at most {policy.max_requeues}")
