"""Settings of the asynchronous checkpointer (``AsyncConfig``). No torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError

__all__ = ["ON_ERROR", "AsyncConfig"]

ON_ERROR = ("raise", "warn")


def _positive(name: str, value: object, *, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        extra = " or None" if none_ok else ""
        raise ConfigError(f"async_save.{name}: must be a whole number >= 1{extra}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    """How :class:`~ftkit.checkpoint.AsyncCheckpointer` snapshots and persists in the background."""

    memory_every: int | None = None
    """Snapshot the state into host memory every this many steps (``on_step``); None: only on save."""

    persist_every: int | None = None
    """Persist every this-many-th memory snapshot: steps that are multiples of
    ``memory_every * persist_every``. None: memory snapshots are persisted only on a save or
    (with ``crash_safe``) when the trainer dies."""

    max_in_flight: int = 1
    """Snapshots accepted but not yet durable. A save beyond it waits for the oldest one.
    Host memory holds up to ``max_in_flight + 1`` copies of the state (one extra with ``memory_every``)."""

    on_error: str = "raise"
    """A failed background save: ``raise`` it (CheckpointError) at the next ``on_step``/``save``/``wait``;
    ``warn``: log it when it happens and at the next call, raise only from ``wait`` (exit paths)."""

    crash_safe: bool = False
    """Keep the snapshots in shared memory, persisted by a saver process (one per node, started by
    the node's first rank), which persists the newest snapshot complete on every rank of the node
    if a trainer dies."""

    shm_dir: Path = Path("/dev/shm")
    """Where the shared-memory segments live with ``crash_safe`` (a tmpfs)."""

    saver_timeout: float = 120.0
    """Seconds to wait for the saver process to start (it imports torch) and, on close, to exit."""

    commit_timeout: float = 600.0
    """Several ranks: seconds rank 0's worker waits for a missing rank's part while no file in the
    step directory grows, and a rank's worker waits for rank 0 to start the step directory,
    before the save fails naming the missing ranks (the directory stays marked incomplete)."""

    def __post_init__(self) -> None:
        _positive("memory_every", self.memory_every, none_ok=True)
        _positive("persist_every", self.persist_every, none_ok=True)
        _positive("max_in_flight", self.max_in_flight, none_ok=False)
        if self.persist_every is not None and self.memory_every is None:
            raise ConfigError(
                "async_save.persist_every: counts memory snapshots, so it needs memory_every too "
                f"(got persist_every={self.persist_every}, memory_every=None)"
            )
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"async_save.on_error: must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if not isinstance(self.crash_safe, bool):
            raise ConfigError(f"async_save.crash_safe: must be True or False, got {self.crash_safe!r}")
        if not isinstance(self.shm_dir, (str, os.PathLike)):
            raise ConfigError(f"async_save.shm_dir: expected a path, got {self.shm_dir!r}")
        self.shm_dir = Path(self.shm_dir)
        if not isinstance(self.saver_timeout, (int, float)) or self.saver_timeout <= 0:
            raise ConfigError(
                f"async_save.saver_timeout: must be a positive number of seconds, got {self.saver_timeout!r}"
            )
        timeout = self.commit_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(
                f"async_save.commit_timeout: must be a positive number of seconds, got {timeout!r}"
            )

    @property
    def persist_period(self) -> int | None:
        """Steps between periodic persists of memory snapshots, or None."""
        if self.memory_every is None or self.persist_every is None:
            return None
        return self.memory_every * self.persist_every

    def persist_due(self, step: int) -> bool:
        period = self.persist_period
        return period is not None and step % period == 0
