"""``ftkit template`` and ``ftkit requeue``: write batch scripts, and end a run the right way."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from ..errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "template",
        help="render an sbatch template (single, srun, torchrun) with signal traps and requeue",
        description="Render an sbatch template from sbatch_templates/. "
        "`ftkit template --list` shows the templates and their settings.",
    )
    p.add_argument("name", nargs="?", help="template name, e.g. single")
    p.add_argument("--set", dest="values", action="append", default=[], metavar="KEY=VALUE",
                   help="set a placeholder (repeatable), e.g. --set time=04:00:00")
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="an extra #SBATCH option (repeatable), e.g. --sbatch=--mem=16G")
    p.add_argument("-o", "--output", type=Path, help="write to FILE instead of stdout")
    p.add_argument("--list", action="store_true", help="list the templates and their settings")
    p.set_defaults(func=_template)

    p = sub.add_parser(
        "requeue",
        help="end a run from the batch script: decide by policy, `scontrol requeue`, exit code for the script",
        description="Run by the batch script after the training exited. Decides whether the job "
        "goes back to the queue, requeues it (scontrol requeue, or resubmits), prints one line "
        "saying why and exits with the code the script should end with: 0 requeued, completed "
        "or stopped; the training's code for a crash that is not requeued; 75 when the work is "
        "unfinished but was not requeued.",
    )
    p.add_argument("jobdir", type=Path)
    p.add_argument("--exit-code", type=int, required=True, metavar="N", help="the training's exit code")
    p.add_argument("--max-requeues", type=int, metavar="N", help="cap on requeues in a row (default 20, env FTKIT_MAX_REQUEUES)")
    p.add_argument("--max-no-progress", type=int, metavar="N",
                   help="crashes in a row requeued without a newer checkpoint (default 2, env FTKIT_MAX_NO_PROGRESS)")
    p.add_argument("--no-requeue-on-crash", dest="requeue_on_crash", action="store_false", default=None,
                   help="never requeue a crash")
    p.add_argument("--fallback", choices=["resubmit", "none"],
                   help="when scontrol requeue fails: resubmit the script (default) or give up")
    p.add_argument("--script", type=Path, metavar="PATH",
                   help="batch script to resubmit (default: Command= of scontrol show job)")
    p.add_argument("--saver-wait", type=float, default=600.0, metavar="SECONDS",
                   help="first wait this long for the job's crash-safe checkpoint savers on this node to "
                        "finish (default 600)")
    p.add_argument("--dry-run", action="store_true", help="decide and print, change nothing")
    p.set_defaults(func=_requeue)


def _parse_values(pairs: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: write KEY=VALUE, e.g. --set time=04:00:00")
        values[key.strip()] = value
    return values


def _template(args: argparse.Namespace) -> int:
    from ..slurm import templates

    if args.list:
        return _list(templates)
    if not args.name:
        raise ConfigError("ftkit template: name a template (" + ", ".join(templates.list_templates())
                          + ") or pass --list")
    values = _parse_values(args.values)
    if args.sbatch:
        values["extra_sbatch"] = "\n".join([values.get("extra_sbatch", ""), *args.sbatch]).strip()
    text = templates.render(args.name, values)
    if args.output is None:
        print(text, end="")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}; submit it with: sbatch {args.output}")
    return 0


def _list(templates) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"templates in {templates.templates_dir()}:")
    for name in templates.list_templates():
        table = Table(title=f"{name}: {templates.template_description(name)}", title_justify="left")
        table.add_column("setting", no_wrap=True)
        table.add_column("default", overflow="fold")
        table.add_column("meaning")
        for key, default in templates.template_params(name).items():
            param = templates.PARAMS.get(key)
            table.add_row(key, "(required)" if default is None else (default or "(empty: left out)"),
                          param.help if param else "")
        console.print(table)
    return 0


def _requeue(args: argparse.Namespace) -> int:
    # SLURM may send SIGTERM to every process of the job while this runs (time limit, or the
    # requeue itself); finishing the bookkeeping matters more. SIGKILL still ends it.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    from ..slurm.requeue import RequeuePolicy, finish_run

    policy = RequeuePolicy.from_env(
        os.environ,
        max_requeues=args.max_requeues,
        max_no_progress=args.max_no_progress,
        requeue_on_crash=args.requeue_on_crash,
        fallback=args.fallback,
    )
    outcome = finish_run(args.jobdir, exit_code=args.exit_code, policy=policy, dry_run=args.dry_run,
                         script=args.script, saver_wait=args.saver_wait)
    print(outcome.message, flush=True)
    return outcome.exit_code
