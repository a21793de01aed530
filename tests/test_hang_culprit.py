"""The culprit's step and the live view of a hang, with real processes.

* A rank that is SIGSTOPped writes nothing: its step comes from a heartbeat that can be a whole
  heartbeat interval old. The culprit's step is bounded by its peers' own records (a rank in
  lockstep, with a gradient all-reduce every step, is at most one step behind the rank waiting
  for it), and the step ``ftkit requeue`` compares between runs ("hung again at step N") is
  exact: it does not move with the heartbeat's timing.
* ``ftkit status`` shows a stall the watchdog has not declared yet (a rank whose heartbeat
  carries its stuck frame), and labels a hang of an earlier run as such.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.cli._status import collect_status
from ftkit.control.hangs import Heartbeat, culprit, describe
from ftkit.errors import EXIT_HANG
from ftkit.events import read_events
from ftkit.slurm.env import SlurmEnv
from ftkit.slurm.requeue_facts import gather
from ftkit.slurm.requeue_policy import RequeuePolicy, decide
from tests.ckpt_helpers import env as base_env
from tests.ckpt_helpers import free_port
from tests.conftest import wait_for
from tests.test_watchdog import finish

PROGRAM = Path(__file__).parent / "programs" / "hang_train.py"
NO_SLURM = SlurmEnv(job_id=None, restart_count=0)


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in base_env(**extra).items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return e


def start(jobdir: Path, *args: str, rank: int, world: int, port: str, **extra: str) -> subprocess.Popen:
    dist = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return subprocess.Popen([sys.executable, str(PROGRAM), str(jobdir), *args], env=env(**dist, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def hangs(jobdir: Path) -> list[dict]:
    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == "hang"]


# -- defect A: the culprit's step --------------------------------------------------------------


def stopped_run(jobdir: Path, stop_in: int) -> dict:
    """Two gloo ranks training a DDP model (a gradient all-reduce every step); rank 1 stops
    itself (SIGSTOP) inside step ``stop_in``, having completed ``stop_in - 1``. Steps are short
    (10 ms) against the heartbeat interval (3 s / 8), so rank 1's last heartbeat is many steps
    old. Returns rank 0's hang event."""
    port = str(free_port())
    extra = {"FTKIT_HANG_TIMEOUT": "3", "FTKIT_TEST_HANG_STEP": str(stop_in), "FTKIT_TEST_HANG_RANK": "1",
             "FTKIT_TEST_HANG_HOW": "stop"}
    procs = [start(jobdir, "--steps", "100000", "--step-time", "0.01", "--every", "1000", rank=r, world=2,
                   port=port, **extra) for r in range(2)]
    try:
        out0 = finish(procs[:1])[0]
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process too
        finish(procs[1:])
    assert procs[0].returncode == EXIT_HANG, out0
    [hang] = hangs(jobdir)[-1:]
    assert hang["rank"] == 0 and hang["step"] == stop_in - 1  # rank 0 waits in step stop_in's all-reduce
    return hang


def test_a_sigstopped_ranks_step_is_its_peers_not_a_stale_heartbeats(tmp_path: Path) -> None:
    stop_in = 60
    hang = stopped_run(tmp_path, stop_in)
    [peer] = hang["peers"]
    # the heartbeat is stale (the point of this test): written a heartbeat interval before the stop
    assert peer["rank"] == 1 and peer["running"] is False and peer["step"] < stop_in - 1, peer
    found = culprit(read_events(tmp_path / "events.jsonl"))
    assert found["rank"] == 1 and found["running"] is False
    # rank 0 completed step 59 in lockstep with it: rank 1 completed 58 or 59 (it was in 60)
    assert (found["step"], found["step_max"]) == (stop_in - 2, stop_in - 1), found
    assert found["step_exact"] is False
    line = describe(found)
    assert f"last step {stop_in - 2} or {stop_in - 1}" in line and f"said {peer['step']}" in line, line
    facts = gather(tmp_path, exit_code=EXIT_HANG, env=NO_SLURM, checkpoints_lookup=lambda _: None)
    d = decide(facts, RequeuePolicy())
    assert d.cause == "hang" and d.run["hang_step"] == stop_in - 1, (d.run, d.reason)
    assert f"step {peer['step']}" not in d.reason and f"{stop_in - 2} or {stop_in - 1}" in d.reason, d.reason


def test_hung_again_at_the_same_place_is_recognised_whatever_the_heartbeats_said(tmp_path: Path) -> None:
    """Two runs stop at the same place; their culprits' last heartbeats differ (jitter) but the
    step ``ftkit requeue`` compares does not: the second is not requeued."""
    stop_in = 40
    first = stopped_run(tmp_path, stop_in)
    facts = gather(tmp_path, exit_code=EXIT_HANG, env=NO_SLURM, checkpoints_lookup=lambda _: None)
    run = decide(facts, RequeuePolicy(max_no_progress=5)).run
    (tmp_path / "runs.json").write_text(json.dumps({"version": 1, "runs": [dict(run)]}))
    # the second run's copy of rank 1's heartbeat is made to say another step, as jitter would
    second = stopped_run(tmp_path, stop_in)
    events = list(read_events(tmp_path / "events.jsonl"))
    for e in events:
        if e is not None and e.get("event") == "hang" and e["time"] == second["time"]:
            e["peers"][0]["step"] = first["peers"][0]["step"] - 7
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    facts = gather(tmp_path, exit_code=EXIT_HANG, env=NO_SLURM, checkpoints_lookup=lambda _: None)
    d = decide(facts, RequeuePolicy(max_no_progress=5))
    assert not d.requeue and d.reason.startswith(f"hung again at step {stop_in - 1} "), d.reason


def test_step_bounds_from_the_records_alone() -> None:
    """A stale heartbeat (step 5) of a stopped rank and its peer's own event (step 7): in
    lockstep (the peer waits in a step's gradient all-reduce) the stopped rank completed 6 or
    7; outside it (the peer waits in some other collective) only "5 to 7" is known. A
    heartbeat written while the rank was already stuck (it carries a frame) is exact, and so
    is a rank's own event."""
    beat = Heartbeat(rank=1, host="n1", step=5, last_step_wall=90.0, written=91.0, interval=1.0).seen(100.0)

    def incident(frame: str) -> list[dict]:
        return [{"event": "hang", "time": 100.0, "rank": 0, "host": "n0", "step": 7, "last_step_wall": 95.0,
                 "frame": frame, "waiting": True, "world_size": 2, "peers": [beat.to_json()]}]

    ddp = culprit(incident("/x/site-packages/torch/autograd/graph.py:825 in _engine_run_backward"))
    assert (ddp["rank"], ddp["step"], ddp["step_max"], ddp["step_exact"]) == (1, 6, 7, False)
    other = culprit(incident("/x/site-packages/torch/distributed/distributed_c10d.py:2800 in all_reduce"))
    assert (other["step"], other["step_max"]) == (5, 7)
    assert "last step 5 to 7" in describe(other)
    stuck = Heartbeat(rank=1, host="n1", step=5, last_step_wall=90.0, written=96.0, interval=1.0,
                      frame="train.py:3 in f", waiting=False).seen(100.0)
    events = incident("/x/torch/autograd/graph.py:825 in _engine_run_backward")
    events[0]["step"] = 5
    events[0]["peers"] = [stuck.to_json()]
    exact = culprit(events)
    assert exact["rank"] == 1 and (exact["step"], exact["step_max"], exact["step_exact"]) == (5, 5, True)
    solo = culprit([{**incident("f")[0], "peers": None, "world_size": 1}])
    assert (solo["step"], solo["step_max"], solo["step_exact"]) == (7, 7, True)


# -- defect B: ftkit status during a stall, and after a later run -------------------------------


def test_status_shows_a_stall_the_watchdog_has_not_declared_yet(tmp_path: Path) -> None:
    """Rank 1 deadlocks in step 15 (outside any collective), rank 0 waits for it in the
    all-reduce; the timeout (40 s) is far off, the heartbeat interval 5 s. Status names the
    stall while the run is still running, with rank, step, time and frame."""
    port = str(free_port())
    extra = {"FTKIT_HANG_TIMEOUT": "40", "FTKIT_TEST_HANG_STEP": "15", "FTKIT_TEST_HANG_RANK": "1"}
    procs = [start(tmp_path, "--steps", "100000", "--step-time", "0.01", "--every", "1000", rank=r, world=2,
                   port=port, **extra) for r in range(2)]
    try:
        def stalled() -> dict | None:
            status = collect_status(tmp_path, events=0)
            return status if {s["rank"] for s in status["stalled"]} == {0, 1} else None

        status = wait_for(stalled, 90, interval=0.5, what="both heartbeats showing the stall")
        assert all(p.poll() is None for p in procs)  # not declared: still running
        assert status["running"] and status["hang"] is None
        first, second = status["stalled"]
        assert first["rank"] == 1 and first["step"] == 14 and first["waiting"] is False
        assert first["frame"].endswith("in _deadlock") and first["seconds"] >= 5 and first["running"]
        assert second["rank"] == 0 and second["waiting"] is True and second["step"] == 14
        out = subprocess.run([sys.executable, "-m", "ftkit", "status", str(tmp_path), "--events", "0"],
                             capture_output=True, text=True, env=env(COLUMNS="300"), timeout=60)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert "stalled: rank 1 on" in text and "completed no step for" in text and "(last step 14)" in text, text
        assert "in _deadlock" in text and "outside any collective" in text and "rank 0" in text, text
        as_json = json.loads(subprocess.run([sys.executable, "-m", "ftkit", "status", str(tmp_path), "--json"],
                                            capture_output=True, text=True, env=env(), timeout=60).stdout)
        assert [s["rank"] for s in as_json["stalled"]] == [1, 0]
    finally:
        for p in procs:
            p.kill()
        finish(procs)


def test_a_stopped_rank_shows_as_a_stall_by_its_stale_heartbeat(tmp_path: Path) -> None:
    """A SIGSTOPped rank writes nothing: its heartbeat grows old while the run runs."""
    port = str(free_port())
    procs = [start(tmp_path, "--steps", "100000", "--step-time", "0.01", "--every", "1000", rank=r, world=2,
                   port=port, FTKIT_HANG_TIMEOUT="40") for r in range(2)]
    try:
        wait_for(lambda: (tmp_path / "ready-rank1").exists() and (tmp_path / "heartbeats" / "rank1.json").exists()
                 and (json.loads((tmp_path / "heartbeats" / "rank1.json").read_text()).get("step") or 0) >= 10,
                 90, what="rank 1 training")
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.5)

        def stalled() -> dict | None:
            status = collect_status(tmp_path, events=0)
            return status if any(s["rank"] == 1 and s["running"] is False for s in status["stalled"]) else None

        status = wait_for(stalled, 60, interval=0.5, what="rank 1's heartbeat going stale")
        first = status["stalled"][0]
        assert first["rank"] == 1 and first["running"] is False and first["heartbeat_age"] > 3 * 5
    finally:
        for p in procs:
            p.kill()
        finish(procs)


def test_a_hang_of_an_earlier_run_is_labelled_once_a_later_run_completed(tmp_path: Path) -> None:
    port = str(free_port())
    extra = {"FTKIT_HANG_TIMEOUT": "3", "FTKIT_TEST_HANG_STEP": "12"}
    proc = start(tmp_path, "--steps", "30", "--save-every", "5", rank=0, world=1, port=port, **extra)
    out = finish([proc])[0]
    assert proc.returncode == EXIT_HANG, out
    during = collect_status(tmp_path, events=0)
    assert during["hang"]["this_run"] is True and not during["running"]
    rerun = start(tmp_path, "--steps", "30", "--save-every", "5", rank=0, world=1, port=str(free_port()),
                  FTKIT_HANG_TIMEOUT="3")
    out = finish([rerun])[0]
    assert rerun.returncode == 0, out
    after = collect_status(tmp_path, events=0)
    assert after["hang"]["this_run"] is False and after["hang"]["run"]["restart_count"] == 0
    assert after["stalled"] == []
    text = " ".join(subprocess.run([sys.executable, "-m", "ftkit", "status", str(tmp_path), "--events", "0"],
                                   capture_output=True, text=True, env=env(COLUMNS="300"), timeout=60).stdout.split())
    assert "an earlier run" in text and "hung: rank 0" in text and "later run completed" in text, text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
