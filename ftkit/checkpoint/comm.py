"""The few collectives a multi-rank save or load needs, and a one-rank stand-in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .._collective import all_gather_objects, all_reduce_max, flag_device
from ..errors import CheckpointError, ConfigError

__all__ = ["Comm"]

T = TypeVar("T")


class Comm:
    """``gather``/``broadcast``/``barrier`` over ``process_group``; no-ops when world_size is 1."""

    def __init__(self, *, rank: int, world_size: int, process_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pg = process_group
        self._flags: dict[int, Any] = {}  # the all_reduce buffers of most(), by length

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def check(self) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"checkpoint: world_size={self.world_size} but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group() before saving or loading"
            )

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        return all_gather_objects(obj, self.pg)

    def anyone(self, flag: bool) -> bool:
        """Whether any rank passed True: one ``all_reduce`` of a flag. ``all_gather_object``
        pickles and makes two collectives (about 4 ms against 1 ms over gloo on a 2-CPU VM), so
        an agreement asks this first and gathers what the ranks have to say only when one has
        something to say, which is rare."""
        return bool(self.most(int(flag))[0])

    def most(self, *values: int) -> tuple[int, ...]:
        """For each of ``values`` (small ints), the largest any rank passed there: one
        ``all_reduce`` (MAX, element by element), as :meth:`anyone`."""
        if not self.distributed:
            return values
        import torch

        flags = self._flags.get(len(values))
        if flags is None:  # on the process group's device (NCCL: the current CUDA device)
            flags = self._flags[len(values)] = torch.zeros(len(values), dtype=torch.int32,
                                                           device=flag_device(self.pg))
        flags.copy_(torch.tensor(values, dtype=torch.int32))
        all_reduce_max(flags, self.pg)
        return tuple(int(v) for v in flags.tolist())

    def first_problem(self, problem: str | None, *, flagged: bool | None = None) -> str:
        """The lowest rank's problem, the same on every rank ("" when no rank has one).
        ``flagged``: whether any rank has one, where a collective (:meth:`most`) said so
        already; else one ``all_reduce`` asks."""
        if not (self.anyone(bool(problem)) if flagged is None else flagged):
            return ""
        return next(p for p in self.gather(problem or "") if p)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.pg)

    def all_ok(self, problem: str | None, what: str) -> None:
        """Raise CheckpointError on every rank if any rank reports a problem."""
        if not self.anyone(bool(problem)):
            return
        problems = [(r, p) for r, p in enumerate(self.gather(problem)) if p]
        if problems:
            raise CheckpointError(f"{what}: " + "; ".join(f"rank {r}: {p}" for r, p in problems))

    def on_rank0(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on rank 0 and hand its result (or its failure) to every rank."""
        if not self.distributed:
            return fn()
        result: Any = None
        problem: str | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as exc:
                error, problem = exc, str(exc)
        gathered = self.gather((result, problem) if self.rank == 0 else None)
        first = gathered[0]
        assert first is not None  # rank 0 always sends its pair
        result, problem = first
        if error is not None:
            raise error
        if problem:
            raise CheckpointError(f"{what}: rank 0: {problem}")
        return result
