"""Copy training state into reused host buffers: the only part of an async save the loop waits for.

``flatten`` (:mod:`ftkit.checkpoint.state.snapshot`, the one walk that ``take_snapshot`` uses too: stateful objects
become their ``state_dict()``, RNG states included) copies nothing: it returns a *skeleton*
(the structure with every tensor replaced by a :class:`Ref`) and the list of live tensors.
``Copier.copy`` (or a :class:`CopyBatch`, one tensor at a time) then ``copy_``-es each live
tensor into its preallocated buffer:

* CPU tensors are copied synchronously;
* CUDA tensors go to pinned host buffers with ``non_blocking=True`` on a side stream that
  first waits for the compute stream; an event recorded after the copies is returned (the
  persisting side ``synchronize()``-s it before reading) and the compute stream waits on it,
  so the next in-place optimizer update cannot overwrite a tensor that is still being copied.

An async save copies each tensor as soon as ``flatten`` finds it (its ``found`` callback, when
the slot already holds a buffer of that path, shape and dtype: every save after the first), so
the GPU copies while the rest of the state is walked and the RNG captured: the walk is
Python, and would otherwise all precede the first copy.

A :class:`BufferSet` keeps one buffer per tensor, keyed by its path in the state and checked
against shape and dtype, so a long run allocates once and then reuses (``copy_``) forever.
"""

from __future__ import annotations

from typing import Any

import torch

from ..io.direct import aligned_like
from ..state.snapshot import Snapshot, materialize

__all__ = ["BufferSet", "Copier", "CopyBatch", "host_snapshot", "layout_of", "wait_events"]


def layout_of(tensors: list[tuple[str, torch.Tensor]]) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """What buffers a flattened state needs: ``(where, shape, dtype)`` per tensor."""
    return tuple((where, tuple(t.shape), t.dtype) for where, t in tensors)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BufferSet:
    """One host copy of the state: a buffer per tensor path, reused while shape and dtype match.

    Pinned buffers (``pin=True``, only when CUDA is available) make device-to-host copies
    asynchronous; other buffers from 64 KiB up start on a page, so that the persist writes them
    with O_DIRECT without a copy (:mod:`ftkit.checkpoint.io.direct`). ``allocations`` counts buffers ever
    allocated (tests check it stays flat).
    """

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers.values())

    def buffers_for(self, tensors: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        seen: set[str] = set()
        for where, t in tensors:
            buf = self.buffers.get(where)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = self.pin and t.device.type == "cuda"
                buf = None if pin else aligned_like(t)  # on a page: O_DIRECT writes it as is
                if buf is None:
                    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self.buffers[where] = buf
                self.allocations += 1
            out.append(buf)
            seen.add(where)
        for stale in set(self.buffers) - seen:  # tensors that left the state
            del self.buffers[stale]
        return out


class Copier:
    """Copies live tensors into host buffers (see the module doc for the CUDA stream rules);
    owns one side stream per device, reused by every save."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def batch(self) -> CopyBatch:
        return CopyBatch(self)

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> tuple[list[Any], int]:
        """Copy ``src[i]`` into ``dst[i]``; returns (CUDA events to wait on, bytes copied)."""
        batch = self.batch()
        for d, s in zip(dst, src, strict=True):
            batch.add(d, s)
        return batch.finish()


class CopyBatch:
    """The copies of one snapshot, started one by one (``add``) and closed by ``finish``.

    A CUDA tensor's copy goes to its device's side stream, which waited for the compute stream
    when the batch met that device first: it sees every update queued before the save.
    ``finish`` records an event per device after the copies and makes the compute stream wait
    for it (later in-place updates wait for the copies, on the GPU); it must follow every batch
    that copied anything, also when the save fails half-way.
    """

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self._sides: dict[torch.device, Any] = {}
        self.nbytes = 0

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.nbytes += _nbytes(src)
        with torch.no_grad():
            if src.device.type != "cuda":
                dst.copy_(src)
                return
            side = self._sides.get(src.device)
            if side is None:
                side = self._sides[src.device] = self._copier.stream(src.device)
                side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            src.record_stream(side)  # the allocator keeps src alive until the copy ran

    def finish(self) -> tuple[list[Any], int]:
        """(CUDA events to wait on before reading the buffers, bytes copied)."""
        events = []
        for device, side in self._sides.items():
            event = torch.cuda.Event()
            event.record(side)
            torch.cuda.current_stream(device).wait_event(event)
            events.append(event)
        self._sides = {}
        return events, self.nbytes


def host_snapshot(skeleton: dict[str, Any], buffers: list[torch.Tensor], nbytes: int) -> Snapshot:
    """A :class:`Snapshot` whose tensors are the (filled) buffers; a skeleton's ``"sharded"``
    entry (several ranks: this rank's DCP plan and data) becomes ``Snapshot.sharded``."""
    local = materialize(skeleton, buffers)
    sharded = local.pop("sharded", None) or {}
    return Snapshot(local=local, sharded=sharded, nbytes=nbytes)


def wait_events(events: list[Any]) -> None:
    """Block until the device-to-host copies behind ``events`` are done (worker side)."""
    for event in events:
        event.synchronize()
