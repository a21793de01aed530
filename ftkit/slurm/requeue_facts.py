"""What ``ftkit requeue`` knows about the run that just ended: gathered once, then only read.

:func:`gather` reads the job directory (this run's ``start``/``exit``/``resume``/``hang``
events and a ``lease-refused`` one, the kill-switch, leftover request files, ``runs.json``,
the newest valid checkpoint), SLURM's view of the job (``scontrol show job``: JobState,
Reason, PreemptTime, Restarts) and the clock into a frozen :class:`RunFacts`. The policy
(:func:`ftkit.slurm.requeue_policy.decide`) decides from those facts alone, so every branch
of it can be tested with a hand-made :class:`RunFacts`.

``runs.json`` is read here (past runs are facts) and appended to by
:func:`ftkit.slurm.requeue.finish_run`, through :func:`write_runs`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._fs import atomic_write
from ..control.hangs import culprit, hang_step
from ..errors import ConfigError, SlurmError
from ..events import read_events
from ..jobdir import JobDir
from ..triggers.switches import read_request, request_files, switch_is_set
from . import env as _env
from .env import Runner, SlurmEnv, job_info

__all__ = [
    "RunFacts",
    "gather",
    "lease_refused",
    "newest_checkpoint_step",
    "read_runs",
    "scontrol_runner",
    "write_runs",
]

log = logging.getLogger(__name__)


def scontrol_runner(runner: Runner | None) -> Runner:
    """``runner``, else :func:`ftkit.slurm.env.run_scontrol` looked up at call time (tests
    patch that single call point)."""
    return runner if runner is not None else (lambda args: _env.run_scontrol(args))


# --------------------------------------------------------------------------------------
# the facts


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """Everything the requeue policy looks at about the run that just ended."""

    jobdir: JobDir
    env: SlurmEnv
    exit_code: int
    """The launcher's exit code (``ftkit requeue --exit-code``)."""
    slurm_job: Mapping[str, str] | None = field(default=None, repr=False)
    """``scontrol show job`` of this job, None when it could not be read (or outside SLURM)."""
    start: Mapping[str, Any] | None = None
    """This run's ``start`` event (rank 0's), None when the trainer never started."""
    exit: Mapping[str, Any] | None = None
    """This run's ``exit`` event (rank 0's): ``requeue``, ``completed``, ``reasons``, ``step``."""
    resumed: Mapping[str, Any] | None = None
    hang: Mapping[str, Any] | None = None
    """The hang watchdog's event, when it fired."""
    refused: Mapping[str, Any] | None = None
    """The ``lease-refused`` event this run wrote: another run held the job dir."""
    handled: Mapping[str, Any] | None = None
    """The ``requeue`` event of an ``ftkit requeue`` that handled this run already (run twice)."""
    clean: bool = False
    """Every rank wrote an ``exit`` event without an error (:func:`_clean_exit`)."""
    kill_switch: bool = False
    requests: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    """Request files left from this run: (path, contents; empty when unreadable or broken)."""
    runs: tuple[Mapping[str, Any], ...] = ()
    """``runs.json``: the records of the runs before this one, oldest first."""
    end_step: int | None = None
    """Step of the newest valid checkpoint now."""
    end_time: float = 0.0
    """Wall clock when the facts were gathered."""

    @property
    def slurm_state(self) -> str | None:
        return self.slurm_job.get("JobState", "").upper() if self.slurm_job else None

    @property
    def training_exit_code(self) -> int:
        """The exit code the training counts as: 0 when every rank exited cleanly. torchrun and
        srun may exit non-zero for a signal that reached them after every rank had saved and
        exited cleanly: that is not a crash."""
        return 0 if self.clean else self.exit_code

    @property
    def start_step(self) -> int | None:
        """The step this run started from: what the previous run left, else what it resumed."""
        if self.runs:
            return self.runs[-1].get("end_step")
        return self.resumed.get("step") if self.resumed else None

    @property
    def progress(self) -> bool:
        """A valid checkpoint newer than the one this run started from exists."""
        start = self.start_step
        return self.end_step is not None and (start is None or self.end_step > start)

    @property
    def requeues(self) -> int:
        """Requeues in a row before this run: SLURM's count, or ``runs.json``'s when larger
        (a resubmission starts SLURM's count at 0 again)."""
        return max(self.env.restart_count, streak(self.runs, lambda r: bool(r.get("requeue"))))

    def record(self) -> dict[str, Any]:
        """What this run adds to ``runs.json``, before the policy adds its verdict."""
        start, hang = self.start, self.hang
        return {
            "job_id": self.env.job_id, "requeue_target": self.env.requeue_target,
            "restart_count": self.env.restart_count,
            "start_time": start.get("time") if start else None, "end_time": round(self.end_time, 3),
            "exit_code": self.exit_code, "start_step": self.start_step, "end_step": self.end_step,
            "progress": self.progress, "hang_step": hang.get("hang_step", hang.get("step")) if hang else None,
            "slurm_state": self.slurm_state,
        }


def _hang(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The hang this run ended in, as the rank that stopped first saw it (:func:`culprit`):
    every rank's watchdog fires, and the last event written is as often a rank that was only
    waiting for it. That rank's own event; where it wrote none (stopped, killed, its node
    lost), the first rank to fire's, naming it, with the culprit's step as far as it is known
    (``step`` to ``step_max``: its last heartbeat may be an interval old). ``hang_step`` is
    the step ``runs.json`` records (:func:`ftkit.control.hangs.hang_step`: exact, not a
    heartbeat's)."""
    hangs = [e for e in events if e.get("event") == "hang"]
    who = culprit(hangs) if hangs else None
    if who is None:
        return hangs[-1] if hangs else None
    own = [e for e in hangs if int(e.get("rank", 0)) == who["rank"]]
    if own:
        return {**own[-1], "hang_step": own[-1].get("step")}
    first = min(hangs, key=lambda e: e.get("time", 0.0))
    return {**first, "rank": who["rank"], "host": who["host"], "step": who["step"], "step_max": who["step_max"],
            "step_exact": who["step_exact"], "hang_step": hang_step(who), "file": who["file"], "seconds": None}


def streak(runs: tuple[Mapping[str, Any], ...], match: Callable[[Mapping[str, Any]], bool]) -> int:
    """How many of the newest ``runs`` in a row ``match``."""
    n = 0
    for record in reversed(runs):
        if not match(record):
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------
# gathering


def gather(
    jobdir: str | os.PathLike[str],
    *,
    exit_code: int,
    env: SlurmEnv | None = None,
    runner: Runner | None = None,
    checkpoints_lookup: Callable[[Path], int | None] | None = None,
    clock: Callable[[], float] = time.time,
) -> RunFacts:
    """Read the facts about the run that just ended with ``exit_code``. Reads only.

    ``checkpoints_lookup`` (default :func:`newest_checkpoint_step`) finds the newest valid
    checkpoint's step in the job's checkpoint root: ``JOBDIR/checkpoints``, or the root its
    events log names (a ``CheckpointConfig(root=...)`` elsewhere, Hugging Face Trainer's output dir).
    """
    job = JobDir.of(jobdir)
    if not job.root.is_dir():
        what = "is a file, not a job dir" if job.root.exists() else "does not exist"
        raise ConfigError(f"job dir {job.root} {what}; pass the JOBDIR the batch script uses")
    env = env if env is not None else SlurmEnv.from_env()

    info: dict[str, str] | None = None
    if env.job_id is not None:
        try:
            info = job_info(env.job_id, runner=scontrol_runner(runner))
        except SlurmError as exc:
            log.warning("cannot ask SLURM about job %s, deciding without it: %s", env.job_id, exc)

    all_events = list(read_events(job.events))
    from ..cli._paths import checkpoint_root

    root = checkpoint_root(job.root, all_events)
    end_step = (checkpoints_lookup(root.path) if checkpoints_lookup is not None
                else newest_checkpoint_step(root.path, hf=root.hf))
    run_events, handled = _this_run(all_events, env)
    start = _last(run_events, "start")
    return RunFacts(
        jobdir=job, env=env, exit_code=int(exit_code), slurm_job=info,
        start=start, exit=_last(run_events, "exit"), resumed=_last(run_events, "resume"),
        hang=_hang(run_events), refused=lease_refused(all_events, env), handled=handled,
        clean=_clean_exit(run_events, start),
        kill_switch=switch_is_set(job, "kill"),
        requests=tuple((str(path), _contents(path)) for path in request_files(job)),
        runs=tuple(read_runs(job.runs)),
        end_step=end_step,
        end_time=clock(),
    )


def newest_checkpoint_step(root: str | os.PathLike[str], *, hf: bool = False) -> int | None:
    """Step of the newest valid checkpoint under ``root`` (``JOBDIR/checkpoints``), or None.
    Uses ftkit's checkpoint manager, which validates manifests; ``hf``: Trainer's sealed
    ``checkpoint-N`` directories."""
    from ..checkpoint import CheckpointConfig, make_manager, validate_dir

    if hf:
        from ..checkpoint.format import list_step_dirs, parse_hf_step

        return next((step for step, path in list_step_dirs(root, parse_hf_step) if validate_dir(path).valid), None)

    manager = make_manager(CheckpointConfig(root=Path(root)), events=None, rank=0, world_size=1)
    steps = [int(info.step) for info in manager.list() if info.valid]
    return max(steps, default=None)


def _contents(path: Path) -> Mapping[str, Any]:
    """A leftover request file's object; empty when it is broken (it still counts as spent)."""
    try:
        return read_request(path).data
    except (OSError, ValueError):
        return {}


def read_runs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The run records of ``runs.json``; a missing or unreadable file gives ``[]``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def write_runs(path: str | os.PathLike[str], runs: list[dict[str, Any]]) -> None:
    """Replace ``runs.json`` atomically with ``runs``."""
    atomic_write(path, (json.dumps({"version": 1, "runs": runs}, indent=1, default=str) + "\n").encode())


_TRAINERS = ("start", "exit", "resume")
"""Records only the trainer's own processes write: another run's (a displaced restart of the
same job, its lease lost, writes its exit after this run started) are not this run's."""


def _same_run(e: Mapping[str, Any], env: SlurmEnv) -> bool:
    """``e`` (a ``start`` or ``requeue`` event) belongs to this job id and restart count (a
    ``requeue`` event of an earlier release has no restart count: taken as this run's)."""
    restart = e.get("restart_count")
    return e.get("job_id") == env.job_id and (restart is None or int(restart) == env.restart_count)


def _started_this_run(e: Mapping[str, Any], env: SlurmEnv) -> bool:
    return (e.get("event") == "start" and e.get("job_id") == env.job_id
            and int(e.get("restart_count") or 0) == env.restart_count)


def _this_run(events: list[dict[str, Any]], env: SlurmEnv) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The events of the run that just ended, and the ``requeue`` event that handled it already
    (an ``ftkit requeue`` run twice for it), else None.

    From the last rank 0 ``start`` of this job id and restart count on (the first ``start`` of
    any rank after the last ``requeue`` where no rank 0 wrote one). The last, not the first:
    outside SLURM every run has no job id, and a batch script or a launcher's restart may start
    several runs in one job, each of which ends the one before (an ``ftkit requeue`` after a
    crash must not read an earlier run's clean exit as this run's). The trainer's records count
    from its own processes only (:data:`_TRAINERS`), and a ``requeue`` event ends the run only
    when it is this run's and came after the trainer's last record: a restart displaced by this
    one (a node SLURM took for lost while its trainer ran on) ends with an ``ftkit requeue`` of
    its own, and an ``ftkit requeue`` typed while the run trains is not its end either; either
    made this run's own ``ftkit requeue`` find no run, and a requeue it asked for was refused."""
    ours = [i for i, e in enumerate(events) if _started_this_run(e, env)]
    leaders = [i for i in ours if events[i].get("rank", 0) == 0]
    if leaders:
        begin = leaders[-1]
    else:
        last_end = max((i for i, e in enumerate(events) if e.get("event") == "requeue"), default=-1)
        later = [i for i in ours if i > last_end]
        if not later:
            return [], None
        begin = later[0]
    block = events[begin:]
    procs = {e.get("pid") for e in block if _started_this_run(e, env)}
    run = [e for e in block if e.get("event") not in _TRAINERS or e.get("pid") in procs]
    last_own = max((float(e.get("time", 0.0)) for e in run if e.get("event") in _TRAINERS), default=0.0)
    for i, e in enumerate(run):
        if e.get("event") == "requeue" and _same_run(e, env) and float(e.get("time", 0.0)) >= last_own:
            return run[:i], e
    return run, None


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    found = [e for e in events if e.get("event") == kind]
    rank0 = [e for e in found if e.get("rank", 0) == 0]
    return (rank0 or found)[-1] if found else None


def lease_refused(events: list[dict[str, Any]], env: SlurmEnv) -> dict[str, Any] | None:
    """The ``lease-refused`` event this run wrote (the job dir was held by another run), else None.

    The refusal comes before any ``start`` event, so the whole log is searched, by job id and
    restart count (outside SLURM: the newest refusal after the last ``requeue`` event).
    """
    last_end = max((i for i, e in enumerate(events) if e.get("event") == "requeue"), default=-1)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.get("event") != "lease-refused":
            continue
        if env.job_id is None:
            return e if i > last_end else None
        if str(e.get("job_id")) == env.job_id and int(e.get("restart_count") or 0) == env.restart_count:
            return e
    return None


def _clean_exit(run_events: list[dict[str, Any]], start: dict[str, Any] | None) -> bool:
    """Every rank of this run wrote an ``exit`` event without an error (from its ``start`` event's
    world size): whatever the launcher's exit code, the trainers ended on purpose."""
    if start is None:
        return False
    world = start.get("world_size")
    world = world if isinstance(world, int) and world > 0 else 1
    clean = {e.get("rank", 0) for e in run_events if e.get("event") == "exit" and not e.get("error")}
    return clean >= set(range(world))
