"""Exact resume in a new process: N steps straight == N/2 steps, checkpoint, new process, N/2 more.

The trainer (tests/ckpt_helpers.py) uses dropout, a shuffled ResumableSampler, Adam and
StepLR, so parameters, optimizer state and per-step losses only match bit for bit when the
model, optimizer, scheduler, sampler position and RNG states all come back exactly.
"""

from __future__ import annotations

import pytest
import torch

from ftkit.checkpoint import validate_dir
from tests.ckpt_helpers import run_ranks


def _load(path):
    return torch.load(path, weights_only=True)


def _assert_same(straight, first, resumed, steps, stop):
    assert len(first["losses"]) == stop and len(resumed["losses"]) == steps - stop
    assert straight["losses"] == first["losses"] + resumed["losses"]  # exact float equality
    assert straight["model"].keys() == resumed["model"].keys()
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    a, b = straight["optimizer"], resumed["optimizer"]
    assert a["param_groups"] == b["param_groups"]
    for pid, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)


@pytest.mark.parametrize("world_size", [1, 2], ids=["single-process", "two-ranks-dcp"])
def test_exact_resume_in_new_process(tmp_path, world_size):
    steps, stop = (20, 11) if world_size == 1 else (14, 7)  # stop mid-epoch (12 batches/epoch)
    base = ["train", "--steps", str(steps)]
    run_ranks(
        [*base, "--root", str(tmp_path / "straight"), "--out", str(tmp_path / "straight")],
        world_size,
    )
    run_ranks(
        [
            *base,
            "--root",
            str(tmp_path / "ck"),
            "--stop-at",
            str(stop),
            "--out",
            str(tmp_path / "first"),
        ],
        world_size,
    )
    info = validate_dir(tmp_path / "ck" / f"step-{stop:08d}", checksums=True)
    assert (
        info.valid
        and info.world_size == world_size
        and info.kind == ("single" if world_size == 1 else "dcp")
    )
    run_ranks(
        [*base, "--root", str(tmp_path / "ck"), "--out", str(tmp_path / "resumed")], world_size
    )
    for rank in range(world_size):
        _assert_same(
            _load(tmp_path / f"straight.rank{rank}"),
            _load(tmp_path / f"first.rank{rank}"),
            _load(tmp_path / f"resumed.rank{rank}"),
            steps,
            stop,
        )
