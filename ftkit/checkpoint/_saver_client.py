"""Trainer side of ``crash_safe``: snapshots in shared-memory slots, persisted by a saver process.

One saver per trainer process (``python -m ftkit.checkpoint._saver``), started here with
``subprocess.Popen``; its stdin is a pipe whose EOF tells it the trainer is gone, so it works
under plain python, srun and torchrun without a custom launcher. A reader thread turns the
saver's answers into ``done(seq, step, error, seconds)`` calls.

Clean close: ``close`` command, wait for the saver to exit, unlink every segment (the saver
unlinks them too; both are idempotent). Trainer killed: the saver persists the newest
COMPLETE slot, unlinks the segments and exits (see ``_saver``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import torch

from ..errors import CheckpointError
from ._async_buffers import Copier, layout_of, wait_events
from ._shm import Segment, new_token

__all__ = ["ShmBackend"]

log = logging.getLogger(__name__)


def _saver_env() -> dict[str, str]:
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[2])  # so `-m ftkit...` imports this ftkit
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class ShmBackend:
    """``slots`` shared-memory segments (created lazily, reused while the layout holds) and the saver."""

    def __init__(self, config: Any, async_config: Any, slots: int, done: Any, copier: Copier,
                 *, events: Any = None, rank: int = 0) -> None:
        self._done = done
        self._copier = copier
        self._dir = Path(async_config.shm_dir)
        self._timeout = float(async_config.saver_timeout)
        self._token = new_token()
        self._generation = 0
        self.segments: list[Segment | None] = [None] * slots
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = False
        self._started = time.monotonic()
        self._lost: str | None = None
        fields = {"root": str(config.root), "keep_last": config.keep_last, "keep_every": config.keep_every,
                  "fsync": config.fsync, "verify_on_load": config.verify_on_load}
        cmd = [sys.executable, "-m", "ftkit.checkpoint._saver", "--config", json.dumps(fields),
               "--trainer-pid", str(os.getpid()), "--rank", str(rank)]
        path = getattr(events, "path", None)
        if path is not None:
            cmd += ["--events", str(path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_saver_env())
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self._to_saver: IO[bytes] = self.proc.stdin
        self._from_saver: IO[bytes] = self.proc.stdout
        self._reader = threading.Thread(target=self._read, name="ftkit-saver-reader", daemon=True)
        self._reader.start()

    # -------------------------------------------------------------- trainer -> saver
    def _send(self, **msg: Any) -> None:
        line = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self._to_saver.write(line)
                self._to_saver.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:
                raise CheckpointError(
                    f"the checkpoint saver process (pid {self.proc.pid}) is gone ({self._lost or exc}); "
                    "snapshots cannot be persisted"
                ) from exc

    def fill(self, slot: int, seq: int, step: int, skeleton: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        layout = layout_of(tensors)
        guess = len(pickle.dumps(skeleton, protocol=5)) + 96 * len(layout) + 512
        seg = self.segments[slot]
        if seg is None or not seg.fits(layout, guess):
            pin = any(t.device.type == "cuda" for _, t in tensors)
            self._generation += 1
            new = Segment(self._dir, self._token, slot, self._generation, layout, 2 * guess, pin=pin)
            try:
                self._send(op="segment", slot=slot, path=str(new.path))
            except BaseException:
                new.close()
                raise
            if seg is not None:
                seg.close()
            self.segments[slot] = seg = new
        seg.begin()
        events, nbytes = self._copier.copy(seg.buffers, [t for _, t in tensors])
        wait_events(events)  # COMPLETE must never precede the device-to-host copy
        seg.commit(seq, step, skeleton, nbytes)

    def submit(self, slot: int, seq: int, step: int, pin: bool, reason: str | None) -> None:
        self._send(op="persist", slot=slot, seq=seq, step=step, pin=pin, reason=reason)

    def buffers(self, slot: int) -> list[torch.Tensor]:
        seg = self.segments[slot]
        return [] if seg is None else list(seg.buffers)

    def problem(self) -> str | None:
        if self._lost:
            return self._lost
        if not self._ready.is_set() and time.monotonic() - self._started > self._timeout:
            return f"the checkpoint saver process did not start within {self._timeout:.0f}s (checkpoint.async.saver_timeout)"
        return None

    # -------------------------------------------------------------- saver -> trainer
    def _read(self) -> None:
        for raw in self._from_saver:
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:
                log.warning("checkpoint saver said something unexpected: %r", raw[:200])
                continue
            if msg.get("op") == "ready":
                self._ready.set()
            elif msg.get("op") == "done":
                error = None if msg.get("ok") else str(msg.get("error") or "unknown error")
                self._done(int(msg["seq"]), int(msg["step"]), error, float(msg.get("seconds") or 0.0))
        code = self.proc.wait()
        if not self._closing:
            self._lost = f"the checkpoint saver process exited unexpectedly (exit code {code})"
            log.error("%s; snapshots are no longer persisted", self._lost)
            self._done(-1, -1, self._lost, 0.0)  # fails whatever is in flight

    # -------------------------------------------------------------- shutdown
    def close(self) -> None:
        self._closing = True
        try:
            with contextlib.suppress(CheckpointError):
                self._send(op="close")
            with contextlib.suppress(OSError):
                self._to_saver.close()
            try:
                self.proc.wait(timeout=self._timeout)
            except subprocess.TimeoutExpired:
                log.error("checkpoint saver pid %d did not exit within %.0fs; killing it", self.proc.pid, self._timeout)
                self.proc.kill()
                self.proc.wait()
            self._reader.join()
            with contextlib.suppress(OSError):
                self._from_saver.close()
        finally:
            for seg in self.segments:
                if seg is not None:
                    seg.close()
            self.segments = [None] * len(self.segments)
