"""Trainer side of ``crash_safe``: snapshots in shared-memory slots, persisted by the node's saver.

One saver process per node (``python -m`` :data:`ftkit.checkpoint.crashsafe.args.SAVER_MODULE`, its command line
a :class:`ftkit.checkpoint.crashsafe.args.SaverArgs`): the node's first rank (the leader) starts it with
``subprocess.Popen`` and talks over its stdin/stdout; the node's other ranks connect to its
Unix socket. A channel's end (or its trainer's death) tells the saver the
trainer is gone, so it works under plain python, srun and torchrun without a custom launcher. A
reader thread turns the saver's answers into ``done(seq, step, error, seconds)`` calls.

Clean close: every rank says ``close``; the leader waits for the saver to exit (it waits for every
rank of the node), then unlinks whatever segment of the node is left. Trainer killed: the saver
persists the newest snapshot complete on every rank of the node, unlinks the segments and exits
(see ``crashsafe.saver``). Segments are named ``ftkit-snap-<leader pid>-<tag>-r<rank>-s<slot>-g<gen>``.
Trainer and saver both killed: nobody unlinks; the next leader that starts a saver on the node
removes what such runs left in its ``shm_dir`` (``crashsafe.find.sweep_leftovers``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import secrets
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from ...errors import CheckpointError, ConfigError
from ..background.buffers import Copier, layout_of, wait_events
from .args import SaverArgs
from .find import sweep_leftovers
from .shm import PREFIX, Segment

__all__ = ["NodePlan", "ShmBackend"]

log = logging.getLogger(__name__)

_SOCKET_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True, slots=True)
class NodePlan:
    """Who shares a saver: this node's ranks (leader first), the leader's pid and a run tag."""

    ranks: tuple[int, ...]
    leader_pid: int
    tag: str
    world_size: int = 1
    run_id: str | None = None

    @classmethod
    def alone(cls) -> NodePlan:
        return cls(ranks=(0,), leader_pid=os.getpid(), tag=secrets.token_hex(4))

    @classmethod
    def from_ranks(cls, rank: int, run_id: str, hosts: list[tuple[str, int]]) -> NodePlan:
        """``hosts[r] = (node name, pid)`` of every rank (gathered): the ranks on this rank's node."""
        mine = hosts[rank][0]
        ranks = tuple(r for r, (host, _) in enumerate(hosts) if host == mine)
        return cls(ranks=ranks, leader_pid=hosts[ranks[0]][1], tag=run_id[:12], world_size=len(hosts), run_id=run_id)

    def prefix(self) -> str:
        return f"{PREFIX}{self.leader_pid}-{self.tag}-"

    def socket_path(self, directory: Path) -> Path:
        return Path(directory) / f"ftkit-saver-{self.leader_pid}-{self.tag}.sock"


def _sweep(directory: Path) -> None:
    """Remove what runs that are over (trainer and saver both killed) left in ``directory``, and
    say so; never fails the run."""
    try:
        swept = sweep_leftovers(directory)
    except Exception as exc:  # housekeeping: a run must not fail over it
        log.warning("crash-safe: could not look for the leftovers of ended runs in %s: %s", directory, exc)
        return
    if swept.removed:
        log.warning("crash-safe: removed %d file(s), %.1f MB, left in %s by run(s) that are over (trainer and "
                    "saver killed; leader pid(s) %s)", len(swept.removed), swept.nbytes / 1e6, directory,
                    ", ".join(map(str, swept.leaders)))
    if swept.failed:
        log.warning("crash-safe: could not remove %d leftover file(s) of ended runs in %s: %s",
                    len(swept.failed), directory, "; ".join(swept.failed[:5]))


def _saver_env() -> dict[str, str]:
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[2])  # so `-m ftkit...` imports this ftkit
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class ShmBackend:
    """``slots`` shared-memory segments (created lazily, reused while the layout holds) and the saver."""

    def __init__(self, config: Any, async_config: Any, slots: int, done: Any, copier: Copier,
                 *, events: Any = None, rank: int = 0, node: NodePlan | None = None) -> None:
        self._done = done
        self._copier = copier
        self._dir = Path(async_config.shm_dir)
        self._timeout = float(async_config.saver_timeout)
        self.node = node if node is not None else NodePlan.alone()
        self.rank = rank
        self.leader = rank == self.node.ranks[0]
        self._token = f"{self.node.leader_pid}-{self.node.tag}-r{rank}"
        self._generation = 0
        self.segments: list[Segment | None] = [None] * slots
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._said_closed = threading.Event()
        self._closing = False
        self._rescuing = False
        self._started = time.monotonic()
        self._lost: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        sock_path = self.node.socket_path(self._dir)
        if len(self.node.ranks) > 1 and len(str(sock_path)) > _SOCKET_MAX:
            raise ConfigError(
                f"async_save.shm_dir: the saver's socket path {sock_path} is longer than "
                f"{_SOCKET_MAX} bytes; use a shorter shm_dir"
            )
        if self.leader:
            self._to_saver, self._from_saver = self._start(config, async_config, events, sock_path)
        else:
            self._to_saver, self._from_saver = self._connect(sock_path)
        self._reader = threading.Thread(target=self._read, name="ftkit-saver-reader", daemon=True)
        self._reader.start()

    def _start(self, config: Any, async_config: Any, events: Any, sock_path: Path) -> tuple[IO[bytes], IO[bytes]]:
        node = self.node
        _sweep(self._dir)  # before our saver: nothing of this run exists yet
        path = getattr(events, "path", None)
        args = SaverArgs(
            config=config, trainer_pid=os.getpid(), ranks=node.ranks, world_size=node.world_size,
            run_id=node.run_id, socket=sock_path if len(node.ranks) > 1 else None,
            commit_timeout=async_config.commit_timeout, connect_timeout=self._timeout,
            events=Path(path) if path is not None else None, shm_dir=self._dir,
        )
        self.proc = subprocess.Popen(args.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_saver_env())
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        return self.proc.stdin, self.proc.stdout

    def _connect(self, path: Path) -> tuple[IO[bytes], IO[bytes]]:
        """Another rank of the node: connect to the saver the leader started (it may still be starting)."""
        deadline = time.monotonic() + self._timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"rank {self.rank}: the node's checkpoint saver (started by rank {self.node.ranks[0]}, "
                        f"pid {self.node.leader_pid}) did not open {path} within {self._timeout:.0f}s "
                        f"(async_save.saver_timeout): {exc}"
                    ) from exc
                time.sleep(0.05)
        self._sock = sock
        sock.sendall((json.dumps({"op": "hello", "rank": self.rank, "pid": os.getpid()}) + "\n").encode())
        writer: Any = sock.makefile("wb", buffering=0)
        return writer, sock.makefile("rb")

    @property
    def saver_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -------------------------------------------------------------- trainer -> saver
    def _send(self, **msg: Any) -> None:
        line = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self._to_saver.write(line)
                self._to_saver.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:
                who = f"pid {self.proc.pid}" if self.proc is not None else f"started by rank {self.node.ranks[0]}"
                raise CheckpointError(
                    f"the checkpoint saver process ({who}) is gone ({self._lost or exc}); "
                    "snapshots cannot be persisted"
                ) from exc

    def start_fill(self, slot: int) -> _Fill:
        """Begin a snapshot into ``slot``: ``found`` per tensor of the walk, then ``finish``
        (or ``abort`` if anything failed)."""
        return _Fill(self, slot)

    def _new_segment(self, slot: int, layout: tuple, skeleton_len: int, pin: bool) -> Segment:
        """A segment of the next generation for ``slot``, announced to the saver; the old one closed."""
        self._generation += 1
        new = Segment(self._dir, self._token, slot, self._generation, layout, 2 * skeleton_len, pin=pin)
        try:
            self._send(op="segment", slot=slot, path=str(new.path))
        except BaseException:
            new.close()
            raise
        old, self.segments[slot] = self.segments[slot], new
        if old is not None:
            old.close()
        return new

    def submit(self, slot: int, seq: int, step: int, pin: bool, reason: str | None) -> None:
        self._send(op="persist", slot=slot, seq=seq, step=step, pin=pin, reason=reason)

    def buffers(self, slot: int) -> list[torch.Tensor]:
        seg = self.segments[slot]
        return [] if seg is None else list(seg.buffers)

    def problem(self) -> str | None:
        if self._lost:
            return self._lost
        if not self._ready.is_set() and time.monotonic() - self._started > self._timeout:
            return f"the checkpoint saver process did not start within {self._timeout:.0f}s (async_save.saver_timeout)"
        return None

    # -------------------------------------------------------------- saver -> trainer
    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in self._from_saver:
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError:
                    log.warning("checkpoint saver said something unexpected: %r", raw[:200])
                    continue
                op = msg.get("op")
                if op == "ready":
                    self._ready.set()
                elif op == "done":
                    error = None if msg.get("ok") else str(msg.get("error") or "unknown error")
                    self._done(int(msg["seq"]), int(msg["step"]), error, float(msg.get("seconds") or 0.0))
                elif op == "closed":
                    self._said_closed.set()
                elif op == "rescuing":
                    self._rescuing = True
                    log.warning("checkpoint saver: a rank of this node died; persisting step %s", msg.get("step"))
        if self.proc is not None:
            what = f"the checkpoint saver process exited unexpectedly (exit code {self.proc.wait()})"
        else:
            what = f"the node's checkpoint saver process (started by rank {self.node.ranks[0]}) closed its connection"
        if not self._closing:
            self._lost = what
            # said as an error once, by the manager at the loop's next call (with what was lost)
            log.info("%s; the snapshots in flight are lost (the trainer persists the next ones itself)", self._lost)
            self._done(-1, -1, self._lost, 0.0)  # fails whatever is in flight

    # -------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Say close; the leader then waits for the saver (which waits for every rank of the node)."""
        self._closing = True
        try:
            with contextlib.suppress(CheckpointError):
                self._send(op="close")
            if self.proc is None and self._lost is None:
                # another rank: the saver keeps our segments until it exits (a rank that dies
                # after we closed still gets its rescue, with our snapshots); a saver gone
                # says nothing more
                self._said_closed.wait(timeout=self._timeout)
            with contextlib.suppress(OSError):
                self._to_saver.close()
            if self.proc is not None:
                self._wait_saver(self.proc)
            elif self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._reader.join(timeout=self._timeout)
            with contextlib.suppress(OSError):
                self._from_saver.close()
            if self._sock is not None:
                self._sock.close()
        finally:
            # the leader (once the saver is gone) or a rank whose saver is lost unlinks; another
            # rank only unmaps: the saver unlinks its segments when the whole node is done
            unlink = self.proc is not None or self._lost is not None or not self._said_closed.is_set()
            for seg in self.segments:
                if seg is not None:
                    seg.close(unlink=unlink)
            self.segments = [None] * len(self.segments)
            if self.proc is not None:
                for leftover in self._dir.glob(self.node.prefix() + "*"):
                    with contextlib.suppress(FileNotFoundError):
                        leftover.unlink()
                with contextlib.suppress(FileNotFoundError):
                    self.node.socket_path(self._dir).unlink()

    def _wait_saver(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for the saver to exit: ``saver_timeout`` once idle, as long as it takes while it rescues."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                proc.wait(timeout=1.0)
                return
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline and not self._rescuing:
                    break
        others = [r for r in self.node.ranks if r != self.rank]
        log.error("checkpoint saver pid %d did not exit within %.0fs%s; killing it", proc.pid, self._timeout,
                  f" (waiting for rank(s) {others} of this node to close?)" if others else "")
        proc.kill()
        proc.wait()


class _Fill:
    """One snapshot into a slot's shared-memory segment.

    The segment in place is marked WRITING (and locked) at once; a tensor whose entry in its
    layout (index, path, shape, dtype) matches is copied as soon as the walk finds it. Once the
    walk is done, a layout that no longer fits gets a new segment (the copies already started
    into the old one are waited for first: it is about to be unmapped) and the rest is copied;
    COMPLETE is written only after every device-to-host copy is done. The slot's previous
    content is never the newest unpersisted snapshot (``AsyncCheckpointer._free_slot``), so
    overwriting it early loses nothing.
    """

    def __init__(self, backend: ShmBackend, slot: int) -> None:
        self._backend = backend
        self._slot = slot
        self._seg = backend.segments[slot]
        if self._seg is not None:
            self._seg.begin()
        self._batch = backend._copier.batch()
        self._copied: set[int] = set()

    def found(self, index: int, where: str, tensor: torch.Tensor) -> None:
        seg = self._seg
        if seg is not None and index < len(seg.layout) and seg.layout[index] == (where, tuple(tensor.shape), tensor.dtype):
            self._batch.add(seg.buffers[index], tensor)
            self._copied.add(index)

    def finish(self, seq: int, step: int, skeleton: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        layout = layout_of(tensors)
        guess = len(pickle.dumps(skeleton, protocol=5)) + 96 * len(layout) + 512
        seg = self._seg
        if seg is None or not seg.fits(layout, guess):
            if self._copied:  # into the segment about to be unmapped: let them land first
                events, _ = self._batch.finish()
                wait_events(events)
                self._batch, self._copied = self._backend._copier.batch(), set()
            pin = any(t.device.type == "cuda" for _, t in tensors)
            seg = self._backend._new_segment(self._slot, layout, guess, pin)
            self._seg = seg
            seg.begin()
        for i, (buf, (_, tensor)) in enumerate(zip(seg.buffers, tensors, strict=True)):
            if i not in self._copied:
                self._batch.add(buf, tensor)
        events, nbytes = self._batch.finish()
        wait_events(events)  # COMPLETE must never precede the device-to-host copy
        seg.commit(seq, step, skeleton, nbytes)
        seg.end()

    def abort(self) -> None:
        """The save failed: wait for the copies started, leave the slot WRITING and unlocked."""
        events, _ = self._batch.finish()
        wait_events(events)
        if self._seg is not None:
            self._seg.end()
