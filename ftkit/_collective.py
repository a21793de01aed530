"""ftkit's own collectives (a MAX all-reduce of small ints, a gather of small objects): where
their tensors live, and waiting for gloo to let go of them.

A gloo collective runs on one of the process group's worker threads, which holds the tensors
until just after the collective completes; the caller wakes a moment before. The worker then
drops its reference, and in torch that touches the tensor's Python object, which takes the GIL.
If the interpreter has begun to shut down in between (the collective was the last thing the
process did), the worker cannot take the GIL any more: it exits inside a C++ destructor and the
process aborts ("terminate called without an active exception", SIGABRT, exit code 134 or -6,
which ``ftkit requeue`` reads as a crash). On the 2-CPU VM a plain ``all_reduce`` returned
while the worker still held its tensor about one time in four, and a two-rank process that
ended right after ftkit's load aborted in about one run in seven.

:func:`all_reduce_max` and :func:`all_gather_objects` (``all_gather_object`` over tensors it
holds) therefore wait, after a gloo collective, until the worker has let go of its tensors: no
C++ reference besides each tensor's own, and the Python reference that torch takes while C++
holds one given back. That wait is usually nothing and at most tens of microseconds.
Collectives on CUDA tensors (NCCL) are left alone: NCCL's watchdog thread releases them later,
on its own schedule. Collectives that ftkit does not make (the user's, DCP's) keep the race.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["all_gather_objects", "all_reduce_max", "flag_device"]

log = logging.getLogger(__name__)

# how long to wait for the worker; past it, stop waiting in this process (a torch whose worker
# keeps the tensor longer, for whatever reason, must not cost every collective this much)
LET_GO_SECONDS = 1.0
_waiting = [True]


def flag_device(group: Any = None) -> str:
    """Where a flag buffer for ``group`` lives: the current CUDA device for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def all_reduce_max(buf: Any, group: Any = None) -> None:
    """``all_reduce(MAX)`` of ``buf`` in place; on the CPU, returns once gloo's worker thread
    has let go of ``buf`` (see the module's docstring)."""
    import torch.distributed as dist

    held = [buf]
    before = _refs(held)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    _let_go(held, before)


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank: ``all_gather_object``
    over tensors this function holds, so that it too returns once gloo has let go of them."""
    import pickle

    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = flag_device(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = torch.zeros(world_size, dtype=torch.int64, device=device)
    sizes[rank] = len(data)
    all_reduce_max(sizes, group)  # every rank's size (the others' slots are 0)
    lengths = [int(n) for n in sizes.tolist()]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    held = [mine, *every]
    before = _refs(held)
    dist.all_gather(every, mine, group=group)
    _let_go(held, before)
    return [pickle.loads(every[r][: lengths[r]].cpu().numpy().tobytes()) for r in range(world_size)]


def _refs(tensors: list[Any]) -> list[int]:
    """Each tensor's Python references (counted the same way before and after a collective)."""
    return [sys.getrefcount(t) for t in tensors]


def _let_go(tensors: list[Any], before: list[int]) -> None:
    """Wait until gloo's worker thread holds none of ``tensors``: no C++ reference besides each
    tensor's own (``_use_count``), and no more Python references than ``before`` (the one torch
    takes while C++ holds the tensor). CUDA tensors are not waited for."""
    if not _waiting[0] or any(t.device.type != "cpu" for t in tensors) or not hasattr(tensors[0], "_use_count"):
        return
    deadline = None
    while any(t._use_count() > 1 for t in tensors) or any(a > b for a, b in zip(_refs(tensors), before, strict=True)):
        now = time.monotonic()
        if deadline is None:
            deadline = now + LET_GO_SECONDS
        elif now > deadline:
            _waiting[0] = False
            log.debug("the process group's worker still holds a collective's tensors after %.1f s; "
                      "not waiting for them any more in this process", LET_GO_SECONDS)
            return
        time.sleep(0.00002)  # lets go of the GIL, which the worker takes to drop its reference
