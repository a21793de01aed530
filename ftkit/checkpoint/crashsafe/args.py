"""The crash-safe saver's command line, in one type: built by the trainer, parsed by the saver,
read back from ``/proc/PID/cmdline`` by ``ftkit requeue`` (``checkpoint/crashsafe/find``). No torch.

The saver runs as ``python -m`` :data:`SAVER_MODULE` ``ARGS``; :class:`SaverArgs` writes ``ARGS``
(:meth:`~SaverArgs.to_argv`) and reads them (:meth:`~SaverArgs.from_argv`), so the three
places cannot disagree. The :class:`CheckpointConfig` travels whole, as the JSON of all its
fields: a field added to it reaches the saver's ``Checkpointer`` without a change here
(``tests/test_saver_args.py`` round-trips every field).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CheckpointConfig

__all__ = ["SAVER_MODULE", "SaverArgs"]

SAVER_MODULE = "ftkit.checkpoint.crashsafe.saver"
"""What ``python -m`` runs as the saver; also how a saver process is recognised in ``/proc``."""


def _config_json(config: CheckpointConfig) -> str:
    """Every field of ``config`` as JSON (paths as text, tuples as lists)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return json.dumps(fields, default=os.fspath, sort_keys=True)


class _Quiet(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting (reading other processes)."""

    def error(self, message: str) -> Any:
        raise ValueError(message)


def _parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap = cls(prog=f"python -m {SAVER_MODULE}")
    ap.add_argument("--config", required=True, help="every CheckpointConfig field, as JSON")
    ap.add_argument("--trainer-pid", type=int, required=True, help="the leader's pid")
    ap.add_argument("--ranks", default="0", help="this node's ranks, the leader's first")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--run-id", help="several ranks: the id the ranks agreed on")
    ap.add_argument("--socket", type=Path, help="where the other ranks of this node connect")
    ap.add_argument("--commit-timeout", type=float, default=600.0)
    ap.add_argument("--connect-timeout", type=float, default=120.0)
    ap.add_argument("--events", type=Path, help="the job's event log")
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="where the segments live")
    return ap


@dataclass(frozen=True, kw_only=True, slots=True)
class SaverArgs:
    """What the node's leader tells the saver it starts (see ``crashsafe.saver`` for the protocol)."""

    config: CheckpointConfig
    """The trainer's checkpoint settings, whole: the saver's ``Checkpointer`` writes with them."""

    trainer_pid: int
    """The leader's pid: gone (or reused) means the leader died."""

    ranks: tuple[int, ...] = (0,)
    """This node's ranks, the leader's first."""

    world_size: int = 1
    """Ranks of the whole job; above 1 each rank's part is committed through ``RankCommit``."""

    run_id: str | None = None
    """Several ranks: the id the ranks agreed on (names each save's parts)."""

    socket: Path | None = None
    """Several ranks on the node: the Unix socket where the leader's peers connect."""

    commit_timeout: float = 600.0
    """``async_save.commit_timeout``: how long rank 0 waits for a missing rank's part."""

    connect_timeout: float = 120.0
    """``async_save.saver_timeout``: a rank that has not connected by then counts as gone."""

    events: Path | None = None
    """The job's event log, if any: the saver's saves are logged there as the trainer's."""

    shm_dir: Path = Path("/dev/shm")
    """``async_save.shm_dir``: where the segments live (its mount decides ``bounce``)."""

    def to_argv(self) -> list[str]:
        """The arguments after ``python -m SAVER_MODULE``."""
        argv = ["--config", _config_json(self.config), "--trainer-pid", str(self.trainer_pid),
                "--ranks", ",".join(map(str, self.ranks)), "--world-size", str(self.world_size),
                "--commit-timeout", repr(float(self.commit_timeout)),
                "--connect-timeout", repr(float(self.connect_timeout))]
        if self.run_id is not None:
            argv += ["--run-id", self.run_id]
        if self.socket is not None:
            argv += ["--socket", os.fspath(self.socket)]
        if self.events is not None:
            argv += ["--events", os.fspath(self.events)]
        return [*argv, "--shm-dir", os.fspath(self.shm_dir)]

    def command(self) -> list[str]:
        """The whole command line that starts the saver with this interpreter."""
        return [sys.executable, "-m", SAVER_MODULE, *self.to_argv()]

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> SaverArgs:
        """Parse :meth:`to_argv`'s arguments (``sys.argv[1:]`` when None); a bad one exits 2
        with argparse's message, a bad config field raises ``ConfigError`` naming it."""
        return cls._parse(_parser(), argv)

    @classmethod
    def from_cmdline(cls, cmdline: bytes) -> SaverArgs | None:
        """The arguments of the process whose ``/proc/PID/cmdline`` is ``cmdline``; None when it
        is not a saver, or one whose arguments do not parse (another ftkit version's)."""
        argv = [os.fsdecode(a) for a in cmdline.split(b"\0")]
        if argv and not argv[-1]:
            argv.pop()  # after the terminating NUL
        at = next((i for i in range(1, len(argv)) if argv[i - 1:i + 1] == ["-m", SAVER_MODULE]), None)
        if at is None:
            return None
        try:
            return cls._parse(_parser(_Quiet), argv[at + 1:])
        except (ValueError, TypeError):  # ConfigError is a ValueError
            return None

    @classmethod
    def _parse(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> SaverArgs:
        ns = parser.parse_args(argv)
        return cls(
            config=CheckpointConfig(**json.loads(ns.config)),
            trainer_pid=ns.trainer_pid,
            ranks=tuple(int(r) for r in ns.ranks.split(",")),
            world_size=ns.world_size,
            run_id=ns.run_id,
            socket=ns.socket,
            commit_timeout=ns.commit_timeout,
            connect_timeout=ns.connect_timeout,
            events=ns.events,
            shm_dir=ns.shm_dir,
        )
