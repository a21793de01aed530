"""The SLURM job environment: ``SLURM_*`` variables and ``scontrol show job``.

:func:`run_scontrol` is the single place that runs ``scontrol``. The helpers look it up at
call time, so tests patch it (or pass ``runner=``).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from ..errors import SlurmError

__all__ = [
    "SlurmEnv",
    "job_end_time",
    "job_info",
    "parse_job_line",
    "run_scontrol",
]

log = logging.getLogger(__name__)

Runner = Callable[[Sequence[str]], str]

_UNSET_TIMES = frozenset({"", "unknown", "none", "(null)", "n/a"})


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value is None or not value.strip():
            continue
        try:
            return int(value.strip())
        except ValueError:
            log.debug("ignoring non-integer %s=%r", name, value)
    return None


def _str(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return value.strip()
    return None


@dataclass(frozen=True, slots=True)
class SlurmEnv:
    """What SLURM tells a task about its job; every field is None outside SLURM."""

    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    procid: int | None = None
    localid: int | None = None
    nodeid: int | None = None
    ntasks: int | None = None
    nnodes: int | None = None
    job_name: str | None = None
    submit_dir: str | None = None
    partition: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if environ is None else environ
        return cls(
            job_id=_str(env, "SLURM_JOB_ID", "SLURM_JOBID"),
            array_job_id=_str(env, "SLURM_ARRAY_JOB_ID"),
            array_task_id=_str(env, "SLURM_ARRAY_TASK_ID"),
            restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
            procid=_int(env, "SLURM_PROCID"),
            localid=_int(env, "SLURM_LOCALID"),
            nodeid=_int(env, "SLURM_NODEID"),
            ntasks=_int(env, "SLURM_NTASKS", "SLURM_NPROCS"),
            nnodes=_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
            job_name=_str(env, "SLURM_JOB_NAME"),
            submit_dir=_str(env, "SLURM_SUBMIT_DIR"),
            partition=_str(env, "SLURM_JOB_PARTITION"),
        )

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def is_array(self) -> bool:
        return self.array_job_id is not None and self.array_task_id is not None

    @property
    def requeue_target(self) -> str | None:
        """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for array tasks, else the job id."""
        if self.is_array:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def run_slurm_command(cmd: Sequence[str], *, timeout: float, cwd: str | None = None,
                      env: Mapping[str, str] | None = None, missing: str) -> str:
    """Run a SLURM client command and return its stdout; SlurmError (naming the command) on any failure."""
    shown = " ".join(cmd)
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=cwd, env=None if env is None else dict(env))
    except FileNotFoundError:
        raise SlurmError(f"`{shown}`: {missing}") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shown}` did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise SlurmError(f"`{shown}` could not be run: {exc}") from exc
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout or "").strip()
        raise SlurmError(f"`{shown}` failed (exit {proc.returncode}): {err or 'no output'}")
    return proc.stdout


def run_scontrol(args: Sequence[str], *, timeout: float = 10) -> str:
    """Run ``scontrol ARGS`` and return its stdout; SlurmError on any failure. The single call
    point for scontrol (tests patch it).

    scontrol runs with ``SLURM_TIME_FORMAT=standard`` (and the rest of this process's
    environment as it is): a user's ``SLURM_TIME_FORMAT=relative``, which sbatch exports into
    the job, would print ``EndTime=10:28:14`` instead of the ISO time :func:`job_end_time` reads.
    """
    return run_slurm_command(
        ["scontrol", *args], timeout=timeout, env={**os.environ, "SLURM_TIME_FORMAT": "standard"},
        missing="scontrol is missing (not on PATH); run inside a SLURM cluster or disable the SLURM lookups in the config")


# A key starts a field when it follows whitespace (or the line start) and looks like a
# SLURM key: an upper-case letter, then letters, digits, '_', '/', ':' (CPUs/Task,
# AllocNode:Sid, ReqB:S:C:T). Values may contain spaces (Command=, Reason=, Comment=) and
# '=' (TRES=cpu=1,mem=4G), so a value runs until the next such key.
_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_/:]*)=")


def parse_job_line(line: str) -> dict[str, str]:
    """Parse one line of ``scontrol show job -o`` into ``{key: value}``."""
    matches = list(_KEY.finditer(line))
    info: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        info.setdefault(m.group(1), line[m.end() : end].strip())
    return info


def job_info(job_id: str | int, *, runner: Runner | None = None,
             timeout: float | None = None) -> dict[str, str]:
    """``scontrol show job -o JOBID`` as a dict (for an array's master id: its own line, else the first).
    ``timeout`` (seconds) replaces :func:`run_scontrol`'s default; a ``runner`` gets no timeout."""
    args = ["show", "job", "-o", str(job_id)]
    if runner is not None:
        out = runner(args)
    else:  # run_scontrol looked up now, so a test's patch applies
        out = run_scontrol(args) if timeout is None else run_scontrol(args, timeout=timeout)
    jobs = [info for info in map(parse_job_line, out.splitlines()) if "JobId" in info]
    for info in jobs:  # the array's master id lists every task; prefer the exact job
        if info["JobId"] == str(job_id):
            return info
    if jobs:
        return jobs[0]
    raise SlurmError(f"`scontrol show job -o {job_id}` printed no job: {out.strip()!r}")


def _field(info: Mapping[str, str], key: str, job_id: str | int) -> str:
    try:
        return info[key]
    except KeyError:
        raise SlurmError(f"`scontrol show job -o {job_id}` has no {key}= field") from None


def job_end_time(job_id: str | int, *, runner: Runner | None = None,
                 timeout: float | None = None) -> float | None:
    """The job's EndTime as UNIX time (scontrol prints local time); None when unset
    (``Unknown``: pending, or ``TimeLimit=UNLIMITED``)."""
    value = _field(job_info(job_id, runner=runner, timeout=timeout), "EndTime", job_id)
    if value.lower() in _UNSET_TIMES:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        raise SlurmError(f"job {job_id}: cannot parse EndTime={value!r}") from None
