"""A rank killed with kill -9 during a background save of several ranks: its peer stops waiting.

Two real processes (DDP over gloo on 127.0.0.1, ``tests/programs/peer_death.py``) under
FaultTolerance with periodic background saves on the thread worker and ``commit_timeout`` at its
600 s default. One rank's checkpoint worker stops inside step 6's save (rank 0 right after it
created the sentinel, before it named the save in it; rank 1 before it wrote its part), and the
test kills that rank with SIGKILL there. The survivor's next all-reduce fails at once; its
background wait must then give up in seconds, not after ``commit_timeout``: it logs why, its
``exit`` event is written with the error, it exits non-zero, and the next run resumes from the
newest valid checkpoint (step 3).

A rank killed while its peer is already in ``close()`` (no collective left to fail) costs the
peer ``commit_timeout`` (5 s here), after which its ``exit`` event says the run crashed, not
that it completed.

Then, without any collective: a rank's wait gives up once the process of the rank it waits
for, on this host, is gone, and still waits (up to the timeout) for one that lives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ckpt_helpers import collect, env, free_port
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[1]
PROGRAM = str(REPO / "tests" / "programs" / "peer_death.py")
WORLD = 2
SURVIVOR_BOUND = 60  # seconds; commit_timeout is 600


def _launch(job: Path, *args: str) -> list[subprocess.Popen]:
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, PROGRAM, str(job), *args],
            env=env(RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]


@pytest.mark.parametrize("dead", [0, 1], ids=["rank0-killed", "rank1-killed"])
def test_survivor_of_a_kill_9_mid_save_exits_promptly_and_the_next_run_resumes(tmp_path, dead):
    from ftkit.checkpoint import validate_dir
    from ftkit.events import read_events

    job = tmp_path / "job"
    root = job / "checkpoints"
    procs = _launch(job, "--steps", "12", "--save-every", "3", "--stall-rank", str(dead), "--stall-at", "6")
    survivor = procs[1 - dead]
    outs: list[str] = ["", ""]
    try:
        wait_for(lambda: (job / f"stalled-rank-{dead}").exists() or any(p.poll() is not None for p in procs),
                 timeout=120, what=f"rank {dead}'s worker to stop inside step 6's save")
        assert all(p.poll() is None for p in procs), "a rank exited before the kill"
        sentinel = root / "step-00000006" / "checkpoint-is-incomplete"
        assert sentinel.exists()
        if dead == 0:  # the save is not named yet: rank 1's worker waits for rank 0 to start it
            assert sentinel.read_bytes() == b""
        os.kill(procs[dead].pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            outs[1 - dead] = survivor.communicate(timeout=SURVIVOR_BOUND)[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - dead} still running {SURVIVOR_BOUND} s after rank {dead} was killed "
                        "(it waits for the dead rank's save, up to commit_timeout=600 s)")
        seconds = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outs = [out or p.communicate()[0] for out, p in zip(outs, procs, strict=True)]
    said = outs[1 - dead]
    assert procs[dead].returncode == -signal.SIGKILL
    assert survivor.returncode != 0, said  # a crash for ftkit requeue
    assert seconds < SURVIVOR_BOUND, said
    # the survivor's log says why it stopped waiting, as it stops
    assert (f"ERROR ftkit.checkpoint.background.commit: rank {dead} is gone: the checkpoint of step 6 "
            "cannot be committed") in said, said
    events = list(read_events(job / "events.jsonl"))
    exits = [e for e in events if e["event"] == "exit" and e["rank"] == 1 - dead]
    assert len(exits) == 1 and exits[0]["error"] and not exits[0]["completed"], exits
    # gloo's word for the peer gone: "closed" (an orderly close of its socket) or "reset"
    assert re.search(r"Connection (closed|reset) by peer", exits[0]["error"]), exits
    if dead == 1:  # rank 0 committed nothing: its committer said the save failed, and why
        failed = [e for e in events if e["event"] == "save-failed" and e.get("step") == 6]
        assert failed and "rank 1 is gone" in failed[0]["error"], failed
    assert validate_dir(root / "step-00000006").status == "incomplete"
    assert validate_dir(root / "step-00000003", checksums=True).valid

    # the next run resumes from the newest valid checkpoint and completes
    resumed = _launch(job, "--steps", "9", "--save-every", "3")
    outs = collect(resumed, 120)
    for r, (p, out) in enumerate(zip(resumed, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    events = list(read_events(job / "events.jsonl"))
    starts = [i for i, e in enumerate(events) if e["event"] == "start" and e["rank"] == 0]
    resumes = [e for e in events[starts[-1]:] if e["event"] == "resume"]
    assert sorted((e["rank"], e["step"]) for e in resumes) == [(0, 3), (1, 3)], resumes
    assert validate_dir(root / "step-00000009", checksums=True).valid


def test_a_final_save_whose_rank_0_is_killed_is_no_completed_run(tmp_path):
    from ftkit.checkpoint import validate_dir
    from ftkit.events import read_events

    job = tmp_path / "job"
    procs = _launch(job, "--steps", "6", "--save-every", "3", "--stall-rank", "0", "--stall-at", "6",
                    "--commit-timeout", "5")
    try:
        wait_for(lambda: (job / "stalled-rank-0").exists() or any(p.poll() is not None for p in procs),
                 timeout=120, what="rank 0's worker to stop inside step 6's save")
        assert all(p.poll() is None for p in procs), "a rank exited before the kill"
        os.kill(procs[0].pid, signal.SIGKILL)
        outs = collect(procs, SURVIVOR_BOUND)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode != 0, outs[1]
    exits = [e for e in read_events(job / "events.jsonl") if e["event"] == "exit"]
    assert [e["rank"] for e in exits] == [1], exits
    assert not exits[0]["completed"] and "checkpoint step 6" in (exits[0]["error"] or ""), exits
    assert validate_dir(job / "checkpoints" / "step-00000006").status == "incomplete"


# ---------------------------------------------------------------- a peer's process on this host
class _Ckpt:
    """What RankCommit's waits read of its checkpointer."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, WORLD


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _here() -> str:
    from ftkit.checkpoint.background.commit import node_name

    return node_name()


def test_a_wait_gives_up_once_the_peer_process_is_gone(tmp_path):
    """Rank 1 waits for rank 0 to start step 5, rank 0 for rank 1's part: each gives up in
    seconds once the other's process on this host is killed, naming it."""
    from ftkit.checkpoint.background.commit import RankCommit
    from ftkit.errors import CheckpointError

    step = tmp_path / "step-00000005"
    step.mkdir()
    for rank, wait in ((1, lambda c: c._await_start(step, "run step 5 #1", 5)),
                       (0, lambda c: c._await_parts(step, "run step 5 #1", 5))):
        peer = _sleeper()
        try:
            peers = [(_here(), os.getpid())] * WORLD
            peers[1 - rank] = (_here(), peer.pid)
            commit = RankCommit(_Ckpt(rank), run_id="run", timeout=600, peers=peers)
            result: dict = {}

            def run(commit=commit, wait=wait, result=result):
                began = time.monotonic()
                try:
                    wait(commit)
                except CheckpointError as exc:
                    result["error"] = str(exc)
                result["seconds"] = time.monotonic() - began

            t = threading.Thread(target=run, daemon=True)
            t.start()
            time.sleep(0.5)
            assert t.is_alive(), result  # the peer lives: it waits
            peer.kill()  # not reaped yet: a zombie is gone too
            t.join(30)
            assert not t.is_alive(), "the wait did not give up once the peer was gone"
        finally:
            peer.kill()
            peer.wait()
        assert f"rank {1 - rank} is gone: the checkpoint of step 5 cannot be committed" in result["error"], result
        assert f"pid {peer.pid}" in result["error"], result
        assert result["seconds"] < 10, result


def test_a_live_peer_is_waited_for_up_to_the_timeout(tmp_path):
    """A slow rank 0 that lives (on this host, or on another one, whose pid means nothing here) is
    waited for as before: the wait ends with the timeout's error."""
    from ftkit.checkpoint.background.commit import RankCommit
    from ftkit.errors import CheckpointError

    step = tmp_path / "step-00000005"
    step.mkdir()
    alive = _sleeper()
    try:
        for peer in ((_here(), alive.pid), ("another-host", 1)):
            commit = RankCommit(_Ckpt(1), run_id="run", timeout=1.5, peers=[peer, (_here(), os.getpid())])
            began = time.monotonic()
            with pytest.raises(CheckpointError, match="rank 0 did not start checkpoint step 5"):
                commit._await_start(step, "run step 5 #1", 5)
            assert time.monotonic() - began >= 1.5
    finally:
        alive.kill()
        alive.wait()
