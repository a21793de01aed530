"""crash_safe on two gloo ranks of one node: one saver process for the node, and a real kill -9 of
the trainers still yields a valid two-rank checkpoint of the snapshotted step.

``python3 tests/test_shm_saver_multirank.py snap|resume|nodes --root R --out F [--mode M --mb N]`` is one
rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment). ``snap`` trains the small
DDP model of ``ckpt_helpers`` for 3 steps with a ``ballast`` tensor of N MB per rank (filled with
``100 * step + rank``), then, by MODE: ``save``: ``save(3)`` returned (the saver is still writing);
``memory``: memory snapshots of steps 1..3 only, never asked to persist. It writes its report
(saver pid, model at step 3) and waits to be killed. ``resume`` loads with the synchronous
Checkpointer and reports the step, the ballast and whether the model matches. ``nodes`` (each rank
its own node: SLURMD_NODENAME differs) saves step 1 and waits until it is durable, then takes a
memory snapshot of step 2 only, reports and waits to be killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
SHM = Path("/dev/shm")


def _launch(*args: str) -> list[subprocess.Popen]:
    from tests.test_async_multirank import _launch as launch

    return launch(*args, script=__file__)


def _report(out: Path, rank: int) -> dict:
    from tests.test_async_multirank import _report as report

    return report(out, rank)


def _write(out: str, rank: int, report: dict) -> None:
    from tests.test_async_multirank import _write as write

    write(out, rank, report)


def _kill(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL, f"exited {proc.returncode}:\n{out}"
    return out


def _node_leftovers(leader_pid: int) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith((f"ftkit-snap-{leader_pid}-", f"ftkit-saver-{leader_pid}-")))


def _crash(tmp_path: Path, mode: str, mb: int, *, stagger: bool = False) -> tuple[Path, dict]:
    """Run ``snap``; once both ranks reported, kill -9 both (rank 1 first, then, if ``stagger``,
    rank 0 only after checking the saver still waits for it). Returns (root, rank 0's report)."""
    from tests.conftest import wait_for
    from tests.test_shm_saver import _alive, _wait_gone

    root, out = tmp_path / "ck", tmp_path / "snap"
    procs = _launch("snap", "--mode", mode, "--mb", str(mb), "--root", str(root), "--out", str(out))
    try:
        wait_for(
            lambda: all((tmp_path / f"snap.rank{r}.json").exists() for r in range(WORLD))
            or any(p.poll() is not None for p in procs),
            timeout=90,
            what="both ranks to report their snapshot",
        )
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs if p.poll() is not None]
        reports = [_report(out, r) for r in range(WORLD)]
        saver = reports[0]["saver"]
        assert reports[1]["saver"] is None and reports[0]["saver_children"] == 1 and reports[1]["saver_children"] == 0
        _kill(procs[1])
        if stagger:  # the rescue starts at once, reading rank 0's snapshot while rank 0 lives
            from ftkit.checkpoint import validate_dir

            wait_for(lambda: validate_dir(root / "step-00000003").valid, timeout=60,
                     what="the saver to rescue step 3 while rank 0 is still alive")
            assert procs[0].poll() is None and _alive(saver), "the saver must wait for rank 0 to go"
        _kill(procs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    _wait_gone(saver)
    assert _node_leftovers(procs[0].pid) == []
    return root, reports[0]


def _check_resumed(tmp_path: Path, root: Path, step: int, mb: int, *, skipped: Path | None = None) -> None:
    """Both ranks resume exactly ``step``; ``skipped``, a newer checkpoint passed over, is said
    once for the job (by rank 0), not once per rank."""
    from ftkit.checkpoint import validate_dir

    info = validate_dir(root / f"step-{step:08d}", checksums=True)
    assert info.valid and info.world_size == WORLD and info.kind == "dcp", info.reason
    assert {"rank-00000.pt", "rank-00001.pt", "dcp/.metadata"} <= set(info.files)
    procs = _launch("resume", "--root", str(root), "--out", str(tmp_path / "resume"), "--mb", str(mb))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    if skipped is not None:
        said = [out.count(f"skipping checkpoint {skipped}") for out in outs]
        assert said == [1, 0], outs
    for r in range(WORLD):
        rep = _report(tmp_path / "resume", r)
        assert rep["step"] == step and rep["ballast"] == [100 * step + r] and rep["model_equal"], rep


def test_kill9_of_both_ranks_right_after_save_commits_the_two_rank_checkpoint(tmp_path):
    root, report = _crash(tmp_path, "save", 256)
    assert not report["valid_at_report"], "the save finished before the kill; make the ballast bigger"
    _check_resumed(tmp_path, root, 3, 256)


def test_kill9_of_one_rank_rescues_memory_snapshots_at_once_then_waits_for_the_other(tmp_path):
    root, _ = _crash(tmp_path, "memory", 8, stagger=True)
    assert [p.name for p in root.glob("step-*")] == ["step-00000003"]
    _check_resumed(tmp_path, root, 3, 8)


def test_under_torchrun_a_worker_killed_9_still_gets_its_snapshot_committed(tmp_path):
    """No custom launcher: torchrun starts the ranks, ftkit starts and stops the node's saver."""
    from tests.ckpt_helpers import env, free_port
    from tests.conftest import wait_for
    from tests.test_shm_saver import _wait_gone

    root, out = tmp_path / "ck", tmp_path / "snap"
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         __file__, "snap", "--mode", "memory", "--mb", "8", "--root", str(root), "--out", str(out)],
        env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_for(
            lambda: all((tmp_path / f"snap.rank{r}.json").exists() for r in range(WORLD)) or run.poll() is not None,
            timeout=90, what="both torchrun workers to report their snapshot",
        )
        assert run.poll() is None, run.communicate()[0]
        reports = [_report(out, r) for r in range(WORLD)]
        assert [r["saver_children"] for r in reports] == [1, 0]
        os.kill(reports[1]["pid"], signal.SIGKILL)  # torchrun then stops rank 0 and exits
        output = run.communicate(timeout=120)[0]
        assert run.returncode != 0, output
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    _wait_gone(reports[0]["saver"])
    assert _node_leftovers(reports[0]["pid"]) == []
    assert (root / "step-00000003").is_dir(), output
    _check_resumed(tmp_path, root, 3, 8)


@pytest.mark.slurm
def test_under_srun_one_task_killed_9_gets_its_snapshot_committed_while_the_other_runs(slurm_jobs, tmp_path):
    """Two srun tasks; rank 1 is killed -9: the saver (started by rank 0's task) commits the node's
    newest snapshot at once, while rank 0's task, and so the step, is still alive."""
    from ftkit.checkpoint import validate_dir
    from tests.ckpt_helpers import env, free_port
    from tests.conftest import wait_for
    from tests.test_shm_saver import _alive, _wait_gone

    root, out = tmp_path / "ck", tmp_path / "snap"
    job = slurm_jobs.submit(
        f"""#!/bin/bash
#SBATCH -n 2 -o {tmp_path}/slurm-%j.out
cd {REPO}
srun -n 2 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} \
    exec {sys.executable} {__file__} snap --mode memory --mb 8 --root {root} --out {out}'
""",
        env=env(),
    )
    wait_for(lambda: all((tmp_path / f"snap.rank{r}.json").exists() for r in range(WORLD))
             or slurm_jobs.job_state(job) not in ("PENDING", "RUNNING"),
             timeout=120, what="both srun tasks to report their snapshot")
    reports = [_report(out, r) for r in range(WORLD)]
    assert [r["saver_children"] for r in reports] == [1, 0]
    os.kill(reports[1]["pid"], signal.SIGKILL)
    wait_for(lambda: validate_dir(root / "step-00000003").valid, timeout=60,
             what="the saver to commit step 3 while rank 0's task runs")
    assert _alive(reports[0]["pid"]) and slurm_jobs.job_state(job) == "RUNNING"
    slurm_jobs.cancel(job)
    _wait_gone(reports[0]["saver"], timeout=60)
    assert _node_leftovers(reports[0]["pid"]) == []
    _check_resumed(tmp_path, root, 3, 8)


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it (by parent pid), parents first."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found = [pid]
    for p in found:
        found += [c for c, parent in parents.items() if parent == p]
    return found


def _saver_ranks(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--ranks") + 1].decode()


def test_node_death_leaves_the_survivors_part_of_a_newer_step_incomplete_and_resume_loads_the_older_one(tmp_path):
    """Two ranks on two "nodes" (SLURMD_NODENAME n1, n2: one saver each). Step 1 is durable, step 2
    only snapshotted in memory. Node 2 dies (its saver and its trainer, kill -9), then rank 0's
    trainer: node 1's saver rescues rank 0's part of step 2, which must stay an incomplete step
    directory (no rank 1 part ever comes), for the saver, validate_dir, ``ftkit ls``/``verify`` and
    the resume, which loads step 1."""
    from ftkit.checkpoint import validate_dir
    from tests.ckpt_helpers import env, free_port
    from tests.conftest import wait_for
    from tests.test_checkpoint_cli import ftkit
    from tests.test_shm_saver import _alive, _wait_gone

    job = tmp_path / "job"
    root, out = job / "checkpoints", job / "snap"
    step1, step2 = root / "step-00000001", root / "step-00000002"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "nodes", "--mb", "1", "--root", str(root), "--out", str(out)],
            env=env(RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    SLURMD_NODENAME=f"n{r + 1}"),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    reports: list[dict] = []
    try:
        wait_for(
            lambda: all((job / f"snap.rank{r}.json").exists() for r in range(WORLD))
            or any(p.poll() is not None for p in procs),
            timeout=120, what="both ranks to report step 1 durable and step 2 snapshotted",
        )
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs if p.poll() is not None]
        reports = [_report(out, r) for r in range(WORLD)]
        savers = [rep["saver"] for rep in reports]
        # one saver per node: each rank leads its own, for its own rank only
        assert None not in savers and savers[0] != savers[1], reports
        assert [rep["saver_children"] for rep in reports] == [1, 1], reports
        assert [_saver_ranks(pid) for pid in savers] == ["0", "1"]
        assert validate_dir(step1).valid and not step2.exists()  # step 2 lives in shared memory only

        # node 2 dies: its saver and its trainer (and anything under them) at once
        for pid in [savers[1], *_tree(procs[1].pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill(procs[1])
        _wait_gone(savers[1])
        assert _alive(savers[0])
        # node 1's trainer dies too: its saver survives and rescues rank 0's step 2 (the saver
        # shares the trainer's output pipe, so this returns once the saver exits)
        said = _kill(procs[0])

        part = step2 / "part-rank-00000.json"
        wait_for(part.exists, timeout=90, what="node 1's saver to write rank 0's part of step 2")
        assert json.loads(part.read_text())["step"] == 2
        # rank 0's saver waits for rank 1's part (commit_timeout, no growth), fails, and exits
        _wait_gone(savers[0])
        assert "persisting the newest complete snapshot, step 2 (rank(s) [0])" in said, said
        assert "rank 1 never confirmed its part of checkpoint step 2" in said, said
    finally:  # kill every rank before reading: a saver holds the output pipe until its ranks are gone
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.communicate(timeout=120)
        # node 2's segments: nobody is left on "node 2" to unlink them (a real node's tmpfs goes with it)
        for leftover in _node_leftovers(procs[1].pid):
            (SHM / leftover).unlink(missing_ok=True)
    assert _node_leftovers(procs[0].pid) == []

    info = validate_dir(step2)
    assert info.status == "incomplete" and not info.valid, info
    assert (step2 / "checkpoint-is-incomplete").exists() and not (step2 / "manifest.json").exists()
    names = {p.name for p in step2.iterdir()}
    assert {"rank-00000.pt", "part-rank-00000.json"} <= names, names
    assert not {"rank-00001.pt", "part-rank-00001.json"} & names, names
    assert not (step2 / "dcp" / ".metadata").exists()

    listed = ftkit("ls", str(job), "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(row["step"], row["status"]) for row in json.loads(listed.stdout)] == [(2, "incomplete"), (1, "valid")]
    assert ftkit("verify", str(step2)).returncode == 3
    job_verify = ftkit("verify", str(job))  # the unfinished step 2 is listed, no mismatch: step 1 is valid
    assert job_verify.returncode == 0 and "1 incomplete" in job_verify.stdout, job_verify
    assert ftkit("verify", str(step1)).returncode == 0

    _check_resumed(tmp_path, root, 1, 1, skipped=step2)  # exactly step 1: its step, ballast and weights
    one = subprocess.run(  # and on one rank (resume across world sizes)
        [sys.executable, __file__, "resume", "--root", str(root), "--out", str(tmp_path / "resume1"), "--mb", "1"],
        env=env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )
    assert one.returncode == 0, one.stdout
    assert f"skipping checkpoint {step2}: incomplete" in one.stdout, one.stdout
    rep = _report(tmp_path / "resume1", 0)
    assert rep["step"] == 1 and rep["ballast"] == [100] and rep["model_equal"], rep


# ---------------------------------------------------------------- the rank programs
def _setup():
    from tests.test_async_multirank import _setup as setup

    return setup(timeout_s=30)


def _saver_children() -> int:
    from ftkit.checkpoint.crashsafe.args import SAVER_MODULE

    me = str(os.getpid())
    count = 0
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[-1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if stat[1] == me and SAVER_MODULE.encode() in cmd:
            count += 1
    return count


def snap_main(a) -> None:
    import torch

    from ftkit.checkpoint import CheckpointConfig, validate_dir
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from tests.ckpt_helpers import build_state
    from tests.test_async_multirank import _train_step

    rank, world = _setup()
    state, loader = build_state(rank=rank, world_size=world)
    state["ballast"] = torch.zeros(a.mb << 18)
    mgr = AsyncCheckpointer(
        CheckpointConfig(root=a.root), rank=rank, world_size=world,
        async_config=AsyncConfig(memory_every=1, crash_safe=True, commit_timeout=60),
    )
    batches = iter(loader)
    for step in (1, 2, 3):
        _train_step(state, next(batches))
        state["ballast"].fill_(100 * step + rank)
        if a.mode == "memory" or step < 3:
            mgr.on_step(step, state)
        else:
            mgr.save(step, state)
    torch.save(state["model"].module.state_dict(), f"{a.out}.rank{rank}.model")
    report = {
        "saver": mgr._backend.saver_pid,
        "pid": os.getpid(),
        "saver_children": _saver_children(),
        "valid_at_report": validate_dir(Path(a.root) / "step-00000003").valid,
    }
    _write(a.out, rank, report)
    time.sleep(300)


def resume_main(a) -> None:
    import torch
    import torch.distributed as dist

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from tests.ckpt_helpers import build_state

    rank, world = _setup()
    state, _ = build_state(rank=rank, world_size=world)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()  # the checkpoint must bring the step-3 weights back
    state["ballast"] = torch.zeros(a.mb << 18)
    mgr = make_manager(CheckpointConfig(root=a.root), rank=rank, world_size=world)
    step = mgr.load(state)
    mgr.close()
    want = torch.load(Path(a.root).parent / f"snap.rank{rank}.model", weights_only=True)
    got = getattr(state["model"], "module", state["model"]).state_dict()  # DDP only on several ranks
    report = {
        "step": step,
        "ballast": sorted({float(x) for x in state["ballast"].unique()}),
        "model_equal": all(torch.equal(want[k], got[k]) for k in want),
    }
    Path(f"{a.out}.rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def nodes_main(a) -> None:
    """Step 1 saved and awaited (durable), step 2 only snapshotted; report; wait to be killed."""
    import torch

    from ftkit.checkpoint import CheckpointConfig
    from ftkit.checkpoint.background.manager import AsyncCheckpointer, AsyncConfig
    from tests.ckpt_helpers import build_state
    from tests.test_async_multirank import _train_step

    rank, world = _setup()
    state, loader = build_state(rank=rank, world_size=world)
    state["ballast"] = torch.zeros(a.mb << 18)
    mgr = AsyncCheckpointer(
        CheckpointConfig(root=a.root), rank=rank, world_size=world,
        async_config=AsyncConfig(memory_every=1, crash_safe=True, commit_timeout=10),
    )
    batches = iter(loader)
    _train_step(state, next(batches))
    state["ballast"].fill_(100 + rank)
    mgr.save(1, state)
    mgr.wait()  # collective: both ranks' parts are in, rank 0's saver committed step 1
    torch.save(state["model"].module.state_dict(), f"{a.out}.rank{rank}.model")
    _train_step(state, next(batches))
    state["ballast"].fill_(200 + rank)
    assert mgr.on_step(2, state)  # a memory snapshot, never asked to persist
    report = {"saver": mgr._backend.saver_pid, "pid": os.getpid(), "saver_children": _saver_children()}
    _write(a.out, rank, report)
    time.sleep(300)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["snap", "resume", "nodes"])
    ap.add_argument("--mode", choices=["save", "memory"], default="save")
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    {"snap": snap_main, "resume": resume_main, "nodes": nodes_main}[args.command](args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_async_multirank: gloo teardown at interpreter exit can abort
