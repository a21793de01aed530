"""``ftkit save|kill|request|status``: ask a running job to act, and see what it is doing."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

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

    p = sub.add_parser("status", help="pending triggers, switches, checkpoints and recent events")
    p.add_argument("jobdir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--events", type=int, default=10, metavar="N", help="show the last N events")
    p.set_defaults(func=_status)


def _existing_jobdir(path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(f"job dir {path} does not exist; pass the directory the job was started with")
    return path


def _switch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..jobdir import JobDir
    from ..triggers.files import touch_switch

    job = JobDir.of(_existing_jobdir(args.jobdir))
    console = Console()
    if getattr(args, "clear", False):
        try:
            job.kill_switch.unlink()
            console.print(f"removed {job.kill_switch}")
        except FileNotFoundError:
            console.print(f"no kill-switch in {job.root}")
        return 0
    path = touch_switch(job, args.which)
    what = "save at its next step and keep training" if args.which == "save" else \
        "save, exit and not be requeued (remove with `ftkit kill --clear`)"
    console.print(f"touched {path}: the job will {what}")
    return 0


def _request(args: argparse.Namespace) -> int:
    from ..triggers.files import write_request

    path = write_request(_existing_jobdir(args.jobdir), args.action, reason=args.reason)
    print(path)
    return 0


def collect_status(jobdir: Path, *, events: int = 10) -> dict[str, Any]:
    """Everything ``ftkit status`` shows, as plain data (also its ``--json`` output)."""
    from ..events import read_events
    from ..jobdir import JobDir

    job = JobDir.of(_existing_jobdir(jobdir))
    requests = []
    for path in sorted(job.requests.glob("*.json")) if job.requests.is_dir() else []:
        try:
            requests.append({"path": str(path), **json.loads(path.read_text())})
        except (OSError, json.JSONDecodeError) as exc:
            requests.append({"path": str(path), "error": str(exc)})
    log = list(read_events(job.events))
    status: dict[str, Any] = {
        "jobdir": str(job.root),
        "time": time.time(),
        "save_switch": job.save_switch.is_file(),
        "kill_switch": job.kill_switch.is_file(),
        "requests": requests,
        "events": log[-events:] if events > 0 else [],
    }
    try:
        from ..checkpoint import CheckpointConfig, make_manager
    except ImportError:  # pragma: no cover - the checkpoint package is part of ftkit
        status["checkpoints"] = None
    else:
        mgr = make_manager(CheckpointConfig(root=job.checkpoints), events=None, rank=0, world_size=1)
        status["checkpoints"] = [_info(i) for i in mgr.list()]
    return status


def _info(info: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    data = asdict(info) if is_dataclass(info) else dict(vars(info))
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in data.items()}


def _status(args: argparse.Namespace) -> int:
    status = collect_status(args.jobdir, events=args.events)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{status['jobdir']}[/]")
    pending = []
    if status["save_switch"]:
        pending.append("save-switch (save at the next step)")
    if status["kill_switch"]:
        pending.append("[red]kill-switch[/] (save and stop; later runs exit at once)")
    pending += [f"request: {r.get('action', '?')} {r.get('reason', '')}" for r in status["requests"]]
    console.print("pending: " + (", ".join(pending) if pending else "nothing"))
    table = Table("time", "event", "rank", "step", "details", title="recent events")
    for e in status["events"]:
        details = e.get("reason") or e.get("reasons") or e.get("action") or ""
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["time"])), e["event"],
                      str(e.get("rank", "")), str(e.get("step", "")), str(details))
    console.print(table)
    return 0
