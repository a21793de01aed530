"""submitit jobs that save through ftkit and resume on requeue.

Wrap the training function; it gets a :class:`~ftkit.FaultTolerance` as first argument::

    from ftkit.integrations.submitit import FtkitCheckpointable

    def train(ft, cfg):
        model, opt = build(cfg)
        ft.state = {"model": model, "optimizer": opt}
        for step in ft.range(cfg.steps):      # resumes from the newest valid checkpoint
            train_step(step)
        return ft.completed

    job = executor.submit(FtkitCheckpointable(train, jobdir="runs/exp1"), cfg)

Why not submitit's own checkpoint path: submitit's handler for its preemption signal
(``SIGUSR2`` unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise) calls ``checkpoint()``
*inside the signal handler*, at whatever line the training was on, then requeues and
exits at once. ftkit never saves from a handler. So while the function runs:

1. submitit's handlers for its preemption signal and ``SIGTERM`` are swapped for a handler
   that only records the signal; ftkit's handlers go on top (ftkit chains to it), with
   submitit's signal mapped to ``requeue`` unless the config maps it already;
2. the loop saves at the next step boundary and leaves ``ft.range``; ``FaultTolerance``
   closes, which waits until the checkpoint is durable;
3. if the exit decision wants a requeue (submitit's signal, ``SIGUSR1``, the time budget,
   ``ftkit request requeue``), submitit's own handler is called from ordinary code: it
   calls :meth:`FtkitCheckpointable.checkpoint` (which saves nothing: the state is in the
   job directory), writes the submission pickle with the timeout countdown, and requeues
   (``scontrol requeue`` on SLURM, exit code 144 under the local executor, which restarts
   the task). Timeouts past ``max_num_timeout`` end the job with ``UncompletedJobError``,
   as submitit does.

The next run builds a ``FaultTolerance`` on the same job directory and ``ft.range``
resumes. Without a requeue wish (training completed, ``SIGTERM``'s save-exit, a
kill-switch, ``stop``) the function's return value is the job's result; ``ft.completed``
tells the function whether training reached the end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from submitit.core.job_environment import JobEnvironment
from submitit.core.utils import UncompletedJobError
from submitit.helpers import Checkpointable, DelayedSubmission

from ..control.controller import Config, FaultTolerance
from ..decision import Request, Source
from ..envvars import config_from_env, jobdir_from_env
from ..errors import ConfigError
from ..triggers.signals import SignalConfig

__all__ = ["FtkitCheckpointable", "submitit_signal"]

log = logging.getLogger(__name__)


def submitit_signal() -> signal.Signals:
    """The signal submitit sends before a timeout / on preemption (``SUBMITIT_PREEMPT_SIGNAL``,
    default ``USR2``); its sbatch scripts ask SLURM for ``--signal=SIG@signal_delay_s``."""
    return signal.Signals(JobEnvironment._usr_sig())


class _Seen:
    """A signal handler that only records which signals arrived."""

    def __init__(self) -> None:
        self.signals: set[int] = set()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signals.add(signum)


def _with_submitit_signal(config: Config, sig: signal.Signals) -> Config:
    """``config`` with ``sig`` -> ``requeue`` added, unless it maps ``sig`` already."""
    signals = config.signals
    if not signals.enabled:
        return config
    # chain: submitit's recorder keeps seeing the signals it handles (it decides requeues)
    actions = signals.actions if sig in signals.resolved else {**signals.actions, sig.name: "requeue"}
    return dataclasses.replace(config, signals=SignalConfig(
        actions=actions, enabled=True, chain=True, interrupt_window=signals.interrupt_window))


def _replay(ft: FaultTolerance, signals: SignalConfig, seen: _Seen) -> None:
    """Post what arrived between swapping submitit's handlers out and ftkit's start."""
    for signum in sorted(seen.signals):
        sig = signal.Signals(signum)
        if sig in signals.resolved:
            action, requeue = signals.resolved[sig]
            ft.box.post(Request(action, Source.SIGNAL, f"{sig.name} received while ftkit started",
                                requeue=requeue, signal=signum))


class FtkitCheckpointable(Checkpointable):
    """A submitit callable that runs ``fn(ft, *args, **kwargs)`` under ftkit.

    ``jobdir`` (default ``FTKIT_JOBDIR``) holds checkpoints, switches and ``events.jsonl``;
    it must be on a filesystem every run of the job sees. ``config`` defaults to the
    ``FTKIT_*`` variables of the job's environment, read when the job starts.
    ``fn`` sets ``ft.state`` before ``ft.range`` (or ``ft.resume``).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        jobdir: str | os.PathLike[str] | None = None,
        config: Config | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"FtkitCheckpointable(fn): {fn!r} is not callable; pass the training function")
        where = Path(jobdir).expanduser().absolute() if jobdir is not None else jobdir_from_env()
        if where is None:
            raise ConfigError("FtkitCheckpointable(jobdir=...): give the job directory or set FTKIT_JOBDIR")
        self.fn = fn
        self.jobdir = where
        self.config = config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = self.config if self.config is not None else config_from_env(jobdir=self.jobdir)
        if not config.signals.enabled:  # another layer owns signals: leave submitit's in place
            with FaultTolerance(self.jobdir, config=config) as ft:
                return self.fn(ft, *args, **kwargs)
        sig = submitit_signal()
        config = _with_submitit_signal(config, sig)
        seen = _Seen()
        previous = {s: signal.signal(s, seen) for s in dict.fromkeys((sig, signal.SIGTERM))}
        try:
            with FaultTolerance(self.jobdir, config=config) as ft:
                _replay(ft, config.signals, seen)
                result = self.fn(ft, *args, **kwargs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        final = ft.final_decision
        if ft.completed or final is None or not final.exit:
            return result
        if final.requeue is False or (final.requeue is None and sig not in seen.signals):
            return result
        return self._requeue(ft, previous[sig], sig, result)

    def _requeue(self, ft: FaultTolerance, handler: Any, sig: signal.Signals, result: Any) -> Any:
        """Hand over to submitit's checkpoint-and-requeue, now that the checkpoint is durable."""
        final = ft.final_decision
        reasons = "; ".join(final.reasons) if final is not None else ""
        owner: Any = getattr(handler, "__self__", None)
        if not callable(getattr(owner, "checkpoint_and_try_requeue", None)):
            log.warning("ftkit: a requeue was asked for (%s), but this is not a submitit job: "
                        "nothing to requeue", reasons)
            return result
        ft.events.emit("requeue", requeue=True, method="submitit", reason=reasons,
                       step=ft.last_saved_step, job_id=owner.env.job_id)
        log.warning("ftkit: checkpoint at step %s is durable; submitit requeues the job (%s)",
                    ft.last_saved_step, reasons)
        try:
            owner.checkpoint_and_try_requeue(sig)  # rank 0 requeues and exits; other ranks return
        except UncompletedJobError as exc:  # e.g. timed out more than max_num_timeout times
            ft.events.emit("requeue", requeue=False, method="submitit", reason=reasons,
                           step=ft.last_saved_step, job_id=owner.env.job_id, error=str(exc))
            raise
        raise UncompletedJobError(f"rank {owner.env.global_rank}: stopped for a requeue ({reasons}); "
                                  "rank 0 requeues the job")

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """What submitit resubmits: this callable with the same arguments. Saves nothing: the
        training state is in the job directory, written by ftkit at a step boundary."""
        return DelayedSubmission(self, *args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"FtkitCheckpointable({name}, jobdir={str(self.jobdir)!r})"
