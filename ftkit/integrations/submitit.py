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

A ``scontrol requeue`` that SLURM refuses because it has requeued the job itself
(preemption with ``PreemptMode=REQUEUE``: "Job is pending execution") counts as requeued:
``scontrol show job`` must show it (PENDING, or ``Restarts`` past this run's
``SLURM_RESTART_COUNT``), as ``ftkit requeue`` checks too. Any other failure surfaces.

The next run builds a ``FaultTolerance`` on the same job directory and ``ft.range``
resumes. Without a requeue wish (training completed, ``SIGTERM``'s save-exit, a
kill-switch, ``stop``) the function's return value is the job's result; ``ft.completed``
tells the function whether training reached the end.

A job of several tasks (``nodes``/``tasks_per_node``) needs its ``torch.distributed``
process group before ``FaultTolerance`` is built, or every task sees world size 1 and all
but one are refused the job dir's lease. ``distributed="auto"`` (the default) initialises it
from submitit's job environment when the job has more than one task and nothing initialised
it yet; ``fn`` then finds it initialised.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
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
from ..errors import ConfigError, SlurmError
from ..slurm.env import SlurmEnv, job_info
from ..slurm.requeue_policy import slurm_requeued
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


def _num_tasks() -> int:
    """How many tasks submitit started for this job; 1 outside a submitit job."""
    try:
        return int(JobEnvironment().num_tasks)
    except RuntimeError:  # not in a submitit job (the function called directly)
        return 1


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch just to learn we are alone
    return dist is not None and dist.is_available() and dist.is_initialized()


def _init_process_group(backend: str) -> None:
    """Set up the default process group the way submitit's docs do: export MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK from the job environment, then ``env://``.
    ``CUDA_VISIBLE_DEVICES`` is left alone; for NCCL the task's device is ``LOCAL_RANK``
    (modulo the visible devices), which ftkit's own collectives use too."""
    import torch
    import torch.distributed as dist
    from submitit.helpers import TorchDistributedEnvironment

    if not dist.is_available():
        raise ConfigError("FtkitCheckpointable(distributed=...): this torch has no torch.distributed; "
                          "pass distributed=None and run one task per job")
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    log.info("ftkit: initialising torch.distributed (%s): rank %d of %d, master %s:%d",
             backend, env.rank, env.world_size, env.master_addr, env.master_port)
    dist.init_process_group(backend)


def _destroy_process_group() -> None:
    """Tear down the group this helper set up (a gloo group left to interpreter shutdown
    can abort it, turning a clean exit into SIGABRT)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _requeued_by_slurm() -> str | None:
    """How ``scontrol show job`` shows that SLURM requeued this job itself, else None."""
    env = SlurmEnv.from_env()
    if env.job_id is None:
        return None
    try:
        return slurm_requeued(job_info(env.job_id), env.restart_count)
    except SlurmError as exc:
        log.warning("ftkit: cannot tell whether SLURM requeued job %s itself: %s", env.job_id, exc)
        return None


class FtkitCheckpointable(Checkpointable):
    """A submitit callable that runs ``fn(ft, *args, **kwargs)`` under ftkit.

    ``jobdir`` (default ``FTKIT_JOBDIR``) holds checkpoints, switches and ``events.jsonl``;
    it must be on a filesystem every run of the job sees. ``config`` defaults to the
    ``FTKIT_*`` variables of the job's environment, read when the job starts.
    ``fn`` sets ``ft.state`` before ``ft.range`` (or ``ft.resume``).

    ``distributed``: who sets up ``torch.distributed`` in a job of several tasks, which
    ``FaultTolerance`` needs before it is built (it reads the world size then).
    ``"auto"``: this helper, with NCCL when CUDA is available, else gloo; a backend name
    (``"gloo"``, ``"nccl"``, ...): this helper, with that backend; None: the caller, before
    the callable runs (a job of several tasks without a group is refused, before the lease
    is taken). A group that exists already is used as it is; one set up here is destroyed
    when the callable returns.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        jobdir: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        distributed: str | None = "auto",
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"FtkitCheckpointable(fn): {fn!r} is not callable; pass the training function")
        where = Path(jobdir).expanduser().absolute() if jobdir is not None else jobdir_from_env()
        if where is None:
            raise ConfigError("FtkitCheckpointable(jobdir=...): give the job directory or set FTKIT_JOBDIR")
        if distributed is not None and (not isinstance(distributed, str) or not distributed.strip()):
            raise ConfigError(f"FtkitCheckpointable(distributed=...): expected 'auto', a torch.distributed "
                              f"backend name ('gloo', 'nccl') or None, got {distributed!r}")
        self.fn = fn
        self.jobdir = where
        self.config = config
        self.distributed = distributed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = self.config if self.config is not None else config_from_env(jobdir=self.jobdir)
        owned = self._setup_distributed()
        try:
            return self._run(config, args, kwargs)
        except ValueError as exc:
            if owned and "default process group twice" in str(exc):  # torch's words, fn's init_process_group
                raise ConfigError(
                    "the training function initialises torch.distributed itself, but FtkitCheckpointable "
                    "(distributed='auto', the default) did already, before building ftkit: remove the function's "
                    "init_process_group call, or pass FtkitCheckpointable(..., distributed=None) and initialise "
                    "the group before the callable runs") from exc
            raise
        finally:
            if owned:
                _destroy_process_group()

    def _setup_distributed(self) -> bool:
        """Initialise the process group where this job needs one and has none; True if it did."""
        tasks = _num_tasks()
        if tasks <= 1 or _group_initialized():
            return False
        if self.distributed is None:
            raise ConfigError(
                f"FtkitCheckpointable: this job runs {tasks} tasks, but torch.distributed is not initialised "
                "when ftkit starts, so every task would see world size 1 and all but one would be refused the "
                "job dir's lease (exit 86). Pass distributed='auto' (the default) or a backend name to let "
                "FtkitCheckpointable set up the group, or initialise it before the callable runs; fn must "
                "not initialise it again")
        _init_process_group(self.distributed)
        return True

    def _run(self, config: Config, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
        """Hand over to submitit's checkpoint-and-requeue, now that the checkpoint is durable.
        Rank 0 records what came of it in a ``requeue`` event."""
        final = ft.final_decision
        reasons = "; ".join(final.reasons) if final is not None else ""
        owner: Any = getattr(handler, "__self__", None)
        if not callable(getattr(owner, "checkpoint_and_try_requeue", None)):
            log.warning("ftkit: a requeue was asked for (%s), but this is not a submitit job: "
                        "nothing to requeue", reasons)
            return result
        rank = owner.env.global_rank

        def record(requeue: bool, method: str, **details: Any) -> None:
            ft.events.emit("requeue", requeue=requeue, method=method, reason=reasons, step=ft.last_saved_step,
                           job_id=owner.env.job_id, **details)

        log.warning("ftkit: checkpoint at step %s is durable; submitit requeues the job (%s)",
                    ft.last_saved_step, reasons)
        try:
            owner.checkpoint_and_try_requeue(sig)  # rank 0 requeues and exits; other ranks return
        except SystemExit:  # requeued: submitit exits (after `scontrol requeue`; code 144 locally)
            record(True, "submitit")
            raise
        except UncompletedJobError as exc:  # e.g. timed out more than max_num_timeout times
            record(False, "submitit", error=str(exc))
            raise
        except subprocess.CalledProcessError as exc:
            how = _requeued_by_slurm()  # preemption may have requeued it first ("Job is pending execution")
            if how is None:
                record(False, "submitit", error=f"{exc}; see the job's stderr for scontrol's answer")
                raise
            detail = f"`scontrol requeue` was refused, but SLURM had requeued the job already ({how})"
            record(True, "slurm", detail=detail)
            log.warning("ftkit: %s; the next run resumes from step %s", detail, ft.last_saved_step)
            exit_ = getattr(owner, "_exit", None)  # what submitit does after its own requeue
            if callable(exit_):
                exit_()
            sys.exit(-1)
        except Exception as exc:
            record(False, "submitit", error=str(exc))
            raise
        raise UncompletedJobError(f"rank {rank}: stopped for a requeue ({reasons}); rank 0 requeues the job")

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """What submitit resubmits: this callable with the same arguments. Saves nothing: the
        training state is in the job directory, written by ftkit at a step boundary."""
        return DelayedSubmission(self, *args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"FtkitCheckpointable({name}, jobdir={str(self.jobdir)!r})"
