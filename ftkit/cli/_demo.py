"""``ftkit demo``: a small real training run under ftkit, with a live display."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a small real training job under ftkit (CPU, local by default)")
    p.add_argument("--jobdir", type=Path, default=Path("runs/demo"), help="job dir (default: runs/demo)")
    p.add_argument("--steps", type=_at_least(0, int), default=3000, help="total steps of the run (default: 3000)")
    p.add_argument("--step-time", type=_at_least(0, float), default=0.02,
                   help="extra seconds per step so there is time to poke it (default: 0.02)")
    p.add_argument("--save-every", type=_at_least(0, int), default=500,
                   help="periodic checkpoint cadence in steps (default: 500; 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", action="store_true", help="watch switch files by polling (network filesystems)")
    p.add_argument("--async", dest="async_save", action="store_true",
                   help="save in the background (the loop stalls only for the memory snapshot)")
    p.add_argument("--no-live", action="store_true",
                   help="plain log lines instead of the live display (the default where stdout is not a terminal)")
    p.add_argument("--slurm", action="store_true", help="submit the same job with sbatch (one-node template)")
    p.set_defaults(func=_demo)


def _at_least(low: float, kind: type) -> Any:
    """An argparse type: a ``kind`` number >= ``low`` (argparse names the option otherwise)."""
    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError: argparse says "invalid ... value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _instructions(jobdir: Path, pid: int) -> Any:
    """What a person can do to the running demo, as two aligned columns."""
    from rich.markup import escape
    from rich.table import Table

    j = escape(str(jobdir))
    t = Table.grid(padding=(0, 3))
    for command, what in (
        (f"ftkit save {j}", "save now and keep training (the save-switch goes once the checkpoint is durable)"),
        (f"ftkit kill {j}", f"save and stop for good; `ftkit kill --clear {j}` lets it run again"),
        (f"Ctrl-C, or kill -TERM {pid}", "save and exit (what preemption does); Ctrl-C twice: stop at once, unsaved"),
        (f"ftkit status {j}", f"what ftkit sees; `ftkit ls {j}` lists the checkpoints"),
    ):
        t.add_row(f"  [cyan]{command}[/]", what)
    return t


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(soft_wrap=True)
    if args.slurm:
        return _submit(args, console)

    import os

    from ..demo import DemoSettings, StepInfo, train

    settings = DemoSettings(jobdir=args.jobdir, steps=args.steps, step_time=args.step_time,
                            save_every=args.save_every or None, seed=args.seed, poll=args.poll,
                            async_save=args.async_save)
    console.print(f"[bold]ftkit demo[/]: {args.steps} steps of a small MLP on the CPU, pid {os.getpid()}, "
                  f"job dir {args.jobdir.absolute()}", highlight=False)
    first: list[int] = []  # the step this run starts from
    began: list[float] = []  # when it did: the rate leaves out imports and loading

    def starting(info: StepInfo) -> None:
        first.append(info.step - 1)
        began.append(time.monotonic())
        # only now: a run refused the job dir (another one holds it) must not tell people to poke it
        if int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0) == 0:  # once per job, not per rank
            console.print("[bold]Poke it from another terminal:[/]")
            console.print(_instructions(args.jobdir, os.getpid()), highlight=False)
            console.print("Run the same command again and it resumes exactly where it stopped.")
        console.print(f"resuming from the checkpoint of step {first[0]}" if first[0]
                      else "no checkpoint yet: starting from step 0", highlight=False)

    try:
        # a live display needs a terminal: piped to a file (`> log`, `| tee`) it would print
        # nothing until the end, so there the run prints plain lines as it goes
        if args.no_live or not console.is_terminal:
            def on_step(info: StepInfo) -> None:
                if not first:
                    starting(info)
                if info.step % 100 == 0:
                    console.print(_line(info, began[0], first[0]), highlight=False)
            result = train(settings, on_step=on_step)
        else:
            from rich.live import Live

            with Live(console=console, refresh_per_second=8, transient=False) as live, _logs_above(console):
                last: list[StepInfo] = []

                def on_step(info: StepInfo) -> None:
                    if not first:
                        starting(info)
                    last[:] = [info]
                    if info.step % 5 == 0:
                        live.update(_panel(info, began[0], first[0], args.steps))
                result = train(settings, on_step=on_step)
                if last:  # the last step and the checkpoint saved on the way out
                    live.update(_panel(last[0], began[0], first[0], args.steps))
    except KeyboardInterrupt:
        console.print(f"interrupted (Ctrl-C twice, or before training started): nothing more was saved; "
                      f"the same command resumes from the newest valid checkpoint (`ftkit ls {args.jobdir}`)",
                      style="red", markup=False, highlight=False)
        raise
    console.print(_ending(result, args.jobdir, trained=bool(first), steps=args.steps), highlight=False)
    return 0


@contextlib.contextmanager
def _logs_above(console: Any) -> Iterator[None]:
    """Log records go through ``console`` while the live display runs, so they print above it.

    A line written straight to the terminal lands inside the display; its next redraw then
    starts that many lines too low and leaves stale lines on screen.
    """
    import logging

    class Above(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # the level shows as a colour: ftkit logs its decisions as warnings so that they
            # reach a job's log, which on this screen would read as something gone wrong
            # (where the run goes on from is a warning too, but routine: ``ftkit_notice``)
            style = "red" if record.levelno >= logging.ERROR else "yellow" if record.levelno >= logging.WARNING \
                and not getattr(record, "ftkit_notice", False) else ""
            try:
                console.print(self.format(record), style=style, markup=False, highlight=False)
            except Exception:  # logging must never break the run
                self.handleError(record)

    root = logging.getLogger()
    handler = Above()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    before = root.handlers[:]
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = before


def _ending(result: dict[str, Any], jobdir: Path, *, trained: bool, steps: int) -> str:
    """The last line: how the run ended, what is on disk, what to do next."""
    from rich.markup import escape

    j = escape(str(jobdir))
    if result["completed"] and not trained:
        last = result["last_step"]
        where = (f"the newest checkpoint in {j}/checkpoints is at step {last}, at or past --steps {steps}" if last
                 else f"--steps {steps}")
        return (f"[green]nothing to train[/]: {where}; params sha256 {result['params_sha256'][:16]}. "
                f"A larger --steps trains on from there; `rm -r {j}` starts over")
    if result["completed"]:
        return f"[green]finished[/] {result['last_step']} steps; params sha256 {result['params_sha256'][:16]}"
    killed = (jobdir / "kill-switch").exists()
    if result["stopping"] and killed and result["last_step"] == 0:
        return (f"[yellow]stopped[/]: the kill-switch is present, so this run trained nothing; "
                f"`ftkit kill --clear {j}` lets the job run again")
    why = escape("; ".join(result.get("reasons") or [])) or "as asked"
    saved = result.get("saved_step")
    where = (f"the checkpoint of step {saved} is in {j}/checkpoints" if saved is not None
             else "nothing was saved")
    again = f"`ftkit kill --clear {j}`, then run the same command to resume" if killed else \
        "run the same command again to resume"
    return f"[yellow]stopped[/] at step {result['last_step']} ({why}); {where}; {again}"


def _line(info: Any, started: float, first: int) -> str:
    rate = (info.step - first) / max(time.monotonic() - started, 1e-9)
    return f"step {info.step} loss {info.loss:.4f} {rate:.0f} steps/s"


def _panel(info: Any, started: float, first: int, total: int) -> Any:
    from rich.table import Table

    from ..triggers.switches import switch_is_set

    ft = info.ft
    rate = (info.step - first) / max(time.monotonic() - started, 1e-9)
    t = Table.grid(padding=(0, 2))
    t.add_row("step", f"{info.step} / {total}")
    t.add_row("loss", f"{info.loss:.5f}")
    t.add_row("throughput", f"{rate:.0f} steps/s")
    last = ft.last_saved_step
    t.add_row("last valid checkpoint", "none yet" if last is None else f"step {last}")
    pending = [f"{which}-switch" for which in ("save", "kill") if switch_is_set(ft.job, which)]
    t.add_row("pending triggers", ", ".join(pending) or "none")
    left = ft.budget.time_left()
    t.add_row("time left", "no deadline" if left is None else f"{left:.0f} s")
    return t


def _submit(args: argparse.Namespace, console: Any) -> int:
    import shutil
    import subprocess
    import sys

    from ..errors import ConfigError
    from ..slurm.templates import render

    if shutil.which("sbatch") is None:
        raise ConfigError("--slurm: sbatch is not on PATH; run without --slurm for a local run")
    jobdir = args.jobdir.absolute()
    jobdir.mkdir(parents=True, exist_ok=True)
    command = (f'"$PYTHON" -m ftkit demo --no-live --jobdir "$JOBDIR" --steps {args.steps} '
               f"--step-time {args.step_time} --save-every {args.save_every} --seed {args.seed}")
    script = jobdir / "demo.sbatch"
    script.write_text(render("single", {
        "job_name": "ftkit-demo", "jobdir": str(jobdir), "command": command, "python": sys.executable,
        "output": str(jobdir / "slurm-%j.out"), "error": str(jobdir / "slurm-%j.out")}))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ConfigError(f"sbatch {script} failed: {out.stderr.strip()}")
    console.print(f"submitted job {out.stdout.strip()} ({script}); watch it with `ftkit status {jobdir}`; "
                  f"its output goes to {jobdir}/slurm-<job id>.out")
    return 0
