"""The saver process: one per node, it persists the snapshots its ranks keep in shared memory
and outlives a crashed trainer.

Started by the node's first rank (the *leader*, ``ShmBackend`` in ``crashsafe.client``) as::

    python -m ftkit.checkpoint.crashsafe.saver --config JSON --trainer-pid PID --ranks R,R,...
        [--world-size W --run-id ID --socket PATH --commit-timeout S --events FILE]

(:class:`ftkit.checkpoint.crashsafe.args.SaverArgs` builds and parses these; ``--config`` is every
``CheckpointConfig`` field.)

Channels. The leader talks over the saver's stdin and (original) stdout; every other rank of the
node connects to the Unix socket ``PATH`` (mode 0600, the peer's uid is checked) and first says
``{"op": "hello", "rank": r, "pid": p}``. On each channel, one JSON command per line:

* ``{"op": "segment", "slot": i, "path": P}``  the rank's slot i now lives in segment P
* ``{"op": "persist", "slot": i, "seq": n, "step": s, "pin": b, "reason": r}``  commit it straight
  from shared memory; answered ``{"op": "done", "seq": n, "step": s, "ok": ...}``
* ``{"op": "close"}``  the rank is done; answered ``{"op": "closed"}``

Persists run on one worker thread per rank: ``Checkpointer.persist`` for a one-rank job, else
``RankCommit.persist`` (each rank's part, rank 0 commits; see ``background.commit``), the very commit
protocol of a save on a trainer thread. The ranks of one node thus share one process, and rank 0's
commit, waiting for the other parts, never blocks them.

A trainer is *gone* when its channel ends without ``close``, or its pid is no longer alive (a
forked child, e.g. a DataLoader worker, may hold the channel open).

* As soon as one trainer of the node is gone, the *rescue*: the newest step of which every rank
  of this node holds a COMPLETE snapshot is persisted for each rank that has not asked for it
  already (unless that step is already a valid checkpoint). It starts at once, not when the last
  rank is gone: under SLURM the end of a step's last task gets every process of the step killed.
  The snapshots of ranks still alive are read under the segment's lock (``crashsafe.shm``).
* Once every rank has closed or is gone (a rank that never connected within
  ``--connect-timeout`` counts as gone), the workers finish what they were given (a persist in
  flight when its trainer died completes), every segment and the socket are unlinked, and the
  saver exits 0.

With several nodes each node's saver rescues its own ranks' parts; rank 0's saver commits the
step only if every node rescued the same one (the common case: all ranks snapshot the same
steps), else it fails after ``--commit-timeout`` and the step stays marked incomplete.

The thread that reads the requests is a batch thread (``SCHED_BATCH``: woken by a request, it
does not preempt the trainer), the workers are normal threads. The saver ignores SIGINT,
SIGTERM, SIGHUP and SIGUSR1/2 (SLURM and Ctrl-C signal the whole step or process group: the
trainers decide, the saver follows its channels), so only kill -9 stops it early.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..._proc import proc_start
from .args import SaverArgs

log = logging.getLogger("ftkit.checkpoint.saver")

_POLL = 0.5


class Channel:
    """One rank's connection: the leader's pipes, or a socket of another rank."""

    def __init__(self, *, fd: int, write: Any, rank: int | None = None, pid: int | None = None,
                 sock: socket.socket | None = None) -> None:
        self.fd = fd
        self._write = write
        self._lock = threading.Lock()
        self.sock = sock
        self.rank = rank
        self.pid: int | None = None
        self.started: str | None = None
        self.buf = b""
        self.segments: dict[int, Path] = {}
        self.submitted: set[int] = set()
        self.state = "open"  # open | closed (said close) | gone (ended without close)
        if pid is not None:
            self.identify(rank, pid)

    def identify(self, rank: int | None, pid: int) -> None:
        self.rank, self.pid, self.started = rank, pid, proc_start(pid)

    def alive(self) -> bool:
        return self.pid is None or (self.started is not None and proc_start(self.pid) == self.started)

    def send(self, **msg: Any) -> bool:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self._write(data)
                return True
            except OSError:
                return False

    def read(self) -> bytes:
        try:
            return os.read(self.fd, 1 << 16)
        except OSError:
            return b""

    def end(self, state: str) -> None:
        if self.state == "open":
            self.state = state

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


class Saver:
    def __init__(self, persisters: dict[int, Any], *, ranks: list[int], leader: Channel, root: Path,
                 listener: socket.socket | None = None, socket_path: Path | None = None,
                 connect_timeout: float = 120.0) -> None:
        self.persisters = persisters
        self.ranks = ranks
        self.root = root
        self.listener = listener
        self.socket_path = socket_path
        self.channels: dict[int, Channel] = {ranks[0]: leader}
        self.pending: list[Channel] = []  # accepted, no hello yet
        self.connect_deadline = time.monotonic() + connect_timeout
        self.rescued = False
        self._maps: dict[Path, Any] = {}
        self._maps_lock = threading.Lock()
        self.queues: dict[int, queue.Queue[tuple | None]] = {}
        self.workers: list[threading.Thread] = []
        for rank in ranks:
            q: queue.Queue[tuple | None] = queue.Queue()
            t = threading.Thread(target=self._work, args=(rank, q), name=f"ftkit-saver-rank{rank}", daemon=True)
            t.start()
            self.queues[rank] = q
            self.workers.append(t)

    # ------------------------------------------------------------------ commands
    def handle(self, ch: Channel, cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        if ch.rank is None:  # a socket channel must introduce itself first
            rank = cmd.get("rank")
            if op != "hello" or rank not in self.ranks or rank in self.channels or not isinstance(cmd.get("pid"), int):
                log.warning("saver: refusing a connection that said %r (expected hello from one of ranks %s)", cmd, self.ranks)
                ch.end("gone")
                return
            ch.identify(int(rank), int(cmd["pid"]))
            self.pending.remove(ch)
            self.channels[ch.rank] = ch  # type: ignore[index]  # identified just above
            ch.send(op="ready", pid=os.getpid())
            return
        if op == "segment":
            slot = int(cmd["slot"])
            self.forget(ch.segments.get(slot))
            ch.segments[slot] = Path(cmd["path"])
        elif op == "persist":
            slot, step = int(cmd["slot"]), int(cmd["step"])
            ch.submitted.add(step)
            self.queues[ch.rank].put((ch, ch.segments.get(slot), int(cmd["seq"]), step, bool(cmd.get("pin")), cmd.get("reason")))
        elif op == "close":
            ch.end("closed")
            ch.send(op="closed")
        else:
            log.warning("saver: unknown command %r ignored", op)

    def mapping(self, path: Path) -> Any:
        """The saver's :class:`~ftkit.checkpoint.crashsafe.shm.SlotMap` of segment ``path`` (kept across persists)."""
        from .shm import SlotMap

        with self._maps_lock:
            found = self._maps.get(path)
            if found is None:
                found = self._maps[path] = SlotMap(path)
            return found

    def forget(self, path: Path | None) -> None:
        """Unmap a segment the trainer replaced (its memory goes once nothing reads it)."""
        with self._maps_lock:
            found = self._maps.pop(path, None) if path is not None else None
        if found is not None:
            found.close()

    def _work(self, rank: int, jobs: queue.Queue[tuple | None]) -> None:
        while (job := jobs.get()) is not None:
            ch, path, seq, step, pin, reason = job
            started = time.monotonic()
            try:
                info = self.persist(rank, path, seq, step, pin=pin, reason=reason, writer_alive=ch.alive)
            except BaseException as exc:
                log.warning("saver: persisting rank %d's step %s failed: %s", rank, step, exc)
                ch.submitted.discard(step)  # not in progress: a rescue after the trainer dies tries it again
                ch.send(op="done", seq=seq, step=step, ok=False, error=str(exc), error_type=type(exc).__name__)
                continue
            ch.send(op="done", seq=seq, step=step, ok=True, size=info.size, path=str(info.path),
                    seconds=round(time.monotonic() - started, 4))

    def persist(self, rank: int, path: Path | None, seq: int | None, step: int, *, pin: bool, reason: str | None,
                writer_alive: Any = lambda: False) -> Any:
        from ...errors import CheckpointError
        from ..background.buffers import host_snapshot
        try:
            view = self.mapping(path).read(seq=seq, writer_alive=writer_alive) if path is not None else None
        except FileNotFoundError:
            view = None
        if view is None:
            raise CheckpointError(f"rank {rank}'s snapshot seq {seq} of step {step} is not complete in shared memory ({path})")
        try:
            snap = host_snapshot(view.skeleton, view.tensors, view.nbytes)
            info = self.persisters[rank].persist(snap, step, pin=pin, reason=reason)
            del snap
        finally:
            view.close()
        return info

    # ------------------------------------------------------------------ the loop
    def all_arrived(self) -> bool:
        """Every rank introduced itself (or the connect deadline passed)."""
        if self.pending:
            return False
        return len(self.channels) == len(self.ranks) or time.monotonic() > self.connect_deadline

    def finished(self) -> bool:
        return self.all_arrived() and not any(ch.state == "open" for ch in self.channels.values())

    def lost(self) -> bool:
        """A rank of the node is gone, or never connected."""
        return len(self.channels) < len(self.ranks) or any(ch.state == "gone" for ch in self.channels.values())

    def run(self) -> int:
        try:
            while not self.finished():
                self.step()
                if not self.rescued and self.all_arrived() and self.lost():
                    self.rescue()  # at once: the survivors' step may end (and kill us) soon
        finally:
            try:
                if not self.rescued and self.lost():
                    self.rescue()
                for q in self.queues.values():
                    q.put(None)
                for t in self.workers:
                    t.join()
            finally:
                self.cleanup()
        return 0

    def step(self) -> None:
        open_channels = [ch for ch in [*self.channels.values(), *self.pending] if ch.state == "open"]
        watch: list[Any] = [ch.fd for ch in open_channels]
        if self.listener is not None and len(self.channels) < len(self.ranks):
            watch.append(self.listener)
        ready, _, _ = select.select(watch, [], [], _POLL)
        for item in ready:
            if item is self.listener:
                self.accept()
            else:
                self.receive(next(c for c in open_channels if c.fd == item))
        for ch in open_channels:
            if ch.state == "open" and not ch.alive():
                while ch.state == "open" and select.select([ch.fd], [], [], 0)[0]:
                    self.receive(ch)  # what it said before it died still counts
                ch.end("gone")
        for ch in list(self.pending):
            if ch.state != "open":
                self.pending.remove(ch)
                ch.close()

    def receive(self, ch: Channel) -> None:
        """Read what ``ch`` sent and run its complete commands; end it on EOF."""
        chunk = ch.read()
        if not chunk:
            ch.end("gone")
            return
        ch.buf += chunk
        while b"\n" in ch.buf and ch.state == "open":
            line, ch.buf = ch.buf.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                self.handle(ch, json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:  # a malformed command must not stop the saver
                log.error("saver: ignoring a malformed command from rank %s: %r (%s)", ch.rank, line[:200], exc)

    def accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = int.from_bytes(creds[4:8], sys.byteorder)
        if uid != os.geteuid():
            log.warning("saver: refusing a connection from uid %d", uid)
            conn.close()
            return
        self.pending.append(Channel(fd=conn.fileno(), write=conn.sendall, sock=conn))

    # ------------------------------------------------------------------ a trainer died
    def rescue(self) -> None:
        """Persist the newest step every rank of this node holds complete in shared memory (module doc)."""
        self.rescued = True
        from ..format.layout import step_name
        from ..format.manifest import validate_dir
        from .shm import COMPLETE, read_header

        gone = sorted(r for r in self.ranks if r not in self.channels or self.channels[r].state == "gone")
        missing = [r for r in self.ranks if r not in self.channels]
        if missing:
            log.warning("saver: rank(s) %s never connected; nothing of theirs is in shared memory to persist", missing)
            return
        complete: dict[int, dict[int, tuple[Path, int]]] = {}
        for rank in self.ranks:
            mine: dict[int, tuple[Path, int]] = {}
            for path in self.channels[rank].segments.values():
                head = read_header(path)
                if head is not None and head[0] == COMPLETE and (head[2] not in mine or mine[head[2]][1] < head[1]):
                    mine[head[2]] = (path, head[1])
            complete[rank] = mine
        common = set.intersection(*(set(steps) for steps in complete.values()))
        if not common:
            log.warning("saver: rank(s) %s gone and no step is complete in shared memory on every rank of this node", gone)
            return
        step = max(common)
        if validate_dir(self.root / step_name(step)).valid:
            log.info("saver: rank(s) %s gone; the newest snapshot (step %d) is already durable", gone, step)
            return
        todo = [r for r in self.ranks if step not in self.channels[r].submitted]
        if not todo:
            log.warning("saver: rank(s) %s gone; the newest snapshot (step %d) is being persisted already", gone, step)
            return
        log.warning("saver: rank(s) %s gone; persisting the newest complete snapshot, step %d (rank(s) %s)", gone, step, todo)
        for ch in self.channels.values():
            ch.send(op="rescuing", step=step)
        for rank in todo:
            path, seq = complete[rank][step]
            ch = self.channels[rank]
            ch.submitted.add(step)
            self.queues[rank].put((ch, path, seq, step, False, "trainer died: newest in-memory snapshot"))

    def cleanup(self) -> None:
        for path in list(self._maps):
            self.forget(path)
        for ch in [*self.channels.values(), *self.pending]:
            for path in ch.segments.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            ch.close()
        if self.listener is not None:
            self.listener.close()
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600: only this user connects
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def main(argv: list[str] | None = None) -> int:
    # The protocol owns the original stdout; anything printed later goes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    args = SaverArgs.from_argv(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="ftkit-saver[%(process)d] %(levelname)s %(message)s")
    ranks = list(args.ranks)
    listener = _listen(args.socket) if args.socket is not None else None  # before the slow imports

    from ..manager import Checkpointer
    from .shm import huge_pages

    config = args.config
    # 4 KiB tmpfs pages may be scattered: copy them through the writer's huge-page staging
    # buffers (format.md, huge pages); a huge-page tmpfs is written as is
    bounce = not huge_pages(args.shm_dir)
    persisters: dict[int, Any] = {}
    for rank in ranks:
        events = None
        if args.events is not None:
            from ...events import EventLog

            events = EventLog(args.events, rank=rank)
        ckpt = Checkpointer(config, events=events, rank=rank, world_size=args.world_size, bounce=bounce)
        if args.world_size > 1:
            from ..background.commit import RankCommit

            persisters[rank] = RankCommit(ckpt, run_id=args.run_id, timeout=args.commit_timeout)
        else:
            persisters[rank] = ckpt
    leader = Channel(fd=0, write=out.write, rank=ranks[0], pid=args.trainer_pid)
    saver = Saver(persisters, ranks=ranks, leader=leader, root=config.root, listener=listener,
                  socket_path=args.socket, connect_timeout=args.connect_timeout)
    # This thread, which reads the trainers' requests, is a batch task: woken by a request it
    # does not preempt the trainer on that CPU (which otherwise lost milliseconds of a save()).
    # Only this thread: the workers (started above) and their writer threads keep the normal
    # policy, since a batch thread woken by its I/O completing waits for the next tick.
    with contextlib.suppress(AttributeError, OSError):  # Linux only; a hint elsewhere
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    leader.send(op="ready", pid=os.getpid())  # if the leader is gone already, its pid check says so
    return saver.run()


if __name__ == "__main__":
    sys.exit(main())
