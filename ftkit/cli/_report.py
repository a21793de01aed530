"""``ftkit report JOBDIR``: what interruptions cost the job, across all its runs and requeues.

Reads only the events log; never imports torch. ``--plot`` imports matplotlib (the ``plot``
extra) only when asked.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["collect_report", "register"]

_LABELS = {
    "productive": "productive training",
    "redone": "re-done work (after the last checkpoint, computed again)",
    "stall": "checkpoint stalls",
    "restart": "restart cost",
    "exit_wait": "waiting at exit (saves, a hang)",
}
_PARTS = {
    "before_ftkit": "until ftkit started (interpreter, imports, user set-up)",
    "setup": "ftkit set-up (handlers, watchers, agreement, checkpoint manager)",
    "find": "finding and validating the checkpoint",
    "load": "loading the checkpoint",
    "other": "user code between start() and resume()",
    "warmup": "first step beyond an ordinary step (warm-up)",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="goodput: where the job's time went across runs and requeues, "
                       "and the checkpoint interval to use")
    p.add_argument("jobdir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node, for lost GPU-hours (default: SLURM_GPUS_* recorded at start)")
    p.add_argument("--mtbf", type=float, default=None, metavar="SECONDS",
                   help="mean time between failures for the interval advice (default: from the job's history)")
    p.add_argument("--max-interval", type=float, default=None, metavar="SECONDS",
                   help="upper bound of the recommended interval (default: interval.max_interval, 3600)")
    p.add_argument("--runs", type=int, default=40, metavar="N",
                   help="list only the newest N runs (default 40; 0: all); the totals are always every run's, "
                        "and --json lists every run")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw the timeline, one lane per run (needs matplotlib: pip install 'ftkit[plot]')")
    p.set_defaults(func=_report)


def collect_report(jobdir: Path, *, gpus_per_node: int | None = None, mtbf: float | None = None,
                   max_interval: float | None = None) -> dict[str, Any]:
    """Everything ``ftkit report`` shows, as plain data (also its ``--json`` output)."""
    from ..control.interval import IntervalConfig
    from ..events import read_events
    from ..jobdir import JobDir
    from ..report import analyse
    from ._paths import place, wrong_place

    where = place(jobdir)
    if where.kind not in ("job", "fresh", "other") or where.job_dirs:  # missing, a file, a checkpoint, ...
        raise ConfigError(wrong_place(where))
    job = JobDir.of(where.path)
    events = list(read_events(job.events))
    if not any(e.get("event") == "start" for e in events):
        raise ConfigError(f"{job.events} holds no run (no 'start' record): nothing to report")
    kw: dict[str, Any] = {}
    if mtbf is not None:
        kw["mtbf"] = mtbf
    if max_interval is not None:
        kw["max_interval"] = max_interval
    report = analyse(events, gpus_per_node=gpus_per_node, interval_config=IntervalConfig(**kw), alive=_alive)
    report["jobdir"] = str(job.root)
    return report


def _alive(host: str | None, pid: int | None) -> bool:
    """Whether a process of this machine still runs (a run without an exit record yet)."""
    import os
    import socket

    if pid is None or host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("h", 3600), ("min", 60)):
        if abs(seconds) >= size:
            return f"{seconds / size:.2f} {unit}"
    return f"{seconds:.2f} s"


_SHORT = {"before_ftkit": "start", "setup": "set-up", "find": "find", "load": "load", "other": "user",
          "warmup": "warm-up"}  # the restart parts, as a run's cell names them


def _restart(r: dict[str, Any], most: int | None = None) -> str:
    """A run's restart cost and its parts (seconds; ``most``: only that many of the largest),
    in the order of the table of all runs' time."""
    parts = r.get("restart_parts") or {}
    shown = sorted((k for k in _SHORT if parts.get(k)), key=lambda k: -parts[k])[:most]
    named = ", ".join(f"{_SHORT[k]} {parts[k]:.2f}" for k in _SHORT if k in shown)
    return _dur((r.get("buckets") or {}).get("restart")) + (f" ({named})" if named else "")


def _resumed_from(r: dict[str, Any]) -> str:
    """The step a run loaded, "fresh" where it found no checkpoint, "not loaded" where it did
    not look (a kill-switch at start, a loop of ``check()`` without ``resume()``): such a run
    did not start over, and the job's checkpoints are still there for the next."""
    if r["resumed_from"] is not None:
        return str(r["resumed_from"])
    return "fresh" if r["resumed"] else "not loaded"


def _run_cells(r: dict[str, Any]) -> dict[str, str]:
    end = _clock(r["end"]) + ("" if r["end_known"] else " (last record)")
    return {"run": str(r["run"]), "job / restart": f"{r['job_id'] or '-'} / {r['restart_count']}",
            "nodes / ranks": f"{r['nodes'] or '?'} / {r['world_size']}", "start": _clock(r["start"]),
            "first step": _clock(r["first_step"]), "end": end, "steps": f"{r['steps']} (to {r['last_step']})",
            "exit": r["cause"], "resumed from": _resumed_from(r),
            "restart cost": _restart(r, most=2), "last durable": "-" if r["last_durable"] is None else str(r["last_durable"])}


def _print_runs(console: Any, runs: list[dict[str, Any]]) -> None:
    """The runs as a table where each run fits on one line of the terminal; else a few lines per
    run, so that no exit cause or time is cut short or broken up (the table needs about 210
    columns; squeezed into 80, rich would cut every cell to a few letters)."""
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    rows = [_run_cells(r) for r in runs]
    table = Table(title="runs")
    for name in rows[0] if rows else ():
        table.add_column(name)
    for row in rows:
        table.add_row(*map(Text, row.values()))  # plain text: a cause is not rich markup
    if not rows or Measurement.get(console, console.options.update_width(1 << 16), table).maximum <= console.width:
        console.print(table)
        return
    console.print("[bold]runs[/]")
    for run, row in zip(runs, rows, strict=True):
        console.print(f"run {row['run']}: exit {row['exit']}", markup=False)
        for names in (("job / restart", "nodes / ranks"), ("start", "first step", "end"),
                      ("steps", "resumed from", "last durable")):
            console.print("  " + ", ".join(f"{name} {row[name]}" for name in names), markup=False)
        console.print(f"  restart cost {_restart(run)}", markup=False)  # every part: there is room


def _clock(t: float | None) -> str:
    return "?" if t is None else time.strftime("%m-%d %H:%M:%S", time.localtime(t))


def _report(args: argparse.Namespace) -> int:
    if args.runs < 0:
        raise ConfigError(f"--runs: a number of runs >= 0 (0: all), got {args.runs}")
    report = collect_report(args.jobdir, gpus_per_node=args.gpus_per_node, mtbf=args.mtbf,
                            max_interval=args.max_interval)
    if args.plot is not None:
        from ..report.plot import plot_timeline

        plot_timeline(report, args.plot)
        report["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    console.print(f"[bold]{report['jobdir']}[/]: {len(report['runs'])} run{'' if len(report['runs']) == 1 else 's'}, wall time {_dur(report['wall'])}"
                  f", between runs {_dur(report['between_runs'])}")
    runs = report["runs"]
    if args.runs and len(runs) > args.runs:
        console.print(f"runs {runs[0]['run']}-{runs[-args.runs - 1]['run']} not listed: the newest {args.runs} "
                      "are (--runs 0 lists every run; the totals below count them all)")
        runs = runs[-args.runs:]
    _print_runs(console, runs)
    wall = report["wall"] or 1.0
    table = Table("where the time went", "time", "share", title="time of all runs")
    for key, label in _LABELS.items():
        table.add_row(label, _dur(report["buckets"][key]), f"{100 * report['buckets'][key] / wall:.1f} %")
        if key == "restart":
            for part, text in _PARTS.items():
                value = report["restart_parts"][part]
                if value:
                    table.add_row(f"  {text}", _dur(value), f"{100 * value / wall:.1f} %")
    table.add_row("[bold]wall time of all runs[/]", _dur(report["wall"]), "100 %")
    table.add_row("between runs (queue)", _dur(report["between_runs"]), "")
    console.print(table)
    gp, gq = report["goodput"], report["goodput_with_queue"]
    line = f"[bold]goodput {100 * gp:.1f} %[/] of the runs' wall time" if gp is not None else "goodput unknown"
    if gq is not None:
        line += f", {100 * gq:.1f} % counting the time between runs"
    if report["lost_gpu_hours"] is not None:
        line += f"; {report['lost_gpu_hours']:.2f} GPU-hours lost"
    console.print(line)
    iv = report["interval"]
    if iv.get("recommended") is None:
        console.print(f"checkpoint interval: no advice ({iv.get('why')})")
    else:
        cur = iv.get("current")
        console.print(
            f"checkpoint interval: recommended every {_dur(iv['recommended'])} ({iv['bound']}; checkpoint "
            f"cost {_dur(iv['cost'])}, durable after {_dur(iv['durable'])}, MTBF {_dur(iv['mtbf'])} "
            f"from {iv['mtbf_source']}); expected loss {_dur(iv['expected_loss_recommended'])}"
            + ("" if cur is None else f" vs {_dur(iv['expected_loss_current'])} at the current "
               f"{_dur(cur)}") + " over this job's training time")
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    if args.plot is not None:
        console.print(f"timeline written to {args.plot}")
    return 0
