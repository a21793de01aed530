"""Where the wall time of a job went: time buckets, goodput and the checkpoint interval advice.

Every run's wall time (process start to end, :mod:`ftkit.report.runs`) is cut into buckets
that add up to it exactly:

* ``restart``: process start until the training loop begins, split into ``before_ftkit``
  (interpreter, imports, the user's set-up up to ``FaultTolerance.start()``, which includes
  ``init_process_group``), ``setup`` (signal handlers, watchers, the time budget, the agreement
  collective, creating the checkpoint manager and its cross-rank agreement), ``find`` (finding
  and validating the checkpoint), ``load`` (reading it into the state), ``other`` (the user's code between ``start()`` and ``resume()``) and ``warmup`` (the
  first step beyond an ordinary step: compilation, caches);
* ``stall``: the loop waiting for checkpoints (a synchronous save's whole time, the memory
  snapshot of a background save);
* ``redone``: steps computed after the newest checkpoint the next run resumed from, which the
  next run computed again: from the moment that checkpoint's step was reached to the run's end;
* ``exit_wait``: from the last step to the process's end (the save on the way out, waiting
  until background saves are durable);
* ``productive``: the rest of the loop.

``between_runs`` (the time from one run's end to the next one's start: queue wait under SLURM)
is reported beside them. Goodput = productive / wall time of all runs, and / (that + between).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from .runs import Run, parse_runs

__all__ = ["BUCKETS", "RESTART_PARTS", "analyse"]

BUCKETS = ("productive", "redone", "stall", "restart", "exit_wait")
RESTART_PARTS = ("before_ftkit", "setup", "find", "load", "other", "warmup")


def _stalls(run: Run, lo: float, hi: float) -> float:
    """Loop stalls whose end falls in (lo, hi]."""
    return sum(float(s["stall"]) for s in run.stalls if not s.get("exiting") and lo < float(s["time"]) <= hi + 1e-6)


def _legacy_stalls(run: Run, lo: float, hi: float) -> float:
    """Older logs: the manager's save seconds (right for synchronous saves only)."""
    return sum(float(s.get("seconds") or 0) for s in run.saves if lo < float(s["time"]) <= hi + 1e-6)


def _step_time(run: Run, stalls) -> float | None:
    steps = (run.last_step or 0) - (run.resume_step or 0)
    fs = run.first_step
    if fs is not None and (run.last_step or 0) > int(fs["step"]):
        t0 = float(fs["time"])
        return max(run.loop_end - t0 - stalls(run, t0, run.loop_end), 0.0) / ((run.last_step or 0) - int(fs["step"]))
    if steps > 0:
        return max(run.loop_end - run.loop_start - stalls(run, run.loop_start, run.loop_end), 0.0) / steps
    return None


def _reached(run: Run, step: int) -> float | None:
    """Wall time the loop was past ``step`` (and its checkpoint stall) in this run."""
    for s in run.stalls:
        if s.get("save_step") == step:
            return float(s["time"])
    for s in run.saves:
        if s.get("step") == step:
            return float(s["time"])
    return None


def _run_buckets(run: Run, nxt: Run | None) -> dict[str, Any]:
    stalls = _stalls if run.has_timing else _legacy_stalls
    step_time = _step_time(run, stalls)
    loop_start, loop_end = run.loop_start or run.ftkit_start, run.loop_end
    parts = dict.fromkeys(RESTART_PARTS, 0.0)
    if run.process_start is not None:
        parts["before_ftkit"] = max(run.ftkit_start - run.process_start, 0.0)
    parts["setup"] = (run.setup_seconds or 0.0) + (run.manager_seconds or 0.0)
    load_call = run.load_call_seconds
    if load_call is not None:
        find = run.find_seconds if run.find_seconds is not None else (load_call if run.resume_step is None else 0.0)
        parts["find"] = find
        parts["load"] = max(load_call - find, 0.0) if run.find_seconds is not None or run.resume_step is None else load_call
    parts["other"] = (loop_start - run.begin) - sum(parts.values())
    fs = run.first_step
    if fs is not None and step_time is not None:
        ordinary = step_time * (int(fs["step"]) - int(fs.get("start_step") or 0))
        parts["warmup"] = min(max(float(fs["seconds"]) - ordinary, 0.0), loop_end - loop_start)
    loop = loop_end - loop_start - parts["warmup"]
    stall = stalls(run, loop_start, loop_end)

    redone_steps, redone, redone_from = 0, 0.0, None
    if nxt is not None and nxt.resumed:
        target = nxt.resume_step or 0
        start = run.resume_step or 0
        redone_steps = max((run.last_step or 0) - max(target, start), 0)
        if redone_steps:
            t = _reached(run, target) if target > start else loop_start + parts["warmup"]
            if t is not None and t <= loop_end:
                redone = loop_end - t - stalls(run, t, loop_end)
            elif step_time is not None:
                redone = redone_steps * step_time
            redone = min(max(redone, 0.0), loop - stall)
            redone_from = loop_end - redone  # for the timeline: the tail of the loop
    buckets = {
        "productive": loop - stall - redone,
        "redone": redone,
        "stall": stall,
        "restart": sum(parts.values()),
        "exit_wait": run.end - loop_end,
    }
    return {"buckets": buckets, "restart_parts": parts, "step_time": step_time, "redone_steps": redone_steps,
            "redone_from": redone_from}


def _gpus(run: Run, gpus_per_node: int | None) -> int | None:
    g = gpus_per_node if gpus_per_node is not None else run.gpus_per_node
    return None if g is None else int(g) * int(run.nodes or 1)


def analyse(events: Sequence[dict[str, Any]], *, gpus_per_node: int | None = None,
            interval_config: Any = None, alive: Any = None) -> dict[str, Any]:
    """The whole report as plain data (``ftkit report --json``); ``alive`` as in :func:`parse_runs`."""
    runs = parse_runs(events, alive=alive)
    rows, notes = [], []
    totals = dict.fromkeys(BUCKETS, 0.0)
    parts_total = dict.fromkeys(RESTART_PARTS, 0.0)
    between = 0.0
    lost_gpu_s, gpus_known = 0.0, True
    for i, run in enumerate(runs):
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        r = _run_buckets(run, nxt)
        gap = None if nxt is None else max(nxt.begin - run.end, 0.0)
        between += gap or 0.0
        for k, v in r["buckets"].items():
            totals[k] += v
        for k, v in r["restart_parts"].items():
            parts_total[k] += v
        gpus = _gpus(run, gpus_per_node)
        if gpus is None:
            gpus_known = False
        else:
            lost_gpu_s += (run.wall - r["buckets"]["productive"]) * gpus
        for n in run.notes:
            if n not in notes:
                notes.append(n)
        rows.append({
            "run": i, "job_id": run.job_id, "restart_count": run.restart_count, "pid": run.pid,
            "nodes": run.nodes, "world_size": run.world_size, "gpus": gpus,
            "process_start": run.process_start, "start": run.begin, "loop_start": run.loop_start,
            "first_step": None if run.first_step is None else run.first_step["time"],
            "loop_end": run.loop_end, "end": run.end, "end_known": run.exit is not None,
            "wall": run.wall, "steps": (run.last_step or 0) - (run.resume_step or 0),
            "last_step": run.last_step, "resumed": run.resumed, "resumed_from": run.resume_step,
            "last_durable": run.last_durable,
            "cause": run.cause, "unplanned": run.unplanned, "step_time": r["step_time"],
            "redone_steps": r["redone_steps"], "between_next": gap, **r,
            "saves": [{"time": s["time"], "step": s.get("step"), "seconds": s.get("seconds")} for s in run.saves],
            "stalls": [{"time": s["time"], "stall": s["stall"], "step": s.get("save_step"),
                        "exiting": bool(s.get("exiting"))} for s in run.stalls],
        })
    wall = sum(r["wall"] for r in rows)
    productive = totals["productive"]
    if runs and (runs[-1].exit is None or not runs[-1].exit.get("completed")):
        notes.append("the last run did not complete: its steps after the newest checkpoint count as "
                     "productive until a later run computes them again")
    if not gpus_known:
        notes.append("GPUs per node unknown (not in SLURM_GPUS_* at start): pass --gpus-per-node for lost GPU-hours")
    return {
        "runs": rows,
        "wall": wall,
        "buckets": totals,
        "restart_parts": parts_total,
        "between_runs": between,
        "goodput": productive / wall if wall > 0 else None,
        "goodput_with_queue": productive / (wall + between) if wall + between > 0 else None,
        "lost_gpu_hours": lost_gpu_s / 3600 if gpus_known and runs else None,
        "interval": advise(runs, rows, events, interval_config, alive=alive),
        "notes": notes,
    }


def advise(runs: list[Run], rows: list[dict[str, Any]], events: Sequence[dict[str, Any]],
           config: Any = None, *, alive: Any = None) -> dict[str, Any]:
    """The interval ``save_every="auto"`` would pick now, and the expected loss at the current one."""
    from ..control.interval import IntervalConfig, choose_interval, expected_waste, read_history

    config = config if config is not None else IntervalConfig()
    history = read_history(events, alive=alive)
    mtbf, source = history.mtbf(config)
    out: dict[str, Any] = {"mtbf": mtbf, "mtbf_source": source, "failures": history.failures,
                           "cost": history.cost, "durable": history.durable}
    legacy = [float(s.get("seconds") or 0) for r in runs for s in r.saves]
    cost = history.cost if history.cost is not None else (statistics.median(legacy) if legacy else None)
    if cost is None:
        out["recommended"] = None
        out["why"] = "no checkpoint measured in this job dir yet"
        return out
    durable = history.durable if history.durable is not None else cost
    plan = choose_interval(cost=cost, mtbf=mtbf, durable=durable, max_interval=config.max_interval,
                           mtbf_source=source)
    out.update(cost=cost, durable=durable, recommended=plan.seconds, bound=plan.bound, optimum=plan.optimum)
    current = _current_interval(events, runs)
    loop = sum(r["buckets"]["productive"] + r["buckets"]["redone"] + r["buckets"]["stall"] for r in rows)
    out["current"] = current
    out["expected_loss_recommended"] = expected_waste(plan.seconds, cost=cost, mtbf=mtbf) * loop
    out["expected_loss_current"] = None if current is None else expected_waste(current, cost=cost, mtbf=mtbf) * loop
    return out


def _current_interval(events: Sequence[dict[str, Any]], runs: list[Run]) -> float | None:
    """The interval in use: the newest ``interval`` record, else the median time between
    periodic checkpoints within a run."""
    chosen = [e for e in events if e.get("event") == "interval" and e.get("interval_seconds") is not None]
    if chosen:
        return float(chosen[-1]["interval_seconds"])
    gaps = []
    for run in runs:
        times = [float(s["time"]) for s in run.saves if str(s.get("reason") or "").startswith("periodic")]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None
