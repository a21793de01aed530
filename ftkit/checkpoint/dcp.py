"""Sharded multi-rank state through torch.distributed.checkpoint (DCP).

Modules and optimizers in the user's state go through the DCP ``state_dict`` helpers
(``get_model_state_dict``/``get_optimizer_state_dict`` and their ``set_`` twins), so FSDP
and DTensor models save their shards; every other entry (scheduler, scaler, sampler,
plain values, RNG) is per-rank state in ``rank-NNNNN.pt``.

The helpers name tensors by their canonical names, without the ``module.`` of a DDP
wrapper (or ``_orig_mod.`` of torch.compile), so a checkpoint loads whether or not the
live model is wrapped, on any number of ranks: DCP reshards a ``dcp/`` checkpoint into the
live layout, also in a single process without a process group (:func:`load_sharded`), and
:func:`load_full` hands a one-process (``single``) checkpoint's full state dicts to every
rank, where ``set_model_state_dict(full_state_dict=True)`` keeps each rank's shards.

Checksums: DCP's public API gives no hook into the byte stream it writes, so each rank
re-reads the ``__<rank>_*.distcp`` files it wrote (rank 0 also ``.metadata``) right after
``dcp.save`` returns and records their size and CRC-32. The read usually comes from the
page cache. It proves the files did not change after the save, not that the
bytes reached the disk intact; the fsync of DCP's writer (``sync_files=True``) covers that.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
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
from .format.layout import DCP_DIR
from .io.files import CHECKSUM, crc32_file, fsync_dir
from .state.keys import match_keys
from .state.restore import clone_tensors, full_mismatches, key_mismatches, loaded_by_torch, misfit

__all__ = [
    "failure_of",
    "live_state_dicts",
    "load_full",
    "load_sharded",
    "save_sharded",
    "saved_keys",
    "sharded_keys",
    "snapshot_sharded",
]


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


def live_state_dicts(
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


_SIZES = (2, 3, 5, 7, 11, 13, 17, 19)  # a stand-in's sizes by dimension: a state tensor shaped as it is the parameter's


def fresh_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give ``optimizer``, which has no state yet (a requeued job's, before its first step),
    state to load a DCP checkpoint into. DCP's ``get_optimizer_state_dict`` makes it by stepping
    the optimizer once with zero gradients and a learning rate of 0: over every parameter,
    into gradients and moments of fresh memory, all of it written (on the 2-CPU VM 115-121 ms
    of a two-rank 0.25 GB requeue's ~260 ms load). Here a copy of the optimizer (its class,
    its param groups' settings) steps once over a small zero stand-in per kind of parameter
    (param group, number of dimensions, dtype, device, whether it requires grad; sizes 2, 3,
    5, ...), and each parameter gets its kind's state laid out in memory of its own, not
    written: a state tensor shaped as the stand-in is shaped as the parameter (and strided as
    it, as ``zeros_like`` makes it), a 0-d one stays 0-d; where a kind's state has a tensor of
    any other shape (factored moments), that kind steps again with stand-ins of each of its
    parameters' own shapes. DCP's read writes every value, or the load fails and takes the
    state away again (``Checkpointer.load``), and ``set_optimizer_state_dict`` replaces the
    whole state with what was read. The real optimizer is not stepped (no step hook or
    scheduler counter of it runs).

    Returns whether it did. Not (nothing changed, DCP makes the state its way) where the
    optimizer has state or is not one of ``torch.optim``'s, a parameter is not a plain tensor
    (a DTensor shard) or has a gradient, or the copy cannot be made or stepped."""
    module = type(optimizer).__module__
    if optimizer.state or not (module == "torch.optim" or module.startswith("torch.optim.")):
        return False  # another's constructor may do more than keep param groups (hooks, collectives)
    groups = optimizer.param_groups
    plain = (torch.Tensor, torch.nn.Parameter)
    params = [(i, p) for i, g in enumerate(groups) for p in g["params"]]
    if any(type(p) not in plain or p.grad is not None or p.dim() > len(_SIZES) for _, p in params):
        return False

    def small(i: int, p: torch.Tensor) -> tuple[Any, ...]:
        return i, p.dim(), p.dtype, p.device, p.requires_grad

    def whole(i: int, p: torch.Tensor) -> tuple[Any, ...]:
        return i, tuple(p.shape), p.stride(), p.dtype, p.device, p.requires_grad

    made: dict[torch.Tensor, dict[str, Any]] = {}
    try:
        laid = _stepped(optimizer, params, small,
                        lambda p: torch.zeros(_SIZES[: p.dim()], dtype=p.dtype, device=p.device))
        again = []
        for i, p in params:
            standin, state = laid[small(i, p)]
            if any(isinstance(v, torch.Tensor) and v.dim() and v.shape != standin.shape for v in state.values()):
                again.append((i, p))
            elif state:
                made[p] = {n: (torch.empty_like(p, dtype=v.dtype, device=v.device, memory_format=torch.preserve_format)
                               if v.dim() else torch.empty((), dtype=v.dtype, device=v.device))
                           if isinstance(v, torch.Tensor) else _copy.deepcopy(v) for n, v in state.items()}
        if again:  # state not shaped as its parameter: stand-ins as large as each parameter
            laid = _stepped(optimizer, again, whole, lambda p: torch.zeros_like(p, memory_format=torch.preserve_format))
            for i, p in again:
                _, state = laid[whole(i, p)]
                made[p] = {n: torch.empty_like(v, memory_format=torch.preserve_format) if isinstance(v, torch.Tensor)
                           else _copy.deepcopy(v) for n, v in state.items()}
    except Exception:  # not an optimizer this way works for: DCP's own step makes the state
        return False
    optimizer.state.update(made)
    return True


def _stepped(optimizer: torch.optim.Optimizer, params: list[tuple[int, torch.Tensor]],
             kind: Callable[[int, torch.Tensor], tuple[Any, ...]],
             standin: Callable[[torch.Tensor], torch.Tensor]) -> dict[tuple[Any, ...], tuple[torch.Tensor, dict[str, Any]]]:
    """:func:`fresh_state`'s copy of ``optimizer`` stepped once with zero gradients over a
    stand-in per ``kind`` of the ``(param group index, parameter)`` pairs: by kind, the
    stand-in and its state (empty where the optimizer keeps none)."""
    standins: dict[tuple[Any, ...], torch.Tensor] = {}
    copies = [{**{n: v for n, v in g.items() if n not in ("params", "param_names")}, "params": []}
              for g in optimizer.param_groups]
    for i, p in params:
        k = kind(i, p)
        if k not in standins:
            standins[k] = standin(p).requires_grad_(p.requires_grad)
            copies[i]["params"].append(standins[k])
    copy = type(optimizer)([g for g in copies if g["params"]])
    for t in standins.values():
        if t.requires_grad:
            t.grad = torch.zeros_like(t)
    copy.step()
    return {k: (t, dict(copy.state.get(t, {}))) for k, t in standins.items()}


def snapshot_sharded(state: Mapping[str, Any], keys: frozenset[str]) -> tuple[dict[str, Any], int]:
    """This rank's shards of ``keys``, copied into CPU memory."""
    sd = clone_tensors(live_state_dicts(state, keys, StateDictOptions(cpu_offload=True)))
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


def save_sharded(
    sharded: dict[str, Any], directory: Path, *, pg=None, sync: bool = True
) -> dict[str, dict[str, Any]]:
    """Collective: write ``sharded`` under ``directory/dcp``; return this rank's file entries."""
    target = directory / DCP_DIR
    writer = dcp.FileSystemWriter(target, sync_files=sync)
    dcp.save(sharded, storage_writer=writer, process_group=pg)
    if sync:  # the files' entries in dcp/ (DCP fsyncs the files themselves)
        fsync_dir(target)
    rank = dist.get_rank(pg)
    prefix = f"__{rank}_"
    files: dict[str, dict[str, Any]] = {}
    for entry in sorted(os.listdir(target)):
        if entry.startswith(prefix) or (rank == 0 and entry == ".metadata"):
            size, crc = crc32_file(target / entry)
            files[f"{DCP_DIR}/{entry}"] = {"size": size, CHECKSUM: crc, "rank": rank}
    return files


def saved_keys(directory: Path, reader: dcp.StorageReader | None = None) -> set[str]:
    """The state keys (``state[key]``) that ``directory/dcp`` holds, from its metadata (read by
    ``reader`` when given: a reader that keeps what it read reads it once per load)."""
    metadata = (reader or dcp.FileSystemReader(directory / DCP_DIR)).read_metadata()
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    keys = set()
    for fqn in metadata.state_dict_metadata:
        path = paths.get(fqn)
        keys.add(path[0] if isinstance(path, tuple) and path else fqn.split(".", 1)[0])
    return keys


def load_sharded(
    state: Mapping[str, Any], keys: frozenset[str], directory: Path, *,
    reader: dcp.StorageReader | None = None, agree: Callable[[BaseException | None], None] | None = None,
    common: Callable[[dict[str, str] | None, list[str]], list[str]] | None = None,
) -> None:
    """Load ``keys`` of ``state`` in place from ``directory/dcp``.

    Each process plans and reads what it needs alone (DCP's ``no_dist``): DCP's default load
    planner coordinates nothing across ranks, and its collectives (the plans gathered and
    scattered, the outcome gathered) cost more than the read of a small checkpoint over gloo.
    With several ranks, ``agree(error)`` is then called on every rank with this rank's failure
    to read (None when it read all it needs) and must raise on every rank when any rank
    failed: nothing is set into the live modules and optimizers before every rank read its
    part (setting an FSDP model's state may be collective). ``reader``: the storage reader
    (``dcp.FileSystemReader`` of ``directory/dcp`` when None; see
    :class:`ftkit.checkpoint.dcp_reader.StreamingReader`). ``common(found, entries)``, with several
    ranks: called on every rank with what it found removed from its modules (None: it could
    not tell; else a message for each entry of the checkpoint it found so, by the entry's name in
    ``.metadata``) and the checkpoint's module entries (:func:`module_entries`, the same on
    every rank), returns the messages of the entries every rank found (a layer no rank holds any
    more).
    """
    options = StateDictOptions()
    for key in sorted(keys):  # a requeued job's optimizer: its state laid out, not computed (not
        if isinstance(state[key], torch.optim.Optimizer):  # for a save: that would save what is laid out)
            fresh_state(state[key])
    target = live_state_dicts(state, keys, options)
    reader = reader if reader is not None else dcp.FileSystemReader(directory / DCP_DIR)
    failed: BaseException | None = None
    found: dict[str, str] | None = None  # None: this rank could not tell
    entries: list[str] = []
    try:
        metadata = reader.read_metadata()
        entries = module_entries(metadata)
        found = _removed(state, target, metadata)
        _without_unsaved_moments(state, target, metadata)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if agree is None or isinstance(failure_of(exc), (KeyboardInterrupt, SystemExit)):
            raise
        failed = exc
    # every rank, whatever it found: one collective
    removed = common(found, entries) if common is not None else sorted((found or {}).values())
    if removed and failed is None:
        failed = CheckpointError(misfit(directory / DCP_DIR, removed))
        if agree is None:
            raise failed
    if failed is None:
        try:
            with warnings.catch_warnings():  # no_dist is what we mean, not a fallback to warn about
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                _load_no_dist(dcp, target, reader)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if agree is None or isinstance(failure_of(exc), (KeyboardInterrupt, SystemExit)):
                raise
            failed = exc
    if agree is not None:
        agree(failed)
    _set(state, keys, target, options)


def _load_no_dist(dcp: Any, target: dict[str, Any], reader: Any) -> None:
    """``dcp.load(..., no_dist=True)``: each rank loads on its own. ``load`` takes ``no_dist``
    from torch 2.7 on; before, only its private ``_load_state_dict`` does (the same load:
    ``load`` calls it after the same preparation of ``target``, which ftkit's does already)."""
    import inspect

    if "no_dist" in inspect.signature(dcp.load).parameters:
        dcp.load(target, storage_reader=reader, no_dist=True)
        return
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(target, storage_reader=reader, no_dist=True)


def failure_of(exc: BaseException) -> BaseException:
    """The exception behind DCP's ``CheckpointException`` (the first failed rank's, which DCP
    wraps with its traceback), else ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            return failure_of(inner)
    return exc


def module_entries(metadata: Any) -> list[str]:
    """The entries of a DCP checkpoint's ``.metadata`` that a module's state may have saved
    (``state[key]``'s ``name``: the two-part paths of its planner data), by their names there,
    sorted: the same list on every rank that read the same ``.metadata``."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return sorted(fqn for fqn, p in paths.items() if isinstance(p, tuple) and len(p) == 2)


def _removed(state: Mapping[str, Any], target: Mapping[str, Any], metadata: Any) -> dict[str, str]:
    """A module's state the checkpoint has and this rank's live module not (a layer or buffer
    removed since), by its entry in ``.metadata`` (:func:`module_entries`), each with what to
    say of it: DCP loads only what the live state asks for, so it would drop it unseen, where
    a one-process checkpoint's load refuses it. A key owned by a module with its own
    ``_load_from_state_dict`` is left to it. With several ranks only a key no rank's module has
    is refused (``load_sharded``'s ``common``): a pipeline stage holds part of the model."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    removed = {}
    for key, sd in target.items():
        live = state[key]
        if not isinstance(live, torch.nn.Module) or not isinstance(sd, Mapping):
            continue
        modules = dict(live.named_modules(remove_duplicate=False))
        saved = {p[1]: fqn for fqn, p in paths.items() if isinstance(p, tuple) and len(p) == 2 and p[0] == key}
        removed.update((saved[name], f"state[{key!r}]: {name} is in the checkpoint, not in the module (removed since?)")
                       for name in sorted(set(saved) - set(sd)) if loaded_by_torch(modules, name))
    return removed


def _without_unsaved_moments(state: Mapping[str, Any], target: dict[str, Any], metadata: Any) -> None:
    """Take out of an optimizer's load target the parameters the checkpoint has no moments for.

    A fresh optimizer gets moments for every parameter that needs a gradient (laid out by
    :func:`fresh_state`, else ``get_optimizer_state_dict``'s zeros), and DCP then wants each
    of them from the checkpoint. A parameter that
    had no gradient before the save (a head not used yet, a layer frozen then) has none there,
    and the same script could not resume. Left out, such a parameter has no moments after the
    load, as before the save (its optimizer makes them at its first gradient): what a
    one-process checkpoint gives. A parameter with only some of its moments saved (another
    optimizer) stays in, and the load fails naming them."""
    optimizers = [key for key, sd in target.items()
                  if not isinstance(state[key], torch.nn.Module) and isinstance(sd, dict)
                  and isinstance(sd.get("state"), dict) and sd["state"]]
    if not optimizers:
        return
    saved = set()  # every dotted prefix of a saved key: a parameter's moments may nest (dicts in its state)
    for fqn in metadata.state_dict_metadata:
        parts = fqn.split(".")
        saved.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for key in optimizers:
        moments = target[key]["state"]
        for name in [n for n in moments if f"{key}.state.{n}" not in saved]:
            del moments[name]


def _set(state: Mapping[str, Any], keys: frozenset[str], sds: dict[str, Any], options: StateDictOptions) -> None:
    for key in sorted(keys):
        value = state[key]
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, sds[key], options=options)
        else:
            # not strict: a parameter the checkpoint has no moments for (_without_unsaved_moments)
            # gets none; the load above already had every other parameter's, or failed
            model, relaxed = _owner(state, key, value), dataclasses.replace(options, strict=False)
            try:
                set_optimizer_state_dict(model, value, sds[key], options=relaxed)
            except KeyError:
                # torch <= 2.6 wants moments for every parameter that needs a gradient, strict
                # or not (its KeyError comes before it loads anything): hide those without
                hidden = _without_moments(model, value, sds[key])
                if not hidden:
                    raise
                try:
                    set_optimizer_state_dict(model, value, sds[key], options=relaxed)
                finally:
                    for p in hidden:
                        p.requires_grad_(True)


def _without_moments(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: Any) -> list[torch.nn.Parameter]:
    """The parameters of ``opt`` that need a gradient and have no moments in ``sd``, with
    ``requires_grad`` turned off (the caller turns it back on)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    moments = sd.get("state") if isinstance(sd, Mapping) else None
    if not isinstance(moments, Mapping):
        return []
    wanted = {id(p) for group in opt.param_groups for p in group["params"]}
    hidden = []
    for name, p in model.named_parameters():
        if id(p) in wanted and p.requires_grad and not any(f in moments for f in _get_fqns(model, name)):
            p.requires_grad_(False)
            hidden.append(p)
    return hidden


def _optimizer_by_name(
    saved: Mapping[str, Any], live_groups: list[dict[str, Any]], where: str
) -> dict[str, Any]:
    """A ``torch.optim.Optimizer.state_dict()`` (parameters numbered) with the live optimizer's
    parameter names instead of the numbers, paired by position in the param groups exactly as
    ``Optimizer.load_state_dict`` pairs them."""
    saved_groups = saved["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    live_sizes = [len(g["params"]) for g in live_groups]
    if sizes != live_sizes:
        raise CheckpointError(
            f"{where}: the checkpoint's optimizer has param groups of {sizes} parameters, the live "
            f"one {live_sizes}"
        )
    names = {
        pid: name
        for group, live in zip(saved_groups, live_groups, strict=True)
        for pid, name in zip(group["params"], live["params"], strict=True)
    }
    return {
        "state": {names[pid]: clone_tensors(dict(v)) for pid, v in saved["state"].items()},
        "param_groups": [{**g, "params": [names[p] for p in g["params"]]} for g in saved_groups],
    }


def load_full(state: Mapping[str, Any], keys: frozenset[str], saved: Mapping[str, Any], where: str) -> None:
    """Collective: load ``keys`` of ``state`` from full (unsharded) state dicts ``saved[key]``,
    as a one-process checkpoint holds them; every rank passes the same ``saved``.

    Module and optimizer tensors may be views of a memory-mapped file: modules copy them into
    their parameters, and the optimizer's are cloned first (an optimizer keeps what it is given).
    A model whose shapes or layers changed, or an optimizer of another kind or other param
    groups, is refused (:class:`CheckpointError` naming ``where``) before anything is set:
    torch's own load would raise only after setting every tensor that fits.
    """
    options = StateDictOptions(full_state_dict=True)
    live = live_state_dicts(state, keys, StateDictOptions())
    sds: dict[str, Any] = {}
    misfits: list[str] = []  # refused before any rank sets what fits (torch's load raises only after)
    for key in sorted(keys):
        if isinstance(state[key], torch.nn.Module):
            sds[key] = match_keys(saved[key], list(live[key]), f"{where}: state[{key!r}]")
            misfits += full_mismatches(key, state[key], live[key], sds[key])
        else:
            misfits += key_mismatches({key: state[key]}, {key: saved[key]})
    if misfits:
        raise CheckpointError(misfit(where, misfits))
    for key in sorted(keys - set(sds)):
        sds[key] = _optimizer_by_name(saved[key], live[key]["param_groups"], f"{where}: state[{key!r}]")
    _set(state, keys, sds, options)
