"""The ``ftkit`` command. The only place that prints with rich.

Each command group lives in its own module (``_triggers``, ``_status``, ``_report``, ``_checkpoints``, ``_slurm``,
``_demo``) with a ``register(subparsers)`` function. Modules import torch and other heavy
packages only inside the command functions, so ``ftkit --help`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ..errors import FtkitError

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
    except FtkitError as exc:
        from rich.console import Console

        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
