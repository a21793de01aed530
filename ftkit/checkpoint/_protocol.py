"""The CheckpointManager protocol and ``make_manager``, which picks the implementation."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError
from ._config import CheckpointConfig, CheckpointInfo

__all__ = ["CheckpointManager", "load_manager_class", "make_manager"]


@runtime_checkable
class CheckpointManager(Protocol):
    """What the training controller needs from a checkpoint manager.

    A custom manager is a class whose constructor takes
    ``(config, *, events, rank, world_size, process_group)`` and which has these methods.
    """

    def save(
        self, step: int, state: Mapping[str, Any], *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo: ...

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None: ...

    def list(self) -> list[CheckpointInfo]: ...

    def validate(self, path: str | os.PathLike[str], checksums: bool = False) -> CheckpointInfo: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


_METHODS = ("save", "load", "list", "validate", "wait", "close")


def load_manager_class(spec: str) -> type:
    """Import ``"pkg.module:Class"`` and check it has every CheckpointManager method."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"checkpoint.manager: expected 'pkg.module:Class', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"checkpoint.manager: cannot import module {module_name!r} ({exc})"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"checkpoint.manager: module {module_name!r} has no {attr!r}"
            ) from None
    if not isinstance(obj, type):
        raise ConfigError(f"checkpoint.manager: {spec!r} is not a class")
    missing = [m for m in _METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"checkpoint.manager: {spec!r} does not implement the CheckpointManager protocol "
            f"(missing {', '.join(missing)}); see ftkit.checkpoint.CheckpointManager"
        )
    return obj


def make_manager(
    config: CheckpointConfig,
    *,
    events: Any = None,
    rank: int = 0,
    world_size: int = 1,
    process_group: Any = None,
) -> CheckpointManager:
    """The manager ``config`` asks for: the default Checkpointer or ``config.manager``."""
    if config.manager is None:
        from ._manager import Checkpointer

        cls: type = Checkpointer
    else:
        cls = load_manager_class(config.manager)
    manager = cls(
        config, events=events, rank=rank, world_size=world_size, process_group=process_group
    )
    if not isinstance(manager, CheckpointManager):
        raise ConfigError(
            f"checkpoint.manager: {config.manager!r} instances do not satisfy the CheckpointManager protocol"
        )
    return manager
