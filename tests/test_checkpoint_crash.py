"""kill -9 during saves (benchmarks/crash_stress.py, few trials): no partial loads, no valid checkpoint lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.ckpt_helpers import REPO, env


def _stress(*args: str, timeout: float = 240) -> dict:
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "crash_stress.py"), "--json", *args],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world_size,trials", [(1, 10), (2, 4)], ids=["single", "two-ranks"])
def test_kill9_during_save(world_size, trials):
    counts = _stress("--trials", str(trials), "--world-size", str(world_size), "--seed", "7")
    assert counts["trials"] == trials and counts["errors"] == 0
    assert (
        counts["partial_loaded"] == 0
        and counts["valid_lost"] == 0
        and counts["leftovers_after_cleanup"] == 0
    )
    assert counts["commits"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_kill9_stress_200(world_size):
    """Deselected by default (pyproject addopts); run with `python3 -m pytest -m slow`."""
    counts = _stress("--trials", "200", "--world-size", str(world_size), timeout=900)
    assert (
        counts["partial_loaded"] == 0
        and counts["valid_lost"] == 0
        and counts["killed_mid_save"] > 20
    )
