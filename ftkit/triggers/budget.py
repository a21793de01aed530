"""The time budget: save and exit while there is still time for one more step and a save.

The job's end time is resolved at start (explicit setting > environment variable > SLURM).
An end time from SLURM is read again every ``refresh_every`` seconds and once more right
before the budget would fire, so ``scontrol update jobid=N TimeLimit=...`` moves it. Each
step the controller calls :meth:`TimeBudget.due`, which is one clock read and one comparison
against a precomputed threshold (the earlier of "fire" and "read SLURM again"); the threshold
moves only when an estimate or the end time changes, or a re-read is done.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from ..decision import Action, Request, Source
from ..errors import ConfigError, SlurmError

__all__ = ["BudgetConfig", "TimeBudget", "parse_deadline"]

log = logging.getLogger(__name__)

_EMA_ALPHA = 0.2  # weight of the newest step in the step-time average
_SAVE_WINDOW = 5  # the save estimate is the slowest of this many recent saves
_REFRESH_TIMEOUT = 5.0  # seconds a re-read of SLURM's EndTime may hold up a step
_REFRESH_BACKOFF = 8  # failing re-reads space out, up to this many times refresh_every
_LOOKUP_FAILED = "SLURM lookup failed"


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """When to stop before the job's time runs out."""

    deadline: float | None = None
    """UNIX time the job must be done by; None looks it up (``env_var``, then SLURM). One out
    of range (milliseconds) is refused here, one already past at start."""

    env_var: str = "FTKIT_DEADLINE"
    """Environment variable holding the deadline as UNIX seconds or ISO-8601 time."""

    use_slurm: bool = True
    """Ask SLURM (``scontrol show job``) for the job's end time when nothing else sets it."""

    margin: float = 30.0
    """Seconds kept free after the last save (SLURM's KillWait, slow exits, requeue)."""

    save_estimate: float = 30.0
    """Seconds a save is assumed to take until one has been measured in this job dir (a
    requeued run starts from the saves earlier runs measured)."""

    refresh_every: float = 300.0
    """Seconds between re-reads of SLURM's EndTime, so a time limit changed while the job runs
    (``scontrol update jobid=N TimeLimit=...``) moves the budget; it is also re-read right
    before the budget fires. Only rank 0 asks SLURM (at start and per re-read) and decides for
    every rank; 0 reads it only at start. An end time from ``deadline`` or ``env_var`` is never
    re-read."""

    enabled: bool = True
    """False turns the time budget off: it never fires."""

    def __post_init__(self) -> None:
        if self.deadline is not None and not _finite_number(self.deadline):
            raise ConfigError(
                f"budget.deadline: got {self.deadline!r}; give UNIX seconds or leave it unset"
            )
        if self.deadline is not None:
            _in_range(float(self.deadline), "budget.deadline", self.deadline)
        if not isinstance(self.env_var, str) or not self.env_var.strip():
            raise ConfigError(
                f"budget.env_var: got {self.env_var!r}; name an environment variable, "
                "e.g. FTKIT_DEADLINE"
            )
        for name in ("margin", "save_estimate", "refresh_every"):
            value = getattr(self, name)
            if not _finite_number(value) or value < 0:
                raise ConfigError(f"budget.{name}: got {value!r}; give seconds as a number >= 0")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_deadline(text: str, *, setting: str) -> float:
    """UNIX seconds from ``"1735689600"`` or ISO-8601 (``"2025-01-01T00:00:00+00:00"``,
    ``"...Z"``; without an offset it is local time). ConfigError naming ``setting`` if neither."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            iso = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
            stamp = datetime.fromisoformat(iso).timestamp()
        except (ValueError, OverflowError, OSError):
            raise ConfigError(
                f"{setting}: cannot read {text!r} as a deadline; give UNIX seconds "
                "(e.g. 1735689600) or an ISO-8601 time (e.g. 2025-01-01T00:00:00+00:00)"
            ) from None
        return _in_range(stamp, setting, text)
    if not math.isfinite(seconds):
        raise ConfigError(f"{setting}: got {text!r}; give finite UNIX seconds")
    return _in_range(seconds, setting, text)


_LATEST = 253402300799.0  # 9999-12-31T23:59:59Z: past it, no datetime can show the deadline


def _in_range(seconds: float, setting: str, given: object) -> float:
    """``seconds`` if a UNIX time a deadline can be (from 1970 to the year 9999), else a
    ConfigError naming ``setting`` (and milliseconds, where it looks like them)."""
    if 0 <= seconds <= _LATEST:
        return seconds
    hint = (f" ({seconds / 1000:.0f} s, if those are milliseconds)" if 0 <= seconds / 1000 <= _LATEST
            else "")
    raise ConfigError(f"{setting}: {given!r} is not a UNIX time in seconds{hint}; give seconds since 1970 "
                      "(e.g. $(date -d '+2 hours' +%s)) or an ISO-8601 time (e.g. 2025-01-01T00:00:00+00:00)")


_Lookup = Callable[[float | None], float | None]  # lookup(timeout or None) -> end time or None


def _slurm_lookup(environ: Mapping[str, str]) -> _Lookup | None:
    """``lookup(timeout)``: the job's EndTime from ``scontrol show job``; None outside SLURM."""
    from ..slurm.env import SlurmEnv, job_end_time

    job_id = SlurmEnv.from_env(environ).job_id
    if job_id is None:
        return None
    return lambda timeout: job_end_time(job_id, timeout=timeout)


def _when(end_time: float | None) -> str:
    if end_time is None:
        return "no end time"
    return datetime.fromtimestamp(end_time).isoformat(timespec="seconds")


class TimeBudget:
    """Says when the time left no longer covers the next step, a save and the margin.

    ``clock`` must return UNIX time (the end time is UNIX time). ``end_time_lookup``
    replaces the SLURM lookup (returns UNIX time or None, raises SlurmError when it cannot
    say); like the SLURM lookup it is called at start, every ``refresh_every`` seconds and
    once right before firing. One-shot: once :meth:`due` returned True, ``fired`` is set and
    it returns False from then on.

    ``follower``: another rank of a multi-rank run asks SLURM and decides for every rank (the
    controller's agreement carries its request to all), so this one never runs ``scontrol``:
    one ``scontrol show job`` per re-read for the whole job, not one per rank. An end time
    from ``deadline`` or ``env_var`` is the same on every rank and used as it is.
    """

    def __init__(
        self,
        config: BudgetConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        end_time_lookup: Callable[[], float | None] | None = None,
        environ: Mapping[str, str] | None = None,
        follower: bool = False,
    ) -> None:
        self.config = config if config is not None else BudgetConfig()
        self._follower = follower
        self._clock = clock
        self._lookup = end_time_lookup
        self._environ = environ
        self.end_time: float | None = None
        self.source: str | None = None  # where end_time came from; None until started
        self.fired = False
        self.step_estimate = 0.0
        self.save_estimate = self.config.save_estimate
        self._ema: float | None = None
        self._saves: collections.deque[float] = collections.deque(maxlen=_SAVE_WINDOW)
        # due() is `now > _threshold`; -inf sends the first call to _slow_due, which starts.
        self._threshold = -math.inf
        self._started = False
        self._ask: _Lookup | None = None  # reads the end time again; None: never
        self._next_refresh = math.inf
        self._refresh_failures = 0

    # -- setup -------------------------------------------------------------------------

    def start(self) -> TimeBudget:
        """Resolve the end time (once). Called by the first :meth:`due` if not before."""
        if self._started:
            return self
        self._started = True
        self.end_time, self.source, lookup = self._resolve()
        given = {"budget.deadline": "budget.deadline", f"${self.config.env_var}": f"environment variable {self.config.env_var}"}
        if self.end_time is not None and self.source in given and self.end_time <= self._clock():
            self._started = False  # an explicit deadline already past: no run can use it
            raise ConfigError(
                f"{given[self.source]}: the deadline {_when(self.end_time)} is {self._clock() - self.end_time:.0f} s "
                "in the past (a value left from an earlier job?); give this job's end time, or unset it")
        if lookup is not None and self.config.refresh_every > 0:
            self._ask = lookup
            self._next_refresh = self._clock() + self.config.refresh_every
            # start() warned already; the re-reads warn again only after one has worked
            self._refresh_failures = int(self.source == _LOOKUP_FAILED)
        if self.end_time is None and self._ask is not None:
            log.info("time budget: no deadline yet (%s); reading it again every %g s",
                     self.source, self.config.refresh_every)
        elif self.end_time is None and self._follower:
            log.debug("time budget: %s", self.source)
        elif self.end_time is None:
            log.info("time budget: no deadline (%s); it will never fire", self.source)
        else:
            log.info(
                "time budget: job ends at %s (%.0f s from now, from %s)",
                datetime.fromtimestamp(self.end_time).isoformat(timespec="seconds"),
                self.end_time - self._clock(),
                self.source,
            )
        self._update_threshold()
        return self

    def _resolve(self) -> tuple[float | None, str, _Lookup | None]:
        """The end time, where it came from, and the lookup that can read it again (SLURM's)."""
        cfg = self.config
        if not cfg.enabled:
            return None, "disabled (budget.enabled=false)", None
        if cfg.deadline is not None:
            return float(cfg.deadline), "budget.deadline", None
        environ = os.environ if self._environ is None else self._environ
        raw = environ.get(cfg.env_var)
        if raw is not None and raw.strip():
            setting = f"environment variable {cfg.env_var}"
            return parse_deadline(raw, setting=setting), f"${cfg.env_var}", None
        unset = f"budget.deadline unset, ${cfg.env_var} unset"
        if not cfg.use_slurm:
            return None, f"{unset}, budget.use_slurm=false", None
        if self._follower:
            return None, "rank 0 reads the job's end time and decides for every rank", None
        given = self._lookup
        if given is not None:
            lookup, source = (lambda timeout: given()), "end_time_lookup"
        else:
            lookup, source = _slurm_lookup(environ), "SLURM EndTime"
        if lookup is None:
            return None, f"{unset}, not in a SLURM job", None
        try:
            end = lookup(None)
        except SlurmError as exc:
            log.warning("time budget: cannot ask SLURM for the job's end time: %s", exc)
            return None, _LOOKUP_FAILED, lookup
        if end is None:
            return None, f"{unset}, no SLURM end time", lookup
        return end, source, lookup

    def _refresh(self, now: float) -> None:
        """Read the end time again; a failed read keeps the last one (warned once per streak)."""
        assert self._ask is not None
        try:
            end = self._ask(_REFRESH_TIMEOUT)
        except SlurmError as exc:
            self._refresh_failures += 1
            wait = self.config.refresh_every * min(2**self._refresh_failures, _REFRESH_BACKOFF)
            self._next_refresh = now + wait
            if self._refresh_failures == 1:
                log.warning("time budget: cannot read the job's end time again (%s); keeping %s, "
                            "retrying in %.0f s", exc, _when(self.end_time), wait)
            return
        if self._refresh_failures:
            log.info("time budget: reading the job's end time works again")
        self._refresh_failures = 0
        self._next_refresh = now + self.config.refresh_every
        if end != self.end_time:
            moved = "" if end is None or self.end_time is None else f" ({end - self.end_time:+.0f} s)"
            log.info("time budget: the job's end time moved from %s to %s%s",
                     _when(self.end_time), _when(end), moved)
            self.end_time = end

    # -- estimates ---------------------------------------------------------------------

    def record_step(self, seconds: float) -> None:
        """Record one step's duration. The estimate is max(EMA, last step): quick to rise
        after a slow step, slow to fall."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self._ema = seconds if self._ema is None else self._ema + _EMA_ALPHA * (seconds - self._ema)
        estimate = max(self._ema, seconds)
        if estimate != self.step_estimate:
            self.step_estimate = estimate
            self._update_threshold()

    def record_save(self, seconds: float) -> None:
        """Record one save's duration; the estimate is the slowest of the recent saves."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self._saves.append(seconds)
        estimate = max(self._saves)
        if estimate != self.save_estimate:
            self.save_estimate = estimate
            self._update_threshold()

    def _fire_at(self) -> float:
        if self.fired or self.end_time is None:
            return math.inf
        return self.end_time - (self.step_estimate + self.save_estimate + self.config.margin)

    def _update_threshold(self) -> None:
        if not self._started:
            return  # stays -inf so the first due() starts
        self._threshold = math.inf if self.fired else min(self._fire_at(), self._next_refresh)

    # -- per step ----------------------------------------------------------------------

    def time_left(self, now: float | None = None) -> float | None:
        self.start()
        if self.end_time is None:
            return None
        return self.end_time - (self._clock() if now is None else now)

    def due(self, now: float | None = None) -> bool:
        """True (once) when the time left is less than next step + save + margin."""
        t = self._clock() if now is None else now
        if t <= self._threshold:
            return False
        return self._slow_due(t)

    def _slow_due(self, now: float) -> bool:
        if not self._started:
            self.start()
            return self.due(now)
        if self.fired:
            return False
        if self._ask is not None and (now > self._fire_at() or now >= self._next_refresh):
            self._refresh(now)  # about to fire: make sure the limit was not extended
        if now <= self._fire_at():
            self._update_threshold()
            return False
        self.fired = True
        self._threshold = math.inf
        return True

    def request(self, now: float | None = None) -> Request:
        """The request to post: save, exit and ask for a requeue."""
        left = self.time_left(now)
        left_text = "no deadline" if left is None else f"{left:.1f} s left"
        return Request(
            Action.SAVE_EXIT,
            Source.TIME_BUDGET,
            reason=(
                # three significant digits: a 0.04 s step is not "0.0 s", the sum stays the one compared
                f"time budget: {left_text} < step {self.step_estimate:.3g} s"
                f" + save {self.save_estimate:.3g} s + margin {self.config.margin:g} s"
            ),
            requeue=True,
        )
