"""Pytest plugin: the local SLURM cluster (``scripts/slurm-cluster``), one or more emulated nodes.

Load it with ``pytest_plugins = ["tests.slurm_fixtures"]`` (tests/conftest.py).

Fixtures
--------
``slurm_cluster`` (session)
    Makes sure the cluster answers (``scontrol ping`` + node idle/mixed/allocated).
    If it does not and we are root, runs ``scripts/slurm-cluster up`` once. If it is
    still unusable: ``pytest.fail`` when ``FTKIT_REQUIRE_SLURM=1`` (CI), otherwise
    ``pytest.skip``. Returns a :class:`SlurmCluster`.
``slurm_jobs`` (function)
    A :class:`SlurmJobs` bound to the test: jobs it submits run in ``tmp_path`` by
    default and are cancelled when the test ends.
``slurm_multinode`` (session)
    Like ``slurm_cluster``, with at least :data:`MULTINODE_NODES` usable nodes
    (``n1``, ``n2``, ...: several ``slurmd -N nX`` on this host). If the cluster has
    fewer and we are root, runs ``scripts/slurm-cluster up --nodes 3`` (CI starts it
    that way already). Fails under ``FTKIT_REQUIRE_SLURM=1``, else skips.
``reference_sha`` (session)
    ``reference_sha(WORLD)``: SHA-256 of the final parameters of an uninterrupted
    ``ftkit demo`` run with WORLD ranks (no SLURM), computed once per session.
``node_killer`` (function)
    ``node_killer(NODE)`` emulates the death of a node (``scripts/slurm-cluster
    kill-node``); every node it killed is started again when the test ends.

Tests that use either fixture get the ``slurm`` marker automatically; mark them
``@pytest.mark.slurm`` anyway for readability.

SLURM 22.05 facts the helpers encode
------------------------------------
* Job records stay visible to ``scontrol show job`` for MinJobAge (300 s here);
  there is no accounting (no slurmdbd), so ``sacct`` does not work.
* ``scontrol requeue`` only works on a RUNNING (or suspended) job; the job then
  goes COMPLETING -> PENDING with ``Reason=BeginTime`` and BeginTime = now+121 s.
* ``scontrol update jobid=N StartTime=now`` clears that delay, but only once the
  job is PENDING (an update while it is COMPLETING is silently overwritten), and
  the relaunch must be in a later wall-clock second than the requeue, or slurmd
  refuses the new launch ("Job credential revoked") and the job ends FAILED.
  :meth:`SlurmCluster.start_now` handles both.
* ``scancel --signal=USR1 --batch`` reaches the batch shell within ~1 s; bash runs
  a trap only when the foreground command returns, so scripts should wait with
  ``sleep N & wait $!``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = REPO_ROOT / "scripts" / "slurm-cluster"
LOG_FILES = (
    Path("/var/log/slurm/slurmctld.log"),
    Path("/var/log/slurm/slurmd-n1.log"),
    Path("/var/log/slurm/slurmd-n2.log"),
    Path("/var/log/slurm/slurmd-n3.log"),
    Path("/var/log/munge/munged.log"),
)
MULTINODE_NODES = 3
REQUIRE_ENV = "FTKIT_REQUIRE_SLURM"
USABLE_NODE_STATES = {"idle", "mixed", "allocated", "completing"}
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
CMD_TIMEOUT = 30.0

__all__ = [
    "SlurmCluster",
    "SlurmError",
    "SlurmJobs",
    "cancel",
    "cluster_problem",
    "hostnames",
    "job_info",
    "job_state",
    "kill_node",
    "node_killer",
    "node_state",
    "reference_sha",
    "requeue",
    "signal_job",
    "slurm_cluster",
    "slurm_jobs",
    "slurm_multinode",
    "start_node",
    "start_now",
    "submit",
    "wait_file_contains",
    "wait_state",
]


class SlurmError(RuntimeError):
    """A SLURM command failed."""


# --------------------------------------------------------------------------- commands


def _run(
    cmd: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT, **kw
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except FileNotFoundError as e:
        raise SlurmError(f"{cmd[0]} not found: is SLURM installed? ({e})") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{' '.join(cmd)} timed out after {timeout}s") from e
    if check and proc.returncode != 0:
        raise SlurmError(
            f"{' '.join(map(str, cmd))} failed (rc={proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _script_path(script: str | os.PathLike, workdir: Path | None) -> Path:
    """A path to ``script`` (an existing file) or to a file holding ``script`` (text)."""
    if isinstance(script, os.PathLike) or ("\n" not in script and Path(script).is_file()):
        return Path(script)
    text = script if script.startswith("#!") else "#!/bin/bash\n" + script
    if not text.endswith("\n"):
        text += "\n"
    fd, name = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=str(workdir) if workdir else None)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(name, 0o755)
    return Path(name)


def submit(
    script: str | os.PathLike,
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> int:
    """Submit a batch job with ``sbatch --parsable [args] SCRIPT``; return its job id.

    ``script`` is a path to a batch script, or the script's text (a ``#!/bin/bash``
    line is added if it has none; the text is written to a file in ``cwd``).
    ``args`` are extra sbatch options (``"-p", "high"``, ``"--requeue"``...).
    ``env`` is added to this process's environment, which sbatch exports to the job.
    ``cwd`` is the job's working directory (where ``slurm-%j.out`` lands).
    """
    workdir = Path(cwd) if cwd is not None else None
    path = _script_path(script, workdir)
    full_env = dict(os.environ)
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    proc = _run(["sbatch", "--parsable", *map(str, args), str(path)], env=full_env, cwd=workdir)
    out = proc.stdout.strip().splitlines()
    if not out:
        raise SlurmError(f"sbatch printed no job id (stderr: {proc.stderr.strip()})")
    return int(out[-1].split(";")[0])


_FIELD_RE = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")


def _parse_oneliner(line: str) -> dict[str, str]:
    """Parse ``scontrol show ... -o`` output (``Key=Value Key2=Value with spaces``)."""
    info: dict[str, str] = {}
    matches = list(_FIELD_RE.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        info[m.group(1)] = line[m.end() : end].strip()
    return info


def job_info(job_id: int) -> dict[str, str]:
    """``scontrol show job -o JOB_ID`` as a dict (JobState, Reason, Restarts, ExitCode, ...).

    Raises :class:`SlurmError` if SLURM no longer (or never) knew the job.
    """
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not line.startswith("JobId="):
        raise SlurmError(f"job {job_id}: {(proc.stderr or proc.stdout).strip() or 'unknown job'}")
    return _parse_oneliner(line)


def job_state(job_id: int) -> str:
    """The job's base state, e.g. ``RUNNING`` (flags such as ``+REQUEUE`` are dropped)."""
    return job_info(job_id).get("JobState", "").split("+")[0].split()[0]


def wait_state(
    job_id: int,
    states: str | Iterable[str],
    timeout: float = 60.0,
    *,
    interval: float = 0.2,
    fail_on_terminal: bool = True,
    where=None,
) -> dict[str, str]:
    """Poll until the job's state is one of ``states`` (and ``where(info)`` is true, if given).

    Returns the job info. Raises ``AssertionError`` on timeout, or at once when the
    job reaches a terminal state that is not wanted (unless ``fail_on_terminal=False``).
    """
    wanted = {states} if isinstance(states, str) else set(states)
    wanted = {s.upper() for s in wanted}
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while True:
        info = job_info(job_id)
        state = info.get("JobState", "").split("+")[0]
        if state in wanted and (where is None or where(info)):
            return info
        if fail_on_terminal and state in TERMINAL_STATES and state not in wanted:
            raise AssertionError(
                f"job {job_id} ended {state} while waiting for {sorted(wanted)}: {_brief(info)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} not in {sorted(wanted)} after {timeout:.0f}s: {_brief(info)}"
            )
        time.sleep(interval)


def _brief(info: Mapping[str, str]) -> str:
    keys = ("JobState", "Reason", "Restarts", "ExitCode", "StartTime", "Partition", "StdOut")
    return " ".join(f"{k}={info[k]}" for k in keys if k in info)


def cancel(job_id: int, *extra: str) -> None:
    """``scancel [extra] JOB_ID``; a job that is already gone is not an error."""
    proc = _run(["scancel", *extra, str(job_id)], check=False)
    if proc.returncode == 0:
        return
    err = (proc.stderr or "").strip()
    try:
        gone = job_state(job_id) in TERMINAL_STATES
    except SlurmError:
        gone = True  # purged or never known
    if not gone:
        raise SlurmError(f"scancel {job_id} failed: {err}")


def signal_job(job_id: int, sig: str = "USR1", *, batch: bool = True) -> None:
    """Send ``sig`` with ``scancel --signal=SIG [--batch]`` (``batch``: to the batch shell only)."""
    args = [f"--signal={sig}"] + (["--batch"] if batch else [])
    _run(["scancel", *args, str(job_id)])


def requeue(job_id: int) -> None:
    """``scontrol requeue JOB_ID`` (the job must be RUNNING)."""
    _run(["scontrol", "requeue", str(job_id)])


def start_now(job_id: int, timeout: float = 30.0) -> None:
    """Make a requeued job eligible at once (instead of BeginTime = requeue + 121 s).

    Waits until the job is PENDING, keeps the relaunch out of the requeue's second
    (slurmd rejects it as a revoked credential otherwise), then
    ``scontrol update jobid=N StartTime=now``.
    """
    wait_state(job_id, "PENDING", timeout)
    time.sleep(1.1)
    _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])


def wait_file_contains(
    path: str | os.PathLike, text: str, timeout: float = 30.0, interval: float = 0.1
) -> str:
    """Poll until file ``path`` contains ``text``; return the file's content."""
    p = Path(path)
    deadline = time.monotonic() + timeout
    content = ""
    while True:
        try:
            content = p.read_text(errors="replace")
        except FileNotFoundError:
            content = ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{p} has no {text!r} after {timeout:.0f}s; content:\n{content[-2000:]}"
            )
        time.sleep(interval)


def hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: ``n[1-2]`` -> ``["n1", "n2"]``."""
    return _run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def node_state(node: str) -> str:
    """slurmctld's state of one node, lower case: ``idle``, ``mixed``, ``down+not_responding``.

    From ``scontrol show node``, not ``sinfo``: right after slurmctld sets a dead node DOWN and
    requeues its job, ``sinfo`` still shows it ``mixed*`` for about half a second."""
    fields = _parse_oneliner(_run(["scontrol", "show", "node", "-o", node]).stdout)
    return fields.get("State", "").lower()


def _cluster_script(*args: str, timeout: float = 120) -> str:
    proc = _run(["bash", str(CLUSTER_SCRIPT), *args], check=False, timeout=timeout)
    if proc.returncode != 0:
        raise SlurmError(f"scripts/slurm-cluster {' '.join(args)} failed (rc={proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    return proc.stdout


def kill_node(node: str) -> str:
    """Emulate the death of ``node``: its slurmd, slurmstepds and their processes get SIGKILL."""
    return _cluster_script("kill-node", node)


def start_node(node: str) -> str:
    """Start ``node``'s slurmd again and wait until SLURM has it back (idle)."""
    return _cluster_script("start-node", node)


# --------------------------------------------------------------------------- cluster


def cluster_problem() -> str | None:
    """None if the cluster is usable now, else a one-line description of what is wrong."""
    if shutil.which("sinfo") is None or shutil.which("scontrol") is None:
        return "SLURM client commands (sinfo, scontrol) are not installed"
    try:
        ping = _run(["scontrol", "ping"], check=False, timeout=15)
    except SlurmError as e:
        return str(e)
    if "is UP" not in ping.stdout:
        first = ((ping.stdout + ping.stderr).strip().splitlines() or ["no output"])[0]
        return f"slurmctld does not answer (scontrol ping: {first})"
    try:
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15).stdout.split("\n")
    except SlurmError as e:
        return str(e)
    states = dict(line.split(None, 1) for line in nodes if line.strip())
    if not states:
        return "sinfo lists no nodes"
    if not any(s.strip() in USABLE_NODE_STATES for s in states.values()):
        return f"no usable node: {states}"
    return None


def _wait_usable(timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        problem = cluster_problem()
        if problem is None or time.monotonic() > deadline:
            return problem
        time.sleep(1.0)


def _log_tail(lines: int = 20) -> str:
    parts = []
    for f in LOG_FILES:
        try:
            tail = f.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        parts.append(f"--- {f} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "\n".join(parts) or "(no SLURM logs found under /var/log/slurm)"


class SlurmCluster:
    """The running local cluster, plus helpers (also available as module functions)."""

    submit = staticmethod(submit)
    job_info = staticmethod(job_info)
    job_state = staticmethod(job_state)
    wait_state = staticmethod(wait_state)
    cancel = staticmethod(cancel)
    signal = staticmethod(signal_job)
    requeue = staticmethod(requeue)
    start_now = staticmethod(start_now)
    wait_file_contains = staticmethod(wait_file_contains)

    def __init__(self) -> None:
        lines = [ln.split() for ln in _run(["sinfo", "-h", "-N", "-o", "%N %c %m"]).stdout.split("\n") if ln.strip()]
        line = lines[0]
        self.nodes: list[str] = sorted({ln[0] for ln in lines}, key=lambda n: (len(n), n))
        """Every node (n1, n2, ...); the single-node tests use the first."""
        self.node: str = line[0]
        self.cpus: int = int(line[1])
        self.memory_mb: int = int(line[2].rstrip("+"))
        self.partitions: list[str] = sorted(set(_run(["sinfo", "-h", "-o", "%R"]).stdout.split()))

    def __repr__(self) -> str:
        return f"SlurmCluster(nodes={self.nodes!r}, cpus={self.cpus}, partitions={self.partitions})"

    def usable_nodes(self) -> list[str]:
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
        return sorted({ln.split()[0] for ln in out if ln.strip() and ln.split()[1] in USABLE_NODE_STATES})


class SlurmJobs:
    """Per-test job helper: submissions default to the test's tmp dir and are cancelled afterwards."""

    def __init__(self, cluster: SlurmCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.job_ids: list[int] = []

    def submit(
        self,
        script: str | os.PathLike,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> int:
        job_id = submit(script, *args, env=env, cwd=cwd if cwd is not None else self.workdir)
        self.job_ids.append(job_id)
        return job_id

    def output_path(self, job_id: int) -> Path:
        """The job's StdOut file (``slurm-<id>.out`` in the work dir by default)."""
        return Path(job_info(job_id)["StdOut"])

    job_info = staticmethod(job_info)
    job_state = staticmethod(job_state)
    wait_state = staticmethod(wait_state)
    cancel = staticmethod(cancel)
    signal = staticmethod(signal_job)
    requeue = staticmethod(requeue)
    start_now = staticmethod(start_now)
    wait_file_contains = staticmethod(wait_file_contains)

    def cancel_all(self, timeout: float = 20.0) -> None:
        """Cancel this test's jobs and wait (up to ``timeout``) until they have left the node."""
        for job_id in self.job_ids:
            with contextlib.suppress(SlurmError):
                cancel(job_id)
        deadline = time.monotonic() + timeout
        for job_id in self.job_ids:
            while time.monotonic() < deadline:
                try:
                    if job_state(job_id) in TERMINAL_STATES:
                        break
                except SlurmError:
                    break
                time.sleep(0.2)


# --------------------------------------------------------------------------- pytest hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: needs the local SLURM cluster (scripts/slurm-cluster)"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's loadgroup reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that use the cluster ``slurm`` and run them first, as one group.

    Under pytest-xdist (``--dist loadgroup``, pyproject's addopts) the group runs on one worker,
    one test at a time, as without xdist: the tests share the cluster's nodes (a preemption test
    fills a node, a node-death test kills one), so two of them at once would disturb each other.
    First, because the group is the longest piece of work: the other worker runs everything else
    meanwhile, mostly while the SLURM tests wait on SLURM.
    """
    for item in items:
        names = getattr(item, "fixturenames", ())
        if ({"slurm_cluster", "slurm_jobs", "slurm_multinode"} & set(names)) and item.get_closest_marker(
            "slurm"
        ) is None:
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: order kept within


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The local SLURM cluster; starts it (as root) if needed, else skips/fails."""
    required = os.environ.get(REQUIRE_ENV) == "1"
    problem = _wait_usable(5.0)
    up_output = ""
    if problem is not None and os.geteuid() == 0 and CLUSTER_SCRIPT.exists():
        try:
            proc = subprocess.run(
                ["bash", str(CLUSTER_SCRIPT), "up"],
                capture_output=True,
                text=True,
                timeout=900,
            )
            up_output = (
                f"$ scripts/slurm-cluster up  (rc={proc.returncode})\n{proc.stdout}{proc.stderr}"
            )
        except subprocess.TimeoutExpired:
            up_output = "$ scripts/slurm-cluster up  timed out after 900 s"
        problem = _wait_usable(30.0)
    elif problem is not None:
        up_output = "(not root: did not try scripts/slurm-cluster up)"
    if problem is not None:
        msg = f"local SLURM cluster unavailable: {problem}"
        if required:
            tail = "\n".join(up_output.splitlines()[-30:])
            pytest.fail(f"{msg}\n{tail}\n{_log_tail()}", pytrace=False)
        pytest.skip(
            f"{msg} (run scripts/slurm-cluster up as root; set {REQUIRE_ENV}=1 to make this a failure)"
        )
    return SlurmCluster()


@pytest.fixture
def slurm_jobs(slurm_cluster: SlurmCluster, tmp_path: Path):
    """Submit jobs from a test; they run in ``tmp_path`` and are cancelled at teardown."""
    jobs = SlurmJobs(slurm_cluster, tmp_path)
    yield jobs
    jobs.cancel_all()


@pytest.fixture(scope="session")
def slurm_multinode(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The cluster with at least MULTINODE_NODES usable nodes (started that way if we may)."""
    if len(slurm_cluster.usable_nodes()) >= MULTINODE_NODES:
        return slurm_cluster
    required = os.environ.get(REQUIRE_ENV) == "1"
    detail = "(not root: did not try scripts/slurm-cluster up --nodes 3)"
    if os.geteuid() == 0 and CLUSTER_SCRIPT.exists():
        try:
            detail = _cluster_script("up", "--nodes", str(MULTINODE_NODES), timeout=300)
        except SlurmError as e:
            detail = str(e)
        _wait_usable(30.0)
    cluster = SlurmCluster()
    usable = cluster.usable_nodes()
    if len(usable) < MULTINODE_NODES:
        msg = f"multi-node SLURM cluster unavailable: usable nodes {usable}, need {MULTINODE_NODES}"
        if required:
            pytest.fail(f"{msg}\n{detail[-3000:]}\n{_log_tail()}", pytrace=False)
        pytest.skip(f"{msg} (run scripts/slurm-cluster up --nodes {MULTINODE_NODES} as root)")
    return cluster


@pytest.fixture
def node_killer(slurm_multinode: SlurmCluster):
    """``node_killer(NODE)`` kills an emulated node; the test's killed nodes come back afterwards."""
    killed: list[str] = []
    pids: list[str] = []

    def kill(node: str) -> str:
        killed.append(node)
        out = kill_node(node)
        pids.extend(re.findall(r"\b\d+\b", " ".join(re.findall(r"processes of \S+: ([\d ]+)", out))))
        return out

    yield kill
    for node in killed:
        start_node(node)
    # crash-safe snapshots of the killed trainers stay in /dev/shm (nothing lived to unlink them)
    for pid in pids:
        for leftover in Path("/dev/shm").glob(f"ftkit-*-{pid}-*"):
            leftover.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def reference_sha(tmp_path_factory):
    """``reference_sha(world)``: the demo's final parameters without interruption (once per world)."""
    from tests.test_slurm_e2e import reference

    cache: dict[int, str] = {}

    def get(world: int) -> str:
        if world not in cache:
            cache[world] = reference(tmp_path_factory, world)
        return cache[world]

    return get
