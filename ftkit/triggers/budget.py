"""The time budget: save and exit while there is still time for one more step and a save.

The job's end time is resolved once (explicit setting > environment variable > SLURM).
Each step the controller calls :meth:`TimeBudget.due`, which is one clock read and one
comparison against a precomputed threshold; the threshold moves only when the step or
save estimate changes.
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


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """When to stop before the job's time runs out."""

    deadline: float | None = None
    """UNIX time the job must be done by; None looks it up (``env_var``, then SLURM)."""

    env_var: str = "FTKIT_DEADLINE"
    """Environment variable holding the deadline as UNIX seconds or ISO-8601 time."""

    use_slurm: bool = True
    """Ask SLURM (``scontrol show job``) for the job's end time when nothing else sets it."""

    margin: float = 30.0
    """Seconds kept free after the last save (SLURM's KillWait, slow exits, requeue)."""

    save_estimate: float = 30.0
    """Seconds a save is assumed to take until one has been measured."""

    enabled: bool = True
    """False turns the time budget off: it never fires."""

    def __post_init__(self) -> None:
        if self.deadline is not None and not _finite_number(self.deadline):
            raise ConfigError(
                f"budget.deadline: got {self.deadline!r}; give UNIX seconds or leave it unset"
            )
        if not isinstance(self.env_var, str) or not self.env_var.strip():
            raise ConfigError(
                f"budget.env_var: got {self.env_var!r}; name an environment variable, "
                "e.g. FTKIT_DEADLINE"
            )
        for name in ("margin", "save_estimate"):
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
            return datetime.fromisoformat(iso).timestamp()
        except ValueError:
            raise ConfigError(
                f"{setting}: cannot read {text!r} as a deadline; give UNIX seconds "
                "(e.g. 1735689600) or an ISO-8601 time (e.g. 2025-01-01T00:00:00+00:00)"
            ) from None
    if not math.isfinite(seconds):
        raise ConfigError(f"{setting}: got {text!r}; give finite UNIX seconds")
    return seconds


def _slurm_end_time(environ: Mapping[str, str]) -> float | None:
    from ..slurm.env import SlurmEnv, job_end_time

    job_id = SlurmEnv.from_env(environ).job_id
    return None if job_id is None else job_end_time(job_id)


class TimeBudget:
    """Says when the time left no longer covers the next step, a save and the margin.

    ``clock`` must return UNIX time (the end time is UNIX time). ``end_time_lookup``
    replaces the SLURM lookup (called once, returns UNIX time or None). One-shot: once
    :meth:`due` returned True, ``fired`` is set and it returns False from then on.
    """

    def __init__(
        self,
        config: BudgetConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        end_time_lookup: Callable[[], float | None] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config if config is not None else BudgetConfig()
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

    # -- setup -------------------------------------------------------------------------

    def start(self) -> TimeBudget:
        """Resolve the end time (once). Called by the first :meth:`due` if not before."""
        if self._started:
            return self
        self._started = True
        self.end_time, self.source = self._resolve()
        if self.end_time is None:
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

    def _resolve(self) -> tuple[float | None, str]:
        cfg = self.config
        if not cfg.enabled:
            return None, "disabled (budget.enabled=false)"
        if cfg.deadline is not None:
            return float(cfg.deadline), "budget.deadline"
        environ = os.environ if self._environ is None else self._environ
        raw = environ.get(cfg.env_var)
        if raw is not None and raw.strip():
            return parse_deadline(raw, setting=f"environment variable {cfg.env_var}"), (
                f"${cfg.env_var}"
            )
        if not cfg.use_slurm:
            return None, f"budget.deadline unset, ${cfg.env_var} unset, budget.use_slurm=false"
        try:
            if self._lookup is not None:
                return self._lookup(), "end_time_lookup"
            end = _slurm_end_time(environ)
        except SlurmError as exc:
            log.warning("time budget: cannot ask SLURM for the job's end time: %s", exc)
            return None, "SLURM lookup failed"
        if end is None:
            return None, f"budget.deadline unset, ${cfg.env_var} unset, no SLURM end time"
        return end, "SLURM EndTime"

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

    def _update_threshold(self) -> None:
        if not self._started:
            return  # stays -inf so the first due() starts
        if self.fired or self.end_time is None:
            self._threshold = math.inf
        else:
            self._threshold = self.end_time - (
                self.step_estimate + self.save_estimate + self.config.margin
            )

    # -- per step ----------------------------------------------------------------------

    def time_left(self, now: float | None = None) -> float | None:
        self.start()
        if self.end_time is None:
            return None
        return self.end_time - (self._clock() if now is None else now)

    def due(self, now: float | None = None) -> bool:
        """True (once) when the time left is less than next step + save + margin."""
        if (self._clock() if now is None else now) <= self._threshold:
            return False
        return self._slow_due(now)

    def _slow_due(self, now: float | None) -> bool:
        if not self._started:
            self.start()
            return self.due(now)
        if self.fired or self.end_time is None:
            return False
        self.fired = True
        self._threshold = math.inf
        return True

    def request(self, now: float | None = None) -> Request:
        """The request to post: save, exit and ask for a requeue."""
        left = self.time_left(now)
        left_text = "no deadline" if left is None else f"{left:.0f} s left"
        return Request(
            Action.SAVE_EXIT,
            Source.TIME_BUDGET,
            reason=(
                f"time budget: {left_text} < step {self.step_estimate:.1f} s"
                f" + save {self.save_estimate:.1f} s + margin {self.config.margin:g} s"
            ),
            requeue=True,
        )
