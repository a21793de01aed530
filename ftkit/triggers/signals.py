"""Signals become requests. Handlers only record; all work happens between steps.

Default mapping: ``SIGUSR1`` (SLURM's ``--signal=B:USR1@N``, relayed by the batch script)
asks to save, exit and be requeued; ``SIGTERM`` (preemption, ``scancel``, Kubernetes) asks
to save and exit. Handlers chain to a Python handler installed before ftkit's and are
restored on ``close``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ..decision import Request, RequestBox, Source, parse_action
from ..errors import ConfigError

__all__ = ["SignalConfig", "SignalTrigger", "parse_signal"]

log = logging.getLogger(__name__)


def parse_signal(value: str | int, *, setting: str = "signals") -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``"usr1"``, ``10`` or ``"10"`` -> ``signal.SIGUSR1``."""
    if isinstance(value, signal.Signals):
        return value
    text = str(value).strip()
    try:
        if text.lstrip("-").isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        valid = "USR1, USR2, TERM, INT, HUP, ... or a number"
        raise ConfigError(f"{setting}: {value!r} is not a signal on this system; use {valid}") from None


_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


@dataclass(kw_only=True, slots=True)
class SignalConfig:
    """Which signals ftkit handles and what each one asks for."""

    actions: Mapping[str | int, str] = field(
        default_factory=lambda: {"USR1": "requeue", "TERM": "save-exit"}
    )
    """Signal (name or number) -> action: ``save``, ``save-exit``, ``requeue``, ``stop``, ``exit``."""

    enabled: bool = True
    """Install handlers at all. Off when another layer (e.g. a launcher) owns signals."""

    resolved: dict[signal.Signals, tuple[Any, bool | None]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for sig, action in self.actions.items():
            signum = parse_signal(sig, setting=f"signals[{sig!r}]")
            if signum in _UNCATCHABLE:
                raise ConfigError(f"signals[{sig!r}]: {signum.name} cannot be caught; remove it")
            self.resolved[signum] = parse_action(action, setting=f"signals[{sig!r}]")


class SignalTrigger:
    """Installs handlers that post a :class:`Request` per signal received.

    Must be created in the main thread (Python delivers signals there). A burst of the same
    signal posts several requests; the controller coalesces them into one decision.
    """

    def __init__(self, config: SignalConfig, box: RequestBox, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._box = box
        self._clock = clock
        self._previous: dict[signal.Signals, Any] = {}

    def start(self) -> SignalTrigger:
        if not self._config.enabled or self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("signals: ftkit must be set up in the main thread to install handlers; "
                              "set signals.enabled=False to run without them")
        for signum in self._config.resolved:
            self._previous[signum] = signal.signal(signum, self._handle)
        log.debug("signal handlers installed for %s", [s.name for s in self._previous])
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Record only: no lock, no I/O, no logging. Work happens at the next step boundary.
        sig = signal.Signals(signum)
        action, requeue = self._config.resolved[sig]
        self._box.post(Request(action, Source.SIGNAL, f"{sig.name} received", requeue=requeue,
                               created=self._clock()))
        previous = self._previous.get(sig)
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):  # not main thread at interpreter shutdown
                log.debug("could not restore handler for %s", signum)
        self._previous.clear()

    def __enter__(self) -> SignalTrigger:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
