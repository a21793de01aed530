"""Checkpoints that are complete or clearly not.

Three lines in a training loop::

    mgr = make_manager(CheckpointConfig(root=jobdir / "checkpoints"))
    start = mgr.load(state) or 0          # state = {"model": m, "optimizer": opt, ...}
    ...; mgr.save(step, state)

This package imports torch only when a torch-using name is first touched, so listing and
validating checkpoints (``ftkit ls``, ``ftkit verify``) never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._async_config import AsyncConfig
from ._config import CheckpointConfig, CheckpointInfo
from ._manifest import validate_dir
from ._pins import pin_checkpoint, unpin_checkpoint
from ._protocol import CheckpointManager, load_manager_class, make_manager

if TYPE_CHECKING:
    from ._async import AsyncCheckpointer
    from ._manager import Checkpointer
    from ._sampler import ResumableSampler
    from ._state import Snapshot, take_snapshot

__all__ = [
    "AsyncCheckpointer",
    "AsyncConfig",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointManager",
    "Checkpointer",
    "ResumableSampler",
    "Snapshot",
    "load_manager_class",
    "make_manager",
    "pin_checkpoint",
    "take_snapshot",
    "unpin_checkpoint",
    "validate_dir",
]

_LAZY = {
    "AsyncCheckpointer": "._async",
    "Checkpointer": "._manager",
    "ResumableSampler": "._sampler",
    "Snapshot": "._state",
    "take_snapshot": "._state",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
