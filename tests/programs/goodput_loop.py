"""A periodic-saving training loop for the goodput report tests.

    python goodput_loop.py JOBDIR STEPS STEP_SECONDS SAVE_EVERY [--progress S] [--fail-rate R] [--seed N]
                           [--die-after S] [--state-mb MB] [--mtbf S] [--max-interval S] [--first-after S]

Trains a small linear model; each step sleeps STEP_SECONDS (the "compute"). SAVE_EVERY is a
step count or ``auto``. Every completed step is appended to JOBDIR/steps.log as
``pid step wall-time`` (the truth the report is checked against). SIGUSR1 saves and exits
asking for a requeue; SIGINT saves and exits (Ctrl-C twice within 2 s: at once). ``--fail-rate R`` makes the process kill itself with SIGKILL with
probability R per step (an injected crash, from its own seeded generator); ``--die-after S``
kills it once its loop has run S seconds (a failure schedule the caller draws). ``--state-mb``
adds a buffer of that size to the checkpointed state (a checkpoint that costs something).
Its last statement writes JOBDIR/ended-PID with the time.
"""

import argparse
import os
import random
import signal
import time
from pathlib import Path

import torch

import ftkit
from ftkit.control.interval import IntervalConfig
from ftkit.control.runclock import TimingConfig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("step_seconds", type=float)
    ap.add_argument("save_every")
    ap.add_argument("--progress", type=float, default=0.1)
    ap.add_argument("--fail-rate", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-interval", type=float, default=3600.0)
    ap.add_argument("--first-after", type=float, default=300.0)
    ap.add_argument("--die-after", type=float, default=None)
    ap.add_argument("--state-mb", type=float, default=0.0)
    ap.add_argument("--mtbf", type=float, default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    every = args.save_every if args.save_every == "auto" else int(args.save_every)
    config = ftkit.Config(
        signals=ftkit.SignalConfig(actions={"USR1": "requeue", "TERM": "save-exit", "INT": "save-exit"}),
        budget=ftkit.BudgetConfig(enabled=False),
        save_every=every or None,
        save_at_end=True,
        timing=TimingConfig(progress_every=args.progress),
        interval=IntervalConfig(max_interval=args.max_interval, first_after=args.first_after, mtbf=args.mtbf),
    )
    rng = random.Random(f"{args.seed}-{os.getpid()}")
    args.jobdir.mkdir(parents=True, exist_ok=True)
    log = open(args.jobdir / "steps.log", "a", buffering=1)  # noqa: SIM115 (lives as long as the loop)
    state = {"model": model, "optimizer": opt}
    if args.state_mb:
        state["buffer"] = torch.zeros(int(args.state_mb * 2**20) // 4)
    with ftkit.FaultTolerance(args.jobdir, state=state, config=config) as ft:
        looping = None
        for step in ft.range(args.steps):
            looping = time.monotonic() if looping is None else looping
            x = torch.randn(32, 64)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_seconds)
            log.write(f"{os.getpid()} {step + 1} {time.time():.6f}\n")
            if args.fail_rate and rng.random() < args.fail_rate:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.die_after is not None and time.monotonic() - looping >= args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    # the last statement: the interpreter's teardown after it (over a second with torch loaded
    # on a busy machine) is invisible to the events log, and to the report
    (args.jobdir / f"ended-{os.getpid()}").write_text(f"{time.time():.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
