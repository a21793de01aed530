"""Sharded multi-rank state through torch.distributed.checkpoint (DCP).

Modules and optimizers in the user's state go through the DCP ``state_dict`` helpers
(``get_model_state_dict``/``get_optimizer_state_dict`` and their ``set_`` twins), so FSDP
and DTensor models save their shards; every other entry (scheduler, scaler, sampler,
plain values, RNG) is per-rank state in ``rank-NNNNN.pt``.

Checksums: DCP's public API gives no hook into the byte stream it writes, so each rank
re-reads the ``__<rank>_*.distcp`` files it wrote (rank 0 also ``.metadata``) right after
``dcp.save`` returns and records their size and CRC-32. The read usually comes from the
page cache. It proves the files did not change after the save, not that the
bytes reached the disk intact; the fsync of DCP's writer (``sync_files=True``) covers that.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import CheckpointError
from ._files import CHECKSUM, crc32_file, fsync_dir
from ._layout import DCP_DIR
from ._state import clone_tensors

__all__ = ["load_sharded", "save_sharded", "sharded_keys", "snapshot_sharded"]


def sharded_keys(state: Mapping[str, Any]) -> frozenset[str]:
    """Keys of ``state`` saved through DCP: every nn.Module and torch.optim.Optimizer."""
    return frozenset(
        k for k, v in state.items() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))
    )


def _owner(state: Mapping[str, Any], key: str, opt: torch.optim.Optimizer) -> torch.nn.Module:
    wanted = {id(p) for group in opt.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, torch.nn.Module) and wanted <= {id(p) for p in value.parameters()}:
            return value
    raise CheckpointError(
        f"state[{key!r}]: the optimizer's parameters belong to no nn.Module in the state; "
        "put the model it trains into the state too"
    )


def _live_state_dicts(
    state: Mapping[str, Any], keys: frozenset[str], options: StateDictOptions
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(keys):
        value = state[key]
        if isinstance(value, torch.nn.Module):
            out[key] = get_model_state_dict(value, options=options)
        else:
            out[key] = get_optimizer_state_dict(_owner(state, key, value), value, options=options)
    return out


def snapshot_sharded(state: Mapping[str, Any], keys: frozenset[str]) -> tuple[dict[str, Any], int]:
    """This rank's shards of ``keys``, copied into CPU memory."""
    sd = clone_tensors(_live_state_dicts(state, keys, StateDictOptions(cpu_offload=True)))
    nbytes = 0
    stack: list[Any] = [sd]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            nbytes += local.numel() * local.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return sd, nbytes


def _group_rank(pg) -> int:
    return dist.get_rank(pg)


def save_sharded(
    sharded: dict[str, Any], directory: Path, *, pg=None, sync: bool = True
) -> dict[str, dict[str, Any]]:
    """Collective: write ``sharded`` under ``directory/dcp``; return this rank's file entries."""
    target = directory / DCP_DIR
    writer = dcp.FileSystemWriter(target, sync_files=sync)
    dcp.save(sharded, storage_writer=writer, process_group=pg)
    if sync:  # the files' entries in dcp/ (DCP fsyncs the files themselves)
        fsync_dir(target)
    rank = _group_rank(pg)
    prefix = f"__{rank}_"
    files: dict[str, dict[str, Any]] = {}
    for entry in sorted(os.listdir(target)):
        if entry.startswith(prefix) or (rank == 0 and entry == ".metadata"):
            size, crc = crc32_file(target / entry)
            files[f"{DCP_DIR}/{entry}"] = {"size": size, CHECKSUM: crc, "rank": rank}
    return files


def load_sharded(
    state: Mapping[str, Any], keys: frozenset[str], directory: Path, *, pg=None
) -> None:
    """Collective: load ``keys`` of ``state`` in place from ``directory/dcp``."""
    options = StateDictOptions()
    target = _live_state_dicts(state, keys, options)
    dcp.load(target, storage_reader=dcp.FileSystemReader(directory / DCP_DIR), process_group=pg)
    for key in sorted(keys):
        value = state[key]
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, target[key], options=options)
        else:
            set_optimizer_state_dict(_owner(state, key, value), value, target[key], options=options)
