"""A resume onto a GPU: each piece the reader brings in is copied to the device as it arrives.

With live tensors on a CUDA device, :func:`ftkit.checkpoint.io.reader.scatter_file` reads the
file into pinned staging buffers (page-locked host memory, :meth:`DeviceCopies.stages`), and
the bytes of a CUDA tensor go to the device by a host-to-device copy queued on a side stream
(:class:`DeviceTensor`, a :class:`ftkit.checkpoint.io.reader.Destination`): a DMA from the
staging buffer, asynchronous because the buffer is pinned, so the next reads are in flight
while earlier pieces cross to the GPU. The reader reads into a buffer again only once the
event recorded after its copies has passed (its :class:`ftkit.checkpoint.io.reader.Fence`).

Stream rules, as for the async save's copies (:mod:`ftkit.checkpoint.background.buffers`): the
side stream first waits for the compute stream of its device, so work queued on the live
tensors before the load (their initialisation, say) runs before the checkpoint's bytes land;
:meth:`DeviceCopies.finish` makes the compute stream wait for the copies and waits for them
itself, so a load returns with the state on the device.

Used only in a process that already uses CUDA (:func:`wanted`): the load never initialises CUDA
itself, and a CPU-only process pays nothing for it.

A copy is queued by calling the CUDA runtime that torch loaded (``cudaMemcpyAsync`` and
``cudaEventRecord`` through ``ctypes``, :class:`_Runtime`), not by ``Tensor.copy_``: a load of
1 GB queues about a thousand copies from four placing threads, and each ``copy_`` with its
stream context, slices and event is tens of microseconds of Python under the GIL, which the
thread submitting the next reads waits for. ``ctypes`` releases the GIL for the call. Where
that runtime is not found (a build that links it statically), :data:`RAW` is False or the
calling thread's current device is another, the copy goes through ``copy_`` as before.

The staging is of one of two kinds (:data:`STAGING`): a block from torch's pinned allocator
(``cudaHostAlloc``), or page-aligned memory in transparent huge pages, as a load onto the CPU
reads into, registered with CUDA (``cudaHostRegister``) and kept for the process's next GPU
load (:class:`_Registered`). An ``O_DIRECT`` read lands in either by DMA; the difference is
the pages it is split into (the block layer merges physically adjacent pages into one segment).
Where registering fails (or torch's CUDA runtime library is not found), the load logs it once
and stages in torch's pinned memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .direct import BLOCK, aligned_empty

__all__ = ["RAW", "STAGING", "DeviceCopies", "DeviceTensor", "forget_cuda_error", "load_copies", "wanted"]

log = logging.getLogger(__name__)

RAW = True  # queue the copies through the CUDA runtime's C API (else Tensor.copy_; both are tested)
EVENTS = 64  # events of one device a load records in turn (a fence waits for its event's latest
# record: one recorded again later waits a little longer, never too little, as the copies of
# one side stream run in order)
STAGING = "pinned"  # a load's staging: torch's pinned allocator ("pinned"), or huge pages registered
# with CUDA ("registered"); benchmarks/read_shape.py --staging times both side by side


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


class _Runtime:
    """The CUDA runtime library this process loaded for torch (``libcudart``, as mapped in
    ``/proc/self/maps``), called through ``ctypes`` (the GIL released during each call)."""

    _lock = threading.Lock()
    _found: _Runtime | bool | None = False  # False: not looked for yet

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i = ctypes.c_void_p, ctypes.c_int
        for name, args in (("cudaMemcpyAsync", [vp, vp, ctypes.c_size_t, i, vp]), ("cudaEventRecord", [vp, vp]),
                           ("cudaEventSynchronize", [vp]), ("cudaGetDevice", [ctypes.POINTER(i)]),
                           ("cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint]),
                           ("cudaEventDestroy", [vp]), ("cudaHostRegister", [vp, ctypes.c_size_t, ctypes.c_uint]),
                           ("cudaHostUnregister", [vp]), ("cudaGetLastError", [])):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, i
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [i], ctypes.c_char_p
        self.lib = lib

    @classmethod
    def get(cls) -> _Runtime | None:
        with cls._lock:
            if cls._found is False:
                cls._found = cls._load()
            return cls._found or None

    @classmethod
    def _load(cls) -> _Runtime | None:
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line[line.index("/"):].strip() for line in maps if "/libcudart.so" in line})
            # another library's runtime may be mapped too: torch's is of its CUDA version
            major = f"/libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
            paths.sort(key=lambda path: major not in path)
            return cls(ctypes.CDLL(paths[0])) if paths else None
        except (OSError, ValueError, AttributeError):
            return None

    def check(self, code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what}: CUDA error {code} ({self.lib.cudaGetErrorString(code).decode()})")

    def device(self) -> int:
        """The calling thread's current device."""
        got = ctypes.c_int(-1)
        self.check(self.lib.cudaGetDevice(ctypes.byref(got)), "cudaGetDevice")
        return got.value


class _RawEvent:
    """The reader's fence over a raw CUDA event of a :class:`_Events` pool."""

    __slots__ = ("_handle", "_rt")

    def __init__(self, rt: _Runtime, handle: int) -> None:
        self._rt, self._handle = rt, handle

    def wait(self) -> None:
        self._rt.check(self._rt.lib.cudaEventSynchronize(self._handle), "cudaEventSynchronize")


class _Events:
    """:data:`EVENTS` raw CUDA events of one device (created with that device current),
    recorded in turn; destroyed with the load's :class:`DeviceCopies`."""

    def __init__(self, rt: _Runtime, device: torch.device) -> None:
        self._rt, self.handles = rt, []
        with torch.cuda.device(device):
            for _ in range(EVENTS):
                handle = ctypes.c_void_p()
                rt.check(rt.lib.cudaEventCreateWithFlags(ctypes.byref(handle), 2), "cudaEventCreateWithFlags")  # no timing
                self.handles.append(handle.value)
        self._turn = itertools.cycle(self.handles)

    def record(self, stream: int) -> _RawEvent:
        handle = next(self._turn)
        self._rt.check(self._rt.lib.cudaEventRecord(handle, stream), "cudaEventRecord")
        return _RawEvent(self._rt, handle)

    def destroy(self) -> None:
        for handle in self.handles:  # once their copies are done (DeviceCopies.finish)
            self._rt.lib.cudaEventDestroy(handle)
        self.handles = []


def _context_device() -> int:
    """A device whose primary context exists (the calling thread's current one where it has
    one), for host-memory calls that work for every device but run in the current one's
    context: a placing thread's current device is 0 and may have none, and creating one costs
    memory on a GPU this process does not use (torch's pinned allocator does the same)."""
    current = torch.cuda.current_device()
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None or has(current):
        return current
    return next((i for i in range(torch.cuda.device_count()) if has(i)), current)


def forget_cuda_error() -> None:
    """Take back the error a failed CUDA runtime call left for this thread (``cudaGetLastError``):
    a call whose failure was handled must not make torch's next kernel launch raise it."""
    rt = _Runtime.get()
    if rt is not None:
        rt.lib.cudaGetLastError()


class _Registered:
    """Host memory in huge pages, registered with CUDA once and reused by the process's GPU
    loads one at a time (:meth:`take`, :meth:`give`); :data:`KEEP` free blocks are kept.

    A registered block is never freed while registered: every one is held in ``_held`` until
    :meth:`unregister` (a block whose copies may still be running, after an error, stays held
    and is not reused)."""

    KEEP = 1
    _lock = threading.Lock()
    _kept: list[torch.Tensor] = []  # registered and free, the latest given back last
    _held: dict[int, torch.Tensor] = {}  # every registered block, by address
    _refused: str | None = None  # why registering failed (then never tried again)

    @staticmethod
    def register(block: torch.Tensor) -> str | None:
        """``cudaHostRegister`` of ``block`` (portable: pinned for every device's context); why
        not, or None when registered."""
        rt = _Runtime.get()
        if rt is None:
            return "the CUDA runtime library torch uses was not found in this process"
        with torch.cuda.device(_context_device()):
            code = rt.lib.cudaHostRegister(block.data_ptr(), block.numel(), 1)
            if code:
                rt.lib.cudaGetLastError()  # handled here: not for torch's next launch to raise
        return f"CUDA error {code} ({rt.lib.cudaGetErrorString(code).decode()})" if code else None

    @classmethod
    def unregister(cls, block: torch.Tensor) -> None:
        """``cudaHostUnregister``, then the block may be freed."""
        rt = _Runtime.get()
        if rt is not None:
            with torch.cuda.device(_context_device()):
                if rt.lib.cudaHostUnregister(block.data_ptr()):
                    rt.lib.cudaGetLastError()
        with cls._lock:
            cls._held.pop(block.data_ptr(), None)

    @classmethod
    def take(cls, nbytes: int) -> torch.Tensor | None:
        """A registered block of ``nbytes`` (one kept from an earlier load, else a new one), or
        None where registering failed (logged once: the caller stages in pinned memory)."""
        with cls._lock:
            for i, block in enumerate(cls._kept):
                if block.numel() == nbytes:
                    return cls._kept.pop(i)
            if cls._refused is not None:
                return None
        block = aligned_empty((nbytes,), torch.uint8)  # on a 2 MiB boundary, huge-page advice
        block.fill_(0)  # faulted in here, in huge pages where the kernel gives them
        why = cls.register(block)
        with cls._lock:
            if why is None:
                cls._held[block.data_ptr()] = block
                return block
            if cls._refused is None:
                cls._refused = why
                log.warning("cudaHostRegister of %d bytes of load staging failed (%s): GPU loads stage in "
                            "torch's pinned memory instead", nbytes, why)
        return None

    @classmethod
    def give(cls, block: torch.Tensor) -> None:
        """Back for the next load (its copies are done). Beyond :data:`KEEP` free blocks, the
        one given back longest ago is unregistered and freed (the latest size is the likelier
        next)."""
        with cls._lock:
            cls._kept.append(block)
            extra = cls._kept[: -cls.KEEP] if len(cls._kept) > cls.KEEP else []
            del cls._kept[: len(extra)]
        for old in extra:
            cls.unregister(old)

    @classmethod
    def clear(cls) -> None:
        """Unregister and free every kept block."""
        with cls._lock:
            kept, cls._kept = cls._kept, []
        for block in kept:
            cls.unregister(block)


class DeviceCopies:
    """The pinned staging buffers of one load and its host-to-device copies (one side stream per
    device); :meth:`finish` after the read, also when it failed."""

    def __init__(self, *, chunk: int, count: int) -> None:
        self._chunk, self._count = chunk, count
        # one pinned block for all pieces, page-aligned (O_DIRECT reads into it)
        self._registered = _Registered.take(chunk * count) if STAGING == "registered" else None
        self._pinned = (self._registered if self._registered is not None
                        else torch.empty(chunk * count + BLOCK, dtype=torch.uint8, pin_memory=True))
        self._base = self._pinned.data_ptr() + (-self._pinned.data_ptr() % BLOCK)
        self._offset = self._base - self._pinned.data_ptr()
        self._sides: dict[torch.device, Any] = {}
        self._events: dict[torch.device, _Events] = {}
        self._rt = _Runtime.get() if RAW else None

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
            if self._rt is not None:
                self._events[device] = _Events(self._rt, device)
        return DeviceTensor(self, tensor, self._sides[device], self._events.get(device))

    def host(self, address: int, n: int) -> torch.Tensor:
        """The pinned bytes ``[address, address + n)`` as a tensor (they lie in a staging buffer)."""
        at = address - self._pinned.data_ptr()
        return self._pinned[at : at + n]

    def finish(self) -> None:
        """Every copy done: the compute streams wait for the side streams, and so does this call."""
        done = False
        try:
            for device, side in self._sides.items():
                torch.cuda.current_stream(device).wait_stream(side)
                side.synchronize()
            done = True
            for events in self._events.values():
                events.destroy()
            self._events = {}
        finally:
            if self._registered is not None and done:  # no copy reads it any more
                _Registered.give(self._registered)
            # (not done: copies may still read it, so it stays registered and held, not reused)
            self._registered = None


class DeviceTensor:
    """A contiguous CUDA tensor as a reader :class:`~ftkit.checkpoint.io.reader.Destination`."""

    def __init__(self, copies: DeviceCopies, tensor: torch.Tensor, side: Any, events: _Events | None = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a DeviceTensor must be contiguous")
        self._copies, self._side, self._events = copies, side, events
        self._bytes = tensor.detach().reshape(-1).view(torch.uint8)
        self._at, self._index, self._stream = self._bytes.data_ptr(), tensor.device.index, side.cuda_stream

    def write(self, at: int, src: int, n: int) -> _EventFence | _RawEvent:
        events = self._events
        if events is not None:
            if events._rt.device() == self._index:
                return self._raw(events, at, src, n)
            # torch's guard: another current device (a placing thread's first copy, a model on
            # several GPUs) is made current and back, without creating a context on one unused
            with torch.cuda.device(self._index):
                return self._raw(events, at, src, n)
        with torch.no_grad(), torch.cuda.stream(self._side):
            self._bytes[at : at + n].copy_(self._copies.host(src, n), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        return _EventFence(event)

    def _raw(self, events: _Events, at: int, src: int, n: int) -> _RawEvent:
        rt = events._rt
        rt.check(rt.lib.cudaMemcpyAsync(self._at + at, src, n, 1, self._stream),  # 1: host to device
                 f"cudaMemcpyAsync of {n} bytes to cuda:{self._index}")
        return events.record(self._stream)
