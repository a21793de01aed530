"""Cross-rank agreement: every rank gets the same decision at the same step.

Each rank encodes what it has seen since the last agreement as a short vector of 0/1 flags
(actions, requeue wishes, sources, and which signals arrived: one flag per signal number)
and the ranks take the element-wise MAX in one small
``all_reduce`` on the process group's device (gloo: CPU, NCCL: the current CUDA device).
Since every rank maps the same flags to the same decision, a trigger seen by one rank on
one node reaches all of them at the same step.

The collective runs at the first check and then every ``every`` steps, or more often when
steps are slow (``max_seconds``); all ranks must call ``check`` with the same step numbers
(they do in a data-parallel loop). How many steps to the next agreement is itself agreed: the
vector's last slot carries each rank's wish, and the MAX takes the slowest rank's.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._collective import all_reduce_max, flag_device
from ..decision import Action, Request, Source
from ..errors import ConfigError

__all__ = ["AgreementConfig", "Flag", "decode_flags", "decode_signals", "encode"]


class Flag(enum.IntEnum):
    """Positions in the agreement vector."""

    SAVE = 0
    EXIT = 1
    REQUEUE = 2
    NO_REQUEUE = 3
    PIN = 4
    NO_SAVE = 5  # kill-switch present at start: exit without writing anything new
    SIGNAL = 6
    SAVE_SWITCH = 7
    KILL_SWITCH = 8
    REQUEST = 9
    TIME_BUDGET = 10
    API = 11


SOURCE_FLAG = {
    Source.SIGNAL: Flag.SIGNAL,
    Source.SAVE_SWITCH: Flag.SAVE_SWITCH,
    Source.KILL_SWITCH: Flag.KILL_SWITCH,
    Source.REQUEST: Flag.REQUEST,
    Source.TIME_BUDGET: Flag.TIME_BUDGET,
    Source.API: Flag.API,
}
SIGNALS = len(Flag)  # flags SIGNALS + n - 1: signal n arrived at some rank (n in 1..NSIG - 1)
SLACK = SIGNALS + signal.NSIG - 1  # every - the steps this rank wants to the next agreement (MAX: the fewest)
WIDTH = SLACK + 1


@dataclass(kw_only=True, slots=True)
class AgreementConfig:
    """How often ranks agree on a decision."""

    every: int = 10
    """Run the agreement collective every this many steps (and at the first check). A trigger
    is acted on within ``every`` steps. One collective costs a small all-reduce on gloo and a
    device synchronisation on NCCL: raise ``every`` when steps are very short
    (``benchmarks/check_overhead.py`` measures it; docs/benchmarks.md has the figures)."""

    max_seconds: float | None = 5.0
    """When ``every`` steps take longer than this (by the slowest rank's step time), agree
    every ``max_seconds / step time`` steps instead (at least every step), so a trigger waits
    about this long, not ``every`` slow steps: SLURM's ``SIGKILL`` follows its ``SIGTERM``
    after 30 s (``KillWait``), torchrun's after 30 s too. None: always every ``every`` steps.
    An agreement per step costs nothing that shows beside steps this slow."""

    device: str | None = None
    """Device for the agreement tensor; None picks ``cuda`` for NCCL, ``cpu`` otherwise."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"agreement.every: must be a whole number of steps >= 1, got {self.every!r}")
        if self.max_seconds is not None and not (isinstance(self.max_seconds, (int, float))
                                                 and not isinstance(self.max_seconds, bool) and self.max_seconds > 0):
            raise ConfigError(f"agreement.max_seconds: must be seconds > 0 or None, got {self.max_seconds!r}")

    def steps_to_next(self, step_time: float) -> int:
        """Steps from one agreement to the next at ``step_time`` seconds a step (0: not measured
        yet, as at the first check: agree again after one step, which measures it)."""
        if self.max_seconds is None:
            return self.every
        if step_time <= 0:
            return 1
        return max(1, min(self.every, int(self.max_seconds // step_time)))


def encode(requests: Iterable[Request], *, no_save: bool = False, slack: int = 0) -> list[int]:
    """``slack``: ``every`` minus the steps this rank wants to the next agreement."""
    flags = [0] * WIDTH
    flags[SLACK] = slack
    for r in requests:
        if r.action & Action.SAVE:
            flags[Flag.SAVE] = 1
        if r.action & Action.EXIT:
            flags[Flag.EXIT] = 1
        if r.requeue is True:
            flags[Flag.REQUEUE] = 1
        elif r.requeue is False:
            flags[Flag.NO_REQUEUE] = 1
        if r.pin:
            flags[Flag.PIN] = 1
        flags[SOURCE_FLAG[r.source]] = 1
        if r.signal is not None and 0 < r.signal < signal.NSIG:
            flags[SIGNALS + r.signal - 1] = 1
    if no_save:
        flags[Flag.EXIT] = flags[Flag.NO_SAVE] = flags[Flag.KILL_SWITCH] = 1
        flags[Flag.NO_REQUEUE] = 1
    return flags


def decode_flags(flags: list[int]) -> tuple[Action, bool | None, bool, frozenset[Source]]:
    """Agreed flags -> (action, requeue wish, pin, sources). A pure function of the flags."""
    action = Action.NONE
    if flags[Flag.SAVE]:
        action |= Action.SAVE
    if flags[Flag.EXIT]:
        action |= Action.EXIT
    if flags[Flag.NO_SAVE]:
        action = Action.EXIT
    requeue: bool | None = None
    if flags[Flag.NO_REQUEUE]:
        requeue = False  # a kill-switch or stop wins over any requeue wish
    elif flags[Flag.REQUEUE]:
        requeue = True
    sources = frozenset(s for s, f in SOURCE_FLAG.items() if flags[f])
    return action, requeue, bool(flags[Flag.PIN]), sources


def decode_signals(flags: list[int]) -> list[int]:
    """The numbers of the signals some rank received, ascending."""
    return [n for n in range(1, signal.NSIG) if flags[SIGNALS + n - 1]]


class Collective:
    """The all_reduce(MAX) of the flag vector on a process group, with a reused buffer."""

    def __init__(self, config: AgreementConfig, group: Any = None) -> None:
        import torch

        self._group = group
        device = config.device if config.device is not None else flag_device(group)
        self._buf = torch.zeros(WIDTH, dtype=torch.int32, device=device)
        self._torch = torch

    def reduce(self, flags: list[int]) -> list[int]:
        buf = self._buf
        buf.copy_(self._torch.tensor(flags, dtype=self._torch.int32), non_blocking=False)
        all_reduce_max(buf, self._group)
        return buf.tolist()
