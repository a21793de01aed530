"""Persist host snapshots on a background thread of the trainer (``crash_safe=False``)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .buffers import BufferSet, Copier, host_snapshot, wait_events

__all__ = ["ThreadBackend"]

log = logging.getLogger(__name__)

Done = Callable[[int, int, "BaseException | str | None", float], None]


class ThreadBackend:
    """``slots`` reusable host buffer sets and one worker thread that runs ``checkpointer.persist``
    (a :class:`~ftkit.checkpoint.Checkpointer`, or with several ranks an ``background.commit.RankCommit``).

    The worker is stopped with a sentinel on its queue; every failure it meets goes to
    ``done(seq, step, error, seconds)``, which the AsyncCheckpointer re-raises to the caller.
    """

    def __init__(self, checkpointer: Any, slots: int, done: Done, copier: Copier) -> None:
        self._ckpt = checkpointer
        self._done = done
        self._copier = copier
        self.sets = [BufferSet(pin=True) for _ in range(slots)]
        self._snaps: dict[int, tuple[Any, list[Any]]] = {}
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        # daemon: an interpreter exiting without close() must not hang here; the manager's
        # atexit hook drains the queue first, so nothing accepted is dropped silently.
        self._thread = threading.Thread(target=self._run, name="ftkit-async-checkpoint", daemon=True)
        self._thread.start()

    def start_fill(self, slot: int) -> _Fill:
        """Begin a snapshot into ``slot``: ``found`` per tensor of the walk, then ``finish``
        (or ``abort`` if anything failed)."""
        return _Fill(self, slot)

    def submit(self, slot: int, seq: int, step: int, pin: bool, reason: str | None) -> None:
        self._queue.put((slot, seq, step, pin, reason))

    def buffers(self, slot: int) -> list[torch.Tensor]:
        return list(self.sets[slot].buffers.values())

    def problem(self) -> str | None:
        return None if self._thread.is_alive() else "the checkpoint worker thread is not running"

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            slot, seq, step, pin, reason = job
            started = time.monotonic()
            error: BaseException | None = None
            try:
                snapshot, events = self._snaps[slot]
                wait_events(events)  # device-to-host copies of this snapshot are done
                self._ckpt.persist(snapshot, step, pin=pin, reason=reason)
            except BaseException as exc:  # handed to the caller, never swallowed
                error = exc
            self._done(seq, step, error, time.monotonic() - started)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._snaps.clear()


class _Fill:
    """One snapshot into a slot's buffers. A tensor whose buffer (same path, shape and dtype)
    exists is copied as soon as the walk finds it; the rest once the walk is done."""

    def __init__(self, backend: ThreadBackend, slot: int) -> None:
        self._backend = backend
        self._slot = slot
        self._set = backend.sets[slot]
        self._batch = backend._copier.batch()
        self._copied: set[int] = set()
        self._began = time.monotonic()  # the walk (state_dict() calls) and the copies: the snapshot's time

    def found(self, index: int, where: str, tensor: torch.Tensor) -> None:
        buf = self._set.buffers.get(where)
        if buf is not None and buf.shape == tensor.shape and buf.dtype == tensor.dtype:
            self._batch.add(buf, tensor)
            self._copied.add(index)

    def finish(self, seq: int, step: int, skeleton: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        buffers = self._set.buffers_for(tensors)  # the same buffers for the tensors copied early
        for i, (buf, (_, tensor)) in enumerate(zip(buffers, tensors, strict=True)):
            if i not in self._copied:
                self._batch.add(buf, tensor)
        events, nbytes = self._batch.finish()
        snapshot = host_snapshot(skeleton, buffers, nbytes)
        snapshot.seconds = time.monotonic() - self._began
        self._backend._snaps[self._slot] = (snapshot, events)

    def abort(self) -> None:
        """The save failed: the copies started stay ordered before later updates, and are done."""
        events, _ = self._batch.finish()
        wait_events(events)
