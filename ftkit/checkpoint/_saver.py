"""The saver process: persists snapshots that live in shared memory, and outlives a crashed trainer.

Started by the trainer (``ShmBackend`` in ``_saver_client``) as::

    python -m ftkit.checkpoint._saver --config JSON --trainer-pid PID [--events FILE --rank R]

It reads one JSON command per line on stdin and answers one JSON line per command on its
(original) stdout; everything else it prints goes to stderr.

* ``{"op": "segment", "slot": i, "path": P}``  slot i now lives in segment P (saver unlinks it at exit)
* ``{"op": "persist", "slot": i, "seq": n, "step": s, "pin": b, "reason": r}``  commit it through
  ``Checkpointer.persist`` straight from shared memory; answers ``{"op": "done", "seq": n, "ok": ...}``
* ``{"op": "close"}``  clean shutdown: unlink the segments, exit 0.

EOF on stdin (or the trainer's pid no longer being our parent) without ``close`` means the
trainer died: the saver persists the newest COMPLETE snapshot (if it is newer than what is
on disk), unlinks every segment and exits. It ignores SIGINT, SIGTERM, SIGHUP and SIGUSR1/2
(SLURM and Ctrl-C signal the whole step or process group; the trainer decides, the saver
only follows the pipe), so only kill -9 stops it early.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ftkit.checkpoint.saver")

_POLL = 0.5


class Saver:
    def __init__(self, checkpointer: Any, trainer_pid: int, out: Any) -> None:
        self.ckpt = checkpointer
        self.trainer_pid = trainer_pid
        self.out = out
        self.segments: dict[int, Path] = {}
        self.persisted: set[int] = set()  # steps this saver committed

    def reply(self, **msg: Any) -> bool:
        try:
            self.out.write(json.dumps(msg) + "\n")
            self.out.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def handle(self, cmd: dict[str, Any]) -> bool:
        """Run one command; False once the saver should stop."""
        op = cmd.get("op")
        if op == "segment":
            self.segments[int(cmd["slot"])] = Path(cmd["path"])
            return True
        if op == "persist":
            started = time.monotonic()
            try:
                info = self.persist(int(cmd["slot"]), int(cmd["seq"]), int(cmd["step"]),
                                    pin=bool(cmd.get("pin")), reason=cmd.get("reason"))
            except Exception as exc:
                log.warning("saver: persisting step %s failed: %s", cmd.get("step"), exc)
                return self.reply(op="done", seq=cmd["seq"], step=cmd["step"], ok=False,
                                  error=str(exc), error_type=type(exc).__name__)
            return self.reply(op="done", seq=cmd["seq"], step=cmd["step"], ok=True, size=info.size,
                              path=str(info.path), seconds=round(time.monotonic() - started, 4))
        if op == "close":
            return False
        log.warning("saver: unknown command %r ignored", op)
        return True

    def persist(self, slot: int, seq: int | None, step: int, *, pin: bool, reason: str | None) -> Any:
        from ..errors import CheckpointError
        from ._async_buffers import materialize
        from ._shm import read_slot
        from ._state import Snapshot

        path = self.segments.get(slot)
        view = read_slot(path, seq=seq) if path is not None else None
        if view is None:
            raise CheckpointError(f"snapshot seq {seq} of step {step} is not complete in shared memory ({path})")
        try:
            snap = Snapshot(local=materialize(view.skeleton, view.tensors), nbytes=view.nbytes)
            info = self.ckpt.persist(snap, step, pin=pin, reason=reason)
            del snap
        finally:
            view.close()
        self.persisted.add(step)
        return info

    def rescue(self) -> None:
        """The trainer is gone: persist the newest complete snapshot unless it is already on disk."""
        from ._shm import COMPLETE, read_header

        best: tuple[int, int, int] | None = None
        for slot, path in self.segments.items():
            head = read_header(path)
            if head is not None and head[0] == COMPLETE and (best is None or head[1] > best[1]):
                best = (slot, head[1], head[2])
        if best is None:
            log.warning("saver: trainer %d is gone and no complete snapshot is in shared memory", self.trainer_pid)
            return
        slot, seq, step = best
        if step in self.persisted or self.ckpt.validate(self.ckpt.root / f"step-{step:08d}").valid:
            log.info("saver: trainer %d is gone; its newest snapshot (step %d) is already durable", self.trainer_pid, step)
            return
        log.warning("saver: trainer %d is gone; persisting its newest complete snapshot, step %d", self.trainer_pid, step)
        try:
            info = self.persist(slot, seq, step, pin=False, reason="trainer died: newest in-memory snapshot")
            log.warning("saver: step %d is durable at %s", step, info.path)
        except Exception as exc:
            log.error("saver: could not persist step %d after the trainer died: %s", step, exc)

    def unlink_all(self) -> None:
        for path in self.segments.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def run(self) -> int:
        buf = b""
        clean = False
        while True:
            ready, _, _ = select.select([0], [], [], _POLL)
            if not ready:
                if os.getppid() != self.trainer_pid:
                    break
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            buf += chunk
            stop = False
            while b"\n" in buf and not stop:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    stop = not self.handle(json.loads(line))
            if stop:
                clean = True
                break
        try:
            if not clean:
                self.rescue()
        finally:
            self.unlink_all()
        return 0


def main(argv: list[str] | None = None) -> int:
    # The protocol owns the original stdout; anything printed later goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="python -m ftkit.checkpoint._saver")
    ap.add_argument("--config", required=True, help="CheckpointConfig fields as JSON")
    ap.add_argument("--trainer-pid", type=int, required=True)
    ap.add_argument("--events")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="ftkit-saver[%(process)d] %(levelname)s %(message)s")

    from ._config import CheckpointConfig
    from ._manager import Checkpointer

    events = None
    if args.events:
        from ..events import EventLog

        events = EventLog(args.events, rank=args.rank)
    checkpointer = Checkpointer(CheckpointConfig(**json.loads(args.config)), events=events, rank=args.rank)
    saver = Saver(checkpointer, args.trainer_pid, out)
    if not saver.reply(op="ready", pid=os.getpid()):
        saver.trainer_pid = -1  # the trainer is already gone: fall through to the rescue path
    return saver.run()


if __name__ == "__main__":
    sys.exit(main())
