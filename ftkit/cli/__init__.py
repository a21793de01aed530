"""The ``ftkit`` command. The only place that prints with rich.

Each command group lives in its own module (``_triggers``, ``_status``, ``_report``, ``_checkpoints``, ``_slurm``,
``_demo``) with a ``register(subparsers)`` function. Modules import torch and other heavy
packages only inside the command functions, so ``ftkit --help`` stays light.

A command fails with ``error: MESSAGE`` on stderr and a non-zero exit, never a traceback: an
``FtkitError`` exits with its code, an ``OSError`` (a file it may not read, a full disk) with 1
and the file's name (``-v`` adds the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from ..errors import FtkitError, JobDirBusyError

__all__ = ["main"]

# Command-group modules, in the order their commands appear in --help.
_GROUPS = ("_triggers", "_status", "_report", "_checkpoints", "_slurm", "_demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftkit",
        description="Fault tolerance for PyTorch training on SLURM: triggers, agreed decisions, "
        "complete checkpoints, requeue.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _GROUPS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # group not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except JobDirBusyError as exc:  # already logged, with its lease file, where it was refused
        return exc.exit_code
    except FtkitError as exc:
        _error(str(exc))
        return exc.exit_code
    except BrokenPipeError:  # `ftkit ... | head`: the reader is gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a file the command could not read or write: say which, no traceback
        if args.verbose:
            traceback.print_exc()
        _error(_os_error(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


def _os_error(exc: OSError) -> str:
    """``PATH: what went wrong`` (like coreutils), with a hint for a permission error."""
    if exc.filename is None:
        return str(exc)
    where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    message = f"{where}: {exc.strerror or exc}"
    if isinstance(exc, PermissionError):
        message += " (run the command as a user who may access it, e.g. the job's owner)"
    return message


def _error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
