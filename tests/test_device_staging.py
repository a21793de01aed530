"""A GPU load's staging in huge pages registered with CUDA (``io.device.STAGING = "registered"``):
the block's life across loads, without a GPU.

``cudaHostRegister`` itself needs a CUDA device: ``tests/test_gpu.py`` loads through real
registered staging where one exists. Here registering and unregistering are recorders, and
what is checked is ftkit's own part: the staging is one page-aligned block on a 2 MiB boundary,
registered once and reused by the next load; a block whose copies may still run is not reused
nor freed; a refused registration is said once and not retried.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ftkit.checkpoint.io import device


@pytest.fixture
def registered(monkeypatch):
    """``STAGING = "registered"``, an empty pool, and ``cudaHostRegister`` / ``cudaHostUnregister``
    replaced by recorders; the test sets what registering answers (``refuse``: a reason)."""
    monkeypatch.setattr(device, "STAGING", "registered")
    monkeypatch.setattr(device._Registered, "_kept", [])
    monkeypatch.setattr(device._Registered, "_held", {})
    monkeypatch.setattr(device._Registered, "_refused", None)
    state = {"calls": [], "gone": [], "refuse": None}

    def register(block):
        state["calls"].append((block.data_ptr(), block.numel()))
        return state["refuse"]

    real_unregister = device._Registered.unregister.__func__
    monkeypatch.setattr(device._Registered, "register", staticmethod(register))
    monkeypatch.setattr(device._Runtime, "get", classmethod(lambda cls: None))  # no CUDA runtime to call
    monkeypatch.setattr(device._Registered, "unregister",
                        classmethod(lambda cls, block: state["gone"].append(block.data_ptr()) or real_unregister(cls, block)))
    return state


def test_registered_staging_is_one_huge_page_aligned_block_kept_for_the_next_load(registered) -> None:
    chunk, count = 2 << 20, 4
    first = device.DeviceCopies(chunk=chunk, count=count)
    stages = first.stages()
    assert [len(s) for s in stages] == [chunk] * count
    base = registered["calls"][0][0]
    assert registered["calls"] == [(base, chunk * count)]
    assert base % (2 << 20) == 0  # on a huge page's boundary: O_DIRECT reads land in 2 MiB segments
    # the stages lie back to back in the registered block, and host() reads from it
    stages[1][:4] = b"abcd"
    assert bytes(first.host(base + chunk, 4).numpy()) == b"abcd"
    first.finish()
    second = device.DeviceCopies(chunk=chunk, count=count)
    assert second.host(base, 1).data_ptr() == base  # the same block, not registered again
    assert len(registered["calls"]) == 1
    concurrent = device.DeviceCopies(chunk=chunk, count=count)  # a load beside it: a block of its own
    other = registered["calls"][1][0]
    assert len(registered["calls"]) == 2 and other != base
    second.finish()
    concurrent.finish()  # one free block is kept: the one given back longest ago is unregistered
    assert registered["gone"] == [base]
    assert [b.data_ptr() for b in device._Registered._kept] == [other]
    assert set(device._Registered._held) == {other}
    device._Registered.clear()
    assert registered["gone"] == [base, other] and not device._Registered._held


def test_a_block_whose_copies_may_still_run_is_neither_reused_nor_freed(registered, monkeypatch) -> None:
    copies = device.DeviceCopies(chunk=2 << 20, count=2)
    base = copies.host(copies._base, 1).data_ptr()

    def failing_sync():
        raise RuntimeError("the side stream failed")

    side = types.SimpleNamespace(synchronize=failing_sync)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(wait_stream=lambda s: None))
    copies._sides[torch.device("cuda", 0)] = side
    with pytest.raises(RuntimeError, match="side stream failed"):
        copies.finish()
    assert not device._Registered._kept and not registered["gone"]
    assert base in device._Registered._held  # still registered, and referenced: never freed under a DMA
    device.DeviceCopies(chunk=2 << 20, count=2).finish()
    assert len(registered["calls"]) == 2  # the next load registered a block of its own


def test_a_refused_registration_is_said_once_and_not_tried_again(registered, caplog) -> None:
    registered["refuse"] = "CUDA error 2 (out of memory)"
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device._Registered.take(8 << 20) is None
        assert device._Registered.take(8 << 20) is None
    assert len(registered["calls"]) == 1 and not device._Registered._held
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cudaHostRegister" in said[0] and "CUDA error 2 (out of memory)" in said[0]
    assert "pinned memory instead" in said[0]
