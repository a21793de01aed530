"""The pickles ``torch.save`` writes, read by the C unpickler where they hold plain state.

A load parses a state file's pickle (every tensor of a one-process checkpoint, and the rest of
the state) and the pickle of each tensor item of a DCP file before the bulk of the bytes can
go to their tensors. torch's ``weights_only`` unpickler is pure Python, and its storages and
tensors go through ``torch.load``'s general path (fake-tensor checks, device restore, typed
storages): about 150 us per tensor, a quarter of a second for the ~2,000 tensors of a model
and its Adam moments, while the read waits. :class:`PlainUnpickler` is the C unpickler with
the same guard: every global a pickle may name is one ``weights_only`` allows too (containers,
dtypes, devices, ``torch.Size``, the plain tensor's rebuild), storage classes stand only for
their dtype, any other global is refused, and the caller then reads that pickle with torch's
unpickler from the start. Its tensors are made directly on the storages its subclass gives:
:func:`meta_tensor` (no bytes, for planning a read), or views of a buffer already read
(:mod:`ftkit.checkpoint.io.statefile`).
"""

from __future__ import annotations

import codecs
import collections
import io
import logging
import pickle
import warnings
from typing import Any

import torch
from torch.serialization import _weights_only_unpickler

__all__ = ["NotOneTensor", "PlainUnpickler", "Storage", "meta_tensor"]

log = logging.getLogger(__name__)


class NotOneTensor(Exception):
    """An archive's pickle is not one tensor of one storage."""


class StorageType:
    """What a pickled storage class (``torch.FloatStorage``, ...) stands for here: its dtype
    only, so that nothing in a pickle can make a storage of its own."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _storage_types() -> dict[str, StorageType]:
    with warnings.catch_warnings():  # the legacy storage classes warn on use
        warnings.simplefilter("ignore")
        found = {name: StorageType(getattr(torch, name).dtype) for name in dir(torch)
                 if name.endswith("Storage") and name != "Storage" and not name.startswith(("Q", "Typed", "Untyped"))
                 and isinstance(getattr(getattr(torch, name), "dtype", None), torch.dtype)}
    return {**found, "UntypedStorage": StorageType(torch.uint8)}


def _plain_globals() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("builtins", "set"): set,
        ("_codecs", "encode"): codecs.encode,  # how protocol 2 pickles bytes
    }
    found.update({("torch", name): getattr(torch, name) for name in dir(torch)  # by their own names only
                  if isinstance(getattr(torch, name, None), torch.dtype) and str(getattr(torch, name)) == f"torch.{name}"})
    found.update({("torch", name): kind for name, kind in _storage_types().items()})
    return found


_PLAIN_GLOBALS = _plain_globals()


class PlainUnpickler(pickle.Unpickler):
    """The C unpickler for the pickle of plain training state (see the module doc). A
    subclass says what a storage is (:meth:`storage`: dtype, key, element count, from the
    pickle's persistent id) and makes a tensor on it (:meth:`tensor`); anything the pickle
    holds that is not plain raises :class:`pickle.UnpicklingError`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild
        found = _PLAIN_GLOBALS.get(("builtins" if module == "__builtin__" else module, name))  # protocol 2's name
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not read here")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], StorageType) and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError("not a storage of a plain tensor")
        return self.storage(pid[1].dtype, str(pid[2]), pid[4])

    def storage(self, dtype: torch.dtype, key: str, numel: int) -> Any:
        raise NotImplementedError

    def tensor(self, storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _rebuild(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                 metadata: Any = None) -> torch.Tensor:
        """``torch._utils._rebuild_tensor_v2``, for the storages :meth:`storage` gave."""
        if not (isinstance(storage, Storage) and type(offset) is int and isinstance(size, tuple)
                and isinstance(stride, tuple) and len(size) == len(stride)
                and all(type(n) is int for n in (*size, *stride)) and isinstance(requires_grad, bool)
                and isinstance(hooks, collections.OrderedDict) and not hooks and metadata is None):
            raise pickle.UnpicklingError("not a plain tensor")
        tensor = self.tensor(storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad = True
        tensor._backward_hooks = hooks  # as torch's rebuild leaves it
        return tensor


class Storage:
    """A storage a :class:`PlainUnpickler` gave: its dtype, record key, element count, and
    (where the bytes were read) the untyped storage that holds them."""

    __slots__ = ("dtype", "held", "key", "numel")

    def __init__(self, dtype: torch.dtype, key: str, numel: int, held: torch.UntypedStorage | None = None) -> None:
        self.dtype, self.key, self.numel, self.held = dtype, key, numel, held


class _MetaUnpickler(PlainUnpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.keys: list[str] = []

    def storage(self, dtype: torch.dtype, key: str, numel: int) -> Storage:
        self.keys.append(key)
        return Storage(dtype, key, numel)

    def tensor(self, storage: Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(storage.numel, dtype=storage.dtype, device="meta").as_strided(size, stride, offset)


def meta_tensor(pickle_bytes: bytes) -> tuple[torch.Tensor, str]:
    """The tensor an archive's pickle holds, its storage on the ``meta`` device (dtype,
    shape, strides and offset, none of its bytes), and its storage key (the record that holds
    the bytes). A plain tensor's pickle is read by :class:`PlainUnpickler`, any other by
    torch's ``weights_only`` unpickler; :class:`NotOneTensor` if it is not one tensor of one
    storage."""
    fast = _MetaUnpickler(pickle_bytes)
    try:
        tensor, keys = fast.load(), fast.keys
    except Exception as exc:  # not the plain kind: torch's own safe unpickler, from the start
        log.debug("item read by torch's weights_only unpickler: %s", exc)
        tensor, keys = _weights_only(pickle_bytes)
    if not isinstance(tensor, torch.Tensor) or len(keys) != 1:
        raise NotOneTensor("an item that is not one tensor of one storage")
    return tensor, keys[0]


def _weights_only(pickle_bytes: bytes) -> tuple[Any, list[str]]:
    keys: list[str] = []

    def persistent_load(pid: Any) -> Any:
        _, storage_type, key, _location, numel = pid
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        keys.append(str(key))
        storage = torch.UntypedStorage(numel * torch.empty((), dtype=dtype).element_size(), device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickle_bytes), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load(), keys
