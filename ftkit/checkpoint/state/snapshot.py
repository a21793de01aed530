"""Training state -> plain CPU data: the one walk over user state, snapshots, RNG states.

Everything a snapshot holds is something ``torch.load(weights_only=True)`` accepts: tensors,
dicts, lists, tuples, numbers, strings, bytes, None, dtypes and devices. An object that
is none of these must offer ``state_dict()``/``load_state_dict()``; anything else is refused
with the key path named (a ``ConfigError``): by a load (:func:`unsavable`), so at a run's start,
and by a save (:func:`flatten`). :func:`flatten` is that walk, for the
synchronous snapshot (:func:`take_snapshot`) and the background copy (``background.buffers``)
alike. Restoring is :mod:`ftkit.checkpoint.state.restore`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CheckpointError, ConfigError
from ..io.direct import aligned_like

__all__ = [
    "Ref",
    "Snapshot",
    "capture_rng",
    "derive_rng",
    "flatten",
    "is_dtensor",
    "materialize",
    "restore_rng",
    "take_snapshot",
    "unsavable",
]

log = logging.getLogger(__name__)

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_SCALARS = frozenset((type(None), bool, int, float, complex, str, bytes))
_MISSING = object()


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, torch.Tensor)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _all_scalars(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list or tuple holds only scalars (say Python's RNG state, 625 ints): it is then
    kept as it is, without a walk (and a path string) per element, which would add a sizeable
    part of an async save's stall."""
    return set(map(type, items)) <= _SCALARS


class Ref:
    """Stands for the ``index``-th tensor of a flattened state inside a skeleton (picklable)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (Ref, (self.index,))

    def __repr__(self) -> str:
        return f"Ref({self.index})"


def is_dtensor(value: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and moments), by name: the
    check imports nothing of torch.distributed."""
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor" and hasattr(value, "full_tensor")


def flatten(
    state: Mapping[str, Any],
    *,
    exclude: frozenset[str] = frozenset(),
    found: Callable[[int, str, torch.Tensor], None] | None = None,
    rng: bool = True,
) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """``(skeleton, [(where, tensor), ...])`` of ``state``: the one walk of what a checkpoint
    holds, shared by the synchronous snapshot and the async one; it copies nothing.

    The rules (see the module doc): a stateful object becomes its ``state_dict()``; dicts,
    lists and tuples are walked; plain values are kept; a tensor is detached, listed and
    replaced in the skeleton by a :class:`Ref` to its index; anything else is refused with its
    key path (``state['model'][3]``). ``exclude`` keys are left out (with several ranks those
    go through DCP). ``rng``: the RNG states (:func:`capture_rng`, taken after the walk) are
    walked in as ``"rng"`` too, so that their tensors land in the same buffers as the state's.

    ``found(index, where, tensor)`` is called for each tensor as the walk reaches it (an async
    save starts copying it while the rest of the state is walked)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a mapping of name -> object, got {type(state).__name__}")
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            # a DTensor (FSDP2's, say, on one rank) is written whole: its storage is not the
            # tensor's, and a one-file checkpoint holds plain tensors, loaded on any world size
            # (every rank walks the same state: full_tensor's collective is every rank's)
            tensor = (value.full_tensor() if is_dtensor(value) else value).detach()
            tensors.append((where, tensor))
            if found is not None:
                found(len(tensors) - 1, where, tensor)
            return Ref(len(tensors) - 1)
        if isinstance(value, _PLAIN):
            return value
        if is_stateful(value):
            return walk(value.state_dict(), where)
        if isinstance(value, Mapping):
            kind: Any = type(value) if type(value) is dict or type(value).__name__ == "OrderedDict" else dict
            return kind((k, walk(v, f"{where}[{k!r}]")) for k, v in value.items())
        if isinstance(value, list):
            if _all_scalars(value):
                return list(value)
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            if type(value) is tuple and _all_scalars(value):
                return value
            return tuple(walk(v, f"{where}[{i}]") for i, v in enumerate(value))
        raise ConfigError(_cannot(where, value))

    skeleton = {"state": {k: walk(v, f"state[{k!r}]") for k, v in state.items() if k not in exclude}}
    if rng:
        skeleton["rng"] = walk(capture_rng(), "rng")
    return skeleton, tensors


def _cannot(where: str, value: Any) -> str:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    how = ("checkpoint its get_state() through an object whose state_dict() returns it and whose "
           "load_state_dict() gives it to set_state()" if callable(getattr(value, "get_state", None))
           else "give it state_dict()/load_state_dict() (a small wrapper object will do)")
    return (f"cannot checkpoint {where}: a {kind} is neither a plain value (tensor, number, str, list, "
            f"tuple, dict) nor an object with state_dict()/load_state_dict(); {how}, or leave it out of the state")


def unsavable(state: Mapping[str, Any]) -> str | None:
    """Why ``state`` could never be saved (:func:`flatten` would refuse a value in it), found
    without a walk of its objects' ``state_dict()`` (a model's, costly or collective): a value
    under a key, or in its dicts, lists and tuples, that is neither plain nor stateful. A load
    checks this first, so that a run refuses it at its start rather than at its first save,
    after the steps since are lost."""

    def walk(value: Any, where: str) -> str | None:
        if isinstance(value, (torch.Tensor, *_PLAIN)) or is_stateful(value):
            return None
        if isinstance(value, Mapping):
            items: Any = ((f"{where}[{k!r}]", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            if _all_scalars(value):
                return None
            items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
        else:
            return _cannot(where, value)
        return next((p for p in (walk(v, w) for w, v in items) if p), None)

    if not isinstance(state, Mapping):
        return f"state must be a mapping of name -> object, got {type(state).__name__}"
    return next((p for p in (walk(v, f"state[{k!r}]") for k, v in state.items()) if p), None)


def materialize(skeleton: Any, buffers: list[torch.Tensor]) -> Any:
    """The skeleton with every :class:`Ref` replaced by its buffer."""
    if isinstance(skeleton, Ref):
        return buffers[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, materialize(v, buffers)) for k, v in skeleton.items())
    if isinstance(skeleton, list):
        if _all_scalars(skeleton):
            return list(skeleton)
        return [materialize(v, buffers) for v in skeleton]
    if isinstance(skeleton, tuple) and not isinstance(skeleton, torch.Size):
        if _all_scalars(skeleton):
            return skeleton
        return tuple(materialize(v, buffers) for v in skeleton)
    return skeleton


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``; a dense one starts on a page (written with O_DIRECT as is)."""
    dense = tensor.device.type in ("cpu", "cuda") and tensor.layout == torch.strided and tensor.is_contiguous()
    out = aligned_like(tensor) if dense else None
    if out is not None:
        out.copy_(tensor)
        return out
    # clone keeps the strides of a non-contiguous tensor
    return tensor.to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.clone()


def capture_rng() -> dict[str, Any]:
    """Python, numpy (if imported), torch CPU and every CUDA device's generator state."""
    rng: dict[str, Any] = {"python": _python_rng(random.getstate())}
    rng["torch"] = torch.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        rng["numpy"] = _numpy_rng(np.random.get_state(legacy=True))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return rng


def _python_rng(state: tuple[Any, ...]) -> dict[str, Any]:
    """A ``random.getstate()`` as plain data (``restore_rng`` turns it back)."""
    version, internal, gauss = state
    return {"version": version, "state": list(internal), "gauss": gauss}


def _numpy_rng(state: Any) -> dict[str, Any]:
    """A legacy numpy ``get_state()`` as plain data: the key array as an int64 tensor."""
    kind, keys, pos, has_gauss, cached = state
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def restore_rng(rng: Mapping[str, Any]) -> None:
    py = rng.get("python")
    if py:
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        n = rng["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
        )
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint has RNG states for %d CUDA devices, this process sees %d; CUDA RNG not restored",
                len(cuda),
                torch.cuda.device_count(),
            )


def derive_rng(rng: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """RNG states for ``rank`` where the checkpoint has none (saved by fewer ranks).

    A deterministic function of ``rng`` (rank 0's saved states) and ``rank``: the same
    checkpoint resumed on the same number of ranks gives every extra rank the same streams
    again, and no two ranks share one (each generator is seeded from a SHA-256 of rank 0's
    torch and Python states and the rank). Holds the same generators as ``rng``.
    """
    digest = hashlib.sha256(f"ftkit rank {rank}".encode())
    if "torch" in rng:
        digest.update(rng["torch"].numpy().tobytes())
    if rng.get("python"):
        digest.update(repr(rng["python"]["state"]).encode())
    seed = int.from_bytes(digest.digest()[:8], "little") >> 1  # < 2**63: any generator takes it
    out: dict[str, Any] = {}
    if rng.get("python"):
        out["python"] = _python_rng(random.Random(seed).getstate())
    if "torch" in rng:
        out["torch"] = torch.Generator().manual_seed(seed).get_state()
    if "numpy" in rng:
        import numpy as np

        out["numpy"] = _numpy_rng(np.random.RandomState(seed % 2**32).get_state(legacy=True))
    if rng.get("cuda") and torch.cuda.is_available():
        out["cuda"] = [
            torch.Generator(device=f"cuda:{i}").manual_seed((seed + i + 1) % 2**63).get_state()
            for i in range(torch.cuda.device_count())
        ]
    return out


@dataclass(slots=True)
class Snapshot:
    """Everything one rank saves, already copied into CPU memory.

    ``local`` is this rank's flat state (saved with ``torch.save``); ``sharded`` the part
    saved through torch.distributed.checkpoint (multi-rank only, else empty).
    """

    local: dict[str, Any]
    sharded: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0  # taking it: the state's capture (state_dict() calls) and the copies


def take_snapshot(state: Mapping[str, Any], *, exclude: frozenset[str] = frozenset()) -> Snapshot:
    """Copy ``state`` (minus ``exclude`` keys) and the RNG states into CPU memory.

    The state is walked by :func:`flatten` and each tensor found is copied; the RNG states are
    fresh tensors already (:func:`capture_rng`), so they are kept without a copy."""
    skeleton, tensors = flatten(state, exclude=exclude, rng=False)
    copies = [_host_copy(t) for _, t in tensors]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return Snapshot(local={"state": materialize(skeleton["state"], copies), "rng": capture_rng()}, nbytes=nbytes)
