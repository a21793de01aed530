"""Loading parses the bytes read in place instead of copying them, and nothing live keeps them.

The state file is read once into a fresh buffer and parsed there (its tensors are views of
the buffer, not copies). A tensor a live object keeps (optimizer state, a new dict entry, a
tensor that replaces an empty placeholder) would otherwise hold the whole buffer; the tests check that every
live tensor lies outside it, that the buffer is freed after ``load``, and (/proc/self/maps)
that no mapping of the file exists, so retention deleting it frees its space.
"""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from ftkit.checkpoint import CheckpointConfig, make_manager
from ftkit.checkpoint.io import reader as _reader
from ftkit.checkpoint.io import statefile as _single


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


def _spy_read(monkeypatch) -> dict[str, list]:
    """Record ``torch.load`` calls (none: the buffer is parsed in place) and every read buffer."""
    seen: dict[str, list] = {"torch.load": [], "buffers": []}
    real_load, real_buffer = _single.torch.load, _reader.read_buffer

    def load(*args, **kwargs):
        seen["torch.load"].append(args)
        return real_load(*args, **kwargs)

    def read_buffer(nbytes):
        mapping, view = real_buffer(nbytes)
        start = _single.torch.frombuffer(mapping, dtype=_single.torch.uint8).data_ptr()
        seen["buffers"].append((weakref.ref(mapping), start, start + nbytes))
        return mapping, view

    monkeypatch.setattr(_single.torch, "load", load)
    monkeypatch.setattr(_reader, "read_buffer", read_buffer)
    return seen


def _live_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.optim.Optimizer):
        return _live_tensors(obj.state_dict())
    if isinstance(obj, torch.nn.Module):
        return list(obj.state_dict().values())
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _live_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _live_tensors(v)]
    return []


def test_resume_parses_the_read_buffer_in_place_and_keeps_none_of_it(tmp_path, monkeypatch):
    model, opt = _trained()
    saved_state = _state(model, opt, torch.arange(5.0))
    saved_state["table"]["b"] = torch.full((2,), 7.0)  # a key the resumed dict lacks: adopted
    mgr = make_manager(CheckpointConfig(root=tmp_path))
    mgr.save(3, saved_state)
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
    }
    seen = _spy_read(monkeypatch)

    # a new process's view: fresh model, an optimizer without state, an empty tensor (a
    # placeholder the saved one replaces)
    fresh_model, _ = _trained(seed=1)
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
    state = _state(fresh_model, fresh_opt, torch.zeros(0))
    assert make_manager(CheckpointConfig(root=tmp_path)).load(state) == 3
    assert seen["torch.load"] == [] and len(seen["buffers"]) == 1  # one read, parsed in place
    buffer, start, end = seen["buffers"][0]
    live = _live_tensors(state)
    assert len(live) > 8 and all(not start <= t.data_ptr() < end for t in live)
    gc.collect()
    assert buffer() is None  # freed: nothing live holds it
    assert _mapped(tmp_path) == []

    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, expected["model"][k]), k
    got = [fresh_opt.state[p]["exp_avg"] for p in fresh_model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected["exp_avg"], strict=True))
    assert torch.equal(state["extra"], torch.arange(5.0))  # adopted: the live one was an empty placeholder
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


@pytest.mark.parametrize("live", ["module", "tensor"])
def test_what_restore_copies_is_not_cloned_first(tmp_path, live):
    # the buffer's tensors restore copies from are passed through as they are (no extra copy)
    from ftkit.checkpoint.state.restore import own_tensors

    saved = {"x": torch.ones(4)}
    obj = torch.nn.Linear(4, 1) if live == "module" else torch.zeros(4)
    if live == "module":
        saved = {"x": {"weight": torch.ones(1, 4), "bias": torch.ones(1)}}
    out = own_tensors({"x": obj}, saved)
    leaves = out["x"].values() if live == "module" else [out["x"]]
    originals = saved["x"].values() if live == "module" else [saved["x"]]
    assert all(a is b for a, b in zip(leaves, originals, strict=True))
