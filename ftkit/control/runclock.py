"""The timing facts of one run, written into the events log for ``ftkit report``.

The controller calls a :class:`RunClock` at fixed points of a run; the clock turns them into
fields of existing events (``start``, ``resume``, ``exit``) and two small records of its own:

* ``first-step``: once per run, when the first training step after the resume is done;
* ``progress``: after every checkpoint the controller takes (with the loop's ``stall``), and
  at most every ``progress_every`` seconds from the between-steps check, so a run killed with
  ``kill -9`` (which writes no ``exit``) still says how far it got and when.

The per-step cost is an attribute store and one comparison (:meth:`RunClock.due` is a plain
attribute the controller compares ``now`` with); everything else happens at most once per
``progress_every`` seconds or once per save.

Times in the log are wall-clock (``time.time``); durations are measured with the controller's
monotonic clock and converted with one offset taken at construction.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["RunClock", "TimingConfig", "process_start_time"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TimingConfig:
    """What a run records about its own timing for ``ftkit report``."""

    progress_every: float = 60.0
    """Seconds between ``progress`` records (the step reached) written from the between-steps
    check. Bounds what a run killed without an ``exit`` record (``kill -9``, node failure) can
    leave unaccounted: its end is taken as its last record. One short line per interval."""

    def __post_init__(self) -> None:
        if not isinstance(self.progress_every, (int, float)) or not self.progress_every > 0:
            raise ConfigError(f"timing.progress_every: must be seconds > 0, got {self.progress_every!r}")


def process_start_time(*, wallclock: Callable[[], float] = time.time) -> float | None:
    """Wall-clock time this process started, from ``/proc/self/stat`` (None off Linux).

    Field 22 (``starttime``) counts clock ticks since boot; ``/proc/uptime`` gives seconds
    since boot on the same clock, so ``now - (uptime - starttime / CLK_TCK)`` is the start
    with the tick's resolution (10 ms), covering interpreter start-up and imports.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(fields[19])  # field 22 counted from 1; fields here start at field 3
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError) as exc:
        log.debug("process start time unknown: %s", exc)
        return None
    return wallclock() - (uptime - ticks / hz)


def gpus_per_node(environ: Mapping[str, str]) -> int | None:
    """GPUs per node from SLURM's variables (``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``
    such as ``4`` or ``h100:4``), else None."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        raw = (environ.get(name) or "").strip()
        if not raw:
            continue
        try:
            return int(raw.split("(")[0].rsplit(":", 1)[-1])
        except ValueError:
            continue
    return None


class RunClock:
    """Timing facts of one run; the controller calls it, it writes them (module doc)."""

    def __init__(
        self,
        events: Any,
        config: TimingConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        emit: bool = True,
    ) -> None:
        self.config = config if config is not None else TimingConfig()
        self.events = events
        self._clock = clock
        self._wallclock = wallclock
        self._offset = wallclock() - clock()  # monotonic -> wall
        self._emit = emit  # only rank 0 writes progress records: one line per job, not per rank
        self.process_start = process_start_time(wallclock=wallclock)
        self.step = -1
        """The step of the last between-steps check (the last step reached); set by the controller."""
        self.last: float | None = None
        """Monotonic time of the last between-steps check, or of the end of a save's stall in
        the loop (where the loop ends, for ``exit``); set by the controller."""
        self.due = -math.inf
        """Monotonic time of the next :meth:`tick`; the controller compares, the clock acts.
        -inf: the next check ticks (the first check, or the first step after a resume)."""
        self._ftkit_start: float | None = None
        self._loop_start: float | None = None
        self._start_step = 0
        self._first_done = False
        self._stalls = 0.0
        self._unreported = 0.0  # memory snapshots' stalls not yet in a progress record

    def wall(self, mono: float) -> float:
        return round(mono + self._offset, 6)

    # -- fixed points ------------------------------------------------------------------------

    def started(self) -> None:
        """``FaultTolerance.start()`` began (imports and user set-up are done)."""
        self._ftkit_start = self._clock()

    def start_fields(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Fields for the ``start`` event, written at the end of ``start()``."""
        env = os.environ if environ is None else environ
        began = self._ftkit_start if self._ftkit_start is not None else self._clock()
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        return {
            "process_start": None if self.process_start is None else round(self.process_start, 3),
            "ftkit_start": self.wall(began),
            "setup_seconds": round(self._clock() - began, 6),
            "nodes": int(nodes) if nodes and nodes.strip().isdigit() else None,
            "gpus_per_node": gpus_per_node(env),
        }

    def resumed(self, step: int | None, *, load_seconds: float, manager_seconds: float) -> dict[str, Any]:
        """The checkpoint is loaded (or there was none): the loop starts now. Fields for the
        ``resume`` event; the manager's ``load`` event splits finding from reading."""
        self.loop_from(0 if step is None else int(step))
        return {"seconds": round(load_seconds, 6), "manager_seconds": round(manager_seconds, 6)}

    def loop_from(self, step: int) -> None:
        """The training loop starts at ``step`` now; the next check past it is the first step."""
        self._loop_start = self._clock()
        self._start_step = step
        self._first_done = False
        self.due = -math.inf  # the first check after the first step records it

    def tick(self, step: int, now: float) -> None:
        """Called from the between-steps check when ``now >= due``: the first step, or a
        ``progress`` record every ``progress_every`` seconds."""
        if self._loop_start is None:  # check() used without resume(): the loop starts here
            self.loop_from(step)
            return
        if not self._first_done:
            if step <= self._start_step:
                return  # the check before the first step
            self._first_done = True
            if self._emit:
                self.events.emit("first-step", step=step, seconds=round(now - self._loop_start, 6),
                                 start_step=self._start_step)
        elif self._emit:
            extra = {"stall": round(self._unreported, 6)} if self._unreported > 0 else {}
            self.events.emit("progress", step=step, steps=step - self._start_step, **extra)
            self._unreported = 0.0
        self.due = now + self.config.progress_every

    def snapshot(self, stall: float) -> None:
        """A background save's memory snapshot stalled the loop ``stall`` seconds (without a
        save: ``memory_every``). Summed into the next ``progress`` record's ``stall`` (one per
        ``progress_every``, not one per snapshot, which may be every step)."""
        if self._loop_start is None:
            return
        self._stalls += stall
        self._unreported += stall
        self.last = self._clock()

    def flush(self) -> None:
        """The snapshot stalls not yet in a ``progress`` record, in one now (at the run's end)."""
        if self._unreported > 0 and self._emit:
            self.events.emit("progress", step=self.step, steps=max(self.step - self._start_step, 0),
                             stall=round(self._unreported, 6))
        self._unreported = 0.0

    def saved(self, step: int, stall: float, *, exiting: bool = False) -> None:
        """The controller's ``save`` of ``step`` returned after stalling the loop ``stall``
        seconds. A save on the way out (an exit decision, the end of training) is not a
        stall of the loop: the loop has ended, the report counts it as waiting at exit."""
        if not exiting and self._loop_start is not None:
            self._stalls += stall
            self.last = self._clock()
        if self._emit:
            self.events.emit("progress", step=max(self.step, step), steps=max(self.step - self._start_step, 0),
                             stall=round(stall, 6), save_step=step, exiting=exiting)

    # -- measurements ------------------------------------------------------------------------

    @property
    def stall_seconds(self) -> float:
        return self._stalls

    def step_time(self, now: float | None = None) -> float | None:
        """Mean seconds per step of this run so far, without checkpoint stalls (None: no step yet)."""
        if self._loop_start is None or self.step <= self._start_step:
            return None
        end = self.last if now is None else now
        if end is None:
            return None
        return max(end - self._loop_start - self._stalls, 0.0) / (self.step - self._start_step)

    def exit_fields(self) -> dict[str, Any]:
        """Fields for the ``exit`` event."""
        last = self.last
        return {
            "last_step": self.step if self.step >= 0 else None,
            "steps": max(self.step - self._start_step, 0) if self._loop_start is not None else 0,
            "loop_end": None if last is None else self.wall(last),
            "stall_seconds": round(self._stalls, 6),
        }
