"""The events log: every trigger, decision, save, delete and requeue as one JSON line.

Lines are appended with a single ``write`` on a file opened with ``O_APPEND``, so lines
from several ranks or processes on a local filesystem never interleave. Readers skip a
torn last line (a process killed mid-write, a full disk) instead of failing, and the next
writer ends it before its own line, so no record written later is lost with it (a log torn
before this was written: the reader finds the record after the torn part of the line).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events"]

log = logging.getLogger(__name__)


class EventLog:
    """Append-only JSON-lines log shared by every rank of a job.

    Each record has ``time`` (UNIX seconds), ``event`` (a short kind such as ``trigger``,
    ``decision``, ``save``, ``delete``, ``requeue``), ``rank``, ``host``, ``pid`` and
    whatever fields the caller adds (``step``, ``reason``, ...).
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: int = 0, clock=time.time) -> None:
        self.path = Path(path)
        self.rank = rank
        self._clock = clock
        self._host = socket.gethostname()
        self._lost = 0  # records not written since the last one that was (a full disk: one warning)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time": round(self._clock(), 6),
            "event": event,
            "rank": self.rank,
            "host": self._host,
            "pid": os.getpid(),
        }
        record.update(fields)
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: ended first
                    line = b"\n" + line
                while line:
                    line = line[os.write(fd, line):]
            finally:
                os.close(fd)
        except OSError as exc:  # the audit trail must never stop training
            # said once per streak: on a full disk every step's records fail, and a warning for
            # each would bury the save's own error
            log.log(logging.WARNING if not self._lost else logging.DEBUG,
                    "could not append to events log %s: %s (said once until a record is written again)",
                    self.path, exc)
            self._lost += 1
            return record
        if self._lost:
            log.warning("events log %s written again; %d record(s) could not be written before", self.path,
                        self._lost)
            self._lost = 0
        return record


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield every complete record of an events log; a missing file yields nothing."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # torn last line from a killed writer
                try:
                    yield json.loads(raw)
                except json.JSONDecodeError:
                    # a torn line a later record was appended to (by a writer before this one
                    # ended torn lines): that record is whole after the torn part
                    at = raw.rfind(b'{"time": ')
                    if at > 0:
                        with contextlib.suppress(json.JSONDecodeError):
                            yield json.loads(raw[at:])
    except FileNotFoundError:
        return
