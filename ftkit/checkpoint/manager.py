"""The default CheckpointManager: snapshot, commit, validated resume, retention.

Commit protocol of one save (``persist``):

1. rank 0 creates ``step-NNNNNNNN/`` with the ``checkpoint-is-incomplete`` sentinel in it
   (and the ``pinned`` marker if asked);
2. every rank writes ``rank-RRRRR.pt`` through a CRC-32-computing writer and fsyncs it;
   with several ranks, model and optimizer shards go through DCP into ``dcp/``;
3. ranks all-gather their file names, sizes and checksums (any failure fails all ranks);
4. rank 0 writes ``manifest.json`` (temp file, fsync, ``os.replace``), removes the sentinel,
   fsyncs the directory, points ``latest`` at it (a hint only; temp file, fsync,
   ``os.replace``) and fsyncs the root. Until the manifest is durable the directory is
   incomplete (no manifest, or the sentinel), after a crash of the process or of the machine
   alike, so nothing is fsynced before the data; five fsyncs per save with one rank.
5. rank 0 applies retention; every rank returns after a final agreement.

Stages 1, 4 and 5 are the commit protocol every write path shares (:mod:`ftkit.checkpoint.format.commit`, through
``self.commits``); this module writes the parts (2) and gathers them (3).
"""

from __future__ import annotations

import builtins
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, NoCheckpointError, out_of_memory
from .comm import Comm
from .config import CheckpointConfig, CheckpointInfo
from .format.commit import Committer, save_error
from .format.layout import DCP_DIR, list_step_dirs, rank_file, step_name
from .format.manifest import known_broken, validate_dir, verify_files, verify_share
from .format.pins import pin_checkpoint
from .io.statefile import (
    WriteProgress,
    parse_state_file,
    read_state_bytes,
    read_state_file,
    read_state_into,
    write_state_file,
)
from .protocol import CheckpointManager
from .state.keys import check_missing, describe_rule, is_dcp, match_keys, refusal
from .state.restore import (
    SetAside,
    group_settings,
    key_mismatches,
    live_targets,
    misfit,
    on_gpu,
    own_tensors,
    plain_mismatches,
    reachable_tensors,
    restore_state,
    scheduler_mismatches,
    settings_replaced,
    shape_mismatches,
)
from .state.snapshot import Snapshot, derive_rng, is_dtensor, restore_rng, take_snapshot, unsavable

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)

# a rank's problem that fails the load on every rank (raised: a refusal to load it, a read that
# failed not for the file's sake), not a broken file (skipped)
_REFUSED = "\x00refused\x00"


def _local_ranks(world_size: int) -> int:
    """How many ranks this host runs, at most: torchrun's ``LOCAL_WORLD_SIZE``, else all."""
    try:
        return min(world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return world_size


def _first_on_host(rank: int, world_size: int) -> bool:
    """Whether ``rank`` is its host's first: torchrun's ``LOCAL_RANK`` (else srun's
    ``SLURM_LOCALID``) is 0; without either, ranks placed on hosts in order of
    :func:`_local_ranks` (all on one host where that is unknown)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        try:
            return int(os.environ[name]) == 0
        except (KeyError, ValueError):
            continue
    return rank % max(1, _local_ranks(world_size)) == 0


# a rank's modules and optimizers (the most of every rank's counts): unknown where a rank had
# no need to look (another rank's need then takes the careful way)
_FITS, _PLAIN, _SHARDED, _UNKNOWN = 0, 1, 2, 3


def _holds_dtensors(state: Mapping[str, Any]) -> bool:
    """Whether a module of ``state`` has DTensor parameters or buffers (FSDP2's)."""
    import torch

    return any(is_dtensor(t) for v in state.values() if isinstance(v, torch.nn.Module)
               for t in (*v.parameters(), *v.buffers()))


def _fit(state: Mapping[str, Any], world_size: int) -> int:
    """Whether ``state``'s modules and optimizers are plain tensors in host memory with room to
    set them aside (:meth:`SetAside.fits`), plain tensors elsewhere, or shards."""
    if SetAside.fits(state, _local_ranks(world_size)):
        return _FITS
    return _PLAIN if SetAside.plain(state) else _SHARDED


def _holds_corrupt(damaged: Path, what: str, root: Path) -> str:
    """Why a load stops with part of the corrupt checkpoint ``damaged`` in the live state."""
    return (f"{damaged} was found corrupt while it was read into the live state, and {what}: this run cannot "
            f"go on from a state that holds part of a corrupt checkpoint. Move {damaged} out of {root} and start "
            "again (the state is then loaded from the one before it, as initialised where that one has nothing)")


def _reshard(state: Mapping[str, Any]) -> None:
    """Reshard every FSDP2 module of ``state`` before a load looks at its parameters. After a
    forward FSDP2 leaves a module's unsharded parameters registered (the root's, by default)
    and frees them at the module's next ``state_dict`` call (its pre-hook reshards): a load
    that saw plain tensors there would write into memory that is gone by then (a segfault),
    and would take the model for a replicated one. Resharded, its parameters are the shards
    DCP's helpers load into, as before the first forward."""
    import torch

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # torch 2.4 and 2.5 keep it here
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:  # a torch without FSDP2
            return
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for module in value.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


class _EarlyRead:
    """A DCP checkpoint's read begun before the ranks agreed to load it (:meth:`Checkpointer._start_read`):
    its streaming reader, this rank's state file parsed and the state keys the checkpoint holds,
    or the problem met reading them."""

    def __init__(self, reader: Any, name: str, own: bool) -> None:
        self.reader = reader
        self.name, self.own = name, own  # the state file this rank loads, and whether it is its own
        self.payload: dict[str, Any] = {}
        self.available: set[str] = set()
        self.problem = ""

    def close(self) -> None:
        """Stop a read the load never took (a refused load), and free the state file's payload."""
        self.reader.close()
        self.payload = {}


class Checkpointer(CheckpointManager):
    """Default :class:`~ftkit.checkpoint.CheckpointManager`; saves synchronously.

    ``save`` = ``take_snapshot`` (copy into CPU memory) + ``persist`` (the commit protocol),
    so an asynchronous manager can run ``persist`` in the background.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        events: Any = None,
        rank: int = 0,
        world_size: int = 1,
        process_group: Any = None,
        clock: Callable[[], float] = time.time,
        bounce: bool = False,
    ) -> None:
        self.config = config
        self.bounce = bounce
        """Direct writes stage every byte (``write_state_file(bounce=)``): the crash-safe saver's,
        whose snapshots lie in tmpfs pages that may be scattered in physical memory."""
        self.events = events
        self.rank = rank
        self.world_size = world_size
        self.comm = Comm(rank=rank, world_size=world_size, process_group=process_group)
        self.commits = Committer(config, rank=rank, world_size=world_size, clock=clock, emit=self._emit)
        """The commit protocol of this manager's root (:mod:`ftkit.checkpoint.format.commit`): every save commits through it."""
        self._closed = False
        self.loaded: CheckpointInfo | None = None
        """The checkpoint the last ``load`` restored (its ``world_size`` is the saving run's)."""
        self._written: dict[str, list[Any] | None] = {}
        """The live tensors the last ``_try_load`` read a file straight into, by key of the state
        (None: any tensor under that key, a DCP load's)."""
        self._covered: tuple[set[str], set[int]] = (set(), set())
        self._passed_broken = False  # the last load skipped a checkpoint that looked complete (_load)
        """What the last ``_try_load`` with ``cover`` restored: keys wholly, and the addresses of
        the other live tensors it wrote."""

    @property
    def root(self) -> Path:
        return self.config.root

    # ------------------------------------------------------------------ save
    def save(
        self, step: int, state: Mapping[str, Any], *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo:
        """Save ``state`` as checkpoint ``step``; returns it once committed (valid) on every rank."""
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.root} is closed")
        self.comm.check()
        return self.persist(self.take_snapshot(state), step, pin=pin, reason=reason)

    def take_snapshot(self, state: Mapping[str, Any]) -> Snapshot:
        """Copy ``state`` and the RNG states into CPU memory (stage 1 of a save)."""
        began = time.monotonic()
        if not self.comm.distributed:
            snap = take_snapshot(state)
        else:
            from .dcp import sharded_keys, snapshot_sharded

            keys = sharded_keys(state)
            snap = take_snapshot(state, exclude=keys)
            snap.sharded, nbytes = snapshot_sharded(state, keys)
            snap.nbytes += nbytes
        snap.seconds = time.monotonic() - began
        return snap

    def set_aside_fork(self) -> None:
        """Before this run's first save or snapshot after a load of a step by number (or a fresh
        start): the root's later checkpoints go aside (:meth:`Committer.set_aside_fork`), on
        rank 0, every rank waiting for it and raising if it failed. Every rank calls it (the
        trainer's main thread, before anything of the save is written or handed over)."""
        if self.commits.forked:
            self.comm.on_rank0(self.commits.set_aside_fork, f"setting aside later checkpoints in {self.root}")
            self.commits.unfork()

    def persist(
        self, snapshot: Snapshot, step: int, *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo:
        """Write ``snapshot`` as checkpoint ``step`` with the full commit protocol (stage 2)."""
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        self.set_aside_fork()
        commits = self.commits
        started = time.monotonic()
        progress = WriteProgress()
        with commits.saving(step) as path:
            try:
                existing = self.comm.on_rank0(lambda: commits.prepare(step, pin=pin), f"preparing {path}")
                if existing is not None:
                    return existing
                files = self._write_parts(snapshot, path, progress)
                info = self.comm.on_rank0(
                    lambda: commits.commit(step, files, pin=pin, reason=reason), f"committing {path}"
                )
            except CheckpointError as exc:
                commits.abandon(step, exc, reason=reason)
                raise
            except OSError as exc:
                err = save_error(exc, step, path, progress, snapshot.nbytes)
                commits.abandon(step, err, reason=reason)
                raise err from exc
            except Exception as exc:  # a bug, rank 0's failure re-raised as it was: still recorded
                commits.abandon(step, exc, reason=reason)
                raise
        # from the start of the save: the snapshot's capture and copies too (an FSDP gather, a
        # slow state_dict), as the time budget and a pod's grace period must count them
        commits.committed(info, seconds=snapshot.seconds + time.monotonic() - started, reason=reason)
        self.comm.barrier()
        return info

    def _write_parts(
        self, snapshot: Snapshot, path: Path, progress: WriteProgress
    ) -> dict[str, dict]:
        name = rank_file(self.rank)
        meta = {"rank": self.rank, "world_size": self.world_size}
        problem: str | None = None
        files: dict[str, dict] = {}
        try:
            files[name] = write_state_file(
                path, name, {**snapshot.local, **meta}, sync=self.config.fsync, progress=progress,
                direct=self.config.direct_io, bounce=self.bounce,
            )
        except OSError as exc:
            if not self.comm.distributed:
                raise
            problem = str(save_error(exc, -1, path, progress, snapshot.nbytes))
        self.comm.all_ok(problem, f"saving {path}")
        if self.comm.distributed:
            from .dcp import save_sharded

            try:
                files.update(
                    save_sharded(snapshot.sharded, path, pg=self.comm.pg, sync=self.config.fsync)
                )
            except Exception as exc:  # DCP raises CheckpointException on every rank
                raise CheckpointError(
                    f"could not save sharded state to {path / DCP_DIR}: {exc}"
                ) from exc
        merged: dict[str, dict] = {}
        for part in self.comm.gather(files):
            merged.update(part)
        return merged

    # ------------------------------------------------------------------ load
    def load(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Restore the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step, or None for a fresh start. Honours ``config.resume``.
        Invalid checkpoints are skipped, newest first, each with a warning and a ``skip`` event.
        """
        problem = unsavable(state)  # refused now, not at the first save (the steps since lost)
        if problem:
            raise ConfigError(problem)
        self.commits.unfork()  # the last load decides where this run goes on from
        if step is None and self.config.resume == "never":
            self._say("ftkit resume: checkpoint.resume is 'never': starting fresh")
            self.commits.fork(None)  # the root's checkpoints are another history's
            return None
        began = time.monotonic()  # the load event splits finding/validating from reading
        self.comm.check()
        import torch

        # a DCP load gives an optimizer without state (a requeued job's, before its first step)
        # state to read into (dcp.fresh_state, else DCP's zeros): a load that fails takes it away again
        fresh = [v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state]
        _reshard(state)
        settings = group_settings(state)  # the script's, before the checkpoint's replace them
        try:
            restored = self._load(state, step, began)
            if step is not None:  # a step asked for: a history goes on from it (later ones go aside)
                self.commits.fork(step)
            elif self._passed_broken:
                # fell back past checkpoints that look complete but are not (a corrupt file): this
                # run goes on from the older one, so they go aside before its first save, as for a
                # step asked for; else its save of such a step would take the broken one for its
                # own ("already exists and is valid") and retention would count it as good
                self.commits.fork(restored, broken=True)
            if restored is not None and self.rank == 0:
                replaced = settings_replaced(settings, state)
                if replaced:
                    log.warning(
                        "%s: the optimizer settings saved in it replace the script's: %s. Torch's "
                        "load_state_dict restores the saved param groups; to change one on resume, set it after "
                        "the load (for g in optimizer.param_groups: g['weight_decay'] = ...; a learning rate "
                        "under a scheduler also in scheduler.base_lrs)", self.loaded.path if self.loaded else
                        restored, "; ".join(replaced))
                    self._emit("settings-replaced", step=restored, settings=replaced)
            return restored
        except BaseException:
            for optimizer in fresh:
                optimizer.state.clear()
            raise

    def _load(self, state: Mapping[str, Any], step: int | None, began: float) -> int | None:
        """``load``'s candidates, newest first: each validated, agreed on and loaded, or skipped."""
        if step is None:
            candidates = [p for _, p in list_step_dirs(self.root)]
        else:
            candidates = [self.root / step_name(step)]
        skipped: list[str] = []
        self._passed_broken = False  # a newer checkpoint skipped that looked complete (corrupt, invalid)
        damaged: Path | None = None  # a corrupt checkpoint read into the live tensors
        held: dict[str, list[Any]] = {}  # the live tensors that hold its bytes, by key of the state
        for i, path in enumerate(candidates):
            # straight into the live tensors only with an older checkpoint to overwrite them
            # if this one turns out corrupt during the read
            direct = step is None and any(validate_dir(p).valid for p in candidates[i + 1 :])
            info = validate_dir(path)  # read once here: each step below works from it
            # how every rank's modules and optimizers lie (see below), and whether every rank
            # has an older checkpoint: one collective, every rank, whatever its own validation
            # said, so that the ways below are the same on every rank (a filesystem may show one
            # node an older checkpoint late; ``damaged`` is the same on every rank, see below)
            needed = info.valid and (not direct if is_dcp(info.files) else self.comm.distributed)
            fit = _fit(state, self.world_size) if needed else _UNKNOWN
            # a rank with an older checkpoint reads this one straight in, as every rank does when
            # every rank has one (nearly always): it checks its part and starts reading before
            # that collective, which then also says whether any rank found a problem (one
            # collective where two were, and its small reads overlap it). Nothing of the read
            # reaches the live state before the ranks agree (``_start_read``)
            early: _EarlyRead | None = None
            ahead = ""  # this rank's problem, found ahead of the collective
            try:
                if direct:
                    ahead = self._check_here(path, info, streamed=True)
                    early = self._start_read(path, info) if not ahead else None
                    ahead = ahead or self._early_problem(state, path, early)
                level, alone, flagged = self.comm.most(fit, not direct, bool(ahead))
            except BaseException:
                if early is not None:
                    early.close()
                raise
            direct, clean = not alone, damaged is None
            if early is not None and not direct:  # some rank has no older checkpoint: read as the others do
                early.close()
                early = None
            # else (the only checkpoint, or the step asked for) straight in too where the reader
            # can undo it (a state file): what it overwrites is set aside on the way and put back
            # if the file turns out corrupt (a fresh start follows, or an error)
            guarded = not direct and clean and info.valid and not is_dcp(info.files)
            # a DCP checkpoint (one process or several ranks): its files are checked first (with
            # several ranks, each by the rank that reads it; through the page cache), and only
            # then streamed into the live tensors from there; should a file differ on that second
            # read, the state holds its bytes
            checked = not direct and clean and self.config.verify_on_load and info.valid and is_dcp(info.files)
            # ... unless every rank's modules and optimizers live in host memory: then each rank
            # reads in one pass as with an older checkpoint, setting aside each part of them just
            # before it writes over it, and puts them back should any rank find a file corrupt
            # (or the load fail)
            aside = checked and level == _FITS
            checked = checked and not aside
            # several ranks, a one-process checkpoint (a requeue onto more ranks): each rank reads
            # the state file whole into its live tensors as one process does, where every rank's
            # modules and optimizers are plain tensors (each rank holds all of them, as with DDP;
            # not shards, which DCP's reshards). With nothing older, the file is checked first
            # (by the first rank of each host, through the page cache that the host's ranks then
            # read it from) and read straight in once every rank agreed on it: no copy of the
            # live state is set aside
            replicated = self.comm.distributed and info.valid and not is_dcp(info.files) and level <= _PLAIN
            first = replicated and not direct and clean and self.config.verify_on_load and level == _PLAIN
            whole = replicated and (direct or first or (guarded and level == _FITS))
            checked = checked or first
            guarded = guarded and not first and (whole or not self.comm.distributed)
            self._written = {}  # what this candidate's _try_load reads into, if it runs
            if not direct:
                problem = self._check_here(path, info, streamed=aside, whole=first)
                early = (self._start_read(path, info, cached=checked)
                         if (checked or aside) and not problem else None)
            kept: SetAside | None = None
            ran = False  # the read began, on every rank (the problems before it agreed on)
            try:
                if direct:  # whether any rank has a problem: said by the collective above
                    problem = self._agree(ahead, flagged=bool(flagged))
                else:
                    problem = self._agree(problem or self._early_problem(state, path, early))
                found = time.monotonic()
                try:
                    if problem.startswith(_REFUSED):  # a key some rank's state has and the checkpoint not
                        raise CheckpointError(problem[len(_REFUSED):])
                    if not problem:
                        ran = True
                        if aside and early is not None:  # what the reader writes over, set aside as it goes
                            kept = SetAside(state)
                            early.reader.guard = kept.guard
                            kept.by(early.reader.undo)
                        elif whole and guarded:  # what each rank's reader wrote over, kept until all agree
                            kept = SetAside(state)
                        problem = self._try_load(state, path, info, into_live=direct or checked or aside,
                                                 early=early, cover=damaged is not None, undo=guarded,
                                                 whole=whole, keep=kept.by if kept is not None else None,
                                                 cached=first)
                        if problem and kept is not None:
                            kept.undo()  # every rank skips it: the state is as it was
                            self._written = {}
                except Exception as exc:  # a refusal, a restore that fails: the state keeps the corrupt bytes
                    if kept is not None:
                        kept.undo()
                    if damaged is None:
                        raise
                    raise CheckpointError(_holds_corrupt(damaged, f"loading {path} instead failed ({exc})",
                                                         self.root)) from exc
                # a corrupt checkpoint's bytes in some rank's live tensors: every rank knows (each
                # then asks whether the one loaded instead overwrote them, a collective)
                if problem and ran and (direct or checked) and self.comm.anyone(bool(self._written)):
                    damaged = damaged or path
                    for key, tensors in self._written.items():
                        held.setdefault(key, []).extend(
                            reachable_tensors(state.get(key)) if tensors is None else tensors)
                elif not problem and damaged is not None:
                    left = self.comm.first_problem(self._left_over(state, held))
                    if left:
                        raise CheckpointError(_holds_corrupt(
                            damaged, f"{path}, loaded instead, does not overwrite all of it: {left} still "
                            f"hold its bytes ({path.name} lacks them)", self.root))
            finally:
                if early is not None:
                    early.close()  # a read it started and the load never took (a refused load)
            if not problem:
                self.loaded = info
                restored, read = int(self.loaded.step), time.monotonic() - found
                self._say("ftkit resume: step %d from %s (written by %s rank(s), read in %.2f s)", restored, path,
                          info.world_size or "?", read)
                self._emit("load", step=restored, path=str(path),
                           saved_world_size=self.loaded.world_size, world_size=self.world_size,
                           find_seconds=round(found - began, 6), read_seconds=round(read, 6))
                return restored
            skipped.append(f"{path.name}: {problem}")
            if known_broken(problem):  # agreed: the same on every rank (not this rank's own validation)
                self._passed_broken = True
            # every rank skips it for the same (agreed) problem: said once (rank 0), as where the
            # run goes on from is, not once per rank of a 512-rank job
            log.log(logging.WARNING if self.rank == 0 else logging.INFO, "skipping checkpoint %s: %s",
                    path, problem.removeprefix(f"{path}: "))  # path once
            self._emit("skip", step=info.step, path=str(path), reason=problem)
        if step is not None and damaged is not None:  # not "no checkpoint": the state is not as it was
            raise CheckpointError(
                f"{damaged}, the step asked for, was found corrupt while it was read into the live state "
                f"({skipped[0]}): this run cannot go on from a state that holds part of a corrupt checkpoint. "
                "Load another step into a fresh state, or restore that step directory"
            )
        if step is not None:
            raise NoCheckpointError(
                f"checkpoint step {step} in {self.root} cannot be loaded: {skipped[0]}"
            )
        if damaged is not None:
            raise CheckpointError(
                f"{damaged} was found corrupt while it was read into the live state, and no older "
                f"checkpoint in {self.root} could be loaded to overwrite it (skipped: {'; '.join(skipped)}): "
                "this run cannot start fresh from a state that holds part of a corrupt checkpoint. Move the "
                f"broken step directories out of {self.root} and start again (a fresh start), or restore them"
            )
        if self.config.resume == "required":
            detail = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            raise NoCheckpointError(
                f"checkpoint.resume is 'required' but there is no valid checkpoint in {self.root}{detail}"
            )
        self._say("ftkit resume: no valid checkpoint in %s: starting fresh", self.root)
        return None

    def _say(self, message: str, *args: Any) -> None:
        """Where this run goes on from, in the job's log: rank 0 logs it as a warning (a default
        ``logging`` set-up shows warnings only, as ftkit's decisions; a requeued job's output
        then says whether it resumed, from which step, or started over), the other ranks at
        INFO. The record carries ``ftkit_notice`` (routine, not a problem) for handlers that
        colour by level."""
        log.log(logging.WARNING if self.rank == 0 else logging.INFO, message, *args, extra={"ftkit_notice": True})

    def _check_here(self, path: Path, info: CheckpointInfo, *, streamed: bool = False, whole: bool = False) -> str:
        """This rank's part of validating ``path``: sizes, and the checksums of what is not
        checked as it is read (a state file is; the DCP files are when ``streamed``, by the
        rank that reads each, ``.metadata`` by each rank as it reads it): one process checks
        every DCP file, several ranks share the files out. ``whole`` (several ranks each read
        one process's state file whole): the first rank of each host checks that file too,
        so a host served other bytes than another finds them here, before any are read in.
        Read before any bulk read queues on the device, through the page cache (a load reads
        them from there next)."""
        if info.status == "unreadable":  # not known to be bad: no falling back past it unseen
            return _REFUSED + (f"checkpoint {path}: {info.reason}" +
                               (f" (rank {self.rank})" if self.comm.distributed else ""))
        if not info.valid:
            return f"{info.status}: {info.reason}"
        if not self.config.verify_on_load:
            return ""
        if not self.comm.distributed:
            if streamed:
                return ""
            return verify_files(path, info.files, [n for n in sorted(info.files) if n.startswith(f"{DCP_DIR}/")],
                                cache=True)
        skip = [n for n in info.files if n.startswith("rank-")  # checked as they are read
                or (streamed and n.startswith(f"{DCP_DIR}/"))]
        mine = verify_share(info.files, self.rank, self.world_size, skip=skip)
        if whole and _first_on_host(self.rank, self.world_size):  # read whole by every rank, checked on every host
            mine.append(self._state_file(info, path)[0])
        return verify_files(path, info.files, mine, cache=True)

    def _agree(self, problem: str, flagged: bool | None = None) -> str:
        """The first rank's problem with the checkpoint, the same on every rank (``flagged``:
        whether any rank has one, where a collective said so already)."""
        return self.comm.first_problem(problem, flagged=flagged)

    def _early_problem(self, state: Mapping[str, Any], path: Path, early: _EarlyRead | None) -> str:
        """This rank's problem with ``early`` (:meth:`_start_read`): its read's, else its
        refusal of the keys it found; "" with no early read."""
        if early is None:
            return ""
        return early.problem or self._refusal(state, early.available, path, early.payload.get("state"))

    def _state_file(self, info: CheckpointInfo, path: Path) -> tuple[str, bool]:
        """The state file this rank loads, and whether it is its own (else rank 0's)."""
        name = rank_file(self.rank)
        if name in info.files:
            return name, True
        if self.rank < int(info.world_size or 1):
            log.warning("%s has no %s although saved by %d ranks; using rank 0's", path, name, info.world_size)
        return rank_file(0), False

    def _start_read(self, path: Path, info: CheckpointInfo, *, cached: bool = False) -> _EarlyRead | None:
        """A DCP checkpoint read straight into the live tensors starts before the ranks agree
        that it is valid: this rank's state file is read (a small read), its own DCP file starts
        streaming (:meth:`ftkit.checkpoint.dcp_reader.StreamingReader.prefetch`), and while it
        streams the state file is parsed and the checkpoint's keys read from DCP's metadata, so
        one agreement covers all of it and DCP's planning overlaps the bulk read. Nothing
        reaches the live state before the load is agreed. None for other checkpoints.
        ``cached``: the files were just checked through the page cache, and are read from
        there (not with ``O_DIRECT``, which would read them from the disk again)."""
        if not is_dcp(info.files):
            return None
        from .dcp import saved_keys
        from .dcp_reader import StreamingReader

        reader = StreamingReader(path / DCP_DIR, info.files, verify=self.config.verify_on_load,
                                 direct=False if cached else self.config.direct_io, rank=self.rank,
                                 world_size=self.world_size if self.comm.distributed else 1,
                                 shared=_local_ranks(self.world_size) > 2)
        early = _EarlyRead(reader, *self._state_file(info, path))
        try:
            state_file = read_state_bytes(path, early.name, info.files[early.name],
                                          verify=self.config.verify_on_load, direct=self.config.direct_io)
            reader.prefetch()  # after the small read above, which would queue behind its bulk
            early.payload = parse_state_file(path / early.name, state_file)
            early.available = set(early.payload["state"]) | saved_keys(path, reader)
        except Exception as exc:  # this rank's problem: every rank skips the checkpoint (none may hang)
            early.problem = str(exc) or type(exc).__name__
            if out_of_memory(exc):  # not the files' doing: the load fails on every rank (nothing set aside)
                early.problem = _REFUSED + (f"could not read {path / early.name}: "
                                            f"{f'rank {self.rank}: ' if self.comm.distributed else ''}"
                                            f"{type(exc).__name__}: {exc}")
        return early

    def _refusal(self, state: Mapping[str, Any], available: set[str], path: Path,
                 saved: Mapping[str, Any] | None = None) -> str:
        """This rank's refusal of ``path`` (:func:`ftkit.checkpoint.state.keys.refusal`; with its
        state file's ``saved`` state, a scheduler of another kind too) as a problem for the ranks
        to agree on (marked, and naming the rank where there are several)."""
        text = refusal(state, available, self.config, path)
        if not text and isinstance(saved, Mapping):
            schedulers = scheduler_mismatches(state, saved)
            text = misfit(path, schedulers) if schedulers else ""
        if not text:
            return ""
        return _REFUSED + (f"rank {self.rank}: {text}" if self.comm.distributed else text)

    def _left_over(self, state: Mapping[str, Any], held: Mapping[str, list[Any]]) -> str:
        """Which of ``held`` (live tensors a corrupt file was read into) the last ``_try_load``
        (with ``cover``) left as they were, though the state still holds them: "" if none."""
        whole, written = self._covered
        left = []
        for key, tensors in held.items():
            if key in whole:
                continue
            alive = {t.data_ptr() for t in reachable_tensors(state.get(key))}
            n = len({t.data_ptr() for t in tensors} & alive - written)
            if n:
                left.append(f"state[{key!r}] ({n} tensor{'s' if n != 1 else ''})")
        return ", ".join(left)

    def _try_load(self, state: Mapping[str, Any], path: Path, info: CheckpointInfo, *, into_live: bool = False,
                  early: _EarlyRead | None = None, cover: bool = False, undo: bool = False, whole: bool = False,
                  keep: Callable[[Callable[[], None]], None] | None = None, cached: bool = False) -> str:
        """Load ``path`` (``info``: its validation) into ``state`` on any number of ranks
        (``state.keys``'s world-size rule).

        Returns a problem with the files (the checkpoint is skipped); a key of the state the
        checkpoint lacks raises (``state.keys``'s strictness rule), before anything is restored.
        ``into_live`` (one process, a state file; a DCP checkpoint through the
        :class:`ftkit.checkpoint.dcp_reader.StreamingReader` of ``early``, :meth:`_start_read`):
        the file's tensors are read straight into the live tensors that take them
        (:func:`ftkit.checkpoint.io.statefile.read_state_into`), so a corrupt file leaves its
        bytes there; ``_written`` says where. ``cover``: note in ``_covered`` what the load
        restored, for a corrupt file's bytes it must overwrite (``_left_over``). ``undo`` (a state
        file): read straight into the live tensors too, but a corrupt file leaves them as they
        were (``read_state_into``'s ``undo``). ``whole`` (several ranks, a one-process state file,
        each rank's modules and optimizers plain tensors): each rank reads and restores it as
        one process does; ``keep`` (with ``undo``): what its reader set aside, registered there
        to put back should another rank fail. ``cached``: the state file was just checked on
        this host through the page cache, and is read from there.
        """
        self._written = {}
        sharded = is_dcp(info.files)
        name, own = (early.name, early.own) if early is not None else self._state_file(info, path)
        reader = early.reader if early is not None else None
        if early is not None:  # read, parsed and agreed on before (_start_read, load)
            payload, available = early.payload, early.available
        else:
            problem = ""
            payload, available = {}, set()
            try:
                payload = self._read(state, path, info, name, into_live=into_live, undo=undo, whole=whole,
                                     keep=keep, cached=cached)
                available = set(payload["state"])
                if sharded:
                    from .dcp import saved_keys

                    available |= saved_keys(path)
            except (CheckpointError, KeyError, OSError, ValueError) as exc:
                problem = str(exc)
            except Exception as exc:  # not the file's doing (memory, a device): fails the load on every rank
                if not self.comm.distributed:
                    raise
                problem = _REFUSED + f"could not read {path / name}: rank {self.rank}: {type(exc).__name__}: {exc}"
            # one problem for every rank: a broken file is skipped, a key the checkpoint lacks
            # refused (on every rank, also where only some ranks' states have it)
            problem = self.comm.first_problem(problem or self._refusal(state, available, path, payload.get("state")))
            if problem.startswith(_REFUSED):
                raise CheckpointError(problem[len(_REFUSED):])
            if problem:
                return problem
        # a failure to restore (the state's, not the file's) on any rank fails the load on every
        # rank, naming it: none trains on alone or hangs in the next collective
        failure, cause = "", None
        try:
            problem = self._restore_into(state, path, info, payload, available, name, own, reader, cover=cover,
                                         whole=whole)
        except Exception as exc:
            if not self.comm.distributed:
                raise
            problem, cause = "", exc
            failure = str(exc) if isinstance(exc, CheckpointError) else (
                f"could not restore {path} into the state: rank {self.rank}: {type(exc).__name__}: {exc}")
        if self.comm.distributed:
            failure = self.comm.first_problem(failure)
            if failure:
                raise CheckpointError(failure) from cause
        return problem

    def _restore_into(self, state: Mapping[str, Any], path: Path, info: CheckpointInfo, payload: dict[str, Any],
                      available: set[str], name: str, own: bool, reader: Any, *, cover: bool,
                      whole: bool = False) -> str:
        """``_try_load``'s restore of ``payload`` (read from ``path``'s ``name``, this rank's
        ``own`` state file or rank 0's; ``reader``: its DCP files' streaming reader, if any)
        into ``state`` (``whole``: as one process restores it). Returns a corrupt file found
        during DCP's read ("" once restored)."""
        saved_world = int(info.world_size or 1)
        sharded = is_dcp(info.files)
        if self.rank == 0 and saved_world != self.world_size:
            log.warning("%s", describe_rule(path, saved_world, self.world_size))
        unused = sorted(k for k in available if k not in state)
        if unused and self.rank == 0:  # removed from the script since? (a key it lacks is refused)
            names = ", ".join(f"state[{k!r}]" for k in unused)
            log.warning("checkpoint %s has %s, which this run's state has no key for: not restored (removed from "
                        "the training script since?)", path, names)
            self._emit("unused-state", step=info.step, path=str(path), keys=unused)
        allowed = check_missing(state, available, self.config, path, self._emit, info.step)
        import torch

        live = {k: v for k, v in state.items() if k not in allowed}
        rest: dict[str, Any] = live
        saved = payload["state"]
        keys: list[str] = []
        # DTensors (FSDP2, even on one process) are set through DCP's state-dict API, which
        # shards the full tensors of a one-process checkpoint into them
        if sharded or (self.comm.distributed and not whole) or _holds_dtensors(live):
            from .dcp import load_full, load_sharded, sharded_keys

            keys = sharded_keys(live)
            misfits = plain_mismatches({k: v for k, v in live.items() if k not in keys}, saved)
            if misfits:  # the per-rank rest, found before DCP sets anything
                raise CheckpointError(misfit(path / name, misfits))
            if reader is not None:
                self._written = dict.fromkeys(keys)
            try:
                if sharded:  # each rank reads its part alone; the ranks agree before it is set
                    load_sharded(live, keys, path, reader=reader,
                                 agree=(lambda failed: self._agree_read(failed, path / DCP_DIR))
                                 if self.comm.distributed else None,
                                 common=functools.partial(self._common, by_entry=reader is not None
                                                          and self.config.verify_on_load)
                                 if self.comm.distributed else None)
                else:  # a one-process checkpoint: every rank reads the full state dicts
                    load_full(live, keys, payload["state"], str(path / name))
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                from .dcp_reader import corrupt_file_in

                corrupt = corrupt_file_in(exc) if reader is not None else None
                if corrupt is not None:  # found during the one read (every rank gets it from DCP)
                    return str(corrupt)
                from torch.distributed.checkpoint.api import CheckpointException

                if isinstance(exc, CheckpointError) or not isinstance(exc, (Exception, CheckpointException)):
                    raise  # KeyboardInterrupt, SystemExit
                from .dcp import failure_of

                where, cause = path / DCP_DIR if sharded else path / name, failure_of(exc)
                text = str(exc) if cause is exc else f"{type(cause).__name__}: {cause}"  # not DCP's traceback
                raise CheckpointError(f"could not load modules and optimizers from {where}: {text}") from exc
            rest = {k: v for k, v in live.items() if k not in keys}  # the rest is per-rank state
            saved = {k: v for k, v in saved.items() if k not in keys}
        else:
            for key, value in live.items():  # a model saved inside DDP loads without it, and back
                if isinstance(value, torch.nn.Module) and key in saved:
                    saved[key] = match_keys(saved[key], list(value.state_dict()), f"{path}: state[{key!r}]")
            misfits = shape_mismatches(live, saved) + key_mismatches(live, saved)  # nothing read in (_targets)
            if misfits:
                raise CheckpointError(misfit(path / name, misfits))
        # the payload's tensors are views of the read buffer: what a live object keeps is copied
        # (unless each was read into a live tensor or memory of its own: read_state_into)
        try:
            restore_state(rest, saved if payload.get("owned") else own_tensors(rest, saved))
        except ConfigError as exc:  # the script's objects refuse the saved state: the checkpoint stays
            raise ConfigError(f"checkpoint {path}: {exc}") from exc
        for key, value in rest.items():  # plain values restored by replacement
            if state[key] is value:
                continue
            if isinstance(state, MutableMapping):
                state[key] = value
            else:
                log.warning("state[%r] is a plain value in a read-only mapping; restored value dropped", key)
        restore_rng(payload["rng"] if own else derive_rng(payload["rng"], self.rank))
        if cover:  # DCP restores the keys it loads whole, or raises
            self._covered = (set(keys), {t.data_ptr() for t in live_targets(rest, saved).values()})
        return ""

    def _read(self, state: Mapping[str, Any], path: Path, info: CheckpointInfo, name: str, *,
              into_live: bool, undo: bool = False, whole: bool = False,
              keep: Callable[[Callable[[], None]], None] | None = None, cached: bool = False) -> dict[str, Any]:
        """This rank's state file of ``path``, read and parsed (``_try_load`` without an early read)."""
        sharded = is_dcp(info.files)
        verify = self.config.verify_on_load  # a state file is checked as it is read (DCP's: _check_here)
        if not ((into_live or undo) and not sharded and (whole or not self.comm.distributed)):
            return read_state_file(path, name, info.files[name], verify=verify, mmap=True,
                                   direct=self.config.direct_io)
        live: set[int] = set()  # ids of the live tensors among the targets (not a moment's new memory)
        # several ranks: before anything reaches the live tensors, the ranks agree that every
        # one of them takes this file (none refuses it for a key it lacks, none failed to parse it)
        agreed: list[str] = [] if self.comm.distributed else [""]

        def targets(payload: dict[str, Any]) -> Mapping[int, Any]:
            if not agreed:
                saved = payload.get("state")
                keys = set(saved) if isinstance(saved, Mapping) else set()
                agreed.append(self.comm.first_problem(self._refusal(state, keys, path, saved)))
            if agreed[0]:  # read into memory of its own: the load refuses or skips it next
                return {}
            found = self._targets(state, payload, path)
            live.update(id(t) for kept in self._written.values() for t in kept or ())
            return found

        # the ranks of one host read the same file: through the page cache, once from the disk
        # (as does a rank that just checked it through there)
        shared = whole and (_local_ranks(self.world_size) > 1 or cached)
        try:
            payload = read_state_into(path, name, info.files[name], targets, verify=verify,
                                      direct=False if shared else self.config.direct_io,
                                      undo=(lambda t: id(t) in live) if undo else None, keep=keep)
        except Exception as exc:
            if not agreed:  # failed before its targets were asked for: the others are waiting to agree
                agreed.append(self.comm.first_problem(str(exc) or type(exc).__name__))
            raise
        if not agreed:  # read without asking (no in-place parse): nothing reached the live tensors
            agreed.append(self.comm.first_problem(""))
        return payload

    def _common(self, found: dict[str, str] | None, entries: list[str], *, by_entry: bool = False) -> list[str]:
        """What every rank found (``found``: a message by entry of the checkpoint's ``entries``;
        None: a rank could not tell, so nothing), one collective. ``by_entry`` (the ranks read
        the same ``.metadata``, checked against its manifest entry before they agreed to load:
        the same ``entries`` on every rank): one ``all_reduce`` of a flag per entry, whether some
        rank's module holds it (a pipeline's stages each find the others' layers: a gather
        of what each found costs several times as much over gloo). Else one flag unless some
        rank found something, then one gather."""
        if by_entry:
            if not entries:  # on every rank
                return []
            held = self.comm.most(*(0 if found is not None and e in found else 1 for e in entries))
            return sorted(found[e] for e, h in zip(entries, held, strict=True) if not h) if found else []
        if not self.comm.anyone(bool(found)):
            return []
        every = self.comm.gather(sorted(found.values()) if found is not None else None)
        if any(f is None for f in every):
            return []
        return sorted(set.intersection(*(set(f) for f in every if f is not None)))

    def _agree_read(self, failed: BaseException | None, where: Path) -> None:
        """After every rank read its part of a DCP checkpoint (``failed``: this rank's failure):
        raise on every rank when any rank failed. A corrupt file found during the read comes
        first, as :class:`ftkit.checkpoint.dcp_reader.CorruptFile` (the checkpoint is skipped);
        else a :class:`CheckpointError` naming the first rank that failed and why."""
        from .dcp import failure_of
        from .dcp_reader import CorruptFile, corrupt_file_in

        if not self.comm.anyone(failed is not None):
            return
        said = None
        if failed is not None:
            corrupt, cause = corrupt_file_in(failed), failure_of(failed)
            said = (corrupt is not None, str(corrupt) if corrupt is not None else f"{type(cause).__name__}: {cause}")
        gathered = self.comm.gather(said)
        found = [entry[1] for entry in gathered if entry is not None and entry[0]]
        if found:
            raise CorruptFile(found[0]) from failed
        rank, text = next((r, entry[1]) for r, entry in enumerate(gathered) if entry is not None)
        raise CheckpointError(f"could not load modules and optimizers from {where}: rank {rank}: {text}") from failed

    def _targets(self, state: Mapping[str, Any], payload: Mapping[str, Any], path: Path) -> dict[int, Any]:
        """The live tensors the payload's tensors will be copied into (``live_targets``), or
        none when the load would refuse the checkpoint anyway (a missing key): nothing of it
        may reach the live state then."""
        import torch

        saved = payload.get("state")
        if not isinstance(saved, Mapping):
            return {}
        if any(k not in saved and self.config.strict and k not in self.config.allow_missing for k in state):
            return {}  # check_missing refuses this checkpoint after the read
        matched = dict(saved)
        for key, value in state.items():  # as _try_load: a model saved inside DDP, or back
            if isinstance(value, torch.nn.Module) and isinstance(saved.get(key), Mapping):
                matched[key] = match_keys(saved[key], list(value.state_dict()), f"{path}: state[{key!r}]")
        if shape_mismatches(state, matched) or key_mismatches(state, matched):
            return {}  # _restore_into refuses it after the read: the state stays as it was
        found: dict[int, Any] = {}
        for key in state:  # by key: a corrupt file's bytes must be overwritten where they went
            # a fresh optimizer's moments for a GPU's parameters: read there (restore.on_gpu)
            mine = live_targets({key: state[key]}, {key: matched[key]}, homes=on_gpu) if key in matched else {}
            if mine:
                found.update(mine)
                # the live ones: not a new moment's memory, which a corrupt file's payload takes
                # with it (held for the whole load, it would double a GPU's moments on a fallback)
                alive = {t.data_ptr() for t in reachable_tensors(state[key])}  # (a module's state_dict: new views)
                self._written[key] = [t for t in mine.values() if t.data_ptr() in alive]
        return found

    # ------------------------------------------------------------------ listing, retention
    def list(self) -> list[CheckpointInfo]:
        """Every step directory in the root, newest first, with its validity (sizes only)."""
        return self.commits.list()

    def validate(self, path: str | os.PathLike[str], checksums: bool = False) -> CheckpointInfo:
        return validate_dir(path, checksums=checksums)

    def pin(self, step: int) -> None:
        if self.rank == 0:
            pin_checkpoint(self.root, step, sync=self.config.fsync)
            self._emit("pin", step=step)

    def apply_retention(self) -> builtins.list[Path]:
        """Delete what the retention policy says (rank 0 only); returns the deleted paths."""
        return self.commits.apply_retention()

    def _emit(self, event: str, **fields: Any) -> bool:
        """Write ``event`` (rank 0, where there is an event log); whether it was written."""
        if self.events is not None and self.rank == 0:
            self.events.emit(event, **fields)
            return True
        return False

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Saves are synchronous: nothing is ever pending."""

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
