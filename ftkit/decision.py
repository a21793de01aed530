"""Requests (what a trigger asks for) and decisions (what every rank agrees to do).

A trigger turns a signal, a switch file, a request file or the time budget into a
:class:`Request`. Requests collect in a :class:`RequestBox`; signal handlers and watcher
threads only ``post`` to it. Between steps the controller drains the box, agrees across
ranks and returns one :class:`Decision`.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field

__all__ = ["Action", "Decision", "Request", "RequestBox", "Source", "parse_action"]


class Action(enum.IntFlag):
    """What to do at a step boundary. ``SAVE | EXIT`` saves, then exits."""

    NONE = 0
    SAVE = 1
    EXIT = 2
    SAVE_EXIT = 3


class Source(str, enum.Enum):
    """Where a request came from; one bit each in the cross-rank agreement."""

    SIGNAL = "signal"
    SAVE_SWITCH = "save-switch"
    KILL_SWITCH = "kill-switch"
    REQUEST = "request"
    TIME_BUDGET = "time-budget"
    API = "api"


# Names accepted for an action in configuration and on the command line.
_ACTIONS: dict[str, tuple[Action, bool | None]] = {
    "save": (Action.SAVE, None),
    "save-exit": (Action.SAVE_EXIT, None),
    "stop": (Action.SAVE_EXIT, False),
    "requeue": (Action.SAVE_EXIT, True),
    "exit": (Action.EXIT, None),
}


def parse_action(name: str, *, setting: str = "action") -> tuple[Action, bool | None]:
    """Map an action name to ``(action, requeue)``; ``requeue`` None means "policy decides".

    ``save`` keeps training, ``save-exit`` saves and exits, ``requeue`` saves, exits and asks
    for a requeue, ``stop`` saves, exits and never requeues, ``exit`` exits without saving.
    """
    from .errors import ConfigError

    try:
        return _ACTIONS[name.strip().lower().replace("_", "-")]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"{setting}: unknown action {name!r}; use one of {', '.join(sorted(_ACTIONS))}"
        ) from None


@dataclass(frozen=True, slots=True)
class Request:
    """One thing a trigger asked for, stamped with the monotonic time it was recorded."""

    action: Action
    source: Source
    reason: str
    requeue: bool | None = None  # True: ask for requeue, False: never requeue, None: no opinion
    pin: bool = False  # the checkpoint it produces is kept by retention
    origin: str | None = None  # the file behind a switch or request file, consumed once acted on
    signal: int | None = None  # the signal's number, for a signal's request (each rank learns which were seen)
    created: float = field(default_factory=time.monotonic)


class RequestBox:
    """A lock-free inbox that signal handlers and watcher threads post to.

    ``post`` is one ``deque.append`` and one attribute store: safe inside a Python signal
    handler (no lock, no I/O, no allocation beyond the request). ``pending`` is a plain
    attribute so the per-step check costs one attribute load when nothing happened.
    """

    __slots__ = ("_queue", "pending")

    def __init__(self) -> None:
        self._queue: collections.deque[Request] = collections.deque()
        self.pending = False

    def post(self, request: Request) -> None:
        self._queue.append(request)
        self.pending = True

    def drain(self) -> list[Request]:
        self.pending = False
        out: list[Request] = []
        while True:
            try:
                out.append(self._queue.popleft())
            except IndexError:
                return out


@dataclass(frozen=True, slots=True)
class Decision:
    """What every rank does at ``step``; identical on all ranks of a job.

    ``requeue`` is the trainer's wish: True asks for a requeue, False forbids one (kill-switch,
    ``stop``), None leaves it to the requeue policy (which has the last word anyway). ``pin``
    asks retention to keep the checkpoint; ``reasons`` says why, in words.
    """

    step: int
    action: Action = Action.NONE
    requeue: bool | None = None
    pin: bool = False
    sources: frozenset[Source] = frozenset()
    reasons: tuple[str, ...] = ()

    @property
    def save(self) -> bool:
        return bool(self.action & Action.SAVE)

    @property
    def exit(self) -> bool:
        return bool(self.action & Action.EXIT)

    def __bool__(self) -> bool:
        return self.action != Action.NONE

    def describe(self) -> str:
        what = {
            Action.NONE: "continue",
            Action.SAVE: "save",
            Action.EXIT: "exit",
            Action.SAVE_EXIT: "save and exit",
        }[self.action]
        if self.exit:
            what += {True: " (requeue)", False: " (no requeue)", None: ""}[self.requeue]
        return f"step {self.step}: {what}" + (f" because {'; '.join(self.reasons)}" if self.reasons else "")
