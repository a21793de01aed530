"""Checkpoints an earlier release wrote load with this one, exactly, on any world size.

A job upgraded between two requeues resumes from what the old code saved. The checkpoints in
``tests/data/previous-release-checkpoints`` were made at e0fc34a, before the load path read
files straight into the live tensors (``tests/data/previous-release-checkpoints.sh`` says how):
a one-process state file and a two-rank DCP checkpoint of the tiny trainer of
``tests/ckpt_helpers.py`` at step 7, with each rank's model and optimizer state as the old
trainer had them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.ckpt_helpers import assert_same_values, run_ranks

DATA = Path(__file__).resolve().parent / "data" / "previous-release-checkpoints"


@pytest.mark.parametrize(("name", "saved", "loaded"), [("one", 1, 1), ("one", 1, 2), ("two", 2, 2), ("two", 2, 1)])
def test_a_checkpoint_of_the_previous_release_loads_exactly(tmp_path: Path, name: str, saved: int, loaded: int) -> None:
    root = tmp_path / name
    shutil.copytree(DATA / name, root)
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "got")], world_size=loaded)
    assert [out.strip().splitlines()[-1] for out in outs] == ["loaded 7"] * loaded
    for rank in range(loaded):
        want = torch.load(DATA / f"{name}.expected.rank{min(rank, saved - 1)}", weights_only=True)
        got = torch.load(tmp_path / f"got.rank{rank}", weights_only=True)
        assert len(want["model"]) == 4 and len(want["optimizer"]["state"]) == 4  # the MLP's, each with Adam's moments
        assert_same_values(want["model"], got["model"], "model")
        assert_same_values(want["optimizer"], got["optimizer"], "optimizer")
    # loading wrote nothing into the old checkpoint (a later requeue of the old code reads it too)
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
