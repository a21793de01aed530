"""GPU-only paths: pinned staging buffers and side-stream copies of the async save, and a resume
onto the GPU (pinned staging, host-to-device copies as the pieces arrive).

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


def _cuda_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(16, 512, device="cuda")).pow(2).mean().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _two_checkpoints(root: Path) -> list[torch.Tensor]:
    """Steps 2 and 3 of two CUDA states saved under ``root``; the values of step 3's."""
    mgr = ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root, keep_last=None), events=None)
    mgr.save(2, _cuda_state(2))
    newest = _cuda_state(3)
    mgr.save(3, newest)
    return _values(newest)


def _device_writes(monkeypatch) -> list[int]:
    """The sizes of the host-to-device copies (``DeviceTensor.write``) of the loads that follow."""
    from ftkit.checkpoint.io import device as _device

    written: list[int] = []
    real = _device.DeviceTensor.write
    monkeypatch.setattr(_device.DeviceTensor, "write", lambda self, at, src, n: written.append(n) or real(self, at, src, n))
    return written


def _values(state: dict) -> list[torch.Tensor]:
    return ([t.detach().cpu() for t in state["model"].state_dict().values()]
            + [v.detach().cpu() for st in state["optimizer"].state.values() for v in st.values() if torch.is_tensor(v)])


@pytest.mark.parametrize("staging", ["pinned", "registered"])
@pytest.mark.parametrize("raw", [True, False], ids=["cuda-runtime", "copy_"])
def test_a_resume_onto_the_gpu_copies_each_piece_to_the_live_tensors_as_it_arrives(tmp_path: Path, monkeypatch,
                                                                                   raw: bool, staging: str) -> None:
    """With an older checkpoint to fall back on, the newest state file is read once into pinned
    staging (torch's pinned allocator, or huge pages registered with CUDA) and its CUDA tensors'
    bytes go to the live GPU tensors by host-to-device copies (``io.device``, queued through the
    CUDA runtime's C API or, without it, ``Tensor.copy_``): the same tensors, filled in place,
    bit for bit the saved values; work queued on them before the load does not overwrite them."""
    from ftkit.checkpoint.io import device as _device

    monkeypatch.setattr(_device, "RAW", raw)
    monkeypatch.setattr(_device, "STAGING", staging)
    monkeypatch.setattr(_device._Registered, "_refused", None)
    _device._Registered.clear()  # unregistered before they are freed
    assert (_device._Runtime.get() is not None) or not raw  # torch's libcudart was found
    recorded: list[int] = []
    real_record = _device._Events.record
    monkeypatch.setattr(_device._Events, "record", lambda self, stream: recorded.append(stream) or real_record(self, stream))

    root = tmp_path / "ck"
    want = _two_checkpoints(root)
    live = _cuda_state(9)
    pointers = [t.data_ptr() for t in live["model"].state_dict().values()]
    for p in live["model"].parameters():
        p.data.mul_(7)  # queued on the compute stream: must run before the checkpoint lands
    written = _device_writes(monkeypatch)
    assert ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live) == 3
    assert [t.data_ptr() for t in live["model"].state_dict().values()] == pointers
    got = _values(live)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    model_bytes = sum(t.numel() * t.element_size() for t in live["model"].state_dict().values())
    assert sum(written) >= model_bytes  # the model (and the moments) went by device copies
    assert (len(recorded) == len(written)) if raw else not recorded
    kept = _device._Registered._kept  # given back after the load, registered: pinned for CUDA
    assert (len(kept) == 1 and kept[0].is_pinned()) if staging == "registered" else not kept
    assert _device._Registered._refused is None
    _device._Registered.clear()
    assert not _device._Registered._held


def test_a_requeued_jobs_fresh_optimizer_gets_its_moments_read_straight_onto_the_gpu(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """A fresh process's optimizer has no state yet: its Adam moments are read into new CUDA
    memory by host-to-device copies as the pieces arrive (``restore.optimizer_homes``), not
    into host memory that ``load_state_dict`` then copies; the optimizer keeps them as they are."""
    root = tmp_path / "ck"
    want = _two_checkpoints(root)
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    live = {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
    written = _device_writes(monkeypatch)
    assert ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live) == 3
    got = _values(live)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    moments = [v for st in live["optimizer"].state.values() for k, v in st.items() if k != "step"]
    assert len(moments) == 8 and all(v.is_cuda for v in moments)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    assert sum(written) >= 3 * model_bytes  # the parameters and both moments went by device copies


def test_a_corrupt_newest_read_onto_the_gpu_falls_back_to_exactly_the_older_state(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mgr = ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root, keep_last=None), events=None)
    older = _cuda_state(2)
    mgr.save(2, older)
    want = _values(older)
    mgr.save(3, _cuda_state(3))
    f = root / "step-00000003" / "rank-00000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    live = _cuda_state(9)
    assert ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live) == 2
    got = _values(live)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_dcp_checkpoint_loads_onto_the_gpu_through_the_streaming_reader(tmp_path: Path) -> None:
    """A two-rank DCP checkpoint (CPU ranks over gloo) loaded in one process into a CUDA model:
    every ``.distcp`` file read once, the tensors copied to the GPU from pinned staging, equal to
    DCP's own reader's result."""
    from tests.ckpt_helpers import build_state, make_mgr, run_ranks

    root = tmp_path / "ck"
    run_ranks(["train", "--root", str(root), "--steps", "4", "--stop-at", "4"], 2)
    run_ranks(["train", "--root", str(root), "--steps", "7", "--stop-at", "7"], 2)
    reference, _ = build_state()
    assert make_mgr(root).load(reference, step=7) == 7  # an explicit step: DCP's own reader (CPU)
    state, _ = build_state()
    state["model"].cuda()
    state["optimizer"] = torch.optim.Adam(state["model"].parameters(), lr=1e-2)
    state["scheduler"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=4, gamma=0.7)
    assert make_mgr(root).load(state) == 7
    for a, b in zip(state["model"].state_dict().values(), reference["model"].state_dict().values(), strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)
    for pid, st in state["optimizer"].state_dict()["state"].items():
        want = reference["optimizer"].state_dict()["state"][pid]
        assert all(torch.equal(torch.as_tensor(v).cpu(), torch.as_tensor(want[k])) for k, v in st.items())


@pytest.mark.parametrize("corrupt", [False, True], ids=["valid", "corrupt"])
def test_the_only_checkpoint_onto_the_gpu_leaves_the_live_state_as_it_was_when_corrupt(tmp_path: Path, monkeypatch,
                                                                                     corrupt: bool) -> None:
    """Nothing older to fall back on: a fresh optimizer's moments (memory the load makes) are
    copied straight to the GPU, the live parameters are read into host memory of their own and
    copied in once the file checks out. Valid: step 3's values. Corrupt: the parameters as they
    were, the optimizer still without state (a fresh start), no moment copied over by then kept."""
    root = tmp_path / "ck"
    mgr = ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None)
    newest = _cuda_state(3)
    mgr.save(3, newest)
    want = _values(newest)
    if corrupt:
        f = root / "step-00000003" / "rank-00000.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    live = {"model": model, "optimizer": torch.optim.Adam(model.parameters())}
    before = [t.detach().cpu().clone() for t in model.state_dict().values()]
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    written = _device_writes(monkeypatch)
    got = ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    assert sum(written) >= 2 * model_bytes  # the moments went by device copies as they arrived
    assert [t.data_ptr() for t in model.state_dict().values()] == pointers
    if corrupt:
        assert got is None and not live["optimizer"].state
        assert all(torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(), before, strict=True))
    else:
        assert got == 3
        have = _values(live)
        assert len(have) == len(want) and all(torch.equal(a, b) for a, b in zip(have, want, strict=True))


@pytest.mark.parametrize("saves,corrupt", [(2, False), (2, True), (1, False), (1, True)],
                         ids=["older-valid", "older-corrupt-newest", "only-valid", "only-corrupt"])
def test_a_one_process_gpu_checkpoint_loads_on_two_ddp_ranks_on_the_gpu(tmp_path: Path, saves: int,
                                                                        corrupt: bool) -> None:
    """A requeue onto more ranks on GPUs: a state file that one process saved from the GPU,
    loaded by two DDP ranks (gloo, both on this one GPU) whose model and Adam moments live on
    the GPU. With an older checkpoint each rank reads the file whole straight into its CUDA
    tensors (through the page cache, as one process does); a corrupt newest falls back to
    exactly the older state on both. With nothing older (a GPU's state has no copy in host
    memory) rank 0 checks the file first, then each rank reads it straight in: valid, the
    trained state; corrupt, nothing read in, the state as built and no optimizer state."""
    from tests.ckpt_helpers import build_state, run_ranks

    root, out = tmp_path / "ck", tmp_path / "trained"
    steps = (4, 7)[:saves]
    for step in steps:
        run_ranks(["train", "--root", str(root), "--steps", str(step), "--stop-at", str(step),
                   "--out", f"{out}{step}", "--device", "cuda"], 1)
    newest = steps[-1]
    if corrupt:
        f = root / f"step-{newest:08d}" / "rank-00000.pt"
        data = bytearray(f.read_bytes())
        data[int(len(data) * 0.6)] ^= 0x10
        f.write_bytes(bytes(data))
    outs = run_ranks(["load", "--root", str(root), "--out", str(tmp_path / "loaded"), "--device", "cuda"], 2,
                     timeout=180)
    expect = {(2, False): 7, (2, True): 4, (1, False): 4, (1, True): None}[(saves, corrupt)]
    if expect is None:
        fresh, _ = build_state()
        want = {"model": fresh["model"].state_dict(), "optimizer": {"state": {}}}
    else:
        want = torch.load(f"{out}{expect}.rank0", weights_only=True, map_location="cpu")
    for rank, said in enumerate(o.strip().splitlines() for o in outs):
        assert said[-1] == f"loaded {expect}", said
        # nothing older: checked first (the GPU's state has no copy in host memory), read in if valid
        assert ("state file into live: direct=False undo=False keep=False" in said) == (saves == 2 or not corrupt), said
        got = torch.load(f"{tmp_path / 'loaded'}.rank{rank}", weights_only=True, map_location="cpu")
        assert got["model"].keys() == want["model"].keys()
        assert all(torch.equal(v, want["model"][k].cpu()) for k, v in got["model"].items()), rank
        assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
        for pid, st in got["optimizer"]["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(want["optimizer"]["state"][pid][k]).cpu())
                       for k, v in st.items()), (rank, pid)


def _cpu_state(seed: int, *, head_on_gpu: bool) -> dict:
    """``_cuda_state``'s model and Adam state in host memory (its last layer on the GPU where
    ``head_on_gpu``: a state partly offloaded to the CPU)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    if head_on_gpu:
        model[2].cuda()
        model[1].register_forward_hook(lambda m, i, out: out.cuda())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(16, 512)).pow(2).mean().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


@pytest.mark.parametrize("head_on_gpu", [False, True], ids=["host", "mixed"])
def test_a_cuda_process_loads_host_memory_state_through_pinned_staging(tmp_path: Path, monkeypatch,
                                                                       head_on_gpu: bool) -> None:
    """In a process that uses CUDA, a load stages in pinned memory (``io.device``) whatever the
    live tensors' devices: host tensors are copied from the staging, CUDA ones by host-to-device
    copies. A corrupt newest state file, found during that single read, falls back to exactly
    the older state; every tensor keeps its device."""
    torch.cuda.init()
    root = tmp_path / "ck"
    mgr = ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root, keep_last=None), events=None)
    older = _cpu_state(2, head_on_gpu=head_on_gpu)
    mgr.save(2, older)
    want = _values(older)
    newest = _cpu_state(3, head_on_gpu=head_on_gpu)
    mgr.save(3, newest)
    live = _cpu_state(9, head_on_gpu=head_on_gpu)
    devices = [t.device.type for t in live["model"].state_dict().values()]
    written = _device_writes(monkeypatch)
    assert ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live) == 3
    assert all(torch.equal(a, b) for a, b in zip(_values(live), _values(newest), strict=True))
    assert [t.device.type for t in live["model"].state_dict().values()] == devices
    assert bool(written) == head_on_gpu  # device copies only for the CUDA tensors

    f = root / "step-00000003" / "rank-00000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    f.write_bytes(bytes(data))
    live = _cpu_state(9, head_on_gpu=head_on_gpu)
    assert ftkit.checkpoint.Checkpointer(CheckpointConfig(root=root), events=None).load(live) == 2
    assert all(torch.equal(a, b) for a, b in zip(_values(live), want, strict=True))
    assert [t.device.type for t in live["model"].state_dict().values()] == devices
