"""The CheckpointManager protocol and ``make_manager``, which picks the implementation."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import CheckpointError, ConfigError
from .config import CheckpointConfig, CheckpointInfo

__all__ = ["CheckpointManager", "load_manager_class", "make_manager"]


@runtime_checkable
class CheckpointManager(Protocol):
    """Everything the training controller uses of a checkpoint manager.

    A custom manager is a class whose constructor takes
    ``(config, *, events, rank, world_size, process_group)`` and which has the six methods
    ``save``, ``load``, ``list``, ``validate``, ``wait`` and ``close``. The rest has defaults
    here, those of a manager whose ``save`` returns once the checkpoint is durable; a manager
    that persists in the background sets ``background`` and overrides ``on_step``,
    ``pending_error``, ``last_durable_step`` and ``last_persist_seconds``. A class that does
    not derive from this one gets the defaults from :func:`make_manager`.
    """

    background: bool = False
    """Saves are persisted after ``save`` returns: the controller calls ``on_step`` and
    ``pending_error`` each step, waits before an exit, and removes the request files a save
    answered only once ``last_durable_step`` reaches it."""

    loaded: CheckpointInfo | None = None
    """The checkpoint the last ``load`` restored (its ``world_size`` goes into the resume event)."""

    last_durable_step: int | None = None
    """Newest step whose background save is durable; None: none yet."""

    last_persist_seconds: float | None = None
    """How long the newest durable background save took to persist (the time budget and the
    auto interval need the time until durable, not the stall); None: none yet."""

    def save(
        self, step: int, state: Mapping[str, Any], *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo: ...

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None: ...

    def list(self) -> list[CheckpointInfo]: ...

    def validate(self, path: str | os.PathLike[str], checksums: bool = False) -> CheckpointInfo: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...

    def on_step(self, step: int, state: Mapping[str, Any]) -> bool:
        """Called by the controller at every step when ``background`` (a memory snapshot may be
        due); whether it took one."""
        return False

    def pending_error(self) -> CheckpointError | None:
        """A background save that failed since the last call, reported once; None: none."""
        return None


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
        from .manager import Checkpointer

        cls: type = Checkpointer
    else:
        cls = _with_defaults(load_manager_class(config.manager))
    manager = cls(
        config, events=events, rank=rank, world_size=world_size, process_group=process_group
    )
    if config.manager is not None:
        _durable_on_return(manager)
    if not isinstance(manager, CheckpointManager):
        raise ConfigError(
            f"checkpoint.manager: {config.manager!r} instances do not satisfy the CheckpointManager protocol"
        )
    return manager


def _with_defaults(cls: type) -> type:
    """``cls``, or where it does not derive from :class:`CheckpointManager`, a subclass of it
    (same name) that takes the protocol's defaults for what ``cls`` lacks: the one place
    where a custom manager's missing members are filled in.

    A class written before ``background`` existed said it persists in the background by
    having ``pending_error``; it keeps being treated so.
    """
    if CheckpointManager in cls.__mro__:
        return cls
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    if not hasattr(cls, "background"):
        namespace["background"] = hasattr(cls, "pending_error")
    try:
        return type(cls.__name__, (cls, CheckpointManager), namespace)
    except TypeError as exc:  # e.g. a metaclass that cannot be combined with the protocol's
        raise ConfigError(
            f"checkpoint.manager: cannot give {cls.__module__}.{cls.__qualname__} the CheckpointManager "
            f"defaults ({exc}); derive it from ftkit.checkpoint.CheckpointManager"
        ) from exc


def _durable_on_return(manager: Any) -> None:
    """A custom background manager that never says when a save is durable (no
    ``last_durable_step`` of its own, on the class or the instance): a step counts as durable
    once ``save`` returns, as it did before ``last_durable_step`` was part of the protocol (else
    the request files a save answered would never be removed)."""
    own = getattr(manager, "__dict__", None)
    if not manager.background or own is None or "last_durable_step" in own:
        return
    if any("last_durable_step" in vars(k) for k in type(manager).__mro__ if k is not CheckpointManager):
        return
    save = manager.save

    def durable_save(step: int, state: Mapping[str, Any], **kwargs: Any) -> Any:
        info = save(step, state, **kwargs)
        manager.last_durable_step = step
        return info

    manager.save = durable_save
