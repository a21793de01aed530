"""Several ranks, asynchronously: every rank's worker writes its part, rank 0's worker commits.

No collective runs off the main thread; the workers coordinate through files in the step directory:

1. Rank 0's worker prepares ``step-N/`` as a synchronous save does (sentinel first, then ``dcp/``),
   then writes this save's id into the sentinel (temp file + ``os.replace``; not fsynced: until
   the manifest is durable the directory is incomplete, see ``manager``).
2. Every other rank's worker waits until the sentinel holds the id of *this* save (a leftover of an
   earlier run holds another id, and rank 0 replaces it), so no data file ever precedes the sentinel.
3. Each rank writes ``rank-RRRRR.pt`` and its DCP shard ``dcp/__R_0.distcp``, fsyncs them and both
   directories, then ``part-rank-RRRRR.plan`` (its DCP write items and results, pickled) and last
   ``part-rank-RRRRR.json`` (save id, size and CRC-32 of each file and of the plan), each atomically
   (temp file, fsync, ``os.replace``, fsync of the directory). A rank whose write fails writes a
   part holding ``"error"`` instead (best effort), so rank 0 fails at once and names the cause.
4. Rank 0's worker waits for all ``world_size`` parts of this save while files in the step
   directory keep growing, and fails after ``commit_timeout`` seconds without growth, naming the
   ranks that never confirmed. Then it merges the plans into DCP's ``dcp/.metadata`` and commits
   through the commit protocol of every write path (:mod:`ftkit.checkpoint.format.commit`: ``manifest.json``, sentinel
   removal, fsync, ``latest``, retention): the layout of a synchronous multi-rank save, loaded by
   ``Checkpointer.load``.

A rank that is gone is not waited for: every wait of steps 2 and 4 fails within a poll
(0.1 s) once the process of a rank it waits for, on this node, is gone (``peers``: each rank's
node and pid, as ``AsyncCheckpointer._agree`` gathered them), or once this process was told that
its process group is broken (:func:`group_broken`: a collective failed because a peer closed its
connection). Its error says so (``rank 0 is gone: the checkpoint of step N cannot be
committed``); a rank that lives, however slow, is waited for up to ``commit_timeout``.

The DCP plans the ranks write and rank 0 merges are :mod:`ftkit.checkpoint.background.plan`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._proc import proc_start
from ...errors import CheckpointError
from ..config import CheckpointInfo
from ..format.commit import save_error
from ..format.layout import DCP_DIR, SENTINEL, rank_file, step_name
from ..format.manifest import validate_dir
from ..io.files import CHECKSUM, atomic_write_bytes, crc32, crc32_file, fsync_dir
from ..io.statefile import WriteProgress, write_state_file
from ..state.snapshot import Snapshot
from .plan import Resolver, merge_metadata

__all__ = ["PART_FORMAT", "RankCommit", "group_broken", "node_name", "part_name"]

log = logging.getLogger(__name__)

PART_FORMAT = "ftkit-part"


def part_name(rank: int, suffix: str = "json") -> str:
    return f"part-rank-{rank:05d}.{suffix}"


def node_name() -> str:
    """This process's node as the ranks name it to each other: SLURM's node name where there is
    one (several slurmd may share a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# every RankCommit of this process, for group_broken (weakly: a closed manager's goes with it)
_commits: weakref.WeakSet[RankCommit] = weakref.WeakSet()
_commits_lock = threading.Lock()


def group_broken(why: str) -> int:
    """This process's process group is broken: a collective failed because a peer is gone (its
    connection closed). No save in flight can be committed any more, so every RankCommit of
    this process stops waiting for another rank's files within a poll, and fails the save with
    ``why`` (as does every later wait of theirs: the group does not heal). The controller calls
    it when the training loop ended with such an error. Returns how many were told."""
    with _commits_lock:
        commits = list(_commits)
    for commit in commits:
        commit.group_broken(why)
    return len(commits)


# ---------------------------------------------------------------------- the per-rank worker side
class RankCommit:
    """``persist`` for one rank of several: its part, plus, on rank 0, the commit (module doc).

    Wraps the rank's :class:`~ftkit.checkpoint.Checkpointer`: rank 0 prepares, commits and applies
    retention through its ``commits`` (:class:`ftkit.checkpoint.format.commit.Committer`, the protocol every write path
    shares). Runs on the rank's checkpoint worker thread.

    ``peers``: each rank's ``(node, pid)`` in rank order, as ``AsyncCheckpointer._agree``
    gathered them; a wait for a rank whose process on this node is gone then fails at once
    (module doc). None: only :func:`group_broken` and the timeout end a wait.
    """

    def __init__(
        self,
        checkpointer: Any,
        *,
        run_id: str,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        peers: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        self.ckpt = checkpointer
        self.rank = checkpointer.rank
        self.world_size = checkpointer.world_size
        self.run_id = run_id
        self.timeout = timeout
        self._clock = clock
        self._sleep = sleep
        self._count: dict[int, int] = {}
        self._broken: str | None = None  # group_broken's why
        # the other ranks whose process is on this node: rank -> (pid, its start), learned now
        self._node = node_name()
        self._watched: dict[int, tuple[int, str]] = {}
        for rank, (node, pid) in enumerate(peers or ()):
            if rank != self.rank and node == self._node and pid != os.getpid():
                started = proc_start(pid)
                if started:  # else another pid namespace's, gone already, or unreadable
                    self._watched[rank] = (pid, started)
        with _commits_lock:
            _commits.add(self)

    def group_broken(self, why: str) -> None:
        """See the module's :func:`group_broken`: every wait of this RankCommit fails from now on."""
        if self._broken is None:
            self._broken = why

    @property
    def sync(self) -> bool:
        return bool(self.ckpt.config.fsync)

    def persist(
        self, snapshot: Snapshot, step: int, *, pin: bool = False, reason: str | None = None
    ) -> CheckpointInfo:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        # the same on every rank as long as the ranks save the same steps in the same order
        self._count[step] = self._count.get(step, 0) + 1
        save_id = f"{self.run_id} step {step} #{self._count[step]}"
        path = self.ckpt.root / step_name(step)
        progress = WriteProgress()
        started = time.monotonic()
        if self.rank != 0:
            if not self._await_start(path, save_id, step):
                return validate_dir(path)
            try:
                self._write_part(snapshot, path, save_id, step, progress)
            except BaseException as exc:
                err = self._error(exc, step, path, progress, snapshot)
                self._write_error_part(path, save_id, step, err)
                if err is exc:
                    raise
                raise err from exc
            return CheckpointInfo(
                step=step,
                path=path,
                status="pending",
                pinned=pin,
                saved_for=reason,
                reason=f"rank {self.rank}'s part is durable; rank 0 commits the checkpoint",
            )
        commits = self.ckpt.commits
        with commits.saving(step):
            try:
                existing = commits.prepare(step, pin=pin)
                if existing is not None:
                    return existing
                # the save id tells the other ranks which save this directory is for; like the
                # sentinel of a synchronous save it is not fsynced (no manifest: incomplete anyway)
                atomic_write_bytes(path / SENTINEL, save_id.encode(), sync=False)
                self._write_part(snapshot, path, save_id, step, progress)
                parts = self._await_parts(path, save_id, step)
                files = self._seal_dcp(path, parts)
                info = commits.commit(step, files, pin=pin, reason=reason)
            except BaseException as exc:
                err = self._error(exc, step, path, progress, snapshot)
                commits.abandon(step, err, reason=reason)
                if err is exc:
                    raise
                raise err from exc
        # the rank commit runs on rank 0's worker: no barrier here, only the log, event, retention
        commits.committed(info, seconds=snapshot.seconds + time.monotonic() - started, reason=reason)
        return info

    def report_lost(self, step: int, why: str) -> threading.Thread | None:
        """This rank's part of ``step`` was being written by a process that died (its crash-safe
        saver, killed): the save counts as ``persist`` counts it (the next save ids stay the
        other ranks'), and, on a thread (it waits for rank 0's sentinel as ``persist`` does), an
        error part tells rank 0 at once, so its commit fails now rather than after
        ``commit_timeout`` with the whole job waiting for it. A part the saver finished before it
        died is left as it is. Rank 0 has nothing to tell. Returns the thread, if any."""
        self._count[step] = self._count.get(step, 0) + 1
        if self.rank == 0:
            return None
        save_id = f"{self.run_id} step {step} #{self._count[step]}"
        path = self.ckpt.root / step_name(step)

        def tell() -> None:
            try:
                if not self._await_start(path, save_id, step):
                    return
            except CheckpointError as exc:
                log.warning("rank %d could not tell rank 0 that its part of step %d is lost: %s", self.rank, step, exc)
                return
            done = _read_part(path, self.rank)
            if done is not None and done.get("save_id") == save_id:
                return  # written (or failed) before the saver died: rank 0 reads that one
            self._write_error_part(path, save_id, step, CheckpointError(
                f"rank {self.rank}'s checkpoint saver died while it wrote this rank's part: {why}"))

        thread = threading.Thread(target=tell, name=f"ftkit-lost-part-{step}", daemon=True)
        thread.start()
        return thread

    def _error(
        self, exc: BaseException, step: int, path: Path, progress: WriteProgress, snapshot: Snapshot
    ) -> BaseException:
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            return exc
        if isinstance(exc, OSError):
            return save_error(exc, step, path, progress, snapshot.nbytes)
        return CheckpointError(
            f"could not save rank {self.rank}'s part of checkpoint step {step} to {path}: {exc}"
        )

    # ------------------------------------------------------------------ waiting on files
    def _poll(
        self,
        ready: Callable[[], Any],
        stalled: Callable[[], bool],
        fail: Callable[[], CheckpointError],
        gone: Callable[[], CheckpointError | None],
    ) -> Any:
        """Poll ``ready()`` (backing off to 0.1 s) until truthy; raise ``gone()``'s error once it
        has one (a rank waited for is gone), ``fail()`` once ``stalled()``."""
        delay = 0.005
        while not (value := ready()):
            lost = gone()
            if lost is not None:
                raise lost
            if stalled():
                raise fail()
            self._sleep(delay)
            delay = min(delay * 2, 0.1)
        return value

    def _await_start(self, path: Path, save_id: str, step: int) -> bool:
        """True once rank 0's sentinel names this save; False if the step is already valid."""
        deadline = self._clock() + self.timeout

        def ready() -> str:
            try:
                content = (path / SENTINEL).read_bytes().decode(errors="replace")
            except OSError:
                content = None
            if content == save_id:
                return "write"
            if content is None and validate_dir(path).valid:
                return "exists"  # rank 0 keeps a valid checkpoint of this step, as a sync save does
            return ""

        decision = self._poll(
            ready,
            lambda: self._clock() > deadline,
            lambda: CheckpointError(
                f"rank 0 did not start checkpoint step {step} in {path} within {self.timeout:g}s "
                f"(async_save.commit_timeout): its {SENTINEL} never named this save ({save_id})"
            ),
            lambda: self._gone([0], step, path),
        )
        if decision == "exists":
            log.info(
                "checkpoint step %d already exists and is valid; rank %d writes nothing",
                step,
                self.rank,
            )
        return decision == "write"

    def _await_parts(self, path: Path, save_id: str, step: int) -> dict[int, dict[str, Any]]:
        """Every rank's confirmation of this save, failing after ``timeout`` s without progress."""
        parts: dict[int, dict[str, Any]] = {}
        state = {"size": -1, "since": self._clock()}

        def ready() -> bool:
            for rank in range(self.world_size):
                if rank in parts:
                    continue
                part = _read_part(path, rank)
                if part is None or part.get("save_id") != save_id:
                    continue
                if part.get("error"):
                    raise CheckpointError(
                        f"rank {rank} could not write its part of checkpoint step {step} to {path}: "
                        f"{part['error']}"
                    )
                parts[rank] = part
            return len(parts) == self.world_size

        def stalled() -> bool:
            size = _tree_size(path)
            if size != state["size"]:
                state["size"], state["since"] = size, self._clock()
            return self._clock() - state["since"] > self.timeout

        def fail() -> CheckpointError:
            missing = [r for r in range(self.world_size) if r not in parts]
            names = ", ".join(part_name(r) for r in missing)
            return CheckpointError(
                f"rank {', '.join(map(str, missing))} never confirmed its part of checkpoint step {step}: "
                f"no {names} in {path}, and no file there grew for {self.timeout:g}s "
                "(async_save.commit_timeout). The directory stays marked incomplete"
            )

        self._poll(ready, stalled, fail,
                   lambda: self._gone([r for r in range(self.world_size) if r not in parts], step, path))
        return parts

    def _gone(self, waited: Iterable[int], step: int, path: Path) -> CheckpointError | None:
        """The error of a wait for the ranks ``waited`` for once one of them is known to be gone
        (its process on this node is, or the process group broke), else None."""
        dead = [(r, self._watched[r][0]) for r in waited if r in self._watched and _exited(*self._watched[r])]
        if dead:
            who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(str(r) for r, _ in dead)}"
            how = "; ".join(f"rank {r}'s process (pid {pid}) on {self._node} has exited" for r, pid in dead)
        elif self._broken is not None:
            # two ranks: the other one is the one gone; more: one of them, which is not known here
            who = f"rank {1 - self.rank}" if self.world_size == 2 else "a rank"
            how = f"a collective of rank {self.rank} failed, its process group is broken: {self._broken}"
        else:
            return None
        verb = "are" if len(dead) > 1 else "is"
        text = (f"{who} {verb} gone: the checkpoint of step {step} cannot be committed ({how}); "
                f"rank {self.rank} stopped waiting for it, {path} stays marked incomplete")
        log.error("%s", text)
        return CheckpointError(text)

    # ------------------------------------------------------------------ writing
    def _write_part(
        self, snapshot: Snapshot, path: Path, save_id: str, step: int, progress: WriteProgress
    ) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.distributed.checkpoint.planner import SavePlan

        sync = self.sync
        name = rank_file(self.rank)
        meta = {"rank": self.rank, "world_size": self.world_size}
        files = {
            name: write_state_file(
                path, name, {**snapshot.local, **meta}, sync=sync, progress=progress,
                direct=self.ckpt.config.direct_io, bounce=self.ckpt.bounce,
            )
        }
        sharded = snapshot.sharded
        written, results = sharded.get("written", []), []
        if written:
            writer = FileSystemWriter(path / DCP_DIR, sync_files=sync)
            plan = SavePlan(items=written, storage_data=_StoragePrefix(f"__{self.rank}_"))
            results = writer.write_data(plan, Resolver(written, sharded["data"])).value()  # type: ignore[arg-type]
            for entry in sorted({wr.storage_data.relative_path for wr in results}):
                size, crc = crc32_file(path / DCP_DIR / entry)
                files[f"{DCP_DIR}/{entry}"] = {"size": size, CHECKSUM: crc, "rank": self.rank}
        if sync:
            fsync_dir(path / DCP_DIR)
            fsync_dir(path)
        plan_blob = pickle.dumps(
            {
                "held": sharded.get("held", []),
                "written": written,
                "results": results,
                "mappings": sharded.get("mappings", {}),
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        atomic_write_bytes(path / part_name(self.rank, "plan"), plan_blob, sync=sync)
        plan_entry = {
            "name": part_name(self.rank, "plan"),
            "size": len(plan_blob),
            CHECKSUM: f"{crc32(plan_blob):08x}",
        }
        self._write_json(
            path, {"save_id": save_id, "step": step, "files": files, "plan": plan_entry}
        )

    def _write_json(self, path: Path, fields: dict[str, Any]) -> None:
        doc = {
            "format": PART_FORMAT,
            "version": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            **fields,
        }
        atomic_write_bytes(
            path / part_name(self.rank),
            (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(),
            sync=self.sync,
        )

    def _write_error_part(self, path: Path, save_id: str, step: int, err: BaseException) -> None:
        """Tell rank 0 at once (best effort: a full disk may refuse this too; rank 0 then times out)."""
        try:
            self._write_json(path, {"save_id": save_id, "step": step, "error": str(err)})
        except OSError as exc:
            log.warning(
                "could not report rank %d's failure to rank 0 in %s: %s", self.rank, path, exc
            )

    def _seal_dcp(
        self, path: Path, parts: Mapping[int, Mapping[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """Check every part's files, merge the plans into ``dcp/.metadata``; the manifest's file list."""
        from torch.distributed.checkpoint import FileSystemWriter

        files: dict[str, dict[str, Any]] = {}
        plans: dict[int, dict[str, Any]] = {}
        for rank, part in sorted(parts.items()):
            for name, meta in part["files"].items():
                try:
                    size = os.lstat(path / name).st_size
                except OSError as exc:
                    raise CheckpointError(
                        f"rank {rank}'s {name} in {path}: {exc.strerror or exc}"
                    ) from exc
                if size != meta["size"]:
                    raise CheckpointError(
                        f"rank {rank}'s {name} in {path}: {size} bytes, its part says {meta['size']}"
                    )
                files[name] = dict(meta)
            entry = part["plan"]
            blob = (path / entry["name"]).read_bytes()
            if len(blob) != entry["size"] or f"{crc32(blob):08x}" != entry[CHECKSUM]:
                raise CheckpointError(
                    f"rank {rank}'s {entry['name']} in {path} does not match its part"
                )
            plans[rank] = pickle.loads(blob)
        metadata, results = merge_metadata(plans)
        FileSystemWriter(path / DCP_DIR, sync_files=self.sync).finish(metadata, [results])
        size, crc = crc32_file(path / DCP_DIR / ".metadata")
        files[f"{DCP_DIR}/.metadata"] = {"size": size, CHECKSUM: crc, "rank": 0}
        if self.sync:
            fsync_dir(path / DCP_DIR)
        return files


def _read_part(path: Path, rank: int) -> dict[str, Any] | None:
    """``part-rank-R.json`` of ``path`` if present and well formed (written atomically), else None."""
    try:
        doc = json.loads((path / part_name(rank)).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable %s in %s: %s", part_name(rank), path, exc)
        return None
    ok = isinstance(doc, dict) and doc.get("format") == PART_FORMAT and doc.get("rank") == rank
    return doc if ok else None


def _exited(pid: int, started: str) -> bool:
    """Whether the process ``pid`` that had started at ``started`` (:func:`ftkit._proc.proc_start`)
    is gone: no such process, a zombie (killed, not yet reaped), or a later one reusing its pid."""
    return proc_start(pid) != started


def _tree_size(path: Path) -> int:
    """Bytes in ``path`` and ``path/dcp`` (temp files included): growth means a rank is writing."""
    total = 0
    for where in (path, path / DCP_DIR):
        with contextlib.suppress(OSError):
            for entry in os.scandir(where):
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    return total
