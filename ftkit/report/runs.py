"""The runs of a job dir, read back from its events log.

A run is everything from one rank-0 ``start`` record to the next: the trainer's records, the
checkpoint manager's and saver's, and the ``requeue`` record ``ftkit requeue`` writes after
the process ended. Pure functions of the records: no files, no torch.

Where a run ends: its ``exit`` record; a run killed without one (``kill -9``, a node failure,
the OOM killer) ends at the last record its own process wrote (a ``progress`` record at most
``timing.progress_every`` seconds old, with logs written before this release, the last save),
or, later, where the crash-safe saver began to persist a snapshot of it (its ``save`` record's
time less its ``seconds``: the trainer had taken that snapshot, and the saver persists the last
one as soon as the trainer is gone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Run", "parse_runs"]

_UNPLANNED = ("crash", "hang", "node", "killed", "saves failing")


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(kw_only=True, slots=True)
class Run:
    """One process lifetime of the job (rank 0's view)."""

    index: int
    events: list[dict[str, Any]] = field(repr=False)
    start: dict[str, Any] = field(repr=False)
    pid: int | None = None
    job_id: str | None = None
    restart_count: int = 0
    world_size: int = 1
    nodes: int | None = None
    gpus_per_node: int | None = None
    process_start: float | None = None
    """Wall time the process started (``/proc/self/stat``); None in older logs."""
    ftkit_start: float = 0.0
    setup_seconds: float | None = None
    loop_start: float | None = None
    """When the loop began: the ``resume`` record (after the checkpoint was loaded)."""
    resume_step: int | None = None
    resumed: bool = False
    manager_seconds: float | None = None
    load_call_seconds: float | None = None
    find_seconds: float | None = None
    first_step: dict[str, Any] | None = field(default=None, repr=False)
    loop_end: float = 0.0
    end: float = 0.0
    exit: dict[str, Any] | None = field(default=None, repr=False)
    requeue: dict[str, Any] | None = field(default=None, repr=False)
    last_step: int | None = None
    stalls: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """``progress`` records written after a save: ``time`` (end of the stall), ``stall``, ``save_step``."""
    saves: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The manager's ``save`` records (durable checkpoints) of this run."""
    cause: str = ""
    unplanned: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def begin(self) -> float:
        return self.process_start if self.process_start is not None else self.ftkit_start

    @property
    def wall(self) -> float:
        return self.end - self.begin

    @property
    def last_durable(self) -> int | None:
        steps = [int(s["step"]) for s in self.saves if s.get("step") is not None]
        return max(steps) if steps else None

    @property
    def has_timing(self) -> bool:
        """Written by a release that records the timing facts (``process_start``)."""
        return "process_start" in self.start

    def stall_values(self) -> list[float]:
        return [float(s["stall"]) for s in self.stalls if not s.get("exiting")]


def parse_runs(events: Iterable[dict[str, Any]], *, alive: Callable[[str | None, int | None], bool] | None = None
               ) -> list[Run]:
    """Group an events log into runs (module doc), in order. ``alive(host, pid)`` tells a last
    run without an exit record that is still running (not an interruption) from a killed one."""
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        if e.get("event") == "start" and e.get("rank", 0) == 0:
            groups.append([e])
        elif groups:
            groups[-1].append(e)
    runs = [_run(i, g) for i, g in enumerate(groups)]
    last = runs[-1] if runs else None
    if last is not None and last.exit is None and last.requeue is None and alive is not None \
            and alive(last.start.get("host"), last.pid):
        last.cause, last.unplanned = "running (no exit record yet)", False
        last.notes[:] = [n for n in last.notes if not n.startswith("no exit record")]
        last.notes.append("the last run is still running: it ends, for now, at its last record")
    return runs


def _first(events: list[dict[str, Any]], kind: str, pid: Any = None) -> dict[str, Any] | None:
    for e in events:
        if e.get("event") == kind and e.get("rank", 0) == 0 and (pid is None or e.get("pid") == pid):
            return e
    return None


def _run(index: int, events: list[dict[str, Any]]) -> Run:
    start = events[0]
    pid = start.get("pid")
    run = Run(index=index, events=events, start=start, pid=pid, job_id=start.get("job_id"),
              restart_count=int(start.get("restart_count") or 0), world_size=int(start.get("world_size") or 1),
              nodes=start.get("nodes"), gpus_per_node=start.get("gpus_per_node"))
    run.process_start = _f(start.get("process_start"))
    run.ftkit_start = float(start.get("ftkit_start") or start["time"])
    run.setup_seconds = _f(start.get("setup_seconds"))
    if not run.has_timing:
        run.notes.append("written before ftkit recorded timing facts: the time before ftkit started, "
                         "the split of the restart cost, checkpoint stalls of background saves and the "
                         "exact end of the training loop are not known")
    own = [e for e in events if e.get("pid") == pid]
    resume = _first(own, "resume")
    if resume is not None:
        run.loop_start = float(resume["time"])
        run.resumed = True
        run.resume_step = None if resume.get("step") is None else int(resume["step"])
        run.load_call_seconds = _f(resume.get("seconds"))
        run.manager_seconds = _f(resume.get("manager_seconds"))
    load = _first(own, "load")
    if load is not None:
        run.find_seconds = _f(load.get("find_seconds"))
    run.first_step = _first(own, "first-step")
    if run.loop_start is None:  # check() without resume(): the loop starts at the first check
        run.loop_start = float(start["time"])
    run.stalls = [e for e in own if e.get("event") == "progress" and e.get("rank", 0) == 0 and "stall" in e]
    run.saves = [e for e in events if e.get("event") == "save" and e.get("rank", 0) == 0]
    run.exit = _first(own, "exit")
    run.requeue = _first(events, "requeue")
    steps = [run.resume_step or 0]
    for e in own:
        if e.get("rank", 0) != 0:
            continue
        for key in ("step", "last_step"):
            if e.get(key) is not None and e.get("event") in ("progress", "first-step", "exit", "save", "decision"):
                steps.append(int(e[key]))
    # a hang: the watchdog's record (any rank's) names the last step done and since when it waited
    hang = next((e for e in events if e.get("event") == "hang"), None)
    if hang is not None and hang.get("step") is not None:
        steps.append(int(hang["step"]))
    # a checkpoint of a step means the trainer got that far: the crash-safe saver persists the
    # last snapshot after the trainer died, past its last progress record
    steps += [int(s["step"]) for s in run.saves if s.get("step") is not None]
    run.last_step = max(steps)
    if run.exit is not None:
        run.end = float(run.exit["time"])
        if run.exit.get("loop_end") is not None:
            run.loop_end = float(run.exit["loop_end"])
        else:
            decision = next((e for e in own if e.get("event") == "decision" and e.get("rank", 0) == 0
                             and "EXIT" in str(e.get("action", ""))), None)
            run.loop_end = float(decision["time"]) if decision is not None else run.end
    elif hang is not None:  # the watchdog ended the process (exit 87) after its record
        run.end = max([float(e["time"]) for e in own] + [float(hang["time"])])
        run.loop_end = run.end
    else:
        # the crash-safe saver persists the dead trainer's last snapshot from a process of its
        # own: the trainer trained at least until that snapshot, past its own last record
        # (a short run's own records may be its start and first step alone)
        rescued = [float(s["time"]) - float(s.get("seconds") or 0.0) for s in run.saves if s.get("pid") != pid]
        run.end = max([float(e["time"]) for e in own] + rescued)
        run.loop_end = run.end
        run.notes.append("no exit record (killed: kill -9, node failure or OOM): the run's end is "
                         "taken as its last record" + (" (the crash-safe saver's persist of its last snapshot, "
                                                      "begun when the trainer was gone)"
                                                      if rescued and max(rescued) == run.end else ""))
    if hang is not None:  # the loop ended at the last step done: the wait after it is lost
        stuck = _f(hang.get("last_step_wall"))
        if stuck is None and hang.get("seconds") is not None:
            stuck = float(hang["time"]) - float(hang["seconds"])
        if stuck is not None:
            run.loop_end = min(run.loop_end, stuck)
        run.notes.append(f"hung after step {hang.get('step')}: the {float(hang.get('seconds') or 0):.0f} s the "
                         "watchdog waited before ending it count as exit_wait, not as training")
    run.loop_end = min(max(run.loop_end, run.loop_start), run.end)
    run.cause, run.unplanned = _cause(run)
    return run


def _first_error(run: Run) -> str:
    """The error of the rank that failed first: where one rank raises, the others' errors are
    mostly its echo (gloo's "Connection closed by peer"), rank 0's among them."""
    errors = [e for e in run.events if e.get("event") == "exit" and e.get("error")]
    if not errors:
        return str((run.exit or {}).get("error"))
    first = min(errors, key=lambda e: float(e.get("time", 0.0)))
    rank = int(first.get("rank", 0))
    return str(first["error"]) if rank == 0 else f"{first['error']} (rank {rank}, the first rank to fail)"


def _cause(run: Run) -> tuple[str, bool]:
    """Why the run ended, and whether that was an unplanned interruption."""
    if any(e.get("event") == "hang" for e in run.events):
        return "hang (watchdog)", True
    if run.requeue is not None and run.requeue.get("cause"):
        cause = str(run.requeue["cause"])
        if run.exit is None and cause == "crash":
            cause = "crash (no exit record)"
        if cause == "requeued by SLURM" and (run.exit is None or run.exit.get("error")):
            # SLURM took the job back while its trainer crashed or was killed: a node lost, as
            # a rule (a preemption is caught as such; an admin's requeue lets it exit cleanly)
            if run.exit is not None:
                return f"requeued by SLURM after a crash (a node lost?): {_first_error(run)}", True
            return "requeued by SLURM, its trainer killed without an exit record (a node lost?)", True
        return cause, cause.startswith(_UNPLANNED)
    ex = run.exit
    if ex is None:
        return "killed (no exit record)", True
    if ex.get("error"):
        return f"crash: {_first_error(run)}", True
    if ex.get("completed"):
        return "completed", False
    reasons = "; ".join(ex.get("reasons") or [])
    if ex.get("requeue") is True:
        return f"requeue: {reasons}" if reasons else "requeue", False
    if ex.get("requeue") is False:
        return f"stopped: {reasons}" if reasons else "stopped", False
    return reasons or "exited", False
