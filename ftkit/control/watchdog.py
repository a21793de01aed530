"""The hang watchdog: a rank that stops completing steps is found, explained and ended.

On a multi-node job the costly failure is a hang, not a crash: one rank stops (a deadlocked
data loader worker, a stuck collective, a GPU that stopped answering) and every other rank
waits in a collective until the time limit. The controller stores ``(step, monotonic time)``
at every step boundary (one tuple store, the whole hot-path cost); a daemon thread compares
that with an allowance and, once it is exceeded, writes every thread's stack to
``JOBDIR/hangs/``, a ``hang`` event, and ends the process with
:data:`~ftkit.errors.EXIT_HANG` so the launcher (``srun --kill-on-bad-exit``, torchrun) tears
the job down and ``ftkit requeue`` can requeue it.

Why a Python thread and not ``faulthandler.dump_traceback_later``: the allowance moves (warm-up,
saves, the slowest recent step), and re-arming the C timer from the hot path would start a
thread per step; the C timer also exits with code 1, writes no event and is one per process.
The price: a hang that holds the GIL stops this thread too (most blocking calls in torch,
gloo, NCCL and I/O release it).

The job dir's filesystem may be the hang itself (``fsfreeze``, an NFS server gone): the main
thread blocks in a save, and so would any job-dir write of the watchdog's thread, before its
check (a user trial: it never fired). So that thread never writes to the job dir: heartbeats
and the dump run on threads of their own, a heartbeat is skipped while the previous one is
still blocked, and before the dump starts the hang is logged and a second timer is armed that
ends the process after ``grace`` seconds. Stacks that cannot be written in time go to the log.

Each rank's watchdog also publishes a small heartbeat file, ``JOBDIR/heartbeats/rank{R}.json``,
from its thread (never from the hot path): last step, its wall time and, while the step is
overdue, the main thread's frame. A rank that declares a hang copies its peers' heartbeats
into its event, so :mod:`ftkit.control.hangs` can name the rank that stopped first even when
that rank (SIGSTOPped, killed, its node lost) could not write anything itself. The files
are written by :mod:`ftkit.control._hang_files`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EXIT_HANG, ConfigError
from ..events import EventLog
from ._hang_files import (
    Offloaded,
    append_native,
    capture_stacks,
    claim_first,
    iso,
    read_peers,
    write_heartbeat,
    write_stacks,
)
from .hangs import Heartbeat, frame_facts

__all__ = ["DEFAULT_TIMEOUT", "Watchdog", "WatchdogConfig"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
"""Seconds without a completed step that count as a hang when nothing else sets it."""
DEFAULT_WARMUP = 1800.0
"""Seconds for each warm-up step when nothing else sets it."""

HANGS = "hangs"
DECLARED = "declared"  # JOBDIR/hangs/declared: created by the first rank of a run to fire
PEERS_KEPT = 16  # a hang event copies this many of its peers' heartbeats, most suspect first
HEARTBEATS = "heartbeats"
_STEP_SAMPLES = 64  # the slowest recent step is the slowest of this many measurements
_SAVE_SAMPLES = 5


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """When a rank that completes no step is declared hung, and what it leaves behind."""

    enabled: bool = True
    """False turns the watchdog off (no thread, no heartbeat files)."""

    timeout: float | None = None
    """The floor: fewest seconds without a completed step that count as a hang. None: the
    environment variable ``env_var`` (seconds, or ``off``), else 300. A hang is declared after
    ``max(timeout, multiple * slowest recent step)``."""

    multiple: float = 10.0
    """A step may take this many times the slowest recent step before it is a hang."""

    warmup_steps: int = 3
    """The first this many steps of ``range()`` (after start or resume) get ``warmup_timeout``
    instead: they compile, fill caches and start data loader workers. (A loop of your own that
    calls ``check``/``step``: from the first step boundary the watchdog sees.)"""

    warmup_timeout: float | None = None
    """Seconds allowed for each warm-up step (at least ``timeout``). None: the environment
    variable ``warmup_env_var`` (seconds), else 1800."""

    save_timeout: float = 1800.0
    """Seconds allowed for one checkpoint save, and for ``close()`` waiting on background saves
    (at least ``timeout`` and ``multiple`` times the slowest recent save)."""

    env_var: str = "FTKIT_HANG_TIMEOUT"
    """Environment variable read when ``timeout`` is None: seconds, or ``off`` / ``0`` to turn
    the watchdog off for one job without editing the script."""

    warmup_env_var: str = "FTKIT_HANG_WARMUP_TIMEOUT"
    """Environment variable read when ``warmup_timeout`` is None: seconds for each warm-up step,
    for one job (a job that hung right after a resume is otherwise found only after 30 min)."""

    heartbeat: float | None = None
    """Seconds between heartbeat files (``JOBDIR/heartbeats/rank{R}.json``); None: an eighth of
    the timeout, at most 10."""

    native: bool = True
    """Append native frames from ``py-spy dump --native`` to the stack file when ``py-spy`` is
    on PATH (optional; never required)."""

    grace: float = 60.0
    """Seconds the stack dump and the event may take; then the process ends regardless (a
    hung job-dir filesystem must not keep a hung job alive)."""

    def __post_init__(self) -> None:
        for name in ("timeout", "heartbeat", "warmup_timeout"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value > 0):
                raise ConfigError(f"watchdog.{name}: got {value!r}; give seconds > 0 or None")
        for name in ("multiple", "save_timeout", "grace"):
            value = getattr(self, name)
            if not (_number(value) and value > 0):
                raise ConfigError(f"watchdog.{name}: got {value!r}; give a number > 0")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError(f"watchdog.warmup_steps: got {self.warmup_steps!r}; give a whole number >= 0")
        for name in ("env_var", "warmup_env_var"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"watchdog.{name}: got {value!r}; name an environment variable")

    def resolve_timeout(self, environ: Mapping[str, str] | None = None) -> float | None:
        """The floor in seconds, or None when the watchdog is off (config or environment)."""
        if not self.enabled:
            return None
        if self.timeout is not None:
            return float(self.timeout)
        return _env_seconds(environ, self.env_var, DEFAULT_TIMEOUT, off=True)

    def resolve_warmup(self, environ: Mapping[str, str] | None = None) -> float:
        """Seconds for each warm-up step (before the floor ``timeout`` applies to it)."""
        if self.warmup_timeout is not None:
            return float(self.warmup_timeout)
        seconds = _env_seconds(environ, self.warmup_env_var, DEFAULT_WARMUP, off=False)
        assert seconds is not None
        return seconds


def _env_seconds(environ: Mapping[str, str] | None, name: str, default: float, *, off: bool) -> float | None:
    """Seconds from the environment variable ``name``: unset or empty, ``default``; where
    ``off``, ``off``/``0``/``no``/``false`` give None; anything else not > 0 is an error."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    if off and raw.lower() in ("off", "no", "false"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if off and value == 0:  # 0, 0.0, 0e0: off, as documented for 0
        return None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"environment variable {name}={raw!r}: give seconds > 0" + (", or off" if off else ""))
    return value


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class _Phase:
    """A stretch that is not a step: a save, close() waiting, or a user's ``allow()`` block."""

    what: str
    began: float
    allowance: float
    save: bool


class Watchdog:
    """One per training process; the controller owns it. See the module docstring.

    The controller stores ``watchdog.last = (step, clock())`` at every step boundary and
    brackets saves with :meth:`begin_save` / :meth:`end_save`. ``clock`` must be the clock of
    those stores (monotonic); ``wallclock`` is UNIX time for the records. ``exit`` ends the
    process (tests of the decision logic pass a recorder; the real one is ``os._exit``).
    """

    __slots__ = (
        "_beat_every",
        "_beats",
        "_clock",
        "_epoch",
        "_events",
        "_exit",
        "_first",
        "_first_hint",
        "_host",
        "_job",
        "_job_id",
        "_main",
        "_next_beat",
        "_phases",
        "_poll",
        "_rank",
        "_ref",
        "_saves",
        "_silent",
        "_steps",
        "_stop",
        "_thread",
        "_wall",
        "_warm",
        "_world",
        "config",
        "fired",
        "last",
        "timeout",
        "warmup",
    )

    def __init__(
        self,
        config: WatchdogConfig | None,
        *,
        job_root: str | os.PathLike[str],
        events: EventLog,
        rank: int = 0,
        world_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        exit: Callable[[int], Any] = os._exit,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.last: tuple[int, float] | None = None  # the hot path's only store; None: disarmed
        self.config = config if config is not None else WatchdogConfig()
        self.timeout = self.config.resolve_timeout(environ)
        self.warmup = self.config.resolve_warmup(environ) if self.timeout is not None else DEFAULT_WARMUP
        env = os.environ if environ is None else environ
        self._job = Path(job_root)
        self._events = events
        self._rank = rank
        self._world = world_size
        self._clock = clock
        self._wall = wallclock
        self._exit = exit
        self._host = socket.gethostname()
        self._job_id = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._phases: list[_Phase] = []
        self._epoch = 0  # changes when a phase begins or the watchdog is disarmed
        self._first: int | None = None  # the first step of the loop, once the thread saw a beat
        self._first_hint: int | None = None  # the first step, when the loop said (arm)
        self._ref: tuple[int, float, int] | None = None  # (step, time, epoch) of the last sample
        self._steps: collections.deque[float] = collections.deque(maxlen=_STEP_SAMPLES)
        self._warm: float | None = None  # the quickest warm-up step: the steps' time until one after is measured
        self._saves: collections.deque[float] = collections.deque(maxlen=_SAVE_SAMPLES)
        self._main = threading.get_ident()
        timeout = self.timeout or DEFAULT_TIMEOUT
        self._poll = min(1.0, max(timeout / 20, 0.02))
        self._beat_every = self.config.heartbeat or min(10.0, timeout / 8)
        self._next_beat = -math.inf
        self._beats = Offloaded(f"ftkit-heartbeat-rank{rank}")
        self._silent = max(self._beat_every, 1.0)  # a heartbeat blocked this long is logged
        self.fired = False

    @property
    def enabled(self) -> bool:
        return self.timeout is not None

    @property
    def heartbeat_path(self) -> Path:
        return self._job / HEARTBEATS / f"rank{self._rank}.json"

    # -- life cycle (main thread) ---------------------------------------------------------

    def start(self) -> Watchdog:
        """Start the thread (once). The watchdog arms itself at the first step boundary."""
        if not self.enabled or self._thread is not None:
            return self
        self._main = threading.get_ident()  # the training loop's thread: its frame is reported
        self._stop.clear()
        if self._rank == 0:  # a new run: the next hang is declared afresh
            with contextlib.suppress(OSError):
                (self._job / HANGS / DECLARED).unlink()
        # here, not on the writer thread: a heartbeat exists once start() returns (start-up
        # writes to the job dir anyway, and is not watched)
        self._next_beat = self._clock() + self._beat_every
        write_heartbeat(self.heartbeat_path, self._facts(self._clock(), self.last, stalled=False))
        self._thread = threading.Thread(target=self._run, name=f"ftkit-watchdog-rank{self._rank}", daemon=True)
        self._thread.start()
        log.info("hang watchdog: on, floor %.0f s, %g x the slowest recent step (%s)", self.timeout,
                 self.config.multiple, self.config.env_var if self.config.timeout is None else "watchdog.timeout")
        return self

    def stop(self) -> None:
        """Stop the thread and remove this rank's heartbeat (a clean end leaves none)."""
        thread, self._thread = self._thread, None
        self._phases.clear()
        self.disarm()
        if thread is None:
            return
        self._stop.set()
        deadline = time.monotonic() + 10 + 2 * self._poll
        thread.join(timeout=10 + 2 * self._poll)
        if thread.is_alive():  # declaring a hang right now: it ends the process
            log.warning("hang watchdog: its thread did not stop within 10 s (job dir %s not answering?)", self._job)
        if not self._beats.join(max(deadline - time.monotonic(), 0.0)):  # a daemon: let it be
            log.warning("hang watchdog: heartbeat %s not written for %.0f s (the job dir's filesystem does not "
                        "answer); left behind", self.heartbeat_path, self._beats.busy_for() or 0.0)
            return
        with contextlib.suppress(OSError):
            self.heartbeat_path.unlink()

    def arm(self, first_step: int) -> None:
        """The loop starts at ``first_step``: the warm-up counts from there. Without this call
        it counts from the first step boundary the thread sees (a fast step may be missed)."""
        self._first, self._first_hint = None, first_step

    def disarm(self) -> None:
        """Not between steps any more (the loop ended): only save phases are watched."""
        self.last = None
        self._first_hint = None
        self._epoch += 1

    def begin_save(self, what: str = "checkpoint save") -> None:
        """A save starts: it gets the save allowance instead of the step's."""
        allowance = max(self.config.save_timeout, self.timeout or 0.0,
                        self.config.multiple * max(self._saves, default=0.0))
        self._begin(_Phase(what, self._clock(), allowance, save=True))

    @contextmanager
    def allow(self, seconds: float, what: str = "allow() block") -> Iterator[None]:
        """Let the code inside take up to ``seconds`` (evaluation between steps, a long first
        data load); time spent inside does not count towards the current step."""
        if not (_number(seconds) or seconds == math.inf) or seconds <= 0:
            raise ConfigError(f"watchdog.allow(seconds): got {seconds!r}; give seconds > 0 (math.inf: unwatched)")
        phase = _Phase(what, self._clock(), float(seconds), save=False)
        self._begin(phase)
        try:
            yield
        finally:
            self._phases.remove(phase)
            self._restart_step(self._clock())

    def progress(self) -> None:
        """Progress outside a step (an evaluation batch, a chunk of a long upload): the
        current step is timed from now. Cheap; call it as often as you like."""
        self._restart_step(self._clock())

    def _begin(self, phase: _Phase) -> None:
        self._phases.append(phase)
        self._epoch += 1

    def end_save(self, now: float | None = None) -> None:
        """A save ended (also called for saves written outside ``save()``, which began
        nothing): record its duration; the next step is timed from now."""
        now = self._clock() if now is None else now
        if self._phases and self._phases[-1].save:
            phase = self._phases.pop()
            self._saves.append(max(now - phase.began, 0.0))
        self._restart_step(now)

    def _restart_step(self, now: float) -> None:
        last = self.last
        if last is not None:
            self.last = (last[0], now)
        self._epoch += 1

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self.tick()
            except Exception:  # the watchdog must never take training down by itself
                log.exception("hang watchdog: check failed (it keeps running)")

    def tick(self) -> None:
        """One check (the thread calls it every poll interval; tests call it directly)."""
        now = self._clock()
        last, phases = self.last, self._phases[-1:]
        self._sample(last)
        overdue = self.overdue(now, last, phases[0] if phases else None)
        if now >= self._next_beat:
            self._beat(now, stalled=overdue is not None and overdue[0] > self._beat_every)
        if overdue is not None and overdue[0] > overdue[1]:
            self._fire(now, last, phases[0] if phases else None, *overdue)

    def overdue(self, now: float, last: tuple[int, float] | None,
                phase: _Phase | None) -> tuple[float, float, str] | None:
        """(seconds waited, allowance, why) for what is being waited on, or None."""
        if phase is not None:
            return now - phase.began, phase.allowance, phase.what
        if last is None or self.timeout is None:
            return None
        step, at = last
        first = self._first if self._first is not None else self._first_hint
        first = step if first is None or first > step else first
        cfg = self.config
        if step - first < cfg.warmup_steps:
            return (now - at, max(self.warmup, self.timeout),
                    f"warm-up step {step - first + 1} of {cfg.warmup_steps}")
        # until a step after the warm-up is measured, the quickest warm-up step stands for one
        # (compiling and filling caches only make warm-up steps slower): steps longer than the
        # floor were each declared a hang at the first step after the warm-up, in every run
        slowest = max(self._steps, default=self._warm or 0.0)
        if cfg.multiple * slowest > self.timeout:
            recent = "recent step" if self._steps else "warm-up step (none after it measured yet)"
            return now - at, cfg.multiple * slowest, f"{cfg.multiple:g} x the slowest {recent} ({slowest:.3g} s)"
        return now - at, self.timeout, f"timeout {self.timeout:g} s"

    def _sample(self, last: tuple[int, float] | None) -> None:
        """Step time from the stores seen between two polls (off the hot path): exact for
        steps longer than a poll, the mean over the window for shorter ones."""
        if last is None:
            self._ref, self._first = None, None
            return
        if self._first is None:
            hint = self._first_hint
            self._first = hint if hint is not None and hint <= last[0] else last[0]
        ref, epoch, warmup = self._ref, self._epoch, self.config.warmup_steps
        if ref is not None and ref[2] == epoch and last[0] > ref[0]:
            seconds = (last[1] - ref[1]) / (last[0] - ref[0])
            if ref[0] - self._first >= warmup:
                self._steps.append(seconds)
            else:
                self._warm = seconds if self._warm is None else min(self._warm, seconds)
        if ref is None or (last[0], last[1], epoch) != ref:
            self._ref = (last[0], last[1], epoch)

    def _facts(self, now: float, last: tuple[int, float] | None, stalled: bool) -> Heartbeat:
        wall = self._wall()
        frame = waiting = None
        if stalled:
            frame, waiting = frame_facts(sys._current_frames().get(self._main))
        return Heartbeat(
            rank=self._rank, host=self._host, pid=os.getpid(), job=self._job_id,
            step=None if last is None else last[0],
            last_step_wall=None if last is None else round(wall - (now - last[1]), 6),
            written=round(wall, 6), interval=self._beat_every, frame=frame, waiting=waiting,
            phase=self._phases[-1].what if self._phases else None,
        )

    def _beat(self, now: float, *, stalled: bool) -> None:
        """Hand the heartbeat to its writer thread; skip it while the previous one is blocked."""
        self._next_beat = now + self._beat_every
        path, beat = self.heartbeat_path, self._facts(now, self.last, stalled)
        if self._beats.offer(lambda: write_heartbeat(path, beat)):
            if self._silent > max(self._beat_every, 1.0):
                log.warning("hang watchdog: the job dir's filesystem answers again (a blocked write of "
                            "heartbeat %s ended)", path)
                self._silent = max(self._beat_every, 1.0)
            return
        blocked = self._beats.busy_for() or 0.0
        if blocked >= self._silent:  # then at twice the time, and so on: a line, not a flood
            log.warning("hang watchdog: the job dir's filesystem has not answered for %.0f s (heartbeat %s still "
                        "being written); heartbeats are skipped until it does", blocked, path)
            self._silent = 2 * blocked

    # -- firing ---------------------------------------------------------------------------

    def _fire(self, now: float, last: tuple[int, float] | None, phase: _Phase | None,
              waited: float, allowance: float, why: str) -> None:
        """Log the hang, dump every stack, write the ``hang`` event, end the process with EXIT_HANG.

        The backstop is armed and the hang logged before anything touches the job dir, and the
        dump is written on a thread of its own: a hung job dir (maybe the very hang) must not
        keep this thread from ending the process. (A thread blocked in the kernel on a frozen
        filesystem keeps the process alive after ``os._exit`` until the thaw; then it ends.)"""
        self.fired = True
        backstop = threading.Timer(self.config.grace, self._exit, args=(EXIT_HANG,))
        backstop.daemon = True
        backstop.start()
        try:
            me = self._facts(now, last, stalled=True)
            stacks = capture_stacks()
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._wall()))
            path = self._job / HANGS / f"hang-rank{self._rank}-{self._host}-{stamp}-{os.getpid()}.txt"
            spy = shutil.which("py-spy") if self.config.native else None
            header = (f"hang watchdog (ftkit): rank {self._rank} on {self._host} (pid {os.getpid()}) "
                      f"completed no step for {waited:.1f} s (allowed {allowance:.1f} s: {why})\n"
                      f"last completed step: {me.step} at {iso(me.last_step_wall)}\n"
                      f"main thread: {me.frame}\n\n")
            log.critical("hang watchdog: rank %d completed no step for %.0f s (allowed %.0f s: %s); "
                         "last step %s; stacks in %s; exiting with code %d", self._rank, waited,
                         allowance, why, me.step, path, EXIT_HANG)
            hung = self._beats.busy_for()
            hung = hung if hung is not None and hung >= max(self._beat_every, 1.0) else None
            written = threading.Event()
            dump = Offloaded(f"ftkit-hang-dump-rank{self._rank}")
            dump.offer(lambda: self._record(path, header + stacks, me, phase, waited, allowance, why,
                                            native=spy is not None, written=written))
            # the event before the slow part (py-spy): the launcher may kill this process as
            # soon as another rank exits
            done = dump.join(0.0 if hung is not None else self.config.grace / 2)
            if not written.is_set():
                silent = hung if hung is not None else self.config.grace / 2
                log.critical("hang watchdog: %s; the stacks follow here instead\n%s%s",
                             f"could not write {path}" if done else
                             f"the job dir's filesystem has not answered for {silent:.0f} s ({path} not written)",
                             header, stacks)
            elif done and spy is not None:
                with open(path, "a") as f:
                    append_native(f, spy, limit=max(self.config.grace / 2, 1.0))
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
                    stream.flush()
        finally:
            self._exit(EXIT_HANG)
            backstop.cancel()  # reached only when ``exit`` returns (a test's recorder)

    def _record(self, path: Path, text: str, me: Heartbeat, phase: _Phase | None, waited: float,
                allowance: float, why: str, *, native: bool, written: threading.Event) -> None:
        """The stack file, then the ``hang`` event (on the dump's thread: both may block)."""
        try:
            write_stacks(path, text)
            written.set()
        except OSError as exc:
            log.error("hang watchdog: could not write the stack file %s: %s", path, exc)
        peers = None
        if claim_first(self._job / HANGS / DECLARED, self._rank):
            peers = read_peers(self._job / HEARTBEATS, rank=self._rank, world_size=self._world,
                               job=self._job_id, now=self._wall())
        self._events.emit("hang", step=me.step, seconds=round(waited, 3),
                          file=str(path) if written.is_set() else None, last_step_wall=me.last_step_wall,
                          threshold=round(allowance, 3), why=why,
                          phase=None if phase is None else phase.what, frame=me.frame,
                          waiting=me.waiting, native=native, world_size=self._world,
                          peers=None if peers is None else [p.to_json() for p in peers[:PEERS_KEPT]],
                          peers_not_running=None if peers is None else sum(not p.running for p in peers))
