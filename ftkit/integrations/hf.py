"""Hugging Face ``transformers.Trainer`` under ftkit: signals, switch files, cross-rank
agreement, time budget, validated resume and requeue.

One call instead of ``trainer.train()``::

    from ftkit.integrations.hf import train

    run = train(trainer)          # resume from the newest *valid* checkpoint-N, train, close
    if not run.completed: ...     # stopped early (preemption, time limit, kill-switch)

Or without changing the script at all (``FTKIT_*`` variables configure it)::

    python -m ftkit.integrations.hf train.py --my-args ...
    torchrun --nproc-per-node 4 -m ftkit.integrations.hf train.py ...

What happens: at every optimizer step the callback asks the ftkit controller what to do;
a save sets ``control.should_save``, an exit also ``control.should_training_stop``, so
Trainer writes ``checkpoint-N`` at the very step the ranks agreed on. ftkit writes the
``checkpoint-is-incomplete`` sentinel into that directory before Trainer writes anything
and seals it afterwards with ``manifest.json`` (size + CRC-32 of every file, fsynced,
written last). :func:`latest_valid_checkpoint` resumes only from sealed checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ModuleNotFoundError as _exc:  # the optional extra is not installed
    if _exc.name is None or _exc.name.split(".")[0] != "transformers":
        raise
    raise ModuleNotFoundError(
        "ftkit.integrations.hf needs transformers (and accelerate), which are not installed: "
        "pip install 'ftkit[hf]'", name=_exc.name) from _exc

from ..control.controller import Config, FaultTolerance
from ..decision import Decision
from ..envvars import config_from_env, jobdir_from_env
from ..errors import CheckpointError, ConfigError
from ._hf_checkpoints import (
    PREFIX,
    arm,
    checked_resume,
    commit,
    discard_crashed,
    discard_if_empty,
    latest_valid_checkpoint,
    parse_hf_step,
    retain,
)

__all__ = ["FtkitCallback", "Run", "latest_valid_checkpoint", "patch_trainer", "train", "unpatch_trainer"]

log = logging.getLogger(__name__)


def _dist() -> Any:
    """torch.distributed when a process group with more than one rank is up, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


class FtkitCallback(TrainerCallback):
    """Brings ftkit's decisions to a ``transformers.Trainer``.

    ``ft`` is a :class:`ftkit.FaultTolerance` the caller starts and closes (as :func:`train`
    does). Without one, the callback builds its own at ``on_train_begin`` from ``jobdir``
    (default ``FTKIT_JOBDIR``, then ``args.output_dir``) and ``config`` (default: the
    ``FTKIT_*`` variables), and closes it at ``on_train_end``.

    ``keep_last``: after each sealed save keep the newest N valid ``checkpoint-N`` (None:
    leave deletion to Trainer's ``save_total_limit``); default from ``config.checkpoint``.
    Use :meth:`attach` rather than ``callbacks=[...]`` so the sentinel is written for every
    save Trainer makes (best-model saves included), not only those decided at step end.
    """

    def __init__(
        self,
        ft: FaultTolerance | None = None,
        *,
        jobdir: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        keep_last: int | str | None = "config",
    ) -> None:
        self.ft = ft
        self._jobdir = jobdir
        self._config = config
        self._owns_ft = ft is None
        self._keep_last = keep_last
        self.decision: Decision | None = None
        """The exit decision that stopped training (None: not stopped by ftkit)."""
        self.completed = False
        """True once Trainer reached ``max_steps`` without ftkit stopping it."""
        self._save_decision: Decision | None = None
        self._reason: str | None = None
        self._armed: Path | None = None
        self._began = 0.0
        self._wrapped = False
        self._resume: tuple[str | None, float] | None = None  # what train() resumes from, since when

    # -- wiring -----------------------------------------------------------------------------

    def attach(self, trainer: Any) -> FtkitCallback:
        """Add this callback to ``trainer`` and mark every checkpoint incomplete before Trainer
        writes it (wraps the instance's ``_save_checkpoint``, Trainer's one save path)."""
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        original = trainer._save_checkpoint
        if getattr(original, "_ftkit_callback", None) is self:
            return self

        @functools.wraps(original)
        def _save_checkpoint(model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
            path = Path(trainer._get_output_dir(trial=trial)) / f"{PREFIX}-{trainer.state.global_step}"
            self._arm(trainer.args, trainer.state.global_step, path)
            return original(model, trial, *args, **kwargs)

        _save_checkpoint._ftkit_callback = self  # type: ignore[attr-defined]
        trainer._save_checkpoint = _save_checkpoint
        self._wrapped = True
        self._wrap_train(trainer)
        if self.ft is not None and not self.ft._started:  # its start event names Trainer's output dir
            self.ft._start_fields = _hf_root(trainer.args.output_dir)
        return self

    def _wrap_train(self, trainer: Any) -> None:
        """Check what the instance's ``train()`` is told to resume from before Trainer loads it:
        ``resume_from_checkpoint=True`` takes the newest *valid* checkpoint, a path ftkit knows
        is broken is replaced by the newest valid one (:func:`checked_resume`), and the
        leftovers of crashed saves are deleted before Trainer looks."""
        original = trainer.train

        @functools.wraps(original)
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            import transformers

            if getattr(trainer, "_ftkit_active", False) or _patched(transformers.Trainer.train):
                # train() / the launcher drive it (the launcher refuses a Trainer with its own callback)
                return original(resume_from_checkpoint, *args, **kwargs)
            began = time.monotonic()
            ft = self._begin(trainer.args)
            try:
                resume = False if resume_from_checkpoint is None else resume_from_checkpoint
                resumed = _resume_path(ft, trainer.args.output_dir, resume, checksums=True)
                _log_resume(ft, resumed, resume, trainer.args.output_dir)
                if trainer.args.should_save:  # before Trainer looks at (or loads) any checkpoint-N
                    discard_crashed(trainer.args.output_dir, events=ft.events)
                self._resume = (resumed, began)
                return original(resumed, *args, **kwargs)
            except BaseException as exc:
                if self._owns_ft and self.ft is not None:  # a crash before on_train_end: the exit event says so
                    self.ft.__exit__(type(exc), exc, exc.__traceback__)
                    self.ft = None
                raise

        train._ftkit_callback = self  # type: ignore[attr-defined]
        trainer.train = train

    def detach(self, trainer: Any) -> None:
        """Undo :meth:`attach`."""
        for name in ("_save_checkpoint", "train"):
            if getattr(trainer.__dict__.get(name), "_ftkit_callback", None) is self:
                delattr(trainer, name)
        self._wrapped = False
        if self in trainer.callback_handler.callbacks:
            trainer.remove_callback(self)

    @property
    def keep_last(self) -> int | None:
        if self._keep_last != "config":
            return self._keep_last  # type: ignore[return-value]
        ckpt = self.ft.config.checkpoint if self.ft is not None else None
        return None if ckpt is None else ckpt.keep_last

    # -- Trainer events ---------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer(callbacks=[FtkitCallback()]): attach to it as attach() would, so that every save
        # is marked in advance and train()'s resume_from_checkpoint is checked before Trainer loads it
        trainer = _constructing_trainer(self)
        if trainer is not None and not self._wrapped:
            self.attach(trainer)

    def _begin(self, args: Any) -> FaultTolerance:
        if self.ft is None:
            jobdir = self._jobdir or jobdir_from_env() or args.output_dir
            config = self._config or config_from_env(jobdir=jobdir)
            self.ft = FaultTolerance(jobdir, config=config)
        if not self.ft._started:  # the start event names Trainer's output dir as the checkpoint root
            self.ft._start_fields = _hf_root(args.output_dir)
        return self.ft.start()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin(args)
        self._record_resume(args, state)
        self.decision = None
        self.completed = False
        if args.should_save:  # before any save of this run: a crashed save's directory is not written into
            discard_crashed(args.output_dir, events=self.ft.events)
        if args.save_total_limit is not None and args.should_save:
            log.warning(
                "save_total_limit=%s: Trainer deletes old checkpoints before ftkit has sealed the new "
                "one, so a crash right then can leave no valid checkpoint; prefer FTKIT_KEEP_LAST",
                args.save_total_limit,
            )

    def _record_resume(self, args: Any, state: Any) -> None:
        """The ``resume`` event, now that Trainer has loaded the checkpoint (``ftkit report``: the
        training loop starts here; the time since ``train()`` was called is the load's). It names
        the checkpoint and Trainer's output dir (``checkpoint_root``), so the CLI finds the
        ``checkpoint-N`` dirs also where the ``FaultTolerance`` was started before the callback
        knew the output dir (its start event names ``JOBDIR/checkpoints``)."""
        ft = self.ft
        assert ft is not None
        pending, self._resume = self._resume, None
        if pending is not None:
            path, began = pending
            step = None if path is None else parse_hf_step(Path(path).name)
            timing = ft.runclock.resumed(step, load_seconds=time.monotonic() - began, manager_seconds=0.0)
        else:  # a train() ftkit did not see called: what Trainer loaded, if anything, is in its state
            path, step = None, state.global_step or None
            ft.runclock.loop_from(step or 0)
            timing = {}
        if step is not None:
            ft._last_saved_step = step  # shown in the exit event if nothing newer is saved
        ft.events.emit("resume", step=step, path=None if path is None else str(Path(path).absolute()),
                       world_size=ft.world_size, **_hf_root(args.output_dir), **timing)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.ft is not None, "FtkitCallback: on_train_begin was not called"
        step = state.global_step
        self._discard_unused()
        decision = self.ft.check(step)
        every = self.ft.config.save_every
        if decision.exit:
            control.should_training_stop = True
            self.decision = decision
        if decision.save:
            control.should_save = True
            self._save_decision = decision
            self._reason = "; ".join(decision.reasons)
        elif decision.exit:
            control.should_save = False  # exit without saving (kill-switch present at start)
        elif every is not None and not self.ft.stopping and self.ft.periodic_due(step):
            control.should_save = True
            self._reason = f"periodic (every {every} steps)" if every != "auto" else "periodic (auto interval)"
        if control.should_save and not self._wrapped:
            self._arm(args, step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save and not self._wrapped:
            self._arm(args, state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._seal(args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._discard_unused()
        # an exit decided at max_steps itself (a signal just then) ends a training that is done
        # all the same, once its end is saved: no requeue, and the script's own ending runs
        self.completed = state.global_step >= state.max_steps and (self.decision is None or self.decision.save)
        if self.ft is not None:
            self.ft.completed = self.completed
            if self._owns_ft:
                self.ft.close()
                self.ft = None

    # -- the commit -------------------------------------------------------------------------

    def _arm(self, args: Any, step: int, path: Path | None = None) -> None:
        self._discard_unused()
        path = path if path is not None else Path(args.output_dir) / f"{PREFIX}-{step}"
        if args.should_save:
            arm(path)
        self._armed = path
        self._began = time.monotonic()

    def _discard_unused(self) -> None:
        """A directory armed for a save Trainer then skipped (e.g. not a new best model)."""
        if self._armed is not None:
            discard_if_empty(self._armed)
            self._armed = None

    def _seal(self, args: Any, state: Any) -> None:
        ft = self.ft
        assert ft is not None, "FtkitCallback: on_train_begin was not called"
        if self._armed is None:  # a save we did not see coming: its duration is unknown
            self._began = time.monotonic()
        path = self._armed or Path(args.output_dir) / f"{PREFIX}-{state.global_step}"
        step = parse_hf_step(path.name)
        step = state.global_step if step is None else step
        decision, reason = self._save_decision, self._reason or "Trainer save_strategy"
        self._armed, self._save_decision, self._reason = None, None, None
        dist = _dist()
        if dist is not None:
            dist.barrier()  # every rank's files (RNG state, shards) are written
        if args.should_save:
            try:
                info = commit(path, step=step, reason=reason, world_size=ft.world_size)
            except CheckpointError as exc:
                ft.events.emit("save-failed", step=step, path=str(path.absolute()), reason=reason, error=str(exc),
                               kind="hf")
                if decision is not None and decision.exit:
                    raise
                log.warning("checkpoint at step %d could not be sealed, training continues: %s", step, exc)
                return
            seconds = time.monotonic() - self._began
            ft.events.emit("save", step=step, path=str(path.absolute()), bytes=info.size, seconds=round(seconds, 3),
                           reason=reason, kind="hf")
            if self.keep_last is not None:
                best = state.best_model_checkpoint
                retain(path.parent.absolute(), keep_last=self.keep_last, protect=[best] if best else (),
                       events=ft.events)  # (absolute: the events log names every checkpoint so)
        if dist is not None:
            dist.barrier()  # the manifest is durable before any rank acts on it (exit, requeue)
        ft.saved(step, seconds=time.monotonic() - self._began, decision=decision)  # Trainer wrote it


# -- one call: resume + callback + close --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """What :func:`train` did."""

    output: Any
    """Trainer's ``TrainOutput`` (None when a kill-switch stopped the run before it began)."""
    completed: bool
    """Training reached ``max_steps``."""
    decision: Decision | None
    """The exit decision that stopped training early, if any (``decision.requeue``: the wish)."""
    resumed_from: str | None
    """The checkpoint training resumed from."""
    stopped: bool = False
    """ftkit stopped the run (an exit decision or a kill-switch present at start)."""


def _hf_root(output_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The start event's fields that name Trainer's output dir as the run's checkpoint root
    (``ftkit status``, ``ls`` and ``verify`` find its ``checkpoint-N`` there before the run saves)."""
    return {"checkpoint_root": str(Path(output_dir).absolute()), "kind": "hf"}


def _resume_path(ft: FaultTolerance, output_dir: str, resume: bool | str, checksums: bool) -> str | None:
    """What to resume from: False nothing, True the newest valid checkpoint in ``output_dir``, a
    path as given unless ftkit knows it is broken (:func:`checked_resume`). Rank 0 chooses and
    broadcasts, so all ranks resume from the same checkpoint (or all raise)."""
    if resume is False:
        return None
    path, error = None, None
    if ft.rank == 0:
        try:
            if isinstance(resume, (str, os.PathLike)):
                path = checked_resume(resume, output_dir, checksums=checksums, events=ft.events)
            else:
                path = latest_valid_checkpoint(output_dir, checksums=checksums, events=ft.events)
        except CheckpointError as exc:
            error = str(exc)
    dist = _dist()
    if dist is not None:
        box = [path, error]
        dist.broadcast_object_list(box, src=0)
        path, error = box
    if error is not None:
        raise CheckpointError(error)
    return path


def _log_resume(ft: FaultTolerance, resumed: str | None, resume: Any, output_dir: str) -> None:
    """Where this run goes on from, in the job's log (as ftkit's own resume says it): rank 0 as a
    warning, which a default logging set-up shows."""
    level = logging.WARNING if ft.rank == 0 else logging.INFO
    if resumed is not None:
        log.log(level, "ftkit resume: step %s from %s", parse_hf_step(Path(resumed).name), resumed,
                extra={"ftkit_notice": True})
    else:
        log.log(level, "ftkit resume: %s", "resume=False: starting fresh" if resume is False else
                f"no valid checkpoint in {Path(output_dir).absolute()}: starting fresh", extra={"ftkit_notice": True})


def _constructing_trainer(callback: FtkitCallback) -> Any:
    """The Trainer whose ``__init__`` is calling ``callback.on_init_end`` (found up the stack: the
    callback event hands callbacks no Trainer), or None."""
    frame = sys._getframe(1)
    for _ in range(10):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if any(cb is callback for cb in getattr(handler, "callbacks", ())) and callable(
                getattr(candidate, "_save_checkpoint", None)) and callable(getattr(candidate, "train", None)):
            return candidate
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _active(trainer: Any) -> Iterator[None]:
    trainer._ftkit_active = True
    try:
        yield
    finally:
        trainer._ftkit_active = False


def _run(
    trainer: Any,
    call: Callable[[str | None], Any],
    *,
    jobdir: str | os.PathLike[str] | None,
    config: Config | None,
    resume: bool | str,
    checksums: bool,
) -> Run:
    jobdir = jobdir or jobdir_from_env() or trainer.args.output_dir
    config = config if config is not None else config_from_env(jobdir=jobdir)
    ft = FaultTolerance(jobdir, config=config)
    callback = FtkitCallback(ft)
    theirs = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, FtkitCallback)]
    if theirs:
        raise ConfigError(
            "this Trainer already has an FtkitCallback, and train() (or python -m ftkit.integrations.hf, "
            "which calls it) adds its own: use one of them. With train() or the launcher, remove the "
            "FtkitCallback from the script; to keep the callback, run the script with plain python/torchrun "
            "and call trainer.train() yourself")
    ft._start_fields = _hf_root(trainer.args.output_dir)
    with ft, _active(trainer):
        if ft.stopping:
            log.warning("ftkit: kill-switch present, not training")
            return Run(None, False, None, None, stopped=True)
        began = time.monotonic()
        resumed = _resume_path(ft, trainer.args.output_dir, resume, checksums)
        _log_resume(ft, resumed, resume, trainer.args.output_dir)
        if trainer.args.should_save:  # before Trainer loads: a crashed save's directory is gone
            discard_crashed(trainer.args.output_dir, events=ft.events)
        callback.attach(trainer)
        callback._resume = (resumed, began)  # the resume event, at on_train_begin (once loaded)
        try:
            output = call(resumed)
        finally:
            callback.detach(trainer)
        return Run(output, callback.completed, callback.decision, resumed,
                   stopped=callback.decision is not None and not callback.completed)


def train(
    trainer: Any,
    jobdir: str | os.PathLike[str] | None = None,
    *,
    config: Config | None = None,
    resume: bool | str = True,
    checksums: bool = True,
    **train_kwargs: Any,
) -> Run:
    """Resume ``trainer`` from the newest valid checkpoint, train under ftkit, close.

    ``jobdir`` (default ``FTKIT_JOBDIR``, then ``trainer.args.output_dir``) holds the switch
    files and ``events.jsonl``; ``config`` defaults to the ``FTKIT_*`` variables. ``resume``:
    True picks :func:`latest_valid_checkpoint` of ``args.output_dir`` (``checksums`` verifies
    CRC-32s too), False starts fresh, a path resumes from it. Other keywords go to
    ``trainer.train`` (but not ``resume_from_checkpoint``: that is ``resume``).
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("train(trainer, resume_from_checkpoint=...): pass resume=... instead (True: the newest "
                        "valid checkpoint, the default; False: start fresh; a path: that checkpoint)")
    return _run(trainer, lambda ckpt: trainer.train(resume_from_checkpoint=ckpt, **train_kwargs),
                jobdir=jobdir, config=config, resume=resume, checksums=checksums)


# -- no script change: patch Trainer.train ------------------------------------------------

def patch_trainer(*, jobdir: str | os.PathLike[str] | None = None, config: Config | None = None,
                  exit_on_stop: bool = True) -> None:
    """Make every ``transformers.Trainer.train()`` in this process run under ftkit.

    ``train()`` / ``train(resume_from_checkpoint=True)`` resume from the newest *valid*
    checkpoint, ``False`` starts fresh, a path resumes from it. When ftkit stops training
    early, ``exit_on_stop`` raises ``SystemExit(0)`` after the checkpoint is sealed, so the
    script's post-training code (final save, evaluation, upload) does not run on a job that
    is being preempted. Idempotent; :func:`unpatch_trainer` undoes it.
    """
    import transformers

    if _patched(transformers.Trainer.train):
        return
    original = transformers.Trainer.train

    @functools.wraps(original)
    def train_under_ftkit(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_ftkit_active", False):  # a subclass's train() calling super().train()
            return original(self, resume_from_checkpoint, *args, **kwargs)
        resume = True if resume_from_checkpoint is None else resume_from_checkpoint
        run = _run(self, lambda ckpt: original(self, ckpt, *args, **kwargs),
                   jobdir=jobdir, config=config, resume=resume, checksums=True)
        if run.stopped and exit_on_stop:
            raise SystemExit(0)
        return run.output

    train_under_ftkit._ftkit_patch = True  # type: ignore[attr-defined]
    transformers.Trainer.train = train_under_ftkit  # type: ignore[method-assign]


def unpatch_trainer() -> None:
    """Restore ``transformers.Trainer.train``."""
    import transformers

    if _patched(transformers.Trainer.train):
        transformers.Trainer.train = transformers.Trainer.train.__wrapped__  # type: ignore[method-assign]


def _patched(train: Callable[..., Any]) -> bool:
    """The patch is recorded on the patched function itself (its ``__wrapped__`` is the original),
    not in a module-level variable: what is installed is the only truth."""
    return getattr(train, "_ftkit_patch", False)


if __name__ == "__main__":
    from ftkit.integrations._hf_launch import main

    sys.exit(main())
