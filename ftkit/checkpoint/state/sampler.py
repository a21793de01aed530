"""A sampler whose position survives a restart: the data order continues where it stopped."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ...errors import ConfigError

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Indices ``0..length-1``, shuffled per epoch from ``seed + epoch``, resumable mid-epoch.

    The order is a pure function of ``(seed, epoch)``, so the state is just
    ``{epoch, position}``: ``position`` counts indices already handed out this epoch. With
    ``world_size > 1`` each rank takes every ``world_size``-th index (like
    DistributedSampler, padding by wrap-around so every rank gets the same count).

    An exhausted iteration moves to the next epoch by itself; ``set_epoch(e)`` with a new
    ``e`` starts that epoch from its beginning, with the current one it keeps the position
    (so a resumed loop calling ``set_epoch`` does not rewind).

    **Another number of ranks.** The ranks of one run hand out the epoch's order in
    lockstep, so after ``position`` indices per rank on ``W`` ranks the first
    ``start + position * W`` indices of the epoch's order are consumed (:attr:`global_position`;
    ``start`` is 0 unless the epoch was already resumed on another number of ranks).
    ``load_state_dict`` of a state saved with another ``world_size`` makes that global count
    the new ``start`` and the position 0: the ``W'`` ranks of this run share the rest of the
    epoch, rank ``r`` taking every ``W'``-th index from ``start + r``, so no index of the epoch
    is handed out twice or skipped (only the last row of a stretch is padded, as
    DistributedSampler pads the epoch). This assumes the saving ranks were at the same
    position, as ranks iterating one DataLoader each are.

    ``position`` counts what the DataLoader asked for. With ``num_workers > 0`` the loader
    prefetches, so the position runs ahead of the training step by up to
    ``num_workers * prefetch_factor`` batches; for exact resume use ``num_workers=0`` or
    call ``set_position``. Give the DataLoader its own ``generator`` so that creating an
    iterator does not draw from the global torch RNG.
    """

    def __init__(
        self,
        data: int | Sized,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        length = data if isinstance(data, int) else len(data)
        if length < 0:
            raise ConfigError(f"ResumableSampler: dataset length must be >= 0, got {length}")
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"ResumableSampler: rank {rank} not in range of world_size {world_size}"
            )
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch
        self.position = 0
        self.start = 0
        """Indices of this epoch's order consumed before this stretch: by a run on another
        number of ranks that this one resumed (0 otherwise)."""

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        order = order[self.start :]
        if self.world_size > 1 and order:
            per_rank = -(-len(order) // self.world_size)
            total = per_rank * self.world_size
            order = (order * (total // len(order) + 1))[:total]
            order = order[self.rank :: self.world_size]
        return order

    def __len__(self) -> int:
        left = self.length - self.start
        return -(-left // self.world_size) if self.world_size > 1 else left

    @property
    def global_position(self) -> int:
        """Indices of this epoch's order consumed by all ranks together (at most ``length``)."""
        return min(self.length, self.start + self.position * self.world_size)

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < len(order):
            index = order[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a no-op when already in it, keeping the position)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0
            self.start = 0

    def set_position(self, position: int) -> None:
        """Resume the current epoch after ``position`` indices of this rank (e.g. what a
        prefetching DataLoader really consumed), counted from where this run began the epoch.

        Like :attr:`position`, it counts from the epoch's beginning, or, in a run that
        resumed the epoch on another number of ranks, from where that run resumed it
        (``start`` indices of the epoch were consumed before)."""
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position in it, seed, dataset length and the layout over ranks (``start``,
        ``world_size``): enough to continue the same order on any number of ranks."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "length": self.length,
            "start": self.start,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state_dict`` was taken; refuses a different dataset length or seed.

        A state saved with another ``world_size`` continues at its global position (class
        doc); a state without ``world_size`` (written before ftkit recorded it) is taken as this one's.
        """
        if (
            state.get("length", self.length) != self.length
            or state.get("seed", self.seed) != self.seed
        ):
            raise ConfigError(
                f"ResumableSampler: checkpoint was made with length={state.get('length')} "
                f"seed={state.get('seed')}, this sampler has length={self.length} seed={self.seed}: its position "
                "is another order's. Resume with the dataset and seed it was saved with, or start the sampler "
                "over: put it in the state under a new key, listed in CheckpointConfig(allow_missing=...) for "
                "the first run"
            )
        self.epoch = int(state["epoch"])
        position, start = int(state["position"]), int(state.get("start", 0))
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world == self.world_size:
            self.start, self.position = start, position
        else:
            self.start = min(self.length, start + position * saved_world)
            self.position = 0
