"""Loading maps the state file instead of copying it, and nothing live stays backed by it.

A tensor a live object keeps (optimizer state, a new dict entry, a tensor of another shape)
would otherwise hold the file's pages and its disk space after retention deletes it; the
tests read /proc/self/maps to see whether any mapping of the file is left after ``load``.
"""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path

import pytest
import torch

from ftkit.checkpoint import CheckpointConfig, _single, make_manager


def _mapped(path: Path) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if str(path) in line]


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
    return model, opt


def _state(model, opt, extra):
    return {"model": model, "optimizer": opt, "extra": extra, "table": {"a": torch.zeros(3)}}


def _spy_mmap(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    real = _single.torch.load

    def load(*args, **kwargs):
        calls.append(bool(kwargs.get("mmap")))
        return real(*args, **kwargs)

    monkeypatch.setattr(_single.torch, "load", load)
    return calls


def test_resume_maps_the_file_and_keeps_no_mapping_of_it(tmp_path, monkeypatch):
    model, opt = _trained()
    saved_state = _state(model, opt, torch.arange(5.0))
    saved_state["table"]["b"] = torch.full((2,), 7.0)  # a key the resumed dict lacks: adopted
    mgr = make_manager(CheckpointConfig(root=tmp_path))
    mgr.save(3, saved_state)
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
    }
    calls = _spy_mmap(monkeypatch)

    # a new process's view: fresh model, an optimizer without state, a tensor of another shape
    fresh_model, _ = _trained(seed=1)
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
    state = _state(fresh_model, fresh_opt, torch.zeros(2))
    assert make_manager(CheckpointConfig(root=tmp_path)).load(state) == 3
    assert calls == [True]
    gc.collect()
    assert _mapped(tmp_path) == []

    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, expected["model"][k]), k
    got = [fresh_opt.state[p]["exp_avg"] for p in fresh_model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected["exp_avg"], strict=True))
    assert torch.equal(state["extra"], torch.arange(5.0))  # adopted: another shape than live
    assert torch.equal(state["table"]["b"], torch.full((2,), 7.0))
    shutil.rmtree(tmp_path)  # retention deleting the files: the resumed state is unaffected
    fresh_model(torch.randn(4, 64)).square().sum().backward()
    fresh_opt.step()
    assert all(torch.isfinite(t).all() for t in fresh_model.parameters())


def test_reload_mid_run_copies_into_the_optimizers_own_tensors(tmp_path):
    model, opt = _trained()
    mgr = make_manager(CheckpointConfig(root=tmp_path))
    mgr.save(1, _state(model, opt, torch.zeros(2)))
    want = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    model(torch.randn(4, 64)).square().sum().backward()
    opt.step()  # the run goes on; then rolls back to step 1 (e.g. after a loss spike)
    tensors = [opt.state[p]["exp_avg_sq"] for p in model.parameters()]
    ptrs = [t.data_ptr() for t in tensors]

    assert mgr.load(_state(model, opt, torch.zeros(2)), step=1) == 1
    gc.collect()
    assert _mapped(tmp_path) == []
    for p, w, t, ptr in zip(model.parameters(), want, tensors, ptrs, strict=True):
        assert opt.state[p]["exp_avg_sq"] is t and t.data_ptr() == ptr  # no new allocation
        for k, v in w.items():
            assert torch.equal(opt.state[p][k], v), k


def test_a_file_that_cannot_be_mapped_is_read_with_a_warning(tmp_path, monkeypatch, caplog):
    model, opt = _trained()
    make_manager(CheckpointConfig(root=tmp_path)).save(2, _state(model, opt, torch.zeros(2)))
    want = {k: v.clone() for k, v in model.state_dict().items()}

    def no_mmap(*args, **kwargs):  # what a filesystem without mmap support answers
        raise OSError(19, "No such device")

    monkeypatch.setattr(_single._mmap, "mmap", no_mmap)
    calls = _spy_mmap(monkeypatch)
    fresh, _ = _trained(seed=1)
    with caplog.at_level(logging.WARNING, logger="ftkit.checkpoint._single"):
        state = _state(fresh, torch.optim.Adam(fresh.parameters()), torch.zeros(2))
        assert make_manager(CheckpointConfig(root=tmp_path)).load(state) == 2
    assert calls == [False]
    assert "cannot memory-map" in caplog.text and "rank-00000.pt" in caplog.text
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("live", ["module", "tensor"])
def test_what_restore_copies_is_not_cloned_first(tmp_path, live):
    # the mapped tensors restore copies from are passed through as they are (no extra copy)
    from ftkit.checkpoint._state import own_tensors

    saved = {"x": torch.ones(4)}
    obj = torch.nn.Linear(4, 1) if live == "module" else torch.zeros(4)
    if live == "module":
        saved = {"x": {"weight": torch.ones(1, 4), "bias": torch.ones(1)}}
    out = own_tensors({"x": obj}, saved)
    leaves = out["x"].values() if live == "module" else [out["x"]]
    originals = saved["x"].values() if live == "module" else [saved["x"]]
    assert all(a is b for a, b in zip(leaves, originals, strict=True))
