"""The requeue policy is a pure function of hand-made facts: no job dir, no scontrol, no clock.

tests/test_requeue_policy.py drives every branch through a real job directory; these
tests show the policy itself needs none of it, so a new rule can be tested from facts alone.
"""

from __future__ import annotations

import builtins
import os
import subprocess
import time

import pytest

from ftkit.jobdir import JobDir
from ftkit.slurm.env import SlurmEnv
from ftkit.slurm.requeue_facts import RunFacts
from ftkit.slurm.requeue_policy import EXIT_UNFINISHED, RequeueDecision, RequeuePolicy
from ftkit.slurm.requeue_policy import decide as policy_decide

JOB = JobDir.of("/nonexistent/ftkit-job")  # never touched: the policy reads no file
ENV = SlurmEnv(job_id="100", restart_count=0)
START = {"event": "start", "time": 1.0, "world_size": 1}


def facts(**kw) -> RunFacts:
    return RunFacts(**{"jobdir": JOB, "env": ENV, "exit_code": 0, "start": START, "end_time": 5.0, **kw})


def decide(f: RunFacts, policy: RequeuePolicy) -> RequeueDecision:
    """The policy, with every file, process and clock access made to fail while it runs."""
    touched: list[tuple] = []

    def refuse(*args, **kwargs):
        touched.append(args)
        raise OSError("the policy must not do I/O or read the clock")

    with pytest.MonkeyPatch.context() as mp:
        for target, name in [(builtins, "open"), (os, "stat"), (os, "lstat"), (os, "listdir"), (os, "scandir"),
                             (subprocess, "run"), (subprocess, "Popen"), (time, "time"), (time, "monotonic")]:
            mp.setattr(target, name, refuse)
        try:
            decision = policy_decide(f, policy)
        finally:
            mp.undo()
    assert touched == [], f"the policy did I/O or read the clock: {touched}"
    return decision


def test_crash_with_progress_is_requeued_from_facts_alone() -> None:
    d = decide(facts(exit_code=137, end_step=150, runs=({"end_step": 100, "requeue": True},)),
               RequeuePolicy(max_requeues=5))
    assert d.requeue and d.cause == "crash" and d.exit_code == 0
    assert d.reason == "crashed with exit code 137 after progress to step 150; requeue 2 of at most 5"
    assert d.run["start_step"] == 100 and d.run["end_time"] == 5.0 and d.run["progress"] is True


def test_crash_without_progress_stops_after_the_streak() -> None:
    runs = ({"end_step": 100, "cause": "crash", "progress": False, "requeue": True},) * 2
    d = decide(facts(exit_code=1, end_step=100, runs=runs), RequeuePolicy(max_no_progress=2))
    assert not d.requeue and d.cause == "crash" and d.exit_code == 1
    assert "3 times in a row" in d.reason


def test_every_rank_exited_cleanly_is_not_a_crash() -> None:
    exit_ = {"event": "exit", "requeue": True, "reasons": ["USR1 received"], "step": 10}
    d = decide(facts(exit_code=1, exit=exit_, clean=True, end_step=10), RequeuePolicy())
    assert d.requeue and d.cause == "requested (SIGUSR1)" and d.training_exit_code == 1


def test_kill_switch_and_stop_request_stop_for_good() -> None:
    preempted = {"JobState": "PREEMPTED"}
    d = decide(facts(kill_switch=True, slurm_job=preempted), RequeuePolicy())
    assert not d.requeue and d.cause == "stopped" and str(JOB.kill_switch) in d.reason
    d = decide(facts(requests=(("/r/1.json", {"action": "stop", "reason": "done"}),), slurm_job=preempted),
               RequeuePolicy())
    assert not d.requeue and d.reason == "a stop request is pending (done)"
    assert d.spent_requests == ("/r/1.json",)


def test_cap_reached_after_a_clean_requeue_wish_is_unfinished() -> None:
    exit_ = {"event": "exit", "requeue": True, "reasons": [], "step": 10}
    d = decide(facts(exit=exit_, clean=True, env=SlurmEnv(job_id="100", restart_count=3)),
               RequeuePolicy(max_requeues=3))
    assert not d.requeue and d.exit_code == EXIT_UNFINISHED and d.requeues == 3
