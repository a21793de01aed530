"""A GPU load's staging in huge pages registered with CUDA (``io.device.STAGING = "registered"``):
the block's life across loads, without a GPU.

``cudaHostRegister`` itself needs a CUDA device: ``tests/test_gpu.py`` loads through real
registered staging where one exists. Here the registration is a recorder, and what is checked
is ftkit's own part: the staging is one page-aligned block on a 2 MiB boundary, registered once
and reused by the next load, and a refused registration is said once and not retried.
"""

from __future__ import annotations

import logging

import pytest

from ftkit.checkpoint.io import device


@pytest.fixture
def registered(monkeypatch):
    """``STAGING = "registered"``, an empty pool, and ``cudaHostRegister`` replaced by a recorder
    whose answer the test sets (``calls``, ``answer``)."""
    monkeypatch.setattr(device, "STAGING", "registered")
    monkeypatch.setattr(device._Registered, "_kept", [])
    monkeypatch.setattr(device._Registered, "_refused", None)
    state = {"calls": [], "answer": 0}

    def register(block):
        state["calls"].append((block.data_ptr(), block.numel()))
        return state["answer"]

    monkeypatch.setattr(device._Registered, "register", staticmethod(register))
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
    third_while_second_runs = device._Registered.take(chunk * count)
    assert third_while_second_runs is not None and third_while_second_runs.data_ptr() != base
    assert len(registered["calls"]) == 2  # a concurrent load gets a block of its own
    second.finish()


def test_a_refused_registration_is_said_once_and_not_tried_again(registered, caplog) -> None:
    registered["answer"] = 2  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device._Registered.take(8 << 20) is None
        assert device._Registered.take(8 << 20) is None
    assert len(registered["calls"]) == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cudaHostRegister" in said[0] and "CUDA error 2" in said[0]
    assert "pinned memory instead" in said[0]
