"""``ftkit demo``: a small real training run under ftkit, with a live display."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a small real training job under ftkit (CPU, local by default)")
    p.add_argument("--jobdir", type=Path, default=Path("runs/demo"), help="job dir (default: runs/demo)")
    p.add_argument("--steps", type=int, default=3000, help="total steps of the run (default: 3000)")
    p.add_argument("--step-time", type=float, default=0.02,
                   help="extra seconds per step so there is time to poke it (default: 0.02)")
    p.add_argument("--save-every", type=int, default=500, help="periodic checkpoint cadence (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", action="store_true", help="watch switch files by polling (network filesystems)")
    p.add_argument("--async", dest="async_save", action="store_true",
                   help="save in the background (the loop stalls only for the memory snapshot)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    p.add_argument("--slurm", action="store_true", help="submit the same job with sbatch (one-node template)")
    p.set_defaults(func=_demo)


def _instructions(jobdir: Path) -> str:
    j = str(jobdir)
    return (
        "[bold]Poke it from another terminal:[/]\n"
        f"  ftkit save {j}        save now and keep training (the save-switch is removed once durable)\n"
        f"  ftkit kill {j}        save and stop for good; `ftkit kill --clear {j}` to allow runs again\n"
        f"  Ctrl-C or kill -TERM <pid>   save and exit (what preemption does)\n"
        f"  ftkit status {j}      what ftkit sees; `ftkit ls {j}` lists checkpoints\n"
        "Run the same command again and it resumes exactly where it stopped."
    )


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
    console.print(f"[bold]ftkit demo[/] pid {os.getpid()}, job dir {args.jobdir.absolute()}")
    console.print(_instructions(args.jobdir))
    started = time.monotonic()
    first: list[int] = []

    if args.no_live:
        def on_step(info: StepInfo) -> None:
            if not first:
                first.append(info.step - 1)
            if info.step % 100 == 0:
                console.print(_line(info, started, first[0]), highlight=False)
        result = train(settings, on_step=on_step)
    else:
        from rich.live import Live

        with Live(console=console, refresh_per_second=8, transient=False) as live:
            def on_step(info: StepInfo) -> None:
                if not first:
                    first.append(info.step - 1)
                if info.step % 5 == 0:
                    live.update(_panel(info, started, first[0], args.steps))
            result = train(settings, on_step=on_step)
    if result["completed"]:
        console.print(f"[green]finished[/] {result['last_step']} steps; params sha256 {result['params_sha256'][:16]}")
    elif result["stopping"] and (args.jobdir / "kill-switch").exists() and result["last_step"] == 0:
        console.print(f"[yellow]stopped[/]: the kill-switch is present, so this run trained nothing; "
                      f"`ftkit kill --clear {args.jobdir}` lets the job run again")
    elif result["stopping"]:
        console.print(f"[yellow]stopped[/] at step {result['last_step']} as asked; run again to resume"
                      + (" after `ftkit kill --clear`" if (args.jobdir / "kill-switch").exists() else ""))
    return 0


def _line(info: Any, started: float, first: int) -> str:
    rate = (info.step - first) / max(time.monotonic() - started, 1e-9)
    return f"step {info.step} loss {info.loss:.4f} {rate:.0f} steps/s"


def _panel(info: Any, started: float, first: int, total: int) -> Any:
    from rich.table import Table

    ft = info.ft
    rate = (info.step - first) / max(time.monotonic() - started, 1e-9)
    t = Table.grid(padding=(0, 2))
    t.add_row("step", f"{info.step} / {total}")
    t.add_row("loss", f"{info.loss:.5f}")
    t.add_row("throughput", f"{rate:.0f} steps/s")
    last = ft.last_saved_step
    t.add_row("last valid checkpoint", "none yet" if last is None else f"step {last}")
    pending = [n for n, p in (("save-switch", ft.job.save_switch), ("kill-switch", ft.job.kill_switch)) if p.exists()]
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
