"""One small exception hierarchy. Every error carries the exit code the CLI uses."""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXIT_HANG",
    "EXIT_JOBDIR_BUSY",
    "CheckpointError",
    "ConfigError",
    "FtkitError",
    "JobDirBusyError",
    "NoCheckpointError",
    "SlurmError",
    "out_of_memory",
]


# Process exit codes a training process ends with on purpose, read by ``ftkit requeue``
# (alongside the events log, since a launcher such as torchrun may replace the code).
EXIT_JOBDIR_BUSY = 86
"""Another run holds the job dir's lease: this run touched nothing and must not be requeued."""

EXIT_HANG = 87
"""The hang watchdog found no step completed within its threshold and ended the process."""


class FtkitError(Exception):
    """Base of every error ftkit raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class ConfigError(FtkitError, ValueError):
    """A setting is wrong; the message names the setting and how to fix it."""

    exit_code = 2


class CheckpointError(FtkitError):
    """A checkpoint could not be written, read or validated; the message names the path."""

    exit_code = 3


class NoCheckpointError(CheckpointError):
    """Resume was required but no valid checkpoint exists."""

    exit_code = 4


class SlurmError(FtkitError):
    """A SLURM command failed or SLURM is not reachable."""

    exit_code = 5


class JobDirBusyError(FtkitError, SystemExit):
    """Another run holds the job dir's lease; this run touched nothing but the events log.

    Also a ``SystemExit`` with ``code`` 86: uncaught, the process exits with 86 and no
    traceback (the message was logged when it was raised); ``except FtkitError`` catches it.
    """

    exit_code = EXIT_JOBDIR_BUSY

    def __init__(self, message: str, holder: Any = None) -> None:
        super().__init__(message)
        self.code = EXIT_JOBDIR_BUSY
        self.holder = holder

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is host memory (``MemoryError``) or a device's (torch's ``OutOfMemoryError``)
    running out: never a checkpoint's fault, so a load that meets it fails instead of skipping
    the checkpoint as broken (and training on from an older one, or from scratch)."""
    return isinstance(exc, MemoryError) or any(
        c.__name__ == "OutOfMemoryError" and c.__module__.startswith("torch") for c in type(exc).__mro__)
