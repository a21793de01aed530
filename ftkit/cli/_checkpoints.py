"""``ftkit ls``, ``verify``, ``pin``, ``unpin``: look at and protect checkpoints. No torch needed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, NoCheckpointError
from ._paths import Root, checkpoint_root, place, wrong_place

__all__ = ["register"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ls", help="list checkpoints of a job: step, age, size, validity, pin"
    )
    p.add_argument("jobdir", type=Path, help="the job dir (its checkpoints are found where its events log "
                   "says they were saved) or a checkpoint root")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("verify", help="check checkpoints including every file checksum")
    p.add_argument("path", type=Path, help="a step directory, a checkpoint root or a job directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_verify)

    for name, what in (
        ("pin", "keep a checkpoint whatever retention says"),
        ("unpin", "let retention delete it again"),
    ):
        p = subparsers.add_parser(name, help=what)
        p.add_argument("jobdir", type=Path, help="the job dir or a checkpoint root")
        p.add_argument("step", type=int, help="the checkpoint's step")
        p.set_defaults(func=cmd_pin if name == "pin" else cmd_unpin)


_TAKES = "a job dir or a checkpoint root"


def _root(path: Path, *, command: str) -> tuple[Root, Path | None]:
    """``(checkpoint root, job dir or None)`` for a job dir (its root from its events log, see
    ``_paths.checkpoint_root``) or a checkpoint root; any other path is refused with what it is
    and what to pass instead."""
    from ..events import read_events
    from ..jobdir import JobDir

    where = place(path)
    if where.kind == "job":
        return checkpoint_root(where.path, read_events(JobDir.of(where.path).events)), where.path
    if where.kind in ("root", "fresh", "inside"):
        job = where.job
        if job is not None and checkpoint_root(job, read_events(JobDir.of(job).events)).path != where.path:
            job = None  # not the root the job saves to
        if where.kind != "inside" or job is not None:  # JOBDIR/checkpoints before the first save is "inside"
            return Root(where.path), job
    if where.kind == "step":
        instead = f"pass {where.job or where.path.parent}"
        if command == "ls":
            instead += f" to list them all, or run `ftkit verify {where.path}` to check this one"
        else:
            instead += " and the step"
        raise ConfigError(wrong_place(where, takes=_TAKES, instead=instead))
    raise ConfigError(wrong_place(where, takes=_TAKES))


def _none(root: Root, job: Path | None) -> str:
    """Why there is no checkpoint to list, in words."""
    if not root.exists:
        return f"no checkpoints in {root}: it does not exist here" if root.found_in else \
            f"no checkpoints in {root} yet"
    if job is None and not any(root.path.iterdir()):
        return f"no checkpoints in {root} yet: it is empty (no step dirs, and no ftkit job has started in it)"
    return f"no checkpoints in {root} yet"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _age(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    s = max(0.0, now - t)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def _table(infos, title: str) -> None:
    """``title`` on a line of its own (a table title wraps to the table's width), then one row
    per checkpoint; ``why`` is what is wrong with it, or for a valid one why it was saved."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    now = time.time()
    colour = {"valid": "green", "incomplete": "yellow", "unsealed": "yellow", "corrupt": "red"}
    table = Table()
    for col in ("step", "age", "size", "status", "pinned", "why"):  # a long path in "why" folds, whole
        table.add_column(col, justify="right" if col in ("step", "size") else "left",
                         overflow="fold" if col == "why" else "ellipsis")
    for i in infos:
        table.add_row(
            str(i.step),
            _age(i.time, now),
            _human(i.size) if i.size else "-",
            f"[{colour.get(i.status, 'white')}]{i.status}[/]",
            "yes" if i.pinned else "",
            escape(i.reason or i.saved_for or ""),
        )
    console = Console()
    console.print(escape(title), highlight=False)  # a path may hold [brackets]
    console.print(table)


def _dump(infos) -> None:
    now = time.time()
    print(
        json.dumps(
            [
                {**i.to_json(), "age_s": None if i.time is None else round(now - i.time, 3)}
                for i in infos
            ],
            indent=1,
        )
    )


def cmd_ls(args: argparse.Namespace) -> int:
    from ..checkpoint import validate_dir

    root, job = _root(args.jobdir, command="ls")
    infos = [validate_dir(p) for _, p in root.step_dirs()]
    if args.json:
        _dump(infos)
    elif not infos:
        from rich.console import Console
        from rich.markup import escape

        Console().print(escape(_none(root, job)), highlight=False)
    else:
        _table(infos, f"checkpoints in {root}")
    return 0


def _progress(items: list[Any], what: str, *, quiet: bool) -> Any:
    """A progress bar on stderr over ``items`` (checksumming reads every byte: it can take minutes)."""
    if quiet or len(items) < 2:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=f"{what} {len(items)} checkpoints", transient=True,
                 console=Console(stderr=True))


def cmd_verify(args: argparse.Namespace) -> int:
    from ..checkpoint import validate_dir

    path = place(args.path)
    if path.kind == "step":  # an empty one too: it is reported as a save that never finished
        dirs = [path.path]
        where = str(path.path)
    elif path.kind == "file" and path.path.parent.is_dir() and place(path.path.parent).kind == "step":
        raise ConfigError(wrong_place(path, takes="a directory",
                                      instead=f"pass its step dir {path.path.parent} to verify that checkpoint"))
    else:
        root, job = _root(args.path, command="verify")
        dirs = [p for _, p in root.step_dirs()]
        where = str(root)
        if not dirs:
            raise NoCheckpointError(_none(root, job))
    infos = [validate_dir(p, checksums=True) for p in _progress(dirs, "verifying", quiet=args.json)]
    if args.json:
        _dump(infos)
    else:
        _table(infos, f"verified {where}: sizes and crc32 checksums")
    # a save that never finished (a process killed during it, or one still running) is no
    # mismatch: resume passes over it and retention removes it; one step dir asked for is
    # reported as it is, and so is a root with nothing valid
    unfinished = [i for i in infos if i.status == "incomplete"] if path.kind != "step" else []
    # Trainer's own, from before ftkit: not verifiable, not bad; a resume takes the newest of them
    unsealed = [i for i in infos if i.status == "unsealed"]
    bad = [i for i in infos if not i.valid and i not in unfinished and i not in unsealed]
    valid = [i for i in infos if i.valid]
    from rich.console import Console

    also = (f"; {len(unfinished)} incomplete (a save that never finished or is running: harmless, "
            "resume passes over it)" if unfinished else "")
    also += (f"; {len(unsealed)} unsealed (Trainer wrote them without ftkit: no manifest to verify them "
             "against; a resume takes the newest where it is newer than every valid one)" if unsealed else "")
    if bad or not (valid or unsealed):
        what = f"{len(bad)} of {len(infos)} checkpoint(s) not valid" if bad else "no valid checkpoint"
        Console(stderr=True).print(f"[bold red]{what}[/]{also}", highlight=False)
        return CheckpointError.exit_code
    if not args.json:
        Console().print(f"[green]all {len(valid)} {'complete ' if unfinished else ''}checkpoint(s) valid[/]{also}",
                        highlight=False)
    return 0


def _pin(args: argparse.Namespace, pin: bool) -> int:
    from rich.console import Console

    from ..checkpoint import pin_checkpoint, unpin_checkpoint, validate_dir
    from ..checkpoint.format.layout import PIN, step_name
    from ..events import EventLog

    root, job = _root(args.jobdir, command="pin" if pin else "unpin")
    if root.hf:
        raise ConfigError(f"ftkit {'pin' if pin else 'unpin'}: {root} holds Hugging Face Trainer's checkpoint-N "
                          "directories, which ftkit does not pin: its retention (FTKIT_KEEP_LAST) keeps Trainer's "
                          "best model's; to keep another, copy it out of the output dir")
    console = Console()
    if not pin and not (root.path / step_name(args.step) / PIN).exists():
        path = unpin_checkpoint(root.path, args.step)  # a missing step is still an error, as for pin
        console.print(f"{path} was not pinned: nothing to do", highlight=False)
        return 0
    path = (pin_checkpoint if pin else unpin_checkpoint)(root.path, args.step)
    info = validate_dir(path)
    console.print(f"{'pinned' if pin else 'unpinned'} {path}", highlight=False)
    if pin and not info.valid:
        console.print(
            f"[yellow]warning:[/] step {args.step} is {info.status}: {info.reason}", highlight=False
        )
    if job is not None:
        from ..jobdir import JobDir

        EventLog(JobDir.of(job).events).emit(
            "pin" if pin else "unpin", step=args.step, path=str(path), source="cli"
        )
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    return _pin(args, True)


def cmd_unpin(args: argparse.Namespace) -> int:
    return _pin(args, False)
