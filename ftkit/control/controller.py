"""The between-steps check: triggers in, one agreed decision out, checkpoints on demand."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..decision import Action, Decision, Request, RequestBox, Source
from ..errors import CheckpointError, ConfigError
from ..events import EventLog
from ..jobdir import JobDir
from ..lease import Lease, LeaseConfig, take_lease
from ..triggers.budget import BudgetConfig, TimeBudget
from ..triggers.files import SwitchWatcher, WatchConfig
from ..triggers.signals import SignalConfig, SignalTrigger
from ..triggers.switches import (
    remove_handled_requests,
    remove_handled_save_switch,
    remove_requests,
    switch_is_set,
    touched_at,
)
from .agreement import (
    SLACK,
    WIDTH,
    AgreementConfig,
    Collective,
    decode_flags,
    decode_signals,
    encode,
)
from .interval import AutoInterval, IntervalConfig
from .runclock import RunClock, TimingConfig
from .watchdog import Watchdog, WatchdogConfig

if TYPE_CHECKING:
    from ..checkpoint import AsyncConfig, CheckpointConfig, CheckpointManager

__all__ = ["Config", "FaultTolerance"]

log = logging.getLogger(__name__)

@dataclass(kw_only=True, slots=True)
class Config:
    """Everything ftkit does for one training job; each component gets only its own part."""

    signals: SignalConfig = field(default_factory=SignalConfig)
    """Which signals are handled and what each asks for."""

    watch: WatchConfig = field(default_factory=WatchConfig)
    """How the save-switch, kill-switch and request files are watched."""

    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """The time budget: save and exit before the job's end time."""

    agreement: AgreementConfig = field(default_factory=AgreementConfig)
    """How often ranks agree on a decision."""

    checkpoint: CheckpointConfig | None = None
    """A ``ftkit.checkpoint.CheckpointConfig``; None: ``JOBDIR/checkpoints`` with defaults."""

    async_save: AsyncConfig | None = None
    """A ``ftkit.checkpoint.AsyncConfig`` to save in the background (the loop stalls only for
    the in-memory snapshot); None: synchronous saves."""

    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The hang watchdog: a rank that completes no step in time dumps its stacks and exits 87."""

    save_every: int | str | None = None
    """Also save every this many steps (periodic checkpoints); ``"auto"``: at the interval
    ``interval`` derives from the measured checkpoint cost and the MTBF (Young/Daly, see
    docs/goodput.md); None: only on request."""

    interval: IntervalConfig = field(default_factory=IntervalConfig)
    """How ``save_every="auto"`` picks the interval (MTBF, bounds)."""

    timing: TimingConfig = field(default_factory=TimingConfig)
    """What the run records about its own timing for ``ftkit report``."""

    save_at_end: bool = True
    """Save a checkpoint when ``range()`` reaches the last step."""

    max_failed_saves: int | None = 3
    """Stop the run (a :class:`ftkit.CheckpointError`, exit non-zero) once this many periodic
    or requested saves in a row have failed, each with a warning: a checkpoint dir that became
    read-only, another user's or full stays so, and a run training on would lose every step
    since its last checkpoint at the end. None: warn and train on, however many fail."""

    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """One run per job dir: rank 0 holds ``JOBDIR/lease.lock``; a second run exits with code 86."""

    def __post_init__(self) -> None:
        if self.save_every is not None and self.save_every != "auto" and (
                not isinstance(self.save_every, int) or isinstance(self.save_every, bool) or self.save_every < 1):
            raise ConfigError(f"save_every: must be a whole number of steps >= 1, 'auto' or None, got {self.save_every!r}")
        if self.max_failed_saves is not None and (not isinstance(self.max_failed_saves, int)
                                                  or isinstance(self.max_failed_saves, bool) or self.max_failed_saves < 1):
            raise ConfigError(f"max_failed_saves: must be a whole number >= 1 or None, got {self.max_failed_saves!r}")
        from ..checkpoint.background.config import AsyncConfig
        from ..checkpoint.config import CheckpointConfig

        parts: dict[str, tuple[type, bool]] = {  # field: its class, and whether None is allowed
            "signals": (SignalConfig, False), "watch": (WatchConfig, False), "budget": (BudgetConfig, False),
            "agreement": (AgreementConfig, False), "checkpoint": (CheckpointConfig, True),
            "async_save": (AsyncConfig, True), "watchdog": (WatchdogConfig, False),
            "interval": (IntervalConfig, False), "timing": (TimingConfig, False), "lease": (LeaseConfig, False)}
        for name, (kind, optional) in parts.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (optional and value is None):
                raise ConfigError(f"{name}: expected {'an' if kind.__name__[0] in 'AEIOU' else 'a'} {kind.__name__}(...){' or None' if optional else ''}, got "
                                  f"{value!r}" + (" (a dict: pass its settings as keywords, "
                                                  f"{kind.__name__}(**settings))" if isinstance(value, dict) else ""))
        if not isinstance(self.save_at_end, bool):
            raise ConfigError(f"save_at_end: expected True or False, got {self.save_at_end!r}")


def _dist_info(process_group: Any) -> tuple[int, int, Any]:
    """(rank, world size, group) from torch.distributed when it is initialised, else (0, 1, None)."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch just to learn we are alone
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1, None
    return dist.get_rank(process_group), dist.get_world_size(process_group), process_group


class FaultTolerance:
    """One per training process. Between steps, ``check(step)`` returns what to do.

    ``step`` is the number of optimizer steps completed so far. Every rank must call
    ``check``/``step`` with the same step numbers. Use as a context manager, or call
    ``start()`` and ``close()``.
    """

    def __init__(
        self,
        job_dir: str | os.PathLike[str],
        *,
        state: Mapping[str, Any] | None = None,
        config: Config | None = None,
        process_group: Any = None,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config if config is not None else Config()
        # the directory the path names now, for the whole run: a symlinked job dir retargeted while
        # the run goes on must not split its checkpoints, events and lease between two directories
        self.job = JobDir.of(JobDir.of(job_dir).ensure().root.resolve())
        self.rank, self.world_size, self._group = _dist_info(process_group)
        self.state = state
        self._clock = clock
        self._wallclock = wallclock
        self.events = EventLog(self.job.events, rank=self.rank, clock=wallclock)
        self.runclock = RunClock(self.events, self.config.timing, clock=clock, wallclock=wallclock,
                                 emit=self.rank == 0)
        self._auto: AutoInterval | None = None  # save_every="auto", made in start()
        self.box = RequestBox()
        self._signals = SignalTrigger(self.config.signals, self.box, clock=clock)
        self._watcher = SwitchWatcher(self.job, self.box, self.config.watch)
        # several ranks: rank 0 alone asks SLURM for the end time; its request reaches every rank
        self.budget = TimeBudget(self.config.budget, clock=wallclock, follower=self.world_size > 1 and self.rank != 0)
        self.watchdog = Watchdog(self.config.watchdog, job_root=self.job.root, events=self.events, rank=self.rank,
                                 world_size=self.world_size, clock=clock, wallclock=wallclock)
        self._collective: Collective | None = None
        self._every = self.config.agreement.every  # steps between agreements now (agreed, see check)
        self._next_agree = 0  # the step of the next agreement
        self._pending: list[Request] = []
        self._final: Decision | None = None
        self._no_save_at_start = False
        self._first_check = True
        self._last_check: float | None = None
        self._last_save_end = float("-inf")  # monotonic time the last save became durable
        self._last_saved_step: int | None = None
        # what resume() returned, and _last_check then: a range() right after it loads nothing again
        self._resumed_at: tuple[int, float | None] | None = None
        self._failed_saves = 0  # saves in a row that failed (max_failed_saves)
        self._durable_seen: int | None = None  # the newest durable step _poll_background saw
        self._stopped_by_saves: int | None = None  # the count that stopped the run (its exit event says it)
        self._snapshot_stall: tuple[int, float] | None = None  # the last memory snapshot's step and stall
        self._handled_wall: dict[Source, float] = {}  # wall time of the last decision per file source
        self._seen_requests: set[str] = set()  # request files this run has logged (acted on or not)
        self._checkpoints: CheckpointManager | None = None
        self._background = False  # the manager persists in the background (on_step, pending_error)
        self._to_consume: list[Decision] = []  # decisions whose files go once their save is durable
        self._started = False
        self._crash: str | None = None
        self._lease: Lease | None = None
        self.completed = False
        self._start_fields: dict[str, Any] = {}  # an integration's own, in the start event (its checkpoint root)

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> FaultTolerance:
        """Take the job dir's lease, install signal handlers, start watching the job dir,
        resolve the time budget and write the ``start`` event. Idempotent; ``range``,
        ``resume`` and ``with`` call it.

        Raises :class:`ftkit.lease.JobDirBusyError` (a ``SystemExit`` with code 86) on every
        rank when another run holds the lease; nothing was started then, and only the
        ``lease-refused`` event was written."""
        if self._started:
            return self
        self.runclock.started()  # ftkit's set-up (the lease, the agreement) starts here
        from ..slurm.env import SlurmEnv

        slurm = SlurmEnv.from_env()
        self._watcher.run = (slurm.job_id, slurm.restart_count)  # another run's trap request is discarded
        if self.world_size > 1:
            self._collective = Collective(self.config.agreement, self._group)
        killed = switch_is_set(self.job, "kill")
        # a killed job dir's run does nothing, so another run's lease does not refuse it
        from ..checkpoint.config import CheckpointConfig

        root = (self.config.checkpoint or CheckpointConfig()).under(self.job.root).root
        outside = not root.resolve().is_relative_to(self.job.root.resolve())
        try:
            self._lease = take_lease(
                self.job, self.config.lease, events=self.events, rank=self.rank, world_size=self.world_size,
                group=self._group, device=self.config.agreement.device, job_id=slurm.job_id,
                restart_count=slurm.restart_count, idle_if_busy=killed,
                on_lost=lambda why: self.box.post(Request(Action.EXIT, Source.API, why, requeue=False)),
                checkpoint_root=root if outside else None)
        except OSError as exc:  # lease.lock / lease.json: a read-only, full or foreign job dir
            raise self.job.unusable(exc) from exc
        self._started = True
        try:
            self._start_triggers(killed)
        except BaseException:  # a deadline out of range, a watcher that cannot start: nothing of it stays
            self._undo_start()
            raise
        self.events.emit(
            "start",
            world_size=self.world_size,
            job_id=slurm.job_id,
            restart_count=slurm.restart_count,
            kill_switch=self._no_save_at_start,
            observer=self._watcher.observer_kind,
            deadline=self.budget.end_time,
            **{"checkpoint_root": str(root), **self._start_fields},
            **self.runclock.start_fields(),
        )
        return self

    def _start_triggers(self, killed: bool) -> None:
        """``start``'s part after the lease: the signal handlers, the job dir's watcher, the
        time budget, the hang watchdog."""
        if killed:
            self._no_save_at_start = True
            log.warning("kill-switch %s exists: this run saves nothing and exits at its first check",
                        self.job.kill_switch)
        self._signals.start()
        self._watcher.start()
        self.budget.start()
        self._seed_budget()
        left = self.budget.time_left()
        if left is not None and left < self.budget.save_estimate + self.budget.config.margin:
            log.warning(
                "time budget: only %.0f s left at start, less than save %.0f s + margin %.0f s; the "
                "job will stop after its first step. Ask for more time or lower budget.margin / "
                "budget.save_estimate", left, self.budget.save_estimate, self.budget.config.margin)
        if not killed:  # a killed run does nothing to watch, and must not touch a holder's heartbeats
            self.watchdog.start()
        if self.config.save_every == "auto":
            self._auto = self._auto_interval()

    def _undo_start(self) -> None:
        """Take down what a failed ``start`` set up: the process gets its signal handlers back,
        no thread of this run stays, and the job dir's lease is released (another
        ``FaultTolerance`` of this job dir may start)."""
        self._started = False
        for stop in (self.watchdog.stop, self._watcher.close, self._signals.close):
            try:
                stop()
            except Exception:  # the start's own error is the one to raise
                log.debug("undoing a failed start: %s", stop, exc_info=True)
        if self._lease is not None:
            try:
                self._lease.release()
            except Exception:
                log.debug("undoing a failed start: releasing the lease", exc_info=True)
            self._lease = None

    def close(self) -> None:
        """Wait until pending checkpoints are durable, stop watchers, restore signal handlers,
        remove spent request files, write the ``exit`` event and release the job dir's lease."""
        if not self._started:
            return
        self._started = False
        self._resumed_at = None  # entered again, the run resumes anew
        self.watchdog.begin_save("close(): waiting for checkpoints")
        try:
            if self._checkpoints is not None:
                try:
                    self._checkpoints.wait()
                    self._consume_durable()
                except BaseException as exc:  # a checkpoint that never became durable (a peer gone)
                    # the exit event says so: a crash, not a completed run (ftkit requeue reads it)
                    self._crash = self._crash or f"{type(exc).__name__}: {exc}"
                    self.completed = False
                    raise
                finally:
                    self._checkpoints.close()
                    # let go of the manager and its process-group handles (a gloo group
                    # that outlives destroy_process_group can abort interpreter shutdown)
                    self._checkpoints = None
                    self._background = False
        finally:
            self.watchdog.stop()
            self._watcher.close()
            self._signals.close()
            if self.box.pending:
                self._take_requests(self.box.drain(), -1 if self._final is None else self._final.step)
            self._forget_requests()
            final = self._final
            self.runclock.flush()  # the memory snapshots' stalls since the last progress record
            self.events.emit(
                "exit",
                step=self._last_saved_step if final is None else final.step,
                completed=self.completed,
                requeue=None if final is None else final.requeue,
                reasons=[] if final is None else list(final.reasons),
                error=self._crash,
                **({} if self._stopped_by_saves is None else {"saves_failed": self._stopped_by_saves}),
                **self.runclock.exit_fields(),
            )
            if self._lease is not None:  # last: the next run may start once everything is written
                self._lease.release()
                self._lease = None

    def __enter__(self) -> FaultTolerance:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:  # the training loop raised: the exit event says so (a crash)
            self._crash = f"{exc_type.__name__ if exc_type else 'error'}: {exc}"
            if self._background and self.world_size > 1 and _peer_gone(exc):
                # a peer is gone: the background saves in flight can never be committed, so
                # close() must not wait for its part (up to commit_timeout) before it exits
                from ..checkpoint.background.commit import group_broken

                group_broken(self._crash)
            if isinstance(exc, KeyboardInterrupt) and self.rank == 0 and not self._maps(signal.SIGINT):
                last = self._last_saved_step
                log.warning("ftkit: Ctrl-C (KeyboardInterrupt) ended the run at step %s without a save: SIGINT is "
                            "not mapped. To save and exit on Ctrl-C, map it: Config(signals=SignalConfig(actions="
                            "{'USR1': 'requeue', 'TERM': 'save-exit', 'INT': 'save-exit'})), or "
                            "FTKIT_SIGNALS=USR1=requeue,TERM=save-exit,INT=save-exit where the config "
                            "comes from FTKIT_* variables (the Hugging Face launcher). %s",
                            self.runclock.step if self.runclock.step >= 0 else "?",
                            f"The next run resumes from step {last}." if last is not None else
                            "No checkpoint was saved: the next run starts fresh.")
            try:
                self.close()
            except CheckpointError as err:  # a save still in flight failed too: said, but the loop's
                log.error("ftkit: %s", err)  # own error is the one that goes on (not replaced by this)
            return
        self.close()

    def _maps(self, signum: signal.Signals) -> bool:
        """Whether ftkit handles ``signum`` in this run."""
        signals = self.config.signals
        return signals.enabled and signum in signals.resolved

    # -- requests from code -----------------------------------------------------------------

    def request(self, action: str = "save", *, reason: str = "requested by the training script") -> None:
        """Ask for ``save``, ``save-exit``, ``requeue``, ``stop`` or ``exit`` at the next check."""
        from ..decision import parse_action

        act, requeue = parse_action(action, setting="request(action)")
        self.box.post(Request(act, Source.API, reason, requeue=requeue, created=self._clock()))

    @property
    def final_decision(self) -> Decision | None:
        """The exit decision once one is taken (the same on every rank), else None."""
        return self._final

    @property
    def last_saved_step(self) -> int | None:
        """Step of the newest checkpoint this run saved or resumed from (None: none yet)."""
        return self._last_saved_step

    @property
    def stopping(self) -> bool:
        """True once an exit has been decided (or a kill-switch was present at start)."""
        return self._final is not None or self._no_save_at_start

    # -- the between-steps check ------------------------------------------------------------

    def check(self, step: int) -> Decision:
        """What every rank does now that ``step`` steps are complete. Cheap when nothing happened."""
        now = self._clock()
        if self._last_check is not None:
            self.budget.record_step(now - self._last_check)
        self._last_check = now
        clk = self.runclock
        clk.step = step
        clk.last = now
        if now >= clk.due:
            clk.tick(step, now)
        self.watchdog.last = (step, now)  # the watchdog's whole hot-path cost
        if self._final is not None:
            if self.box.pending:  # log what arrives after the exit was decided; it changes nothing
                self._take_requests(self.box.drain(), step)
            return self._final
        if self.box.pending:
            self._take_requests(self.box.drain(), step)
        # Between agreements a trigger waits up to ``every`` steps: look that far ahead. The
        # budget only acts once there is progress to save: stopping at the step just resumed
        # from would requeue a job that can never move forward.
        ahead = (self._every - 1) * self.budget.step_estimate if self._collective is not None else 0.0
        if step > (self._last_saved_step or 0) and self.budget.due(self._wallclock() + ahead):
            self._take_requests([self.budget.request()], step)
        if self._collective is not None:
            if not (self._first_check or step >= self._next_agree):
                return Decision(step)
            agreement = self.config.agreement
            wish = agreement.steps_to_next(self.budget.step_estimate)
            flags = self._collective.reduce(encode(self._pending, no_save=self._no_save_at_start,
                                                   slack=agreement.every - wish))
            self._every = agreement.every - flags[SLACK]  # the same on every rank: the slowest rank's wish
            self._next_agree = (step // self._every + 1) * self._every  # multiples of it, as every rank counts
        elif self._pending or self._no_save_at_start:
            flags = encode(self._pending, no_save=self._no_save_at_start)
        else:
            self._first_check = False
            return Decision(step)
        self._first_check = False
        return self._decide(step, flags)

    def _take_requests(self, requests: list[Request], step: int) -> None:
        """Log each request as a ``trigger`` event; keep the ones not already satisfied for the
        next decision."""
        for r in requests:
            if r.source is Source.REQUEST and r.origin is not None:
                self._seen_requests.add(r.origin)
            stale = self._stale(r)
            self.events.emit("trigger", step=step, source=r.source.value, action=r.action.name,
                             reason=r.reason, origin=r.origin, ignored=stale)
            if stale:
                log.info("ignoring %s at step %d: %s", r.reason, step, stale)
            else:
                self._pending.append(r)

    def _stale(self, r: Request) -> str | None:
        """Why a request is already satisfied, or None. Makes bursts change only the log."""
        if self._final is not None:
            return "an exit is already decided"
        if r.action == Action.SAVE and r.created <= self._last_save_end:
            return "a save that finished after it was asked for covers it"
        if r.origin is not None and r.source in self._handled_wall:
            mtime = touched_at(r.origin)
            if mtime is None:
                return "its file is gone (already handled)"
            if mtime <= self._handled_wall[r.source]:
                return "its file was already handled"
        return None

    def _decide(self, step: int, flags: list[int]) -> Decision:
        action, requeue, pin, sources = decode_flags(flags)
        if action == Action.NONE:
            return Decision(step)
        local = {r.source for r in self._pending}
        reasons = [r.reason for r in self._pending]
        # another rank's signal by name: the requeue policy tells a SIGUSR1 from a SIGTERM by it
        theirs = [n for n in decode_signals(flags) if n not in {r.signal for r in self._pending}]
        reasons += [f"{_signal_name(n)} received by another rank" for n in theirs]
        named = local | ({Source.SIGNAL} if theirs else set())
        reasons += [f"{s.value} (seen by another rank)" for s in sorted(sources - named, key=lambda s: s.value)]
        if self._no_save_at_start:  # the switch's own request says less: said once
            switch = {r.reason for r in self._pending if r.source is Source.KILL_SWITCH}
            reasons = [f"kill-switch {self.job.kill_switch} present at start: exiting without saving",
                       *(x for x in reasons if x not in switch)]
        decision = Decision(step, action, requeue, pin, sources, tuple(dict.fromkeys(reasons)))
        self._pending.clear()
        wall = self._wallclock()
        for source in (Source.SAVE_SWITCH, Source.KILL_SWITCH, Source.REQUEST):
            if source in sources:
                self._handled_wall[source] = wall
        if decision.exit:
            self._final = decision
        self.events.emit("decision", step=step, action=action.name, requeue=requeue, pin=pin,
                         sources=sorted(s.value for s in sources), reasons=list(decision.reasons))
        log.warning("ftkit decision: %s", decision.describe())
        return decision

    # -- acting on decisions ----------------------------------------------------------------

    def step(self, step: int) -> Decision:
        """``check(step)``, then save if the decision (or ``save_every``) says so."""
        if self._background:
            self._poll_background(step)
        decision = self.check(step)
        if decision.save or (self.periodic_due(step) and not decision.exit):
            self.save(step, decision=decision if decision.save else None)
        return decision

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint (``save_every``: a fixed step count, or ``"auto"``) is
        due at ``step``; the same answer on every rank. Integrations whose framework writes the
        checkpoint ask this instead of computing it, then report the save with ``saved``."""
        if self.config.save_every is None or self._no_save_at_start:
            return False
        if self._auto is None:
            return step % self.config.save_every == 0
        due = step >= self._auto.next_step
        if self._auto.steps is None and not due:  # the first step: a step time to plan with
            step_time = self.runclock.step_time()
            if step_time is not None:
                self._auto.schedule(step, step_time=step_time)
        return due

    def range(self, total: int, *, start: int | None = None) -> Iterator[int]:
        """Yield the steps still to do (after resuming), acting on decisions between them.

        Stops early when an exit is decided; ``completed`` is True only if ``total`` was reached.
        Resumed past ``total`` (trained further before), it yields nothing and writes no
        checkpoint (one of step ``total`` would hold a later step's state), with a warning.
        """
        try:
            yield from self._range(total, start)
        finally:
            self.watchdog.disarm()  # what runs after the loop is not a step

    def _range(self, total: int, start: int | None) -> Iterator[int]:
        self.start()
        # right after the script's own resume() (and what it set since: a learning rate, say),
        # the state is not loaded again over it; once only (a second range() resumes anew)
        resumed, self._resumed_at = self._resumed_at, None
        if resumed is not None and resumed[1] != self._last_check:
            resumed = None  # the script checked or saved since: it trained on from there
        first = start if start is not None else resumed[0] if resumed is not None else self.resume()
        self._resumed_at = None  # the resume() just above set it
        self.watchdog.arm(first)
        # One check before the first step: a kill-switch present at start, or a signal that
        # came during start-up, ends the run before it trains anything.
        decision = self.check(first)
        if decision.save and self._last_saved_step != first:
            self.save(first, decision=decision)
        elif decision.save:  # the checkpoint just resumed from is this step: it answers the request
            if decision.pin:  # a save-switch asks for it to be kept: pin the one that answers
                pin = getattr(self.checkpoints, "pin", None)
                if pin is not None:
                    pin(first)
            self._consume(decision)
        if decision.exit:
            return
        if first > total:  # trained further before: a checkpoint of step total would hold step first's state
            log.warning("resumed at step %d, past range(total=%d): nothing left to train, and no checkpoint "
                        "is written at step %d (it would hold step %d's state)", first, total, total, first)
            self.completed = True
            return
        for s in range(first, total):
            yield s
            if self.step(s + 1).exit:
                # an exit decided at the last step (a signal just then) ends a training that is done
                # all the same, once its end is saved: no requeue to train nothing
                self.completed = s + 1 == total and (self._last_saved_step == total or not self.config.save_at_end)
                return
        if self.config.save_at_end and not self._no_save_at_start and self._last_saved_step != total:
            self.save(total, reason="end of training")  # raises if it fails: the run did not complete
        self.completed = True

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def checkpoints(self) -> CheckpointManager:
        """The checkpoint manager (created on first use)."""
        if self._checkpoints is None:
            from ..checkpoint import CheckpointConfig, make_manager

            cfg = (self.config.checkpoint or CheckpointConfig()).under(self.job.root)
            if self.config.async_save is not None:
                from ..checkpoint import AsyncCheckpointer

                self._checkpoints = AsyncCheckpointer(
                    cfg, async_config=self.config.async_save, events=self.events, rank=self.rank,
                    world_size=self.world_size, process_group=self._group)
            else:
                self._checkpoints = make_manager(cfg, events=self.events, rank=self.rank,
                                                 world_size=self.world_size, process_group=self._group)
            self._background = self._checkpoints.background
        return self._checkpoints

    def _require_state(self) -> Mapping[str, Any]:
        if self.state is None:
            raise ConfigError("FaultTolerance(state=...): pass the objects to checkpoint, e.g. "
                              "state={'model': model, 'optimizer': optimizer}")
        return self.state

    def resume(self) -> int:
        """Load the newest valid checkpoint into ``state``; return the step to continue from.

        :meth:`range` calls it, unless the script did: what the script changes in the state after
        its own ``resume()`` (a learning rate to go on with) is not loaded over."""
        self.start()
        if self._no_save_at_start:
            self._resumed_at = (0, self._last_check)
            return 0
        began = self._clock()
        manager = self.checkpoints
        loaded_at = self._clock()
        step = manager.load(self._require_state())
        timing = self.runclock.resumed(step, load_seconds=self._clock() - loaded_at,
                                       manager_seconds=loaded_at - began)
        # the run that saved it may have had another number of ranks (custom managers: unknown)
        loaded = manager.loaded if step is not None else None
        saved_world = None if loaded is None else loaded.world_size
        self.events.emit("resume", step=step, world_size=self.world_size, saved_world_size=saved_world, **timing)
        self._last_saved_step = step
        first = 0 if step is None else int(step)
        self._resumed_at = (first, self._last_check)
        return first

    def save(self, step: int, *, decision: Decision | None = None, reason: str | None = None) -> Any:
        """Write a checkpoint of ``state`` at ``step`` through the manager; time it for the budget.

        A periodic save that fails with a :class:`CheckpointError` (a full disk, an I/O error)
        logs a warning and training goes on; a failed save on the way out (an exit's, or the
        end of training's) raises, so the process exits non-zero and the requeue policy sees a
        crash: the steps since the last checkpoint are not lost unseen. Any other exception (a
        bug) raises at once.
        """
        every = "the auto interval" if self.config.save_every == "auto" else f"every {self.config.save_every} steps"
        why = reason or ("; ".join(decision.reasons) if decision else f"periodic ({every})")
        pin = bool(decision and decision.pin)
        last = (decision is not None and decision.exit) or reason == "end of training"
        began = self._clock()
        self.watchdog.begin_save()
        try:
            info = self.checkpoints.save(step, self._require_state(), pin=pin, reason=why)
            if self._background and last:
                self.checkpoints.wait()  # leave only once the checkpoint is durable
        except CheckpointError as exc:
            self.watchdog.end_save()
            if not _event_written(exc, step):
                self.events.emit("save-failed", step=step, reason=why, error=str(exc))
            if last:
                raise
            self._save_failed(f"checkpoint at step {step}", exc)
            if decision is not None and Source.SAVE_SWITCH in decision.sources and self.job.save_switch.exists():
                # the switch stays until a save answers it: ask again (it would sit there, shown as
                # pending, with no save coming; max_failed_saves ends the tries)
                self._handled_wall.pop(Source.SAVE_SWITCH, None)
                self.box.post(Request(Action.SAVE, Source.SAVE_SWITCH, pin=decision.pin,
                                      origin=str(self.job.save_switch),
                                      reason=f"save-switch still present ({self.job.save_switch}): the save it "
                                             "asked for failed, tried again"))
            return None
        except Exception as exc:  # not a failure of the disk's (a bug, state that cannot be saved): raised
            self.watchdog.end_save()
            if not _event_written(exc, step):
                self.events.emit("save-failed", step=step, reason=why, error=f"{type(exc).__name__}: {exc}")
            raise
        stall = self._clock() - began
        exiting = last
        seconds = stall
        cost = stall
        if self._background:  # the budget needs the time until durable, not the stall
            seconds = max(stall, self.checkpoints.last_persist_seconds or 0.0)
            if self._snapshot_stall is not None and self._snapshot_stall[0] == step:
                cost += self._snapshot_stall[1]  # this checkpoint's snapshot was taken at the step's start
        self._saved(step, seconds=seconds, stall=stall, decision=decision, exiting=exiting, cost=cost)
        return info

    def _seed_budget(self) -> None:
        """The time budget's save estimate starts from the saves earlier runs of this job dir
        measured (the slowest of the last few, as ``ftkit status`` shows it), not from
        ``budget.save_estimate``'s guess: a requeued run stops no earlier, and no later, than
        its saves need. Rank 0 decides for every rank where the end time is SLURM's (it alone
        asks); an end time given (``budget.deadline``, ``FTKIT_DEADLINE``) every rank holds, and
        each fires on it, so each starts from those saves too."""
        if not self.config.budget.enabled or (self.rank != 0 and self.budget.end_time is None):
            return
        from ..events import read_events

        saves = [float(e["seconds"]) for e in read_events(self.job.events)
                 if e.get("event") == "save" and isinstance(e.get("seconds"), (int, float))]
        for seconds in saves:  # the budget keeps the slowest of its own window of the last ones
            self.budget.record_save(seconds)

    def _auto_interval(self) -> AutoInterval:
        """``save_every="auto"``: the rule, primed with what earlier runs of this job dir measured."""
        from ..events import read_events
        from .interval import read_history

        collective = self._collective
        agree = None if collective is None else (lambda n: int(collective.reduce([n] + [0] * (WIDTH - 1))[0]))
        in_flight = 1 if self.config.async_save is None else self.config.async_save.max_in_flight
        return AutoInterval(self.config.interval, events=self.events if self.rank == 0 else None,
                            history=read_history(list(read_events(self.job.events))),
                            max_in_flight=in_flight, agree=agree)

    def _replan(self, step: int, stall: float) -> None:
        """After a periodic or requested save: new measurements, maybe a new interval."""
        auto = self._auto
        durable = self.checkpoints.last_persist_seconds if self._background else stall
        auto.measured(cost=stall, durable=durable)
        step_time = self.runclock.step_time()
        if step_time is not None:
            auto.schedule(step, step_time=step_time)

    def _poll_background(self, step: int) -> None:
        """Memory snapshots due at this step, and a background save that failed since the last
        step: reported here, never lost (the manager's ``on_error`` decides raise or warn)."""
        mgr = self.checkpoints
        began = self._clock()
        if mgr.on_step(step, self._require_state()):  # a memory snapshot: the loop stalled for it
            stall = self._clock() - began
            self._snapshot_stall = (step, stall)
            self.runclock.snapshot(stall)
        if self._to_consume:
            self._consume_durable()
        durable = mgr.last_durable_step
        if durable is not None and durable != self._durable_seen:  # a save became durable: the row of
            self._durable_seen = durable  # failed saves ends (a failure reported below is a newer one)
            self._failed_saves = 0
        error = mgr.pending_error()
        if error is not None:
            if not _event_written(error):
                self.events.emit("save-failed", step=step, reason="background save", error=str(error))
            self._save_failed("a background checkpoint", error)

    def _save_failed(self, what: str, error: BaseException) -> None:
        """A save that failed while training goes on: a warning, until ``max_failed_saves`` in a
        row have failed; then the run stops with the last one's error."""
        self._failed_saves += 1
        most = self.config.max_failed_saves
        if most is None or self._failed_saves < most:
            left = "" if most is None else f" ({self._failed_saves} of {most} in a row: then the run stops)"
            log.warning("%s failed, training continues%s: %s", what, left, error)
            return
        since = ("its start" if self._last_saved_step is None else f"step {self._last_saved_step}")
        self._stopped_by_saves = self._failed_saves
        raise CheckpointError(
            f"{self._failed_saves} saves in a row failed (max_failed_saves={most}); stopping rather than train on "
            f"with nothing saved since {since}. The last: {error}") from error

    def _consume_durable(self) -> None:
        durable = None if self._checkpoints is None else self._checkpoints.last_durable_step
        if durable is None:
            return
        done = [d for d in self._to_consume if d.step <= durable]
        self._to_consume = [d for d in self._to_consume if d.step > durable]
        for d in done:
            self._consume(d)

    def saved(self, step: int, *, seconds: float, decision: Decision | None = None) -> None:
        """Record that a checkpoint of ``step`` is durable, for checkpoints written outside
        ``save`` (integrations whose framework writes the files): times it for the budget,
        and removes the save-switch and request files the decision acted on."""
        self._saved(step, seconds=seconds, stall=seconds, decision=decision,
                    exiting=decision is not None and decision.exit)

    def _saved(self, step: int, *, seconds: float, stall: float, decision: Decision | None,
               exiting: bool, cost: float | None = None) -> None:
        """Every durable checkpoint, written by ``save`` or reported to ``saved``: the report's
        stall, the auto interval's next step (``cost``: the loop's whole stall for this
        checkpoint, its memory snapshot's too), the budget, and the files the decision consumes."""
        self.runclock.saved(step, stall, exiting=exiting)
        if self._auto is not None and not exiting:
            self._replan(step, stall if cost is None else cost)
        ended = self._clock()
        self._last_save_end = ended
        self._last_check = ended  # a save is not part of the next step's time
        self.watchdog.end_save(ended)
        self._last_saved_step = step
        if not self._background:  # a background save counts once durable (_poll_background)
            self._failed_saves = 0
        self.budget.record_save(seconds)
        if decision is None:
            return
        if self._background and self.checkpoints.last_durable_step != step:
            self._to_consume.append(decision)  # once the background save is durable
        else:
            self._consume(decision)

    def _forget_requests(self) -> None:
        """Remove the request files this run saw, so the next run does not act on them again
        (a batch-script trap writes one even when the forwarded signal got there first)."""
        remove_requests(self._seen_requests)
        self._seen_requests.clear()

    def _consume(self, decision: Decision) -> None:
        """Once a checkpoint is durable: remove the save-switch and handled request files."""
        if self.rank != 0:
            return
        cutoff = self._handled_wall.get(Source.SAVE_SWITCH)
        if (Source.SAVE_SWITCH in decision.sources and cutoff is not None
                and remove_handled_save_switch(self.job, cutoff)):
            self.events.emit("switch-removed", step=decision.step, path=str(self.job.save_switch))
        cutoff = self._handled_wall.get(Source.REQUEST)
        if Source.REQUEST in decision.sources and cutoff is not None:
            remove_handled_requests(self.job, cutoff)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _peer_gone(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is a collective's failure because a peer's connection
    closed: gloo's "Connection closed by peer", a reset or broken pipe, NCCL's remote error (all
    RuntimeErrors; a BrokenPipeError of the script's own output is not one)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        text = str(seen).lower()
        if not isinstance(seen, OSError) and any(s in text for s in (
                "connection closed by peer", "connection reset by peer", "broken pipe", "remote process exit")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _event_written(error: BaseException, step: int | None = None) -> bool:
    """Whether ftkit's checkpoint committer wrote the ``save-failed`` event of ``error`` already
    (``Committer.abandon`` marks the error with the step; a background manager raises it again
    as the cause of its own), for ``step`` where given (a save that raised an earlier save's
    failure before it began is one more failed save): the controller writes one only for a
    failure nobody wrote (a custom manager's, one before the commit protocol began, another
    rank's, whose event log rank 0 keeps)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        written = getattr(seen, "event_step", None)
        if written is not None and (step is None or written == step):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
