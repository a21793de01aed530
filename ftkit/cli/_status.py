"""``ftkit status JOBDIR``: is my job safe, and what happens if it dies now? One screen.

Reads only files (events log, checkpoints, switch and request files) plus one
``scontrol show job`` when the events log names a SLURM job; never imports torch. The
checkpoints are where the events log's newest save (load, delete) record puts them, else in
``JOBDIR/checkpoints``; a checkpoint, a checkpoint root or a file given for JOBDIR is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SlurmError
from ._paths import checkpoint_root, place, wrong_place

__all__ = ["collect_status", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="job state, pending triggers, checkpoints, time left and recent events")
    p.add_argument("jobdir", type=Path, help="the job dir: the directory the job was started with; its "
                   "checkpoints are found where its events log says they were saved")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--events", type=int, default=10, metavar="N", help="show the last N events")
    p.set_defaults(func=_status)


def _slurm(job_id: str | None) -> dict[str, Any] | None:
    """The job's state and time left from ``scontrol show job``; an error entry if SLURM can't say."""
    if not job_id:
        return None
    from ..slurm.env import job_end_time, job_info

    try:
        info = job_info(job_id)
        end = job_end_time(job_id)
    except SlurmError as exc:
        said = str(exc)
        if "Invalid job id" in said:  # ended longer ago than SLURM's MinJobAge: forgotten, not an error
            said = "no longer known to SLURM (it ended; scontrol forgets a job MinJobAge after its end)"
        return {"job_id": job_id, "state": None, "error": said}
    state = info.get("JobState")
    return {
        "job_id": job_id,
        "state": state,
        "reason": info.get("Reason"),
        "restarts": info.get("Restarts"),
        "end_time": end,
        "time_left": (end - time.time()) if end is not None and state == "RUNNING" else None,
    }


def _request(path: Path) -> dict[str, Any]:
    """One request file; ``error`` says why the job ignores it when it is broken (the job's
    watcher takes a JSON object with a known ``action`` string and skips anything else)."""
    from ..triggers.switches import read_request

    entry: dict[str, Any] = {"path": str(path)}
    try:
        found = read_request(path)
    except OSError as exc:
        entry["error"] = f"cannot be read: {exc.strerror or exc}"
    except ValueError as exc:  # ConfigError too: it names the valid actions
        entry["error"] = str(exc)
    else:
        entry.update({k: v for k, v in found.data.items() if k not in entry})
    return entry


def collect_status(jobdir: Path, *, events: int = 10) -> dict[str, Any]:
    """Everything ``ftkit status`` shows, as plain data (also its ``--json`` output)."""
    from ..checkpoint import validate_dir
    from ..control.hangs import culprit
    from ..events import read_events
    from ..jobdir import JobDir
    from ..lease import lease_status
    from ..triggers.switches import request_files, switch_is_set

    where = place(jobdir)
    if where.kind not in ("job", "fresh", "other") or where.job_dirs:
        raise ConfigError(wrong_place(where))  # a checkpoint, the checkpoints dir, a file, ...
    job = JobDir.of(where.path)
    now = time.time()
    requests = [_request(path) for path in request_files(job)]
    log = list(read_events(job.events))
    root = checkpoint_root(job.root, log)
    starts = [e for e in log if e.get("event") == "start"]
    last_start = starts[-1] if starts else None
    # the last run's own exit: a displaced restart of the same job (its node taken for lost while
    # its trainer ran on) writes its exit after the run that took the job dir over started
    exits = [e for e in log if e.get("event") == "exit"]
    if last_start is not None:
        ident = (last_start.get("job_id"), int(last_start.get("restart_count") or 0))
        pids = {e.get("pid") for e in starts if (e.get("job_id"), int(e.get("restart_count") or 0)) == ident}
        ended = [e for e in exits if e.get("pid") in pids]
    else:
        ended = exits
    running = last_start is not None and (not ended or ended[-1]["time"] < last_start["time"])
    lease = lease_status(job.root, now=now)
    if running and lease is not None and lease["state"] in ("dead", "released"):
        running = False  # its process is gone without an exit event (kill -9, a crash)
    for r in requests:  # a signal trap's request (--this-run) of a run that is over: never acted on
        if r.get("job_id") is not None and "error" not in r:
            from ..triggers.switches import stale_request

            r["stale"] = (stale_request(r, last_start.get("job_id"), int(last_start.get("restart_count") or 0))
                          if running and last_start is not None else
                          f"written for SLURM job {r['job_id']} (restart {r.get('restart_count', 0)}), whose run "
                          "is over")
    saves = [e for e in log if e.get("event") == "save" and "seconds" in e]
    save_estimate = max((float(e["seconds"]) for e in saves[-5:]), default=None)

    items = []
    for _, path in root.step_dirs():  # newest first; pure file work, no torch
        info = validate_dir(path)
        items.append({
            "step": info.step, "path": str(info.path), "status": info.status, "valid": info.valid,
            "reason": info.reason, "pinned": info.pinned, "size": info.size, "time": info.time,
            "age": None if info.time is None else now - info.time, "saved_for": info.saved_for,
        })
    broken = _found_broken(log)
    for c in items:  # sizes look right, but a resume found it broken (read since its save)
        why = broken.get(c["path"]) if c["valid"] else None
        if why is not None:
            c.update(status="corrupt", valid=False,
                     reason=f"a resume skipped it: {why} (`ftkit verify` checks its files)")
    newest = next((c for c in items if c["valid"]), None)
    aside = _set_aside(root.path)

    slurm = _slurm(last_start.get("job_id") if last_start else None)
    # rank 0 alone knows a SLURM end time: its start event of the latest run (none yet: none)
    began = max((e["time"] for e in exits if last_start and e["time"] < last_start["time"]), default=float("-inf"))
    lead = [e for e in starts if e.get("rank", 0) == 0 and e["time"] > began]
    deadline = lead[-1].get("deadline") if lead else None
    time_left = slurm.get("time_left") if slurm else None
    if time_left is None and deadline is not None and running:
        time_left = float(deadline) - now
    # what a resume meets first, newest first: ftkit's load stops at a checkpoint it cannot read
    # (not known to be bad); a Hugging Face resume passes it, and takes Trainer's own (unsealed)
    met = next((c for c in items if c["valid"] or c["status"] == ("unsealed" if root.hf else "unreadable")), None)
    if newest is None and not root.exists and root.found_in:
        verdict = (f"cannot tell what the job resumes from: {root} does not exist here (deleted, or on a "
                   "filesystem not mounted on this machine)")
    elif met is not None and met["status"] == "unreadable":
        verdict = (f"if the job dies now, its next run stops at step {met['step']} instead of resuming "
                   f"({met['reason']})")
    elif met is not None and met["status"] == "unsealed":
        verdict = (f"if the job dies now, it resumes from step {met['step']}, a checkpoint Trainer wrote without "
                   "ftkit (not verifiable)")
    elif newest is None:
        verdict = "no valid checkpoint yet: if the job dies now, it starts from scratch"
    else:
        verdict = f"if the job dies now, it resumes from step {newest['step']}"
    if time_left is not None and save_estimate is not None:
        verdict += (f"; {time_left:.0f} s left, a save takes ~{save_estimate:.1f} s"
                    + (" (enough)" if time_left > 2 * save_estimate else " (TIGHT)"))
    elif time_left is not None:  # no save measured yet: the time left all the same
        verdict += f"; {time_left:.0f} s left, no save measured yet"
    run_starts = [e for e in starts if e["time"] > began and last_start is not None
                  and e.get("job_id") == last_start.get("job_id")
                  and e.get("restart_count") == last_start.get("restart_count")]
    stalled = _stalls(job.root, last_start, run_starts, now) if running and last_start is not None else []
    return {
        "jobdir": str(job.root),
        "time": now,
        "running": running,
        "slurm": slurm,
        "lease": lease,
        "hang": _which_run(culprit(log), log),
        "stalled": stalled,
        "save_switch": switch_is_set(job, "save"),
        "kill_switch": switch_is_set(job, "kill"),
        "requests": requests,
        "checkpoint_root": {"path": str(root.path), "found_in": root.found_in or None, "exists": root.exists,
                            "described": str(root)},
        "checkpoints": items,
        "newest_valid": newest,
        "problems": [c for c in items if not c["valid"]],
        "set_aside": aside,
        "save_estimate": save_estimate,
        "time_left": time_left,
        "verdict": verdict,
        "events": log[-events:] if events > 0 else [],
        "events_logged": len(log),
    }


def _which_run(found: dict[str, Any] | None, log: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest hang (:func:`ftkit.control.hangs.culprit`) with the run it happened in:
    ``this_run`` (no run started after it), ``run`` (job id, restart count, start time of
    that run) and ``after`` (what later runs did, in words; None for this run's hang)."""
    if found is None:
        return None
    from ..control.hangs import last_incident

    incident = {id(e) for e in last_incident(log)}
    hang_at = max(i for i, e in enumerate(log) if id(e) in incident)
    before = [e for e in log[:hang_at] if e.get("event") == "start"]
    lead = [e for e in before if e.get("rank", 0) == 0] or before
    began = lead[-1] if lead else {}
    later = [e for e in log[hang_at + 1:] if e.get("event") in ("start", "exit")]
    later_starts = [e for e in later if e["event"] == "start" and e.get("rank", 0) == 0] or \
        [e for e in later if e["event"] == "start"]
    after = None
    if later_starts:
        done = [e for e in later if e["event"] == "exit" and e.get("completed")]
        n = len({(e.get("job_id"), e.get("restart_count"), round(e["time"])) for e in later_starts})
        after = (f"a later run completed training (step {done[-1].get('step')})" if done else
                 f"{n} later run{'s' if n > 1 else ''} started since")
    return {**found, "this_run": not later_starts, "after": after,
            "run": {"job_id": began.get("job_id"), "restart_count": began.get("restart_count"),
                    "start_time": began.get("time")}}


def _stalls(root: Path, start: dict[str, Any], run_starts: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The ranks of the running run that show a stall in their heartbeats
    (``JOBDIR/heartbeats/rank{R}.json``), most suspect first: one whose step is overdue (its
    watchdog writes the main thread's frame once the step has taken longer than a heartbeat
    interval), or whose heartbeat is stale (older than three intervals: the process is not
    running: stopped, killed, its node lost). Before the watchdog declares anything."""
    from ..control.hangs import Heartbeat, suspicion

    world = start.get("world_size") if isinstance(start.get("world_size"), int) else 1
    since = min((e["time"] for e in run_starts), default=start["time"]) - 60.0  # heartbeats precede the start
    job = start.get("job_id")
    found = []
    for path in sorted((root / "heartbeats").glob("rank*.json")):
        try:
            beat = Heartbeat.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if beat.rank >= world or beat.written < since or (job and beat.job and str(beat.job) != str(job)):
            continue  # another run's, or another job's
        beat = beat.seen(now)
        if beat.running and beat.frame is None:
            continue
        found.append(beat)
    found.sort(key=suspicion)
    return [{
        "rank": b.rank, "host": b.host, "pid": b.pid, "step": b.step, "running": b.running,
        "seconds": None if b.last_step_wall is None else round(max(now - b.last_step_wall, 0.0), 1),
        "frame": b.frame, "waiting": b.waiting, "phase": b.phase, "heartbeat_age": b.age,
        "heartbeat_interval": b.interval,
    } for b in found]


def _stall_line(s: dict[str, Any]) -> str:
    """One stalled rank in words (plain text)."""
    who = f"rank {s['rank']} on {s.get('host') or '?'}"
    if s["running"] is False:
        return (f"{who}: its heartbeat is {s['heartbeat_age']:.0f} s old (written every {s['heartbeat_interval']:g} s): "
                f"its process is not running (stopped, killed, or its node was lost); last step {s['step']} or later")
    took = "" if s["seconds"] is None else f" for {s['seconds']:.0f} s"
    phase = f"; in {s['phase']}" if s.get("phase") else ""
    where = "waiting inside a collective" if s.get("waiting") else \
        "outside any collective" if s.get("waiting") is False else ""
    return (f"{who} has completed no step{took} (last step {s['step']}{phase}), in {s['frame']}"
            + (f" ({where})" if where else ""))


def _found_broken(log: list[dict[str, Any]]) -> dict[str, str]:
    """The checkpoints a resume skipped as broken since they were saved (``skip`` events after
    the last ``save`` of their path, for a reason that shows them broken: not a save that never
    finished, not a read the system failed): path -> why."""
    from ..checkpoint.format.manifest import known_broken

    broken: dict[str, str] = {}
    for e in log:
        path = e.get("path")
        if not isinstance(path, str):
            continue
        if e.get("event") == "save":
            broken.pop(path, None)
        elif (e.get("event") == "skip" and e.get("status") not in ("incomplete", "unreadable")
              and known_broken(str(e.get("reason", "")))):  # (a Hugging Face resume's skip says its status)
            broken[path] = str(e.get("reason") or "no reason given")
    return broken


def _set_aside(root: Path) -> list[dict[str, Any]]:
    """The ``set-aside-*`` directories under the checkpoint root (a rollback's or a fresh
    start's earlier history, moved there whole): path, step directories, bytes."""
    found = []
    try:
        dirs = sorted(d for d in root.glob("set-aside-*") if d.is_dir())
    except OSError:
        return []
    for d in dirs:
        size, steps = 0, 0
        for here, _dirs, files in os.walk(d):
            if Path(here).parent == d and Path(here).name.startswith("step-"):
                steps += 1
            for name in files:
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(here, name)).st_size
        found.append({"path": str(d), "checkpoints": steps, "size": size})
    return found


def _status(args: argparse.Namespace) -> int:
    if args.events < 0:
        raise ConfigError(f"--events: a number of events >= 0 (0: none), got {args.events}")
    status = collect_status(args.jobdir, events=args.events)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ._checkpoints import _age, _human

    console = Console(soft_wrap=True)
    console.print(f"[bold]{status['jobdir']}[/]  {'running' if status['running'] else 'not running'}")
    s = status["slurm"]
    if s:
        left = "" if s.get("time_left") is None else f", {s['time_left']:.0f} s left"
        console.print(f"SLURM job {s['job_id']}: {s.get('state') or s.get('error')}"
                      f"{'' if not s.get('reason') or s['reason'] == 'None' else ' (' + s['reason'] + ')'}{left}")
    if status["lease"]:
        lease = status["lease"]
        colour = {"held": "", "stale": "yellow", "released": "dim"}.get(lease["state"], "")
        text = escape(f"lease: {lease['description']}")
        console.print(f"[{colour}]{text}[/]" if colour else text, highlight=False)
    pending = []
    if status["save_switch"]:
        pending.append("save-switch (save at the next step)")
    if status["kill_switch"]:
        pending.append("[red]kill-switch[/] (save and stop; later runs exit at once; `ftkit kill --clear`)")
    for r in status["requests"]:
        name = escape(Path(r["path"]).name)
        if "error" in r:
            pending.append(f"[red]broken request file[/] {name}: {escape(r['error'])}; the job ignores "
                           f"it: delete it, or write requests with `ftkit request`")
        elif r.get("stale"):
            pending.append(f"[yellow]left-over request[/] {escape(r['action'])} ({name}): {escape(r['stale'])}; "
                           "the next run removes it without acting on it")
        else:
            pending.append(f"request {escape(r['action'])}" + (f": {escape(str(r['reason']))}" if r.get("reason") else "")
                           + f" ({name})")
    if len(pending) > 1:
        console.print("pending:\n" + "\n".join(f"  {p}" for p in pending))
    else:
        console.print("pending: " + (pending[0] if pending else "nothing"))
    console.print(f"[bold]{escape(status['verdict'])}[/]", highlight=False)
    if status["newest_valid"] is not None:  # status reads no data file: a flipped byte shows only there
        console.print(f"  (its files have their recorded sizes; `ftkit verify {escape(str(status['jobdir']))}` "
                      "reads every checksum, and a resume falls back past a corrupt one)", style="dim",
                      highlight=False)
    root = status["checkpoint_root"]
    if root["found_in"] and root["exists"]:
        console.print(escape(f"checkpoints in {root['described']}"), highlight=False)
    for i, s in enumerate(status["stalled"]):
        colour = "bold red" if i == 0 else "yellow"
        note = "; the hang watchdog has not declared a hang (yet)" if i == 0 else ""
        console.print(f"[{colour}]stalled: {escape(_stall_line(s) + note)}[/]", highlight=False)
    hang = status["hang"]
    if hang and hang.get("this_run", True):
        from ..control.hangs import describe

        console.print(f"[bold red]{escape(describe(hang))}[/]", highlight=False)
    elif hang:
        from ..control.hangs import describe

        run = hang.get("run") or {}
        which = (f"job {run['job_id']} restart {run.get('restart_count') or 0}" if run.get("job_id") else
                 "started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["start_time"]))
                 if run.get("start_time") else "")
        text = f"an earlier run{f' ({which})' if which else ''} {describe(hang).replace('hang: ', 'hung: ', 1)}"
        console.print(escape(text + (f"; {hang['after']}" if hang.get("after") else "")), style="dim", highlight=False)
    if status["checkpoints"]:
        table = Table("step", "age", "size", "status", "pinned", title="checkpoints")
        table.add_column("why", overflow="fold")  # a long path folds, whole
        for c in status["checkpoints"]:
            colour = {"valid": "green", "incomplete": "yellow", "unsealed": "yellow"}.get(c["status"], "red")
            table.add_row(str(c["step"]), _age(c["time"], status["time"]), _human(c["size"]) if c["size"] else "-",
                          f"[{colour}]{c['status']}[/]", "yes" if c["pinned"] else "",
                          escape(c["reason"] or c["saved_for"] or ""))
        console.print(table)
    for a in status["set_aside"]:
        console.print(escape(f"set aside: {a['path']} ({a['checkpoints']} checkpoint"
                             f"{'' if a['checkpoints'] == 1 else 's'}, {_human(a['size'])}): another history, "
                             "never resumed from nor deleted by ftkit; delete it when no longer wanted"),
                      style="yellow", highlight=False)
    if not status["events_logged"]:
        console.print(f"no events yet: no ftkit job has started with this job dir ({escape(str(status['jobdir']))}"
                      "/events.jsonl is written when one does)", highlight=False)
        return 0
    if not status["events"]:  # --events 0
        return 0
    table = Table("time", "event", "rank", "step", title="recent events")
    table.add_column("details", overflow="fold")
    for e in status["events"]:
        step = e.get("step")
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["time"])), e["event"],
                      str(e.get("rank", "")), "" if not isinstance(step, int) or step < 0 else str(step),
                      _details(e))
    console.print(table)
    return 0


def _details(e: dict[str, Any]) -> str:
    """The events table's last column: what the event means, in words (rich markup)."""
    from rich.markup import escape

    kind = e.get("event")
    if kind == "resume":
        return ("fresh start: no valid checkpoint to resume from" if e.get("step") is None
                else f"resumed from the checkpoint of step {e['step']}")
    if kind == "exit":
        if e.get("error"):
            return f"[red]crashed[/]: {escape(str(e['error']).rstrip(': '))}"
        if e.get("completed"):
            return "training completed"
        reasons = "; ".join(map(str, e.get("reasons") or []))
        wish = _wish(e.get("requeue"))
        return escape(f"stopped: {reasons}{wish}" if reasons else f"stopped{wish}")
    if kind == "start":
        parts = [f"world size {e['world_size']}"] if e.get("world_size") else []
        if e.get("job_id"):
            parts.append(f"SLURM job {e['job_id']}, restart {e.get('restart_count', 0)}")
        if e.get("kill_switch"):
            parts.append("kill-switch present: exits at the first check")
        return escape(", ".join(parts))
    reasons = "; ".join(map(str, e.get("reasons") or [])) if isinstance(e.get("reasons"), list) else ""
    if kind == "decision":
        what = _ACTIONS.get(str(e.get("action")), str(e.get("action", "")).lower())
        wish = _wish(e.get("requeue"))
        return escape(f"{what}{wish}: {reasons}" if reasons else f"{what}{wish}")
    if kind == "save":
        took = f" in {float(e['seconds']):.2f} s" if isinstance(e.get("seconds"), (int, float)) else ""
        return escape(f"saved{took}: {e.get('reason') or ''}".rstrip(": "))
    if kind == "load" and e.get("path"):
        return escape(f"loaded {Path(str(e['path'])).name}")
    return escape(reasons or str(e.get("reason") or e.get("action") or ""))


def _wish(requeue: Any) -> str:
    return ", asks for a requeue" if requeue is True else ", no requeue" if requeue is False else ""


_ACTIONS = {"SAVE": "save", "SAVE_EXIT": "save and exit", "EXIT": "exit without saving"}
