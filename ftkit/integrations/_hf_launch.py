"""``python -m ftkit.integrations.hf [--jobdir DIR] SCRIPT [ARGS...]`` (or ``-m MODULE``).

Runs an unchanged Hugging Face training script with ``transformers.Trainer.train`` patched
(:func:`ftkit.integrations.hf.patch_trainer`): resume from the newest valid checkpoint,
ftkit's callback, close. Configuration comes from ``FTKIT_*`` variables; works under
``torchrun ... -m ftkit.integrations.hf SCRIPT``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ftkit.integrations.hf",
        description="Run a transformers training script under ftkit (FTKIT_* variables configure it).",
    )
    ap.add_argument("--jobdir", help="job directory (default: FTKIT_JOBDIR, then the Trainer's output_dir)")
    ap.add_argument("-m", dest="module", help="run a module instead of a script, like python -m")
    ap.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] (or ARGS for -m)")
    ns = ap.parse_args(argv)
    if ns.module is None and not ns.target:
        ap.error("give the training script to run")

    from ..envvars import config_from_env
    from .hf import patch_trainer

    if ns.jobdir:
        os.environ["FTKIT_JOBDIR"] = ns.jobdir
    # a bad FTKIT_* value fails here, before any training starts (the job dir is known only at
    # train(): FTKIT_JOBDIR, else the Trainer's output_dir; any directory checks the values)
    config_from_env(jobdir=ns.jobdir or os.environ.get("FTKIT_JOBDIR") or os.getcwd())
    patch_trainer()
    if ns.module is not None:
        sys.argv = [ns.module, *ns.target]
        runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
    else:
        script, *rest = ns.target
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0
