"""GPU-only paths: pinned staging buffers and side-stream copies of the async save.

These run where a CUDA device exists (the project's GPU machine); CI has none, and the CPU
tests cover the same code paths without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ftkit
from ftkit.checkpoint import AsyncCheckpointer, CheckpointConfig, validate_dir
from ftkit.checkpoint.background.buffers import BufferSet, Copier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


def test_pinned_buffers_and_side_stream_copy_match_the_device_tensors() -> None:
    src = [torch.randn(1024, 1024, device="cuda"), torch.randn(333, device="cuda", dtype=torch.bfloat16)]
    buffers = BufferSet(pin=True)
    dst = buffers.buffers_for([(f"t{i}", t) for i, t in enumerate(src)])
    assert all(b.is_pinned() and b.device.type == "cpu" for b in dst)
    events, _ = Copier().copy(dst, src)
    for e in events:
        e.synchronize()
    for d, s in zip(dst, src, strict=True):
        assert torch.equal(d, s.cpu())
    again = buffers.buffers_for([(f"t{i}", t) for i, t in enumerate(src)])
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in dst]  # reused, not reallocated


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "crash-safe"])
def test_async_save_of_a_cuda_model_resumes_exactly(tmp_path: Path, crash_safe: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    cfg = CheckpointConfig(root=tmp_path / "checkpoints")
    async_config = ftkit.AsyncConfig(crash_safe=crash_safe)  # crash-safe: cudaHostRegister'ed /dev/shm
    with AsyncCheckpointer(cfg, async_config=async_config, events=None, rank=0, world_size=1) as mgr:
        mgr.save(3, {"model": model, "optimizer": opt})
        # training goes on while the snapshot persists: the snapshot must not see this update
        opt.zero_grad()  # as the resumed run below starts: with no gradient carried over
        model(x).pow(2).mean().backward()
        opt.step()
        after = [p.detach().clone() for p in model.parameters()]
        mgr.wait()
    assert validate_dir(tmp_path / "checkpoints" / "step-00000003", checksums=True).valid
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    opt2 = torch.optim.Adam(model2.parameters())
    with ftkit.checkpoint.Checkpointer(cfg, events=None, rank=0, world_size=1) as mgr:
        assert mgr.load({"model": model2, "optimizer": opt2}) == 3
    model2(x).pow(2).mean().backward()
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(after, model2.parameters(), strict=True))


@pytest.mark.parametrize("crash_safe", [False, True], ids=["thread", "crash-safe"])
def test_cuda_state_whose_layout_changes_is_snapshotted_before_the_next_update(tmp_path: Path, crash_safe: bool) -> None:
    """Copies start during the walk on the side stream (into the previous layout's buffers,
    or segment, while it still fits); an in-place update queued right after ``save`` must not
    reach the snapshot, also when a new buffer or segment replaces the old one."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    big = 64 << 20  # 256 MiB per tensor: still being copied when save() returns (thread worker)
    states = [
        {"x": r(big), "y": r(64, 64)},
        {"x": r(big), "y": r(64, 64), "z": r(big)},  # appended: same prefix
        {"x": r(big), "y": r(128, 64), "z": r(big)},  # reshaped
        {"w": r(8), "x": r(big), "y": r(128, 64), "z": r(big)},  # inserted in front
        {"w": r(8), "x": r(big).double(), "y": r(128, 64), "z": r(big)},  # dtype
    ]
    cfg = CheckpointConfig(root=tmp_path / "checkpoints")
    with AsyncCheckpointer(cfg, async_config=ftkit.AsyncConfig(crash_safe=crash_safe), events=None) as mgr:
        for step, state in enumerate(states, 1):
            expect = {k: v.to("cpu", copy=True) for k, v in state.items()}
            mgr.save(step, state)
            for v in state.values():
                v.mul_(2)  # queued on the compute stream right after the save
            mgr.wait()
            d = tmp_path / "checkpoints" / f"step-{step:08d}"
            assert validate_dir(d, checksums=True).valid
            got = torch.load(d / "rank-00000.pt", weights_only=True)["state"]
            assert got.keys() == expect.keys()
            for k, v in expect.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (step, k)
