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

from tests.ckpt_helpers import run_ranks

DATA = Path(__file__).resolve().parent / "data" / "previous-release-checkpoints"


def _equal(want, got, where: str) -> int:
    """Assert ``got`` is ``want`` (tensors bit for bit); the number of tensors compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
        return 1
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, set(got) ^ set(want)))}"
        return sum(_equal(want[k], got[k], f"{where}/{k}") for k in want)
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        return sum(_equal(w, g, f"{where}[{i}]") for i, (w, g) in enumerate(zip(want, got, strict=True)))
    assert got == want, f"{where}: {got!r} != {want!r}"
    return 0


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
        # the MLP's 4 parameters, their Adam moments (8) and steps (4)
        assert _equal(want["model"], got["model"], "model") + _equal(want["optimizer"], got["optimizer"], "optimizer") == 16
    # loading wrote nothing into the old checkpoint (a later requeue of the old code reads it too)
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
