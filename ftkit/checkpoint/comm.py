"""The few collectives a multi-rank save or load needs, and a one-rank stand-in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointError, ConfigError

__all__ = ["Comm"]

T = TypeVar("T")


class Comm:
    """``gather``/``broadcast``/``barrier`` over ``process_group``; no-ops when world_size is 1."""

    def __init__(self, *, rank: int, world_size: int, process_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pg = process_group

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
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.pg)

    def all_ok(self, problem: str | None, what: str) -> None:
        """Raise CheckpointError on every rank if any rank reports a problem."""
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
