"""ftkit: fault tolerance for PyTorch training on SLURM.

Three lines in a training loop::

    with ftkit.FaultTolerance("runs/exp1", state={"model": model, "optimizer": opt}) as ft:
        for step in ft.range(10_000):
            train_step(step)

``import ftkit`` stays light: torch and watchdog load only when a controller is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Action",
    "AgreementConfig",
    "AsyncConfig",
    "BudgetConfig",
    "CheckpointConfig",
    "CheckpointError",
    "Config",
    "ConfigError",
    "Decision",
    "FaultTolerance",
    "FtkitError",
    "JobDirBusyError",
    "LeaseConfig",
    "NoCheckpointError",
    "ResumableSampler",
    "SignalConfig",
    "SlurmError",
    "WatchConfig",
    "WatchdogConfig",
    "__version__",
]

_LAZY = {
    "Action": "ftkit.decision",
    "Decision": "ftkit.decision",
    "AgreementConfig": "ftkit.control.agreement",
    "Config": "ftkit.control.controller",
    "FaultTolerance": "ftkit.control.controller",
    "SignalConfig": "ftkit.triggers.signals",
    "WatchConfig": "ftkit.triggers.files",
    "BudgetConfig": "ftkit.triggers.budget",
    "WatchdogConfig": "ftkit.control.watchdog",
    "CheckpointConfig": "ftkit.checkpoint",
    "AsyncConfig": "ftkit.checkpoint",
    "ResumableSampler": "ftkit.checkpoint",
    "FtkitError": "ftkit.errors",
    "ConfigError": "ftkit.errors",
    "CheckpointError": "ftkit.errors",
    "NoCheckpointError": "ftkit.errors",
    "SlurmError": "ftkit.errors",
    "LeaseConfig": "ftkit.lease",
    "JobDirBusyError": "ftkit.errors",
}

if TYPE_CHECKING:
    from .checkpoint import AsyncConfig, CheckpointConfig, ResumableSampler
    from .control.agreement import AgreementConfig
    from .control.controller import Config, FaultTolerance
    from .control.watchdog import WatchdogConfig
    from .decision import Action, Decision
    from .errors import (
        CheckpointError,
        ConfigError,
        FtkitError,
        JobDirBusyError,
        NoCheckpointError,
        SlurmError,
    )
    from .lease import LeaseConfig
    from .triggers.budget import BudgetConfig
    from .triggers.files import WatchConfig
    from .triggers.signals import SignalConfig


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ftkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
