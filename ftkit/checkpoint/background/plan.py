"""Multi-rank DCP saves without DCP's collective planner: each rank plans alone, rank 0 merges.

Each rank plans locally (``DefaultSavePlanner``, on the main thread while snapshotting,
:func:`plan_sharded`). An item every rank holds (a plain tensor or value, e.g. DDP's replicated
weights) is written by rank 0 only; a DTensor shard by the replica at coordinate 0 of its
``Replicate`` mesh dimensions: DCP's ``dedup_save_to_lowest_rank`` choice, made without a gather.
Rank 0 checks that every item some rank holds was written by one and that each tensor's chunks
cover it, before it writes the metadata (:func:`merge_metadata`). The plans travel between the
workers as files (:mod:`ftkit.checkpoint.background.commit`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import CheckpointError
from ..state.snapshot import Ref

__all__ = ["Resolver", "merge_metadata", "plan_sharded"]


# ---------------------------------------------------------------------- main thread: local DCP plan
def _writes_item(obj: Any, rank: int) -> bool:
    """Whether this rank writes ``obj``'s item: one writer per item, decided without a gather."""
    from ..state.snapshot import is_dtensor

    if is_dtensor(obj):  # (by name: torch.distributed.tensor is public from torch 2.5 on)
        coord = obj.device_mesh.get_coordinate()
        return coord is not None and all(
            c == 0 for c, p in zip(coord, obj.placements, strict=True) if p.is_replicate()
        )
    if hasattr(obj, "local_shards"):  # legacy ShardedTensor: its local shards are this rank's alone
        return True
    return rank == 0  # plain tensors and values are replicated (DCP's semantics): lowest rank


def plan_sharded(
    state: Mapping[str, Any], keys: frozenset[str], rank: int, start: int
) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """This rank's DCP part of ``keys``: ``(skeleton, [(where, live tensor), ...])``, no copies.

    The skeleton holds the local plan (``held``: every item this rank has; ``written``: those it
    writes), DCP's flattening ``mappings`` and per written item a :class:`Ref` (numbered from
    ``start``) or, for a non-tensor value, its ``torch.save`` bytes taken now. No collectives.
    """
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ..dcp import live_state_dicts

    planner = DefaultSavePlanner()
    planner.set_up_planner(
        state_dict=live_state_dicts(state, keys, StateDictOptions()),
        storage_meta=None,
        is_coordinator=rank == 0,
    )
    plan = planner.create_local_plan()
    written: list[Any] = []
    data: list[Any] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    for item in plan.items:
        if not _writes_item(planner.state_dict[item.index.fqn], rank):
            continue
        value = planner.lookup_object(item.index)
        written.append(item)
        if item.type == WriteItemType.BYTE_IO:
            data.append(planner.transform_object(item, value).getvalue())
        else:
            offset = tuple(item.index.offset) if item.index.offset is not None else ()
            tensors.append((f"dcp[{item.index.fqn!r}]@{offset}", value.detach()))
            data.append(Ref(start + len(tensors) - 1))
    skeleton = {
        "held": [item.index for item in plan.items],
        "written": written,
        "data": data,
        "mappings": dict(planner.mappings),
    }
    return skeleton, tensors


class Resolver:
    """The ``planner.resolve_data`` that DCP's FileSystemWriter asks for each item's host copy."""

    def __init__(self, items: list[Any], data: list[Any]) -> None:
        self._data = {item.index: value for item, value in zip(items, data, strict=True)}

    def resolve_data(self, item: Any) -> Any:
        value = self._data[item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else value


# ---------------------------------------------------------------------- rank 0: merge the plans
def merge_metadata(plans: Mapping[int, Mapping[str, Any]]) -> tuple[Any, list[Any]]:
    """DCP ``Metadata`` and the write results of all ranks' plans; CheckpointError if a piece is missing."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import WriteItemType

    md: dict[str, Any] = {}
    results: dict[Any, Any] = {}
    mappings: dict[str, Any] = {}
    holders: dict[Any, list[int]] = {}
    for rank in sorted(plans):
        plan = plans[rank]
        for fqn, path in plan["mappings"].items():
            mappings.setdefault(fqn, path)
        for index in plan["held"]:
            holders.setdefault(index, []).append(rank)
        by_index = {wr.index: wr for wr in plan["results"]}
        for item in plan["written"]:
            if item.index in results:
                continue
            results[item.index] = by_index[item.index]
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
            else:
                td = item.tensor_data
                entry = md.setdefault(
                    fqn, TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
                )
                entry.chunks.append(td.chunk)
    unwritten = sorted({i.fqn for i in holders if i not in results})
    if unwritten:
        held_by = {i.fqn: holders[i] for i in holders if i not in results}
        raise CheckpointError(
            f"no rank wrote {', '.join(unwritten[:5])} (held by ranks {held_by[unwritten[0]]}): a "
            "non-DTensor value that rank 0 lacks cannot be saved asynchronously; keep such state "
            "identical on every rank, or use the synchronous Checkpointer"
        )
    for fqn, entry in md.items():
        if isinstance(entry, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in entry.chunks)
            if covered != math.prod(entry.size):
                raise CheckpointError(
                    f"the shards of {fqn} cover {covered} of {math.prod(entry.size)} elements"
                )
    return Metadata(state_dict_metadata=md, planner_data=mappings), list(results.values())
