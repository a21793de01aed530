"""Checkpoints that are complete or clearly not.

Three lines in a training loop::

    mgr = make_manager(CheckpointConfig(root=jobdir / "checkpoints"))
    start = mgr.load(state) or 0          # state = {"model": m, "optimizer": opt, ...}
    ...; mgr.save(step, state)

This package imports torch only when a torch-using name is first touched, so listing and
validating checkpoints (``ftkit ls``, ``ftkit verify``) never import it.

Where things are (docs/architecture.md has the whole data flow)::

    config.py, protocol.py   settings; what the controller uses of a manager; make_manager
    manager.py               Checkpointer: the synchronous manager (snapshot, persist, resume)
    dcp.py, dcp_reader.py    sharded state through torch.distributed.checkpoint
    format/                  layout, manifest, the one commit protocol, retention, pins (no torch)
    io/                      direct I/O, durable checksummed files, the reader, the state file
    state/                   the state walk and snapshot, restore, the world-size rule, the sampler
    background/              AsyncCheckpointer: host buffers, the thread writer, multi-rank commit
    crashsafe/               shared-memory slots and the per-node saver process
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .background.config import AsyncConfig
from .config import CheckpointConfig, CheckpointInfo
from .format.manifest import validate_dir
from .format.pins import pin_checkpoint, unpin_checkpoint
from .protocol import CheckpointManager, load_manager_class, make_manager

if TYPE_CHECKING:
    from .background.manager import AsyncCheckpointer
    from .manager import Checkpointer
    from .state.sampler import ResumableSampler
    from .state.snapshot import Snapshot, take_snapshot

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
    "AsyncCheckpointer": ".background.manager",
    "Checkpointer": ".manager",
    "ResumableSampler": ".state.sampler",
    "Snapshot": ".state.snapshot",
    "take_snapshot": ".state.snapshot",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
