"""A small trainer whose job dir's filesystem a test freezes (``fsfreeze -f``) under it.

    python tests/programs/freeze_train.py JOBDIR PROGRESS [--steps N] [--save-every K]
        [--timeout S] [--save-timeout S] [--grace S] [--heartbeat S]

The watchdog settings come from the command line (``grace`` has no environment variable).
After each step it writes the step number to PROGRESS, a file outside JOBDIR, so that the
test can tell when to freeze without touching the frozen filesystem. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn

import ftkit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("progress", type=Path)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--save-timeout", type=float, default=4.0)
    ap.add_argument("--grace", type=float, default=3.0)
    ap.add_argument("--heartbeat", type=float, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watchdog = ftkit.WatchdogConfig(timeout=args.timeout, save_timeout=args.save_timeout, grace=args.grace,
                                    heartbeat=args.heartbeat, warmup_steps=1, native=False)
    config = ftkit.Config(save_every=args.save_every, watchdog=watchdog)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with ftkit.FaultTolerance(args.jobdir, state={"model": model, "optimizer": opt}, config=config) as ft:
        for step in ft.range(args.steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            time.sleep(args.step_time)
            args.progress.write_text(str(step + 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
