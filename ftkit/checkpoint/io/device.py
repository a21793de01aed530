"""A resume onto a GPU: each piece the reader brings in is copied to the device as it arrives.

With live tensors on a CUDA device, :func:`ftkit.checkpoint.io.reader.scatter_file` reads the
file into pinned staging buffers (page-locked host memory from torch's pinned allocator,
:meth:`DeviceCopies.stages`), and the bytes of a CUDA tensor go to the device by a
host-to-device copy queued on a side stream (:class:`DeviceTensor`, a
:class:`ftkit.checkpoint.io.reader.Destination`): a DMA from the staging buffer, asynchronous
because the buffer is pinned, so the next reads are in flight while earlier pieces cross to the
GPU. The reader reads into a buffer again only once the event recorded after its copies has
passed (its :class:`ftkit.checkpoint.io.reader.Fence`).

Stream rules, as for the async save's copies (:mod:`ftkit.checkpoint.background.buffers`): the
side stream first waits for the compute stream of its device, so work queued on the live
tensors before the load (their initialisation, say) runs before the checkpoint's bytes land;
:meth:`DeviceCopies.finish` makes the compute stream wait for the copies and waits for them
itself, so a load returns with the state on the device.

Used only in a process that already uses CUDA (:func:`wanted`): the load never initialises CUDA
itself, and a CPU-only process pays nothing for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .direct import BLOCK

__all__ = ["DeviceCopies", "DeviceTensor", "load_copies", "wanted"]


def wanted() -> bool:
    """Whether this process uses CUDA already (then its live tensors may be on a device)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def load_copies(*, chunk: int, count: int) -> Iterator[DeviceCopies | None]:
    """A load's :class:`DeviceCopies` (``count`` pinned staging buffers of ``chunk`` bytes) where
    this process uses CUDA (:func:`wanted`), else None; finished on leaving, also on an error."""
    copies = DeviceCopies(chunk=chunk, count=count) if wanted() else None
    try:
        yield copies
    finally:
        if copies is not None:
            copies.finish()


class _EventFence:
    """The reader's fence over a CUDA event."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


class DeviceCopies:
    """The pinned staging buffers of one load and its host-to-device copies (one side stream per
    device); :meth:`finish` after the read, also when it failed."""

    def __init__(self, *, chunk: int, count: int) -> None:
        self._chunk, self._count = chunk, count
        # one pinned block for all pieces, page-aligned (O_DIRECT reads into it)
        self._pinned = torch.empty(chunk * count + BLOCK, dtype=torch.uint8, pin_memory=True)
        self._base = self._pinned.data_ptr() + (-self._pinned.data_ptr() % BLOCK)
        self._offset = self._base - self._pinned.data_ptr()
        self._sides: dict[torch.device, Any] = {}

    def stages(self) -> list[memoryview]:
        """The pinned staging buffers: ``count`` views of ``chunk`` bytes, each on a page."""
        whole = self._pinned.numpy().data.cast("B")
        return [whole[self._offset + i * self._chunk : self._offset + (i + 1) * self._chunk]
                for i in range(self._count)]

    def target(self, tensor: torch.Tensor) -> DeviceTensor:
        """The destination for a contiguous CUDA tensor's bytes."""
        device = tensor.device
        if device not in self._sides:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))  # the load's bytes land after queued work
            self._sides[device] = side
        return DeviceTensor(self, tensor, self._sides[device])

    def host(self, address: int, n: int) -> torch.Tensor:
        """The pinned bytes ``[address, address + n)`` as a tensor (they lie in a staging buffer)."""
        at = address - self._pinned.data_ptr()
        return self._pinned[at : at + n]

    def finish(self) -> None:
        """Every copy done: the compute streams wait for the side streams, and so does this call."""
        for device, side in self._sides.items():
            torch.cuda.current_stream(device).wait_stream(side)
            side.synchronize()


class DeviceTensor:
    """A contiguous CUDA tensor as a reader :class:`~ftkit.checkpoint.io.reader.Destination`."""

    def __init__(self, copies: DeviceCopies, tensor: torch.Tensor, side: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a DeviceTensor must be contiguous")
        self._copies, self._side = copies, side
        self._bytes = tensor.detach().reshape(-1).view(torch.uint8)

    def write(self, at: int, src: int, n: int) -> _EventFence:
        with torch.no_grad(), torch.cuda.stream(self._side):
            self._bytes[at : at + n].copy_(self._copies.host(src, n), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        return _EventFence(event)
