"""Asynchronous, two-tier checkpoints: the loop only pays for a copy of its state into host memory.

::

    mgr = AsyncCheckpointer(CheckpointConfig(root=...), async_config=AsyncConfig(memory_every=10, persist_every=5))
    start = mgr.load(state) or 0
    for step in range(start + 1, total + 1):
        train_one_step()
        mgr.on_step(step, state)          # snapshot every 10 steps, persist every 50th step
    mgr.save(total, state); mgr.close()   # close() returns once everything is durable

Rules:

* **Stall.** ``save``/``on_step`` copy the state into reused host buffers (pinned, side stream
  and event on CUDA; see ``background.buffers``) and return; ``Checkpointer.persist`` (the full
  commit protocol) runs on a worker thread, or in the saver process with ``crash_safe``.
* **Bound.** At most ``max_in_flight`` snapshots accepted but not yet durable. A save beyond
  that *waits* for the oldest to become durable (no coalescing: every save asked for is
  written). Buffers: ``max_in_flight + 1`` slots, allocated on first use, then reused.
* **Two tiers.** ``on_step`` snapshots every ``memory_every`` steps and persists the steps that
  are multiples of ``memory_every * persist_every``. ``save(step)`` persists the newest snapshot
  if it is of ``step`` (no second copy), else snapshots now. The newest snapshot is never
  overwritten before it is durable or superseded (double buffering).
* **Errors.** A failed background save becomes a CheckpointError naming the step; with
  ``on_error="raise"`` the next ``on_step``/``save``/``wait`` raises it (once), with ``warn`` it is
  logged and only ``wait`` raises it unless a later save succeeded. ``pending_error()`` hands it
  over (and clears it) without raising, for a controller that checks every step.
* **Exit.** ``wait`` blocks until every accepted save is durable; ``close`` waits, then stops the
  worker or saver. An interpreter exiting without ``close`` runs it from ``atexit``.
* **Several ranks** (``world_size > 1``): each rank snapshots in the loop without any collective,
  its worker (a thread, or with ``crash_safe`` the node's saver process) writes the rank's part and
  a confirmation file, and rank 0's worker commits once every rank confirmed (``background.commit``).
  Construction is collective (the ranks agree on a run id and learn who shares a node); ``wait`` is collective: every rank drains its own worker (rank 0's
  includes the commit), then the ranks exchange their outcomes, so each returns only once the
  checkpoint is committed and raises if any rank's part or the commit failed.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import CheckpointError, ConfigError
from ..config import CheckpointConfig, CheckpointInfo
from ..format.layout import step_name
from ..manager import Checkpointer
from ..protocol import CheckpointManager
from ..state.snapshot import flatten
from .buffers import Copier
from .config import AsyncConfig

__all__ = ["AsyncCheckpointer", "AsyncConfig"]

log = logging.getLogger(__name__)


class _Slot:
    __slots__ = ("busy", "durable", "in_flight", "index", "seq", "step", "used")

    def __init__(self, index: int) -> None:
        self.index = index
        self.seq = -1
        self.step = -1
        self.busy = False  # being filled right now
        self.used = False  # has buffers
        self.in_flight = False
        self.durable = False


class AsyncCheckpointer(CheckpointManager):
    """A :class:`~ftkit.checkpoint.CheckpointManager` that persists in the background (module doc)."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        async_config: AsyncConfig | None = None,
        events: Any = None,
        rank: int = 0,
        world_size: int = 1,
        process_group: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.async_config = async_config if async_config is not None else AsyncConfig()
        self.checkpointer = Checkpointer(config, events=events, rank=rank, world_size=world_size,
                                         process_group=process_group)
        self._distributed = world_size > 1
        node = None
        persister: Any = self.checkpointer
        self._run_id: str | None = None
        self._hosts: list[tuple[str, int]] | None = None
        if self._distributed:
            run_id, hosts = self._agree()
            self._run_id, self._hosts = run_id, hosts
            if self.async_config.crash_safe:
                from ..crashsafe.client import NodePlan

                node = NodePlan.from_ranks(rank, run_id, hosts)
            else:
                from .commit import RankCommit

                persister = RankCommit(self.checkpointer, run_id=run_id, timeout=self.async_config.commit_timeout,
                                       peers=hosts)  # a peer of this node that dies is not waited for
        self._clock = clock
        self._cond = threading.Condition()
        self._slots = [_Slot(i) for i in range(self.async_config.max_in_flight + 1)]
        self._newest: _Slot | None = None
        self._in_flight = 0
        self._seq = 0
        self._error: CheckpointError | None = None
        self._orphaned: list[tuple[int, str]] = []  # (step, why): persists a dead saver took with it
        self._wait_failed = False  # a failure was handed over (a later wait's exchange then says no other)
        self._closed = False
        self.last_stall_seconds: float | None = None
        self.last_persist_seconds: float | None = None
        self.last_durable_step: int | None = None
        copier = self._copier = Copier()
        if self.async_config.crash_safe:
            from ..crashsafe.client import ShmBackend

            self._backend: Any = ShmBackend(config, self.async_config, len(self._slots), self._done, copier,
                                            events=events, rank=rank, node=node)
        else:
            from .thread import ThreadBackend

            self._backend = ThreadBackend(persister, len(self._slots), self._done, copier)
        atexit.register(self._at_exit)

    def _agree(self) -> tuple[str, list[tuple[str, int]]]:
        """Several ranks: check torch.distributed, agree on a run id and learn who shares a node
        (one collective, main thread)."""
        import uuid

        import torch.distributed as dist

        comm = self.checkpointer.comm
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"async_save: world_size={comm.world_size} but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group() before creating the AsyncCheckpointer"
            )
        from .commit import node_name

        # SLURM's node name where there is one: several slurmd may share a host (MULTIPLE_SLURMD,
        # the multi-node test cluster), and each node has its own saver
        node = node_name()
        gathered = comm.gather((uuid.uuid4().hex, node, os.getpid()))
        run_id = gathered[0][0]  # save ids name this run: leftovers never match
        return run_id, [(host, pid) for _, host, pid in gathered]

    @property
    def config(self) -> CheckpointConfig:
        return self.checkpointer.config

    @property
    def root(self) -> os.PathLike[str]:
        return self.checkpointer.root

    # ------------------------------------------------------------------ the loop's calls
    def on_step(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot (and maybe persist) if ``step`` is due; True when a snapshot was taken."""
        self._replace_lost_saver()
        if self._error is not None:
            self._raise_pending()
        cfg = self.async_config
        if cfg.memory_every is None or step % cfg.memory_every:
            return False
        self.checkpointer.set_aside_fork()  # before a snapshot the crash-safe saver may persist
        persist = cfg.persist_due(step)
        self._snapshot_now(step, state, persist=persist, pin=False,
                   reason=f"periodic (persist every {cfg.persist_period} steps)" if persist else None)
        return True

    def save(
        self, step: int, state: Mapping[str, Any], *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo:
        """Start saving ``state`` as ``step``; returns once the snapshot is taken (status ``pending``)."""
        self._check_open()
        self._replace_lost_saver()
        self._raise_pending()
        # a load of an older step: the later checkpoints go aside here, in the trainer, whichever
        # process persists (the crash-safe saver's committer never loaded anything)
        self.checkpointer.set_aside_fork()
        newest = self._newest
        if newest is not None and newest.step == step and not newest.busy:
            if newest.in_flight or newest.durable:
                if pin:  # already being written without the pin: add it once durable
                    self.wait()
                    self.checkpointer.pin(step)
            else:
                self._submit(newest, pin=pin, reason=reason)
        else:
            self._snapshot_now(step, state, persist=True, pin=pin, reason=reason)
        return CheckpointInfo(
            step=step, path=self.checkpointer.root / step_name(step), status="pending",
            reason="being persisted in the background; wait() returns once it is durable",
            pinned=pin, saved_for=reason,
        )

    def pin(self, step: int) -> None:
        """Pin the durable checkpoint ``step`` (retention keeps it); rank 0 writes the marker."""
        self.checkpointer.pin(step)

    def pending_error(self) -> CheckpointError | None:
        """The failure of a background save not yet reported, handed over once (then cleared)."""
        err, self._error = self._error, None
        if err is not None:
            self._wait_failed = True
        return err

    def wait(self) -> None:
        """Block until every accepted save is durable; raise the failure of any of them.

        Several ranks: collective (module doc); every rank returns once rank 0 committed, and
        raises if a save failed on any rank.
        """
        with self._cond:
            while self._in_flight:
                self._cond.wait(timeout=1.0)
                problem = self._backend.problem() if self._in_flight else None
                if problem:
                    self._fail_in_flight(problem)
            for step, problem in self._orphaned:  # awaited, they never became durable
                self._record(step, problem)
            self._orphaned.clear()
        try:
            if self._distributed:
                self._agree_on_outcome()
            self._raise_pending(final=True)
        except CheckpointError:
            self._wait_failed = True
            raise

    def _agree_on_outcome(self) -> None:
        """Exchange each rank's unreported failure (main thread) and raise them on every rank."""
        import torch.distributed as dist

        err, self._error = self._error, None
        if not (dist.is_available() and dist.is_initialized()):  # e.g. atexit after destroy_process_group
            log.warning("checkpoint wait: torch.distributed is gone; only this rank's saves were awaited")
            self._error = err
            return
        mine = str(err) if err is not None else None
        try:
            outcomes = self.checkpointer.comm.gather(mine)
        except Exception as exc:  # a rank is gone: report what this rank knows
            if mine is None and self._wait_failed:  # the failure was raised or handed over before: said once
                log.info("checkpoint wait: the ranks could not exchange their outcomes (%s); the failure was "
                         "raised by an earlier wait", exc)
                return
            raise CheckpointError(
                f"{mine or 'every save of this rank is durable'}; the ranks could not exchange "
                f"their outcomes (a rank died?): {exc}"
            ) from (err or exc)
        failed = [(r, p) for r, p in enumerate(outcomes) if p]
        if failed:
            raise CheckpointError(
                "background checkpoint save failed: " + "; ".join(f"rank {r}: {p}" for r, p in failed)
            ) from err

    # ------------------------------------------------------------------ snapshot and submit
    def _snapshot_now(self, step: int, state: Mapping[str, Any], *, persist: bool, pin: bool, reason: str | None) -> None:
        """Copy ``state`` into a free slot now (waiting for one), then submit it when ``persist``;
        a crash-safe saver found dead meanwhile is replaced (``_replace_lost_saver``) and the
        snapshot taken again, into the trainer's own buffers."""
        try:
            self._snapshot_once(step, state, persist=persist, pin=pin, reason=reason)
        except CheckpointError:
            if not self._replace_lost_saver():
                raise
            self._snapshot_once(step, state, persist=persist, pin=pin, reason=reason)

    def _snapshot_once(self, step: int, state: Mapping[str, Any], *, persist: bool, pin: bool,
                       reason: str | None) -> None:
        self._check_open()
        began = self._clock()
        limit = self.async_config.max_in_flight
        with self._cond:
            if persist:
                self._wait_until(lambda: self._in_flight < limit)
            slot = self._wait_until(self._free_slot)
            slot.busy = True
            if self._newest is slot:
                self._newest = None
            self._seq += 1
            seq = self._seq
        fill = None
        try:
            # the backend copies each tensor as the walk finds it (see _async_buffers)
            fill = self._backend.start_fill(slot.index)
            skeleton, tensors = self._flatten(state, fill.found)
            fill.finish(seq, step, skeleton, tensors)
        except BaseException:
            if fill is not None:
                fill.abort()
            with self._cond:
                slot.busy, slot.seq, slot.step, slot.durable = False, -1, -1, False
                self._cond.notify_all()
            raise
        with self._cond:
            slot.busy, slot.used, slot.durable = False, True, False
            slot.seq, slot.step = seq, step
            self._newest = slot
        if persist:
            self._submit(slot, pin=pin, reason=reason)
        self.last_stall_seconds = self._clock() - began

    def _flatten(
        self, state: Mapping[str, Any], found: Callable[[int, str, Any], None]
    ) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        if not self._distributed:
            return flatten(state, found=found)
        from ..dcp import sharded_keys
        from .plan import plan_sharded

        keys = sharded_keys(state)
        skeleton, tensors = flatten(state, exclude=keys, found=found)
        skeleton["sharded"], more = plan_sharded(state, keys, self.checkpointer.rank, start=len(tensors))
        return skeleton, tensors + more

    def _free_slot(self) -> _Slot | None:
        newest = self._newest
        free = [s for s in self._slots if not (s.in_flight or s.busy) and (s is not newest or s.durable)]
        if not free:
            return None
        return min(free, key=lambda s: (not s.used, s is newest, s.index))

    def _replace_lost_saver(self) -> bool:
        """``crash_safe``: the node's saver process died (the OOM killer, a kill -9) while this
        trainer lives on. Its snapshots can no longer outlive the trainer, but they must still
        be saved: from here on this run persists them itself, on a thread, with the same commit
        protocol (the other ranks' savers commit with it as before), in host buffers of its own
        (the shared-memory ones are unlinked). Said once, as an error and a ``saver-lost``
        event; a save that was in flight when the saver died fails as before (``_raise_pending``).
        The next run starts a saver again. Returns whether it replaced one."""
        backend = self._backend
        lost = getattr(backend, "_lost", None)  # ShmBackend's: set once its saver is gone
        if not lost or self._closed:
            return False
        with self._cond:
            if self._in_flight:  # the reader thread hands them over (_done(-1)) right after _lost
                self._cond.wait_for(lambda: not self._in_flight, timeout=1.0)
            if self._in_flight:
                self._orphan_in_flight(lost)
            orphaned, self._orphaned = self._orphaned, []
            for slot in self._slots:  # the shared-memory buffers go with the old backend
                slot.seq, slot.step, slot.used, slot.durable, slot.busy = -1, -1, False, False, False
            self._newest = None
        rank = self.checkpointer.rank
        gone = "".join(f"; the save of step {step} it was persisting is lost" for step, _ in orphaned)
        log.error("rank %d: %s%s; crash-safe saves are off for the rest of this run: its checkpoints are persisted "
                  "from a thread of the trainer (a crash of the trainer now loses the snapshot being written); "
                  "the next run starts a saver again", rank, lost, gone)
        events = self.checkpointer.events
        if events is not None:
            events.emit("saver-lost", rank=rank, error=str(lost), saver_pid=backend.saver_pid,
                        lost_steps=[step for step, _ in orphaned])
            for step, problem in orphaned:
                events.emit("save-failed", rank=rank, step=step, error=f"the checkpoint saver died: {problem}",
                            reason="background save")
        with contextlib.suppress(Exception):  # already gone: close unlinks what is left of it
            backend.close()
        from .commit import RankCommit
        from .thread import ThreadBackend

        persister: Any = self.checkpointer if self._run_id is None else RankCommit(
            self.checkpointer, run_id=self._run_id, timeout=self.async_config.commit_timeout, peers=self._hosts)
        if isinstance(persister, RankCommit):
            for step, problem in orphaned:  # rank 0's commit must not wait commit_timeout for these parts
                persister.report_lost(step, problem)
        self._backend = ThreadBackend(persister, len(self._slots), self._done, self._copier)
        return True

    def _submit(self, slot: _Slot, *, pin: bool, reason: str | None) -> None:
        limit = self.async_config.max_in_flight
        with self._cond:
            self._wait_until(lambda: self._in_flight < limit)
            slot.in_flight = True
            self._in_flight += 1
        try:
            self._backend.submit(slot.index, slot.seq, slot.step, pin, reason)
        except BaseException:
            with self._cond:
                slot.in_flight = False
                self._in_flight -= 1
                self._cond.notify_all()
            raise

    def _wait_until(self, predicate: Callable[[], Any]) -> Any:
        """Wait (holding ``_cond``) until ``predicate()`` is truthy; fail if the backend died."""
        while not (value := predicate()):
            self._cond.wait(timeout=1.0)
            problem = self._backend.problem()
            if problem and self._saver_lost():  # in flight: said and replaced by _replace_lost_saver
                self._orphan_in_flight(problem)
                raise CheckpointError(problem)
            if problem and self._in_flight:
                self._fail_in_flight(problem)
            elif problem:
                raise CheckpointError(problem)
        return value

    def _saver_lost(self) -> bool:
        """A crash-safe saver died while this trainer lives (``_replace_lost_saver`` replaces it)."""
        return self.async_config.crash_safe and not self._closed and bool(getattr(self._backend, "_lost", None))

    def _orphan_in_flight(self, problem: str) -> None:
        """The saves in flight died with the saver (holding ``_cond``): set aside to be said, and
        told to rank 0, by ``_replace_lost_saver``; ``wait`` raises them."""
        self._orphaned += [(s.step, problem) for s in self._slots if s.in_flight]
        for s in self._slots:
            s.in_flight = False
        self._in_flight = 0
        self._cond.notify_all()

    # ------------------------------------------------------------------ completion (worker side)
    def _done(self, seq: int, step: int, error: BaseException | str | None, seconds: float) -> None:
        with self._cond:
            if seq < 0:  # the backend is gone: everything in flight failed
                if self.async_config.crash_safe and not self._closed:
                    # the saver died, the trainer lives: said, and replaced, by the loop's next
                    # call (_replace_lost_saver); only wait() raises it (an exit's save is lost)
                    self._orphan_in_flight(str(error))
                else:
                    self._fail_in_flight(str(error))
                return
            slot = next((s for s in self._slots if s.seq == seq and s.in_flight), None)
            if slot is not None:
                slot.in_flight = False
                slot.durable = error is None
                self._in_flight -= 1
            if error is None:
                self._wait_failed = False  # a durable save since: a failed exchange is news again
                self.last_persist_seconds = seconds
                self.last_durable_step = step if self.last_durable_step is None else max(step, self.last_durable_step)
                if self.async_config.on_error == "warn":
                    self._error = None  # superseded by a durable save
            else:
                self._record(step, error)
            self._cond.notify_all()

    def _fail_in_flight(self, problem: str) -> None:
        for s in self._slots:
            if s.in_flight:
                s.in_flight = False
                self._record(s.step, problem)
        self._in_flight = 0
        self._cond.notify_all()

    def _record(self, step: int, error: BaseException | str) -> None:
        err = CheckpointError(f"background save of checkpoint step {step} failed: {error}")
        if isinstance(error, BaseException):
            err.__cause__ = error
        if self._error is not None:
            log.error("%s (an earlier failure is still unreported: %s)", err, self._error)
        else:
            log.warning("%s", err)
        self._error = self._error or err

    def _raise_pending(self, *, final: bool = False) -> None:
        err = self._error
        if err is None or (self.async_config.on_error == "warn" and not final):
            return
        self._error = None
        self._wait_failed = True
        raise err

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.checkpointer.root} is closed")

    # ------------------------------------------------------------------ delegated
    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """``Checkpointer.load`` once every save is durable: any world size, strict (see there)."""
        self.wait()
        return self.checkpointer.load(state, step)

    @property
    def loaded(self) -> CheckpointInfo | None:
        """The checkpoint the last ``load`` restored (its ``world_size`` is the saving run's)."""
        return self.checkpointer.loaded

    def list(self) -> list[CheckpointInfo]:
        return self.checkpointer.list()

    def validate(self, path: str | os.PathLike[str], checksums: bool = False) -> CheckpointInfo:
        return self.checkpointer.validate(path, checksums=checksums)

    def buffers(self, slot: int = 0) -> builtins.list[Any]:
        """The host buffers of ``slot`` (tests check their identity stays the same across saves)."""
        return self._backend.buffers(slot)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait until every accepted save is durable, then stop the worker/saver. Raises a failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            atexit.unregister(self._at_exit)
            self._backend.close()
            self.checkpointer.close()
            # Let go of the snapshots and anything a failure's traceback holds (tensors, the
            # process group): torch must not meet them first during interpreter shutdown.
            self._slots = []
            self._newest = None
            self._error = None

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:
            log.error("checkpoint manager closed at interpreter exit: %s", exc)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    background = True
    """Saves persist after ``save`` returns (see :class:`CheckpointManager`)."""
