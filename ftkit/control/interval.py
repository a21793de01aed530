"""``save_every="auto"``: the periodic checkpoint interval from measurements (Young/Daly).

A checkpoint every ``tau`` seconds costs the loop ``C / tau`` of its time (``C``: the stall of
one checkpoint, the whole save when saves are synchronous) and, at a failure, half an interval
of work on average is lost and computed again: ``tau / (2 * MTBF)``. The sum is smallest at

    tau* = sqrt(2 * C * MTBF)                       (Young 1974; Daly 2006, first order)

The rule (:func:`choose_interval`, a pure function) bounds it:

* below by the time until a checkpoint is durable divided by ``max_in_flight``: a shorter
  interval would start a new persist while the allowed ones are still being written, and the
  loop would wait for them (a synchronous save is durable when it returns: the bound is C);
* above by ``IntervalConfig.max_interval``. Where the two bounds cross, the lower one wins.

MTBF is ``IntervalConfig.mtbf`` when set, else the job dir's own history: the wall time of its
runs divided by its unplanned interruptions (crashes, runs that left no exit record, hangs).
Time limits, preemption notices and requested requeues are not failures: the time budget and
the signal handlers save before those. With no failure seen yet the MTBF is
``max(assumed_mtbf, observed time)``.

:class:`AutoInterval` applies the rule in a run: after the first step and after every save it
re-evaluates from the latest measurements (the median of the newest :data:`WINDOW` costs, earlier
runs' included; a job dir whose runs never reached a periodic checkpoint, from their exit saves'
times until durable) and writes an ``interval`` event with every input
whenever the interval moves by more than ``change``.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["WINDOW", "AutoInterval", "IntervalConfig", "IntervalPlan", "choose_interval", "expected_waste",
           "young_daly"]

log = logging.getLogger(__name__)

_MAX_STEPS = 2**31 - 1  # the agreement collective carries int32


@dataclass(kw_only=True, slots=True)
class IntervalConfig:
    """How ``save_every="auto"`` picks the interval between periodic checkpoints."""

    mtbf: float | None = None
    """Mean time between unplanned interruptions, seconds; None: from the job dir's history
    (module doc)."""

    assumed_mtbf: float = 86400.0
    """MTBF used while neither ``mtbf`` is set nor the job dir has seen an unplanned
    interruption (then ``max(assumed_mtbf, observed wall time)``)."""

    max_interval: float = 3600.0
    """Upper bound of the interval, seconds: at most this much work is at risk."""

    first_after: float = 300.0
    """Seconds until the first periodic checkpoint when the job dir has no measured checkpoint
    cost yet (its first run): the rule needs one measurement of C."""

    change: float = 0.1
    """Write a new ``interval`` event when the interval moves by more than this fraction."""

    def __post_init__(self) -> None:
        for name in ("assumed_mtbf", "max_interval", "first_after"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"interval.{name}: must be seconds > 0, got {value!r}")
        if self.mtbf is not None and (not isinstance(self.mtbf, (int, float)) or not self.mtbf > 0):
            raise ConfigError(f"interval.mtbf: must be seconds > 0 or None (from the job dir's history), "
                              f"got {self.mtbf!r}")
        if not isinstance(self.change, (int, float)) or self.change < 0:
            raise ConfigError(f"interval.change: must be a fraction >= 0, got {self.change!r}")


def young_daly(cost: float, mtbf: float) -> float:
    """The first-order optimum interval sqrt(2 * C * MTBF), seconds."""
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))


def expected_waste(interval: float, *, cost: float, mtbf: float) -> float:
    """Expected fraction of the loop's time lost at ``interval``: C/tau + tau/(2 MTBF)."""
    if interval <= 0:
        return math.inf
    return cost / interval + interval / (2.0 * mtbf)


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalPlan:
    """One evaluation of the rule, with every input (what the ``interval`` event records)."""

    seconds: float
    optimum: float
    lower: float
    upper: float
    bound: str
    """Which term decided: ``formula``, ``durable`` (the lower bound) or ``max``."""
    cost: float
    durable: float
    mtbf: float
    mtbf_source: str

    def as_fields(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in ((s, getattr(self, s)) for s in self.__slots__)}


def choose_interval(
    *, cost: float, mtbf: float, durable: float, max_in_flight: int = 1, max_interval: float,
    mtbf_source: str = "config",
) -> IntervalPlan:
    """The bounded Young/Daly interval (module doc). A pure function of its inputs."""
    optimum = young_daly(cost, mtbf)
    lower = max(durable / max(max_in_flight, 1), cost)
    seconds, bound = optimum, "formula"
    if seconds > max_interval:
        seconds, bound = max_interval, "max"
    if seconds < lower:
        seconds, bound = lower, "durable"
    return IntervalPlan(seconds=seconds, optimum=optimum, lower=lower, upper=max_interval, bound=bound,
                        cost=cost, durable=durable, mtbf=mtbf, mtbf_source=mtbf_source)


WINDOW = 5
"""How many of the newest measurements the rule takes the median of: one save slowed by a busy
disk or a neighbour (or one that happened to be quick) does not move the interval; a cost that
changed for good does within a few saves."""


def _median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples[-WINDOW:]) if samples else None


@dataclass(frozen=True, kw_only=True, slots=True)
class History:
    """What earlier runs of the job dir tell the rule."""

    failures: int = 0
    observed: float = 0.0
    """Wall time of the earlier runs, seconds."""
    costs: tuple[float, ...] = ()
    """The newest measured in-loop checkpoint costs (stalls), seconds, oldest first; where the
    job dir has none (its runs ended before their first periodic checkpoint: only their exit
    saves were measured), the newest times until durable, which a stall never exceeds."""
    durables: tuple[float, ...] = ()
    """The newest measured times until durable, seconds, oldest first."""

    @property
    def cost(self) -> float | None:
        """The median of the newest :data:`WINDOW` costs."""
        return _median(self.costs)

    @property
    def durable(self) -> float | None:
        """The median of the newest :data:`WINDOW` times until durable."""
        return _median(self.durables)

    def mtbf(self, config: IntervalConfig) -> tuple[float, str]:
        if config.mtbf is not None:
            return float(config.mtbf), "config"
        if self.failures:
            return self.observed / self.failures, f"history ({self.failures} unplanned interruptions in {self.observed:.0f} s)"
        return max(config.assumed_mtbf, self.observed), f"assumed (no unplanned interruption in {self.observed:.0f} s)"


def read_history(events: Sequence[dict[str, Any]], *, alive: Callable[[Any, Any], bool] | None = None) -> History:
    """The rule's inputs from an events log (earlier runs of this job dir)."""
    from ..report.runs import parse_runs

    runs = parse_runs(events, alive=alive)
    costs = [s for r in runs for s in r.stall_values()]
    durable = [float(e["seconds"]) for e in events if e.get("event") == "save" and "seconds" in e]
    return History(
        failures=sum(1 for r in runs if r.unplanned),
        observed=sum(r.wall for r in runs if r.wall is not None),
        costs=tuple((costs or durable)[-WINDOW:]),
        durables=tuple(durable[-WINDOW:]),
    )


class AutoInterval:
    """The rule applied in a run: ``next_step`` is the step of the next periodic checkpoint."""

    def __init__(
        self,
        config: IntervalConfig,
        *,
        events: Any,
        history: History,
        max_in_flight: int = 1,
        agree: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.events = events
        self.history = history
        self.max_in_flight = max_in_flight
        self._agree = agree
        self._clock = clock
        self._costs = collections.deque(history.costs, maxlen=WINDOW)
        self._durables = collections.deque(history.durables, maxlen=WINDOW)
        self.next_step: float = math.inf
        self.steps: int | None = None
        self.plan: IntervalPlan | None = None

    def measured(self, *, cost: float, durable: float | None) -> None:
        """A checkpoint stalled the loop ``cost`` s and (when known) took ``durable`` s to persist."""
        self._costs.append(cost)
        if durable is not None:
            self._durables.append(durable)

    @property
    def cost(self) -> float | None:
        """The checkpoint cost the rule uses: the median of the newest :data:`WINDOW` measured."""
        return _median(list(self._costs))

    @property
    def durable(self) -> float | None:
        """The time until durable the rule uses: the median of the newest :data:`WINDOW` measured."""
        return _median(list(self._durables))

    def evaluate(self) -> IntervalPlan | None:
        """The rule on the current inputs; None while no checkpoint cost is known."""
        cost = self.cost
        if cost is None:
            return None
        mtbf, source = self.history.mtbf(self.config)
        durable = self.durable if self.durable is not None else cost
        return choose_interval(cost=cost, mtbf=mtbf, durable=durable, max_in_flight=self.max_in_flight,
                               max_interval=self.config.max_interval, mtbf_source=source)

    def first_after(self) -> float:
        """Seconds to the first periodic checkpoint while no cost is measured: ``first_after``, or
        half the job dir's MTBF when its runs failed sooner than that (runs killed hard before their
        first checkpoint, every time, would otherwise never save one)."""
        first = self.config.first_after
        if self.history.failures and self.config.mtbf is None:
            return max(1.0, min(first, self.history.mtbf(self.config)[0] / 2))
        return first

    def schedule(self, step: int, *, step_time: float) -> int:
        """Re-evaluate at ``step`` (every rank at the same step) and set ``next_step``."""
        plan = self.evaluate()
        seconds = self.first_after() if plan is None else plan.seconds
        steps = min(max(1, round(seconds / step_time)) if step_time > 0 else _MAX_STEPS, _MAX_STEPS)
        if self._agree is not None:
            steps = self._agree(steps)  # ranks measure differently; they must save at one step
        self.next_step = step + steps
        previous = self.steps
        self.steps = steps
        self.plan = plan
        changed = previous is None or abs(steps - previous) > self.config.change * previous
        if changed and self.events is not None:
            fields = plan.as_fields() if plan is not None else {"seconds": seconds, "bound": "first_after"}
            fields["interval_seconds"] = fields.pop("seconds")
            self.events.emit("interval", step=step, steps=steps, next_step=self.next_step,
                             step_time=round(step_time, 6), max_in_flight=self.max_in_flight,
                             previous_steps=previous, **fields)
            log.info("checkpoint interval: every %d steps (%.1f s, %s)", steps, seconds,
                     "no checkpoint measured yet" if plan is None else plan.bound)
        return steps
