"""``ftkit save|kill|request``: ask a running job to act."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("save", help="touch the save-switch: save at the next step, keep training")
    p.add_argument("jobdir", type=Path)
    p.set_defaults(func=_switch, which="save")

    p = sub.add_parser("kill", help="touch the kill-switch: save, exit, never requeue")
    p.add_argument("jobdir", type=Path)
    p.add_argument("--clear", action="store_true", help="remove the kill-switch so the job may run again")
    p.set_defaults(func=_switch, which="kill")

    p = sub.add_parser(
        "request",
        help="write a request file a running job acts on (used by batch-script signal traps)",
    )
    p.add_argument("action", choices=["save", "save-exit", "stop", "requeue", "exit"])
    p.add_argument("jobdir", type=Path)
    p.add_argument("--reason", default="", help="recorded in the events log")
    p.set_defaults(func=_request)


def _existing_jobdir(path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(f"job dir {path} does not exist; pass the directory the job was started with")
    return path


def _switch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..jobdir import JobDir
    from ..triggers.switches import remove_kill_switch, touch_switch

    job = JobDir.of(_existing_jobdir(args.jobdir))
    console = Console()
    if getattr(args, "clear", False):
        if remove_kill_switch(job):
            console.print(f"removed {job.kill_switch}")
        else:
            console.print(f"no kill-switch in {job.root}")
        return 0
    path = touch_switch(job, args.which)
    what = "save at its next step and keep training" if args.which == "save" else \
        "save, exit and not be requeued (remove with `ftkit kill --clear`)"
    console.print(f"touched {path}: the job will {what}")
    return 0


def _request(args: argparse.Namespace) -> int:
    from ..triggers.switches import write_request

    path = write_request(_existing_jobdir(args.jobdir), args.action, reason=args.reason)
    print(path)
    return 0
