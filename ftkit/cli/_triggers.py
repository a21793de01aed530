"""``ftkit save|kill|request``: ask a running job to act.

The path must be a job dir (see ``_paths``): a switch or request file anywhere else is never
seen, so those commands refuse a checkpoint, a checkpoint root, a file, the parent of job dirs,
or (``save``/``kill`` without ``--force``) a directory that holds other things but no ftkit
file, and say which path to pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from ..jobdir import REQUESTS
from ._paths import Place, place, wrong_place

__all__ = ["register"]


_JOBDIR_HELP = ("the job dir: the directory the job was started with (not its checkpoints/ or a step "
                "dir); an empty directory counts (a job that has not started yet sees the file at its start)")
_FORCE_HELP = ("use JOBDIR although it does not look like a job dir (not empty, yet no ftkit files, or "
               "inside another job dir); a checkpoint or a checkpoint root is refused even so")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("save", help="touch the save-switch: save at the next step, keep training")
    p.add_argument("jobdir", type=Path, help=_JOBDIR_HELP)
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_switch, which="save")

    p = sub.add_parser("kill", help="touch the kill-switch: save, exit, never requeue")
    p.add_argument("jobdir", type=Path, help=_JOBDIR_HELP)
    p.add_argument("--clear", action="store_true", help="remove the kill-switch so the job may run again")
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_switch, which="kill")

    p = sub.add_parser(
        "request",
        help="write a request file a running job acts on (used by batch-script signal traps)",
    )
    p.add_argument("action", choices=["save", "save-exit", "stop", "requeue", "exit"])
    p.add_argument("jobdir", type=Path, help=_JOBDIR_HELP + "; so does one with other files but no ftkit "
                   "file yet (the training may write there before ftkit starts): a note on stderr says so")
    p.add_argument("--reason", default="", help="recorded in the events log")
    p.add_argument("--this-run", action="store_true",
                   help="for this SLURM job's current run only (SLURM_JOB_ID, SLURM_RESTART_COUNT): a later run "
                        "discards it (the sbatch templates' signal traps: a request of a run whose batch script "
                        "was killed must not stop the next one)")
    p.add_argument("--force", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_request)


def _jobdir(args: argparse.Namespace) -> Place:
    """The job dir a switch or request file goes into: refuses a path the job never watches
    (a checkpoint, a checkpoint root, a file, the parent of job dirs) with what to pass instead.

    An empty directory is accepted: the sbatch template creates the job dir, and its signal
    trap may write a request before the training has started (it acts on it at its start),
    as may ``ftkit kill`` to stop a queued job. ``ftkit request`` (the traps' command) also
    takes a directory with other files but no ftkit file yet; ``save`` and ``kill`` (typed by
    a person) want ``--force`` for it.
    """
    where = place(args.jobdir)
    if where.kind in ("job", "fresh") or (args.force and where.kind in ("other", "inside")):
        return where
    own = where.kind == "inside" and where.path.parent == where.job and where.path.name in (REQUESTS, "heartbeats")
    if args.func is _request and where.kind in ("other", "inside") and not where.job_dirs and not own:
        # a batch script's trap: the training may have written its own files into the job dir
        # before ftkit started in it, and a job dir not started yet may lie below a directory
        # that looks like a job dir (one with a checkpoints/ of its own); a request refused
        # there would lose a requeue (a job dir's own requests/ is refused: a slip)
        return where
    if getattr(args, "clear", False) and where.kind in ("other", "inside"):
        return where  # nothing is written: at worst "no kill-switch in ..."
    message = wrong_place(where)
    if where.kind == "other" and not where.job_dirs:
        message += f", or add --force if a job that has not started yet will use {where.path}"
    raise ConfigError(message)


def _not_started(where: Place, what: str) -> str:
    return f"no job has started in {where.path} yet; a job started with this job dir {what}"


def _switch(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ..jobdir import JobDir
    from ..triggers.switches import remove_kill_switch, touch_switch

    where = _jobdir(args)
    job = JobDir.of(where.path)
    console = Console()
    if getattr(args, "clear", False):
        if remove_kill_switch(job):
            console.print(f"removed {escape(str(job.kill_switch))}", highlight=False)
        else:
            console.print(f"no kill-switch in {escape(str(job.root))}", highlight=False)
        return 0
    path = touch_switch(job, args.which)
    from ..lease import lease_status

    try:
        lease = lease_status(job.root) if job.events.exists() else None
    except OSError:  # the switch is in place; what holds the job dir is a nicety
        lease = None
    if lease is not None and lease["state"] in ("released", "dead"):  # no run is there to act on it now
        what = "saves at its first step" if args.which == "save" else \
            "exits at its first check, trains nothing and is not requeued (`ftkit kill --clear` removes it)"
        console.print(f"touched {escape(str(path))}: no run holds the job dir now (lease: "
                      f"{escape(lease['description'])}); the next run started in it {what}", highlight=False)
    elif job.events.exists():
        what = "save at its next step and keep training" if args.which == "save" else \
            "save, exit and not be requeued (remove with `ftkit kill --clear`)"
        console.print(f"touched {escape(str(path))}: the job will {what}", highlight=False)
    else:
        what = "saves at its first step" if args.which == "save" else \
            "exits at its first check, trains nothing and is not requeued (`ftkit kill --clear` removes it)"
        console.print(f"touched {escape(str(path))}: {escape(_not_started(where, what))}", highlight=False)
    return 0


def _request(args: argparse.Namespace) -> int:
    from ..jobdir import JobDir
    from ..triggers.switches import write_request

    where = _jobdir(args)
    run = None
    if args.this_run:
        from ..slurm.env import SlurmEnv

        slurm = SlurmEnv.from_env()
        if slurm.job_id is None:
            raise ConfigError("ftkit request --this-run: SLURM_JOB_ID is not set (not in a SLURM job); "
                              "leave --this-run out to write a request for whichever run reads it")
        run = (slurm.job_id, slurm.restart_count)
    path = write_request(where.path, args.action, reason=args.reason, run=run)
    print(path)
    if not JobDir.of(where.path).events.exists():  # stdout: the path alone (scripts read it)
        print(f"note: {_not_started(where, 'acts on it at its start')}", file=sys.stderr)
    return 0
