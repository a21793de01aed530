"""Saved state back into the live objects, in place.

* an object with ``load_state_dict`` gets ``load_state_dict(saved)``;
* a dict is updated in place key by key (recursively; keys not in the checkpoint are kept);
* a list is refilled in place, a tuple's items restored one by one (its tensors in place);
* a tensor of the same shape is ``copy_``-ed into (another dtype converts, as a module's
  parameter does); one of another shape is refused before anything is restored
  (:func:`plain_mismatches`), unless the live one is empty (a placeholder: replaced);
* any other value (int, float, str, ...) is written back into the state mapping, so
  ``state["step_in_epoch"]`` holds the restored value after ``load``.

A checkpoint is loaded memory-mapped (no copy of the file into fresh memory), so before
restoring, :func:`own_tensors` gives every saved tensor that a live object would keep, rather
than copy from, memory of its own: nothing live stays backed by the checkpoint file.
:func:`live_targets` names, before a file is read, the live tensor each saved tensor will be
copied into, so a resume can read the file straight into them (``io.statefile``).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ...errors import ConfigError
from .keys import canonical
from .snapshot import is_dtensor, is_stateful

__all__ = [
    "SetAside",
    "clone_tensors",
    "full_mismatches",
    "group_settings",
    "key_mismatches",
    "live_targets",
    "loaded_by_torch",
    "misfit",
    "on_gpu",
    "optimizer_homes",
    "own_tensors",
    "plain_mismatches",
    "reachable_tensors",
    "restore_state",
    "scheduler_mismatches",
    "settings_replaced",
    "shape_mismatches",
]

log = logging.getLogger(__name__)

_MISSING = object()


def _restore_value(live: Any, saved: Any) -> Any:
    if live is _MISSING:
        return saved
    if is_stateful(live):
        live.load_state_dict(saved)
        return live
    if isinstance(live, MutableMapping) and isinstance(saved, Mapping):
        for k, v in saved.items():
            new = _restore_value(live.get(k, _MISSING), v)
            if k not in live or live[k] is not new:
                live[k] = new
        return live
    if isinstance(live, list) and isinstance(saved, list):
        if len(live) == len(saved):
            live[:] = [_restore_value(a, b) for a, b in zip(live, saved, strict=False)]
        else:
            live[:] = saved
        return live
    if isinstance(live, tuple) and isinstance(saved, (tuple, list)) and len(live) == len(saved):
        # a tuple cannot be refilled, but the tensors in it can: the script's own references
        # (an EMA it updates in place) go on from the saved values, as in a list
        items = [_restore_value(a, b) for a, b in zip(live, saved, strict=True)]
        if all(a is b for a, b in zip(live, items, strict=True)):
            return live
        return type(live)(*items) if hasattr(live, "_fields") else tuple(items)  # a namedtuple stays one
    if _same_kind(live, saved) or _converts(live, saved):
        with torch.no_grad():
            live.copy_(saved)  # another dtype converts, as a module's load_state_dict does
        return live
    return saved


def _converts(live: Any, saved: Any) -> bool:
    """Both tensors, same shape, another dtype (the script changed it since the save): the
    saved values are copied into the live tensor with a conversion, as ``Module.load_state_dict``
    does for a parameter."""
    return (isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor) and not is_lazy(live)
            and not is_dtensor(live) and live.shape == saved.shape)


def own_tensors(state: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` (read memory-mapped from a checkpoint file), made safe to ``restore_state``.

    ``restore_state`` copies a saved tensor into a live one where there is one (a module's
    parameters and buffers, a tensor of the same shape and dtype) and keeps the saved tensor
    itself everywhere else: optimizer state (``torch.optim.Optimizer.load_state_dict`` keeps
    the tensors it is given), new dict keys, plain tensors of another shape. A kept tensor
    still backed by the mapped file would hold the file's disk space after retention deletes
    it (on NFS, as a ``.nfsXXXX`` file) and fault its pages in from the file later. So each
    tensor that would be kept is replaced here: where a stateful object (not a module)
    already has a tensor at the same place of its ``state_dict()``, with the same shape and
    dtype, the saved values are copied into it and that tensor is handed back to
    ``load_state_dict`` (a reload in the middle of a run allocates nothing); any other is
    cloned into ordinary memory. Tensors that ``restore_state`` copies are left mapped.
    """
    return {k: _own(state.get(k, _MISSING), v) for k, v in saved.items()}


def _own(live: Any, saved: Any) -> Any:
    """Mirror of ``_restore_value``: what it would keep is replaced by memory of our own."""
    if live is _MISSING:
        return clone_tensors(saved)
    if isinstance(live, torch.nn.Module):
        return saved  # Module.load_state_dict copies into its parameters and buffers
    if is_stateful(live):
        return _into(live.state_dict(), saved)
    if isinstance(live, MutableMapping) and isinstance(saved, Mapping):
        return {k: _own(live.get(k, _MISSING), v) for k, v in saved.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        return type(saved)(_own(a, b) for a, b in zip(live, saved, strict=True))
    if _same_kind(live, saved):
        return saved
    return clone_tensors(saved)


def _into(current: Any, saved: Any) -> Any:
    """Saved values copied into the live object's own tensors where it has them, else cloned."""
    if _same_kind(current, saved):
        with torch.no_grad():
            current.copy_(saved)
        return current
    if isinstance(current, Mapping) and isinstance(saved, Mapping):
        return {k: _into(current.get(k, _MISSING), v) for k, v in saved.items()}
    if isinstance(current, list) and isinstance(saved, list) and len(current) == len(saved):
        return [_into(a, b) for a, b in zip(current, saved, strict=True)]
    return clone_tensors(saved)


def live_targets(state: Mapping[str, Any], saved: Mapping[str, Any],
                 homes: Callable[[torch.Tensor], bool] | None = None) -> dict[int, torch.Tensor]:
    """For each saved tensor that ``restore_state(state, own_tensors(state, saved))`` would copy
    into a live tensor, that live tensor, by ``id`` of the saved one: a module's parameters
    and buffers (by state-dict key), the tensors of a stateful object's ``state_dict()``
    (an optimizer's moments), a live tensor of the same shape and dtype. A loader may read
    the saved values straight into them (:func:`ftkit.checkpoint.io.statefile.read_state_into`).

    ``homes(param)``: also, for the moments of an optimizer that has no state for ``param``
    yet (a requeued job's, before its first step), new memory on ``param``'s device, which
    ``load_state_dict`` keeps as it is (:func:`optimizer_homes`): a resume onto a GPU reads
    them straight there, rather than into host memory that ``load_state_dict`` then copies."""
    out: dict[int, torch.Tensor] = {}

    def walk(live: Any, saved: Any) -> None:
        if is_stateful(live):  # a module copies into its own tensors, an optimizer is handed them
            if homes is not None and isinstance(live, torch.optim.Optimizer) and isinstance(saved, Mapping):
                out.update(optimizer_homes(live, saved, homes))
            walk(live.state_dict(), saved)
        elif isinstance(live, Mapping) and isinstance(saved, Mapping):
            for k, v in saved.items():
                walk(live.get(k, _MISSING), v)
        elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
            for a, b in zip(live, saved, strict=True):
                walk(a, b)
        elif _same_kind(live, saved) and not is_dtensor(live):  # a DTensor's bytes are not its own
            out[id(saved)] = live

    for key, value in saved.items():
        if key in state:
            walk(state[key], value)
    return out


def shape_mismatches(state: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The saved tensors of ``state``'s modules whose shape is not the live one's, as
    ``state['model']: 0.weight is [32, 64] in the checkpoint, [48, 64] in the module``: a model
    changed since the checkpoint was saved. ``Module.load_state_dict`` raises for each of them,
    but only after copying every tensor that does fit; found first, before a byte reaches the
    live state, the load can refuse the checkpoint and leave the state as it was.

    Only a parameter or buffer of a module whose ``_load_from_state_dict`` is torch's own
    (``torch.nn``'s modules, yours unless they override it): one that overrides it may convert
    a saved tensor of another shape itself. Nothing of a model that overrides
    ``load_state_dict`` or has a load pre-hook anywhere (it may reshape what it is given). Not
    a lazy parameter (no shape before its first forward)."""
    found: list[str] = []
    for key, live in state.items():
        if not isinstance(live, torch.nn.Module) or not isinstance(saved.get(key), Mapping):
            continue
        if type(live).load_state_dict is not torch.nn.Module.load_state_dict or any(
                getattr(m, "_load_state_dict_pre_hooks", None) for m in live.modules()):
            continue
        theirs = saved[key]
        for prefix, module in live.named_modules():
            own = type(module)._load_from_state_dict
            if own is not torch.nn.Module._load_from_state_dict and not own.__module__.startswith("torch.nn."):
                continue
            for name, tensor in (*module._parameters.items(), *module._buffers.items()):
                other = theirs.get(f"{prefix}.{name}" if prefix else name)
                if (isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor) and not is_lazy(tensor)
                        and tuple(other.shape) != tuple(tensor.shape)):
                    found.append(f"state[{key!r}]: {prefix + '.' if prefix else ''}{name} is {list(other.shape)} "
                                 f"in the checkpoint, {list(tensor.shape)} in the module")
    return found


def full_mismatches(key: str, module: torch.nn.Module, live: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """:func:`shape_mismatches` and :func:`key_mismatches` for a one-process checkpoint's full
    state dict ``saved`` (keys matched to the live ones) loaded into a sharded module (FSDP2,
    DTensor; :func:`ftkit.checkpoint.dcp.load_full`), found before every rank sets what fits:
    ``live`` is the module's state dict by canonical names (``get_model_state_dict``), whose
    sharded tensors have the whole tensor's shape. As there, a key owned by a module that
    loads it its own way is left to it, and nothing of a model that overrides
    ``load_state_dict`` or has a load pre-hook; missing and extra keys also not where a module
    has a load post-hook other than FSDP's own (it may excuse them)."""
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict or any(
            not _fsdp_own(hook) for m in module.modules()
            for hook in getattr(m, "_load_state_dict_pre_hooks", {}).values()):
        return []
    modules = {canonical(n): m for n, m in module.named_modules(remove_duplicate=False)}
    found: list[str] = []
    for name in sorted(n for n in live if n in saved):
        mine, theirs = live[name], saved[name]
        if (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and not is_lazy(mine)
                and tuple(theirs.shape) != tuple(mine.shape) and loaded_by_torch(modules, name)):
            found.append(f"state[{key!r}]: {name} is {list(theirs.shape)} in the checkpoint, {list(mine.shape)} "
                         "in the module")
    if any(not _fsdp_own(hook) for m in module.modules()
           for hook in getattr(m, "_load_state_dict_post_hooks", {}).values()):
        return found
    found += [f"state[{key!r}]: {name} is not in the checkpoint (added since?)"
              for name in sorted(set(live) - set(saved)) if loaded_by_torch(modules, name)]
    found += [f"state[{key!r}]: {name} is in the checkpoint, not in the module (removed since?)"
              for name in sorted(n for n in saved if isinstance(n, str) and n not in live)
              if loaded_by_torch(modules, name)]
    return found


def _fsdp_own(hook: Any) -> bool:
    """A load hook FSDP2 registers itself (its parameters resharded before and after a load,
    the pre-hook from the first forward on): it changes neither what loads nor what is missing."""
    function = getattr(hook, "hook", hook)  # torch wraps a pre-hook in _WrappedHook
    return getattr(function, "__qualname__", "").startswith(("FSDPParam.", "FSDPParamGroup."))


def misfit(where: Any, misfits: list[str]) -> str:
    """The refusal of a checkpoint ``where`` whose tensors or keys do not fit the live state
    (:func:`shape_mismatches`, :func:`key_mismatches`, :func:`scheduler_mismatches`,
    :func:`plain_mismatches`, a DCP load's removed layers), naming what changed: the model, its
    optimizer, its scheduler, a plain tensor."""
    more = f" and {len(misfits) - 3} more" if len(misfits) > 3 else ""
    said = {_kind_of(m) for m in misfits}
    kinds = [kind for kind in ("model", "optimizer", "scheduler", "tensor") if kind in said] or ["model"]
    what = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
    if kinds == ["tensor"]:
        return (f"{where} does not fit the live state: {'; '.join(misfits[:3])}{more}. The script's tensor has "
                "another shape than the one saved: resume with the shape it was saved with (a tensor the script "
                "grows as training goes is restored by replacement when the script starts it empty, "
                "torch.empty(0)), or start it anew under another key (checkpoint.allow_missing). Nothing of the "
                "checkpoint was loaded")
    return (f"{where} does not fit the live state: {'; '.join(misfits[:3])}{more}. The {what} changed since "
            f"this checkpoint was saved: resume with the {what} it was saved with, or start the changed "
            f"{'one' if len(kinds) == 1 else 'ones'} in a new job dir (or with checkpoint.resume='never'). "
            "Nothing of the checkpoint was loaded")


def _kind_of(mismatch: str) -> str:
    """What a mismatch of :func:`misfit`'s is about (by the words only those of an optimizer
    or a scheduler say: a model's names may hold any word)."""
    if "(saved by another optimizer?" in mismatch or "the checkpoint's optimizer has param groups" in mismatch:
        return "optimizer"
    if "the checkpoint's scheduler lacks" in mismatch:
        return "scheduler"
    if mismatch.endswith(_PLAIN_MARK):
        return "tensor"
    return "model"


_NOT_SETTINGS = frozenset({"self", "optimizer", "last_epoch", "verbose"})


def scheduler_mismatches(state: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """A learning-rate scheduler of another kind than the one saved (``StepLR`` live,
    ``CosineAnnealingLR`` in the checkpoint): torch's ``LRScheduler.load_state_dict`` takes any
    dict into the object, so the live scheduler would go on with the other's settings beside
    its own (a ``StepLR`` with Cosine's learning rates, 0 for good), raising nothing. Found by
    the live class's own settings (its constructor's parameters it keeps under their names)
    missing from the saved state while the saved state has settings the live object does not
    (another class's): a setting only missing is a class that leaves it out of its
    ``state_dict`` or gained it since (a newer torch, a user's class), not another kind. Only a
    scheduler whose ``load_state_dict`` and ``state_dict`` are torch's own."""
    from torch.optim.lr_scheduler import LRScheduler

    found: list[str] = []
    for key, live in state.items():
        theirs = saved.get(key)
        if (not isinstance(live, LRScheduler) or not isinstance(theirs, Mapping)
                or type(live).load_state_dict is not LRScheduler.load_state_dict
                or type(live).state_dict is not LRScheduler.state_dict):
            continue
        try:
            params = inspect.signature(type(live).__init__).parameters
        except (TypeError, ValueError):
            continue
        own = [n for n in params if n not in _NOT_SETTINGS and n in vars(live)]
        lacking = [n for n in own if n not in theirs]
        shown = sorted(k for k in theirs if isinstance(k, str) and not k.startswith("_")
                       and k not in ("base_lrs", "last_epoch", "verbose"))
        foreign = [k for k in shown if k not in vars(live)]
        if lacking and foreign:
            settings = ", ".join(shown)
            found.append(f"state[{key!r}]: the checkpoint's scheduler lacks {', '.join(lacking)} of the live "
                         f"{type(live).__name__} (saved by another scheduler? its settings: {settings or 'none'})")
    return found


def loaded_by_torch(modules: Mapping[str, torch.nn.Module], name: str) -> bool:
    """Whether the module that owns the state key ``name`` loads it with torch's own code."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = modules.get(".".join(parts[:i]))
        if owner is not None:
            return type(owner)._load_from_state_dict is torch.nn.Module._load_from_state_dict
    return True


def key_mismatches(state: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """What ``load_state_dict`` would raise for after copying what fits, found before: a
    module's keys the checkpoint lacks or has besides (a layer or buffer added or removed), and
    an optimizer's param groups of other sizes (a group or a parameter added or removed), as
    ``state['model']: 3.weight is not in the checkpoint``.

    Only what torch's own loading decides: a key owned by a module that overrides
    ``_load_from_state_dict`` (it may make or take keys itself, as BatchNorm does) is left to
    it; nothing of a model or optimizer that overrides ``load_state_dict`` or has load hooks."""
    found: list[str] = []
    for key, live in state.items():
        theirs = saved.get(key)
        if isinstance(live, torch.nn.Module) and isinstance(theirs, Mapping):
            if type(live).load_state_dict is not torch.nn.Module.load_state_dict or any(
                    getattr(m, "_load_state_dict_pre_hooks", None) or getattr(m, "_load_state_dict_post_hooks", None)
                    for m in live.modules()):
                continue
            modules = dict(live.named_modules(remove_duplicate=False))
            mine = set(live.state_dict())
            # a DDP (or DataParallel) model's keys are named as the model inside it names them
            inner = (lambda n: n.removeprefix("module.")) if _wrapper(live) else (lambda n: n)
            for name in sorted(mine - set(theirs)):
                if loaded_by_torch(modules, name):
                    found.append(f"state[{key!r}]: {inner(name)} is not in the checkpoint (added since?)")
            for name in sorted(n for n in theirs if isinstance(n, str) and n not in mine):
                if loaded_by_torch(modules, name):
                    found.append(f"state[{key!r}]: {inner(name)} is in the checkpoint, not in the module "
                                 "(removed since?)")
        elif isinstance(live, torch.optim.Optimizer) and isinstance(theirs, Mapping):
            if (type(live).load_state_dict is not torch.optim.Optimizer.load_state_dict
                    or getattr(live, "_optimizer_load_state_dict_pre_hooks", None)):
                continue
            groups = theirs.get("param_groups")
            if not isinstance(groups, list):
                continue
            sizes = [len(g.get("params", ())) for g in groups if isinstance(g, Mapping)]
            live_sizes = [len(g["params"]) for g in live.param_groups]
            if sizes != live_sizes:
                found.append(f"state[{key!r}]: the checkpoint's optimizer has param groups of {sizes} parameters, "
                             f"the live one {live_sizes}")
            else:
                found += [f"state[{key!r}]: {m}" for m in _group_key_mismatches(live, groups)]
    return found + scheduler_mismatches(state, saved) + plain_mismatches(state, saved)


_PLAIN_MARK = "in the state (a plain tensor)"


def plain_mismatches(state: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The state's plain tensors (under a key, in its dicts, lists and tuples: not a module's
    or an optimizer's) whose shape is not the saved one's, as ``state['stats'] is [4] float32
    in the checkpoint, [6] float32 in the state (a plain tensor)``: the script changed it
    since the save. Restored, the saved tensor would take its place in the state while the
    script's own references to the live one (a running statistic it updates in place) start
    over, unseen. An empty live tensor (a placeholder for what the checkpoint holds) is not one."""
    found: list[str] = []

    def walk(live: Any, theirs: Any, where: str) -> None:
        if is_stateful(live):
            return
        if isinstance(live, torch.Tensor):
            if (isinstance(theirs, torch.Tensor) and not is_lazy(live) and not is_dtensor(live) and live.numel()
                    and tuple(live.shape) != tuple(theirs.shape)):
                found.append(f"{where} is {list(theirs.shape)} {str(theirs.dtype).removeprefix('torch.')} in the "
                             f"checkpoint, {list(live.shape)} {str(live.dtype).removeprefix('torch.')} {_PLAIN_MARK}")
        elif isinstance(live, Mapping) and isinstance(theirs, Mapping):
            for k, v in theirs.items():
                if k in live:
                    walk(live[k], v, f"{where}[{k!r}]")
        elif isinstance(live, (list, tuple)) and isinstance(theirs, (list, tuple)) and len(live) == len(theirs):
            for i, (a, b) in enumerate(zip(live, theirs, strict=True)):
                walk(a, b, f"{where}[{i}]")

    for key, value in state.items():
        if key in saved:
            walk(value, saved[key], f"state[{key!r}]")
    return found


def _wrapper(module: torch.nn.Module) -> bool:
    """DDP or DataParallel: its state dict's keys are its ``module``'s, behind ``module.``."""
    return isinstance(module, torch.nn.DataParallel | torch.nn.parallel.DistributedDataParallel)


def _group_key_mismatches(live: torch.optim.Optimizer, groups: list[Any]) -> list[str]:
    """The settings the live optimizer's param groups have that the saved groups would lack once
    loaded: ``load_state_dict`` replaces the groups with the saved ones, and the class's
    ``__setstate__`` fills in only the settings it added since (a checkpoint of another torch
    version); one of another kind (Adam's ``betas`` saved, SGD's ``momentum`` live) raises a
    ``KeyError`` at the next step, after the load. Found by giving the saved groups to the live
    class's ``__setstate__`` on an empty stand-in; nothing where that fails. Only the class's
    own settings (``defaults``) count: a scheduler's ``initial_lr`` or the ``param_names`` of
    an optimizer built from named parameters are not its kind, and torch loads without them."""
    try:
        probe = type(live).__new__(type(live))
        probe.__dict__.update({k: v for k, v in live.__dict__.items()
                               if k not in ("state", "param_groups")})
        probe.defaults = dict(live.defaults)
        probe.__setstate__({"state": {}, "param_groups": [dict(g) for g in groups]})
        loaded = probe.param_groups
    except Exception:  # another class's ways: torch's own load decides
        return []
    found = []
    settings = set(live.defaults) - {"params", "param_names"}  # not a scheduler's initial_lr, say
    for i, (mine, theirs) in enumerate(zip(live.param_groups, loaded, strict=False)):
        lacking = sorted(k for k in mine if k not in theirs and k in settings)
        if lacking:
            saved = ", ".join(sorted(k for k in theirs if k != "params" and isinstance(k, str)))
            found.append(f"param group {i} of the checkpoint lacks {', '.join(lacking)} of the live "
                         f"{type(live).__name__} (saved by another optimizer? its settings: {saved})")
    return found


def group_settings(state: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The settings of every optimizer's param groups in ``state`` (not its parameters), by
    key: what a load replaces with the checkpoint's (:func:`settings_replaced`)."""
    return {key: [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                  for group in value.param_groups]
            for key, value in state.items() if isinstance(value, torch.optim.Optimizer)}


def _setting(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 8 else None  # a capturable optimizer's lr, say
    return list(value) if isinstance(value, tuple) else value


def settings_replaced(before: Mapping[str, list[dict[str, Any]]], state: Mapping[str, Any]) -> list[str]:
    """The settings of ``before`` (:func:`group_settings`, taken before a load) that the load
    changed, as ``state['optimizer'] param group 0: weight_decay 0.05 -> 0.0``: torch's
    ``load_state_dict`` restores the saved param groups, so a setting changed in the script
    since the save is silently the checkpoint's again. Not the learning rate itself, which a
    scheduler (or the script, step by step) changes as training goes: a scheduler's base
    learning rate (``initial_lr``) instead. Nor the momentum (``momentum``, ``betas``) of an
    optimizer whose scheduler cycles it (``OneCycleLR``, ``CyclicLR``: ``cycle_momentum``), which
    changes at every step as the learning rate does: their ``max_momentum``/``base_momentum``
    instead."""
    found: list[str] = []
    for key, groups in before.items():
        live = state.get(key)
        if not isinstance(live, torch.optim.Optimizer) or len(live.param_groups) != len(groups):
            continue
        moving = {"lr"}
        if any(getattr(v, "optimizer", None) is live and getattr(v, "cycle_momentum", False) for v in state.values()):
            moving |= {"momentum", "betas"}
        for i, (was, group) in enumerate(zip(groups, live.param_groups, strict=True)):
            changed = []
            for name in sorted(was):
                if name in moving or name not in group:
                    continue
                old, new = _setting(was[name]), _setting(group[name])
                if old is not None and new is not None and old != new:
                    changed.append(f"{name} {was[name]!r} -> {group[name]!r}")
            if changed:
                found.append(f"state[{key!r}] param group {i}: {', '.join(changed)}")
    return found


def on_gpu(param: torch.Tensor) -> bool:
    """:func:`live_targets`'s ``homes`` for a load: the parameters on a GPU (on the host, a
    moment's memory of its own is what the reader gives it anyway)."""
    return param.device.type == "cuda"


def optimizer_homes(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
                    homes: Callable[[torch.Tensor], bool]) -> dict[int, torch.Tensor]:
    """New memory for the saved moments of each parameter ``homes`` accepts that ``optimizer``
    has no state for, by ``id`` of the saved tensor: on the parameter's device, of the saved
    shape and dtype. ``load_state_dict`` pairs the saved parameters with its own in order and
    moves each moment to its parameter's device (and a floating-point parameter's dtype): a
    tensor already there is kept as it is. Not ``step``, which it leaves where it was; nothing
    where the groups do not pair up (``load_state_dict`` raises), nor for an optimizer whose
    ``load_state_dict`` or placing policy is its own (one that keeps its state on the host
    while the parameters are on a GPU, say)."""
    base = torch.optim.Optimizer
    policy = "_process_value_according_to_param_policy"
    if (type(optimizer).load_state_dict is not base.load_state_dict
            or getattr(type(optimizer), policy, None) is not getattr(base, policy, None)):
        return {}
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return {}
    try:
        sizes = [len(g["params"]) for g in groups]
        ids = [i for g in groups for i in g["params"]]
    except (TypeError, KeyError):
        return {}
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        return {}
    out: dict[int, torch.Tensor] = {}
    for pid, param in zip(ids, (p for g in optimizer.param_groups for p in g["params"]), strict=True):
        entry = state.get(pid)
        if not isinstance(entry, Mapping) or optimizer.state.get(param) or not homes(param):
            continue
        for key, value in entry.items():
            if (key == "step" or not isinstance(value, torch.Tensor) or value.layout != torch.strided
                    or (param.is_floating_point() and value.dtype != param.dtype)):
                continue
            out[id(value)] = torch.empty(value.shape, dtype=value.dtype, device=param.device)
    return out


def reachable_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor a live value holds: its own, a stateful object's ``state_dict()``'s (a
    module's parameters and buffers, an optimizer's moments), those in dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [] if is_lazy(value) else [value]
    if is_stateful(value):
        return reachable_tensors(value.state_dict())
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in reachable_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in reachable_tensors(v)]
    return []


def _memory_of(t: torch.Tensor) -> int | None:
    """The address of the memory holding ``t``'s bytes: its storage's, a sharded tensor's (a
    DTensor of FSDP2) local shard's; None for a tensor without memory of its own (a wrapper)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # "invalid python storage": a subclass that only wraps others
        return None


class SetAside:
    """What a one-pass load into the live modules and optimizers of ``state`` may change, to
    put back (:meth:`undo`) when the load turns out not to happen (a corrupt file found while
    it was read in, on any rank): which memory is theirs (:meth:`guard`: the reader that
    writes into it copies each part aside just before it writes over it, on its placing
    threads while the device reads on, and registers how to put those back, :meth:`by`), and
    which optimizers had no state yet (DCP gives those state before it reads: :meth:`undo`
    takes it away again; their new moments are not set aside, nor need to be)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        live = _modules_and_optimizers(state)
        self._memory = {ptr for v in live for t in reachable_tensors(v) if (ptr := _memory_of(t)) is not None}
        self._fresh = [v for v in live if isinstance(v, torch.optim.Optimizer) and not v.state]
        self._undo: list[Callable[[], None]] = []

    def guard(self, t: torch.Tensor) -> bool:
        """Whether a load must set aside what it writes over in ``t``: the memory of a live
        module's or optimizer's tensor (a view of one too), in host memory."""
        return t.device.type == "cpu" and _memory_of(t) in self._memory

    def by(self, undo: Callable[[], None]) -> None:
        """``undo()`` puts back what a writer of :meth:`guard`'s memory set aside."""
        self._undo.append(undo)

    def undo(self) -> None:
        """Every part written put back (by the writers that set it aside, once they are done),
        the fresh optimizers without state again."""
        undo, self._undo = self._undo, []
        for put_back in reversed(undo):
            put_back()
        for optimizer in self._fresh:
            optimizer.state.clear()

    @staticmethod
    def fits(state: Mapping[str, Any], sharing: int = 1) -> bool:
        """Whether a :class:`SetAside` of ``state`` is one in host memory that the host has room
        for: every tensor of its modules and optimizers a plain CPU tensor (not a GPU's, nor a
        DTensor's shards), and ``sharing`` such copies (the ranks on this host, at most) no more
        than half of ``MemAvailable``."""
        tensors = _live_tensors(state)
        if tensors is None or not all(_plain(t) and t.device.type == "cpu" for t in tensors):
            return False
        nbytes = sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())
        return nbytes * max(1, sharing) <= _available() // 2

    @staticmethod
    def plain(state: Mapping[str, Any]) -> bool:
        """Whether every tensor of ``state``'s modules and optimizers is a plain tensor (on any
        device): each rank holds all of it (replicated, as with DDP), none a shard (a DTensor,
        FSDP's flat parameters), so a one-process checkpoint goes into it as into one process's."""
        tensors = _live_tensors(state)
        return tensors is not None and all(_plain(t) for t in tensors)


def _live_tensors(state: Mapping[str, Any]) -> list[torch.Tensor] | None:
    """The tensors of ``state``'s modules (parameters, buffers) and optimizers (their state),
    uninitialised ones left out; None where a module is FSDP's, whose parameters may be plain
    ones, each rank's a shard of them. Without ``state_dict()``: a model of thousands of
    parameters makes its state dict in milliseconds, and FSDP's gathers on every rank."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # none can exist where it was never imported
    out: list[torch.Tensor] = []
    for value in _modules_and_optimizers(state):
        if isinstance(value, torch.nn.Module):
            if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in value.modules()):
                return None
            out.extend(value.parameters())
            out.extend(value.buffers())
        else:
            out.extend(t for moments in value.state.values() for t in moments.values() if isinstance(t, torch.Tensor))
    return [t for t in out if not is_lazy(t)]


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _modules_and_optimizers(state: Mapping[str, Any]) -> list[Any]:
    return [v for v in state.values() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]


def _same_kind(live: Any, saved: Any) -> bool:
    """Both tensors, same shape and dtype: the saved one is copied into the live one. Not a
    lazy module's parameter before its first forward (it has no shape yet: its module's
    ``load_state_dict`` gives it the saved one's)."""
    return (
        isinstance(live, torch.Tensor)
        and isinstance(saved, torch.Tensor)
        and not is_lazy(live)
        and live.shape == saved.shape
        and live.dtype == saved.dtype
    )


def clone_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (dicts, lists, tuples) detached and cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_tensors(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_tensors(v) for v in value)
    return value


def restore_state(state: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Restore ``saved`` into the live objects of ``state`` in place (see module doc)."""
    for key, live in state.items():
        if key not in saved:
            log.warning("state[%r] is not in the checkpoint; left as it is", key)
            continue
        try:
            new = _restore_value(live, saved[key])
        except ConfigError as exc:  # an object refusing its saved state (ResumableSampler's): say whose
            raise ConfigError(f"state[{key!r}]: {exc}") from exc
        if new is not live:
            if isinstance(state, MutableMapping):
                state[key] = new
            else:
                log.warning(
                    "state[%r] is a plain value in a read-only mapping; restored value dropped", key
                )
    for key in saved:
        if key not in state:
            log.debug("checkpoint entry %r has no object in state; ignored", key)
