"""Signals become requests. Handlers only record; all work happens between steps.

Default mapping: ``SIGUSR1`` (SLURM's ``--signal=B:USR1@N``, relayed by the batch script)
asks to save, exit and be requeued; ``SIGTERM`` (preemption, ``scancel``, Kubernetes) asks
to save and exit. The handlers in place before ftkit's are restored on ``close``.

A signal ftkit maps is ftkit's while it runs: nothing installed before may end the step
half-way, or the save it asks for never happens. So the previous handler is never called
by default: ftkit records the request and the step ends normally. A layer that needs to keep
seeing its signal (submitit's own recorder, a user's) asks for it with ``chain=True``: then
the previous *Python* handler is called after ftkit records, except Python's
``default_int_handler`` (Ctrl-C raising ``KeyboardInterrupt``) and what is not a Python
function (``SIG_DFL`` would kill the process, ``SIG_IGN`` does nothing); whatever it raises
(``SystemExit``, ``KeyboardInterrupt``, an error) is held back and named in the request's
reason. Signals ftkit does not map are never touched.

The one way out at once: a second ``SIGINT`` within ``interrupt_window`` seconds of the one
before raises ``KeyboardInterrupt``, as Ctrl-C twice does in any terminal program. Nothing
more is saved then; a checkpoint being written stays marked incomplete and is never loaded.
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

    chain: bool = False
    """Off (default): a mapped signal is ftkit's alone; the handler installed before is not
    called (it is restored on close). On: also call that handler if it is a Python function,
    after ftkit records; what it raises is held back, so it cannot end the step. Never
    Python's Ctrl-C handler (``KeyboardInterrupt``), ``SIG_DFL`` or ``SIG_IGN``."""

    interrupt_window: float | None = 2.0
    """Seconds: a second ``SIGINT`` (Ctrl-C) this soon after the one before, when ``INT`` is
    mapped, raises ``KeyboardInterrupt`` at once and nothing more is saved. None: every
    ``SIGINT`` only asks for its action."""

    resolved: dict[signal.Signals, tuple[Any, bool | None]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for sig, action in self.actions.items():
            signum = parse_signal(sig, setting=f"signals[{sig!r}]")
            if signum in _UNCATCHABLE:
                raise ConfigError(f"signals[{sig!r}]: {signum.name} cannot be caught; remove it")
            self.resolved[signum] = parse_action(action, setting=f"signals[{sig!r}]")
        window = self.interrupt_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float))
                                   or not window > 0):
            raise ConfigError(f"signals.interrupt_window: must be seconds > 0 or None (a second "
                              f"Ctrl-C never interrupts at once), got {window!r}")


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
        self._last_interrupt: float | None = None  # clock time of the last SIGINT

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
        now = self._clock()
        if sig is signal.SIGINT:
            window, last = self._config.interrupt_window, self._last_interrupt
            self._last_interrupt = now
            if window is not None and last is not None and now - last <= window:
                raise KeyboardInterrupt  # Ctrl-C twice: the user wants out now
        action, requeue = self._config.resolved[sig]
        reason = f"{sig.name} received"
        previous = self._previous.get(sig)
        if self._config.chain and callable(previous) and previous is not signal.default_int_handler:
            try:
                previous(signum, frame)
            except BaseException as exc:  # it must not end the step; the reason names it
                reason += (f" (the handler installed before ftkit's raised {type(exc).__name__}"
                           f"{': ' + str(exc) if str(exc) else ''}; held back so the step ends cleanly)")
        self._box.post(Request(action, Source.SIGNAL, reason, requeue=requeue, signal=signum, created=now))

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
