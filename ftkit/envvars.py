"""``FTKIT_*`` environment variables -> a :class:`ftkit.Config`, a job directory and the
settings of ``ftkit requeue``. The one place that reads them.

An orchestrator (batch script, launcher, Kubernetes manifest) turns ftkit on and tunes it
without touching the training script. Every integration reads the same variables:

==========================  =============================================================
``FTKIT_JOBDIR``            the job directory (switch files, request files, events log)
``FTKIT_SIGNALS``           ``USR1=requeue,TERM=save-exit``; ``off`` installs no handlers
``FTKIT_WATCH``             ``auto``, ``native``, ``polling`` or ``off`` (switch files)
``FTKIT_POLL_INTERVAL``     seconds between two scans when polling (> 0)
``FTKIT_AGREE_EVERY``       agree across ranks every N steps (>= 1)
``FTKIT_AGREE_SECONDS``     agree more often when N steps take longer than this (> 0); ``off``: every N
``FTKIT_DEADLINE``          UNIX seconds or ISO-8601 time the job must end by
``FTKIT_BUDGET_MARGIN``     seconds kept free after the last save (>= 0)
``FTKIT_SAVE_EVERY``        also save every N steps (>= 1); ``auto``: measured interval; ``off`` (or 0): only on request
``FTKIT_KEEP_LAST``         keep the newest N valid checkpoints; ``all`` keeps every one
==========================  =============================================================

``ftkit requeue`` (the batch script's exit path) reads its own, through
:func:`requeue_settings`:

==========================  =============================================================
``FTKIT_MAX_REQUEUES``      cap on requeues in a row (>= 0)
``FTKIT_MAX_NO_PROGRESS``   crashes in a row requeued without a newer checkpoint (>= 0)
``FTKIT_REQUEUE_ON_CRASH``  ``1`` or ``0``: requeue a run that crashed
``FTKIT_REQUEUE_FALLBACK``  ``resubmit`` or ``none``: when ``scontrol requeue`` fails
==========================  =============================================================

Variables that name themselves in a config field (``WatchdogConfig.env_var`` and
``warmup_env_var``, ``BudgetConfig.env_var``) and ``FTKIT_TEMPLATES_DIR`` (where sbatch
templates are looked for) are read by the component they configure.

An unset or empty variable keeps the default. A value that cannot be read raises
:class:`ftkit.errors.ConfigError` naming the variable. No torch, no transformers.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = ["REQUEUE_VARIABLES", "VARIABLES", "config_from_env", "jobdir_from_env", "requeue_settings"]

VARIABLES = (
    "FTKIT_JOBDIR",
    "FTKIT_SIGNALS",
    "FTKIT_WATCH",
    "FTKIT_POLL_INTERVAL",
    "FTKIT_AGREE_EVERY",
    "FTKIT_AGREE_SECONDS",
    "FTKIT_DEADLINE",
    "FTKIT_BUDGET_MARGIN",
    "FTKIT_SAVE_EVERY",
    "FTKIT_KEEP_LAST",
)
"""The variables :func:`config_from_env` and :func:`jobdir_from_env` read."""

REQUEUE_VARIABLES = (
    "FTKIT_MAX_REQUEUES",
    "FTKIT_MAX_NO_PROGRESS",
    "FTKIT_REQUEUE_ON_CRASH",
    "FTKIT_REQUEUE_FALLBACK",
)
"""The variables :func:`requeue_settings` reads."""

_OFF = frozenset({"off", "none", "no", "false", "0"})
T = TypeVar("T")


def _get(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _number(name: str, text: str, convert: Callable[[str], T], want: str) -> T:
    try:
        value = convert(text)
    except ValueError:
        raise ConfigError(f"{name}: cannot read {text!r}; give {want}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: got {text!r}; give {want}")
    return value


def _positive_int(name: str, text: str, *, also: str = "") -> int:
    """A whole number >= 1 from ``text``; ``also``: the words the variable takes besides (said
    in the error)."""
    want = "a whole number >= 1, e.g. 10" + (f", or {also}" if also else "")
    value = _number(name, text, int, want)
    if value < 1:
        raise ConfigError(f"{name}: got {text!r}; give {want}")
    return value


def _seconds(name: str, text: str, *, allow_zero: bool) -> float:
    want = "seconds as a number >= 0" if allow_zero else "seconds as a number > 0, e.g. 1.0"
    value = _number(name, text, float, want)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}: got {text!r}; give {want}")
    return value


def _signals(text: str) -> Any:
    from .decision import parse_action
    from .triggers.signals import SignalConfig, parse_signal

    if text.lower() in _OFF:
        return SignalConfig(enabled=False)
    actions: dict[str | int, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        sig, sep, action = item.partition("=")
        if not sep or not sig.strip() or not action.strip():
            raise ConfigError(
                f"FTKIT_SIGNALS: cannot read {item!r}; write SIGNAL=ACTION pairs separated by "
                "commas, e.g. USR1=requeue,TERM=save-exit (or 'off')"
            )
        signum = parse_signal(sig, setting="FTKIT_SIGNALS")
        parse_action(action, setting="FTKIT_SIGNALS")
        actions[signum.name] = action.strip()
    if not actions:
        raise ConfigError("FTKIT_SIGNALS: no SIGNAL=ACTION pair given; e.g. USR1=requeue,TERM=save-exit")
    try:
        return SignalConfig(actions=actions)
    except ConfigError as exc:  # e.g. KILL, which cannot be caught
        raise ConfigError(f"FTKIT_SIGNALS: {exc}") from None


def jobdir_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """``FTKIT_JOBDIR`` as an absolute path, or None when it is unset or empty."""
    environ = os.environ if environ is None else environ
    value = _get(environ, "FTKIT_JOBDIR")
    return None if value is None else Path(value).expanduser().absolute()


def config_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    jobdir: str | os.PathLike[str] | None = None,
) -> Any:
    """Build a :class:`ftkit.Config` from the ``FTKIT_*`` variables in ``environ`` (default
    ``os.environ``); unset variables keep ftkit's defaults.

    ``jobdir`` (default ``FTKIT_JOBDIR``) roots the checkpoint settings: ``FTKIT_KEEP_LAST``
    needs one of them.
    """
    from .control.agreement import AgreementConfig
    from .control.controller import Config
    from .triggers.budget import BudgetConfig, parse_deadline
    from .triggers.files import WatchConfig

    environ = os.environ if environ is None else environ
    kw: dict[str, Any] = {}

    if (text := _get(environ, "FTKIT_SIGNALS")) is not None:
        kw["signals"] = _signals(text)

    watch: dict[str, Any] = {}
    if (text := _get(environ, "FTKIT_WATCH")) is not None:
        watch["mode"] = text.lower()
    if (text := _get(environ, "FTKIT_POLL_INTERVAL")) is not None:
        watch["poll_interval"] = _seconds("FTKIT_POLL_INTERVAL", text, allow_zero=False)
    if watch:
        try:
            kw["watch"] = WatchConfig(**watch)
        except ConfigError as exc:
            raise ConfigError(f"FTKIT_WATCH: {exc}") from None

    agreement: dict[str, Any] = {}
    if (text := _get(environ, "FTKIT_AGREE_EVERY")) is not None:
        agreement["every"] = _positive_int("FTKIT_AGREE_EVERY", text)
    if (text := _get(environ, "FTKIT_AGREE_SECONDS")) is not None:
        agreement["max_seconds"] = None if text.lower() in ("off", "none") else _seconds("FTKIT_AGREE_SECONDS", text, allow_zero=False)
    if agreement:
        kw["agreement"] = AgreementConfig(**agreement)

    budget: dict[str, Any] = {}
    if (text := _get(environ, "FTKIT_DEADLINE")) is not None:
        # Read here, from ``environ``, so a bad value fails now and not at start().
        budget["deadline"] = parse_deadline(text, setting="FTKIT_DEADLINE")
        if (late := time.time() - budget["deadline"]) >= 0:  # said here, not as budget.deadline at start
            raise ConfigError(f"FTKIT_DEADLINE: the deadline {text.strip()!r} is {late:.0f} s in the past (a value "
                              "left from an earlier job?); give this job's end time, or unset it")
    if (text := _get(environ, "FTKIT_BUDGET_MARGIN")) is not None:
        budget["margin"] = _seconds("FTKIT_BUDGET_MARGIN", text, allow_zero=True)
    if budget:
        kw["budget"] = BudgetConfig(**budget)

    if (text := _get(environ, "FTKIT_SAVE_EVERY")) is not None:
        lowered = text.strip().lower()
        kw["save_every"] = (None if lowered in _OFF else "auto" if lowered == "auto"
                            else _positive_int("FTKIT_SAVE_EVERY", text, also="auto (the measured interval), or off"))

    if (text := _get(environ, "FTKIT_KEEP_LAST")) is not None:
        from .checkpoint import CheckpointConfig
        from .jobdir import JobDir

        keep = None if text.lower() in ("all", "none", "off") else _positive_int("FTKIT_KEEP_LAST", text, also="all")
        root = jobdir if jobdir is not None else jobdir_from_env(environ)
        if root is None:
            raise ConfigError("FTKIT_KEEP_LAST: set FTKIT_JOBDIR too (checkpoints live under it)")
        kw["checkpoint"] = CheckpointConfig(root=JobDir.of(root).checkpoints, keep_last=keep)

    return Config(**kw)


def requeue_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :class:`ftkit.slurm.requeue.RequeuePolicy` fields the ``FTKIT_*`` variables in
    ``environ`` (default ``os.environ``) set, by field name; unset or empty ones are left out.
    The policy validates the values (``fallback`` is checked there)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, var in (("max_requeues", "FTKIT_MAX_REQUEUES"), ("max_no_progress", "FTKIT_MAX_NO_PROGRESS")):
        if environ.get(var, "").strip():
            try:
                values[name] = int(environ[var])
            except ValueError:
                raise ConfigError(f"{var}={environ[var]!r}: give a whole number >= 0") from None
    flag = environ.get("FTKIT_REQUEUE_ON_CRASH", "").strip().lower()
    if flag:
        if flag not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"FTKIT_REQUEUE_ON_CRASH={flag!r}: use 1 or 0")
        values["requeue_on_crash"] = flag in ("1", "true", "yes")
    if environ.get("FTKIT_REQUEUE_FALLBACK", "").strip():
        values["fallback"] = environ["FTKIT_REQUEUE_FALLBACK"].strip()
    return values
