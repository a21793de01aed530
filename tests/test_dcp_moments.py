"""A DCP checkpoint (several ranks) whose optimizer has no moments for some parameters: a head
not used yet, a layer frozen when it was saved. The same script resumes from it, exactly, on as
many ranks or on one; before, every rank failed with DCP's 'Missing key in checkpoint
state_dict: optimizer.state.aux.weight.step'."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ckpt_helpers import collect, env, free_port

# save: a step in which `aux` gets no gradient (or is frozen), then checkpoint step 1 and the
# optimizer's state_dict beside it; load: a fresh process loads step 1 and compares
PROGRAM = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from ftkit.checkpoint import CheckpointConfig, make_manager

    root, phase, how = sys.argv[1:4]
    verify = sys.argv[4:] != ["noverify"]  # without checksums the load plans without ftkit's reader
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if how.startswith("stages"):  # each rank holds its own stage, as pipeline parallelism does
        model = torch.nn.Sequential()
        model.add_module(f"stage{rank}", torch.nn.Linear(4, 4))
    model.aux = torch.nn.Linear(4, 2)
    if how == "frozen" and phase == "save":
        model.aux.requires_grad_(False)
    if how.endswith("removed") and phase == "load":  # the head was taken out of the model since
        del model.aux
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    mgr = make_manager(CheckpointConfig(root=root, verify_on_load=verify), rank=rank, world_size=world)
    if phase == "save" and how.startswith("requeue"):  # two checkpoints: the newest has one to fall back on
        for step in (1, 2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            mgr.save(step, state)
        if rank == 0:
            torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, f"{root}/expected.pt")
    elif phase == "save":
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        mgr.save(1, state)
        if rank == 0 or how == "stages":
            torch.save({"opt": opt.state_dict(), "model": model.state_dict()},
                       f"{root}/expected{rank if how == 'stages' else ''}.pt")
    elif how.endswith("broken"):  # every checkpoint skipped: the fresh optimizer as the script made it
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.load(state) is None
        assert opt.state_dict()["state"] == {}, opt.state_dict()["state"]
        assert all(p.grad is None for p in model.parameters())
        assert [g["lr"] for g in opt.param_groups] == [0.1]
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        print("as built", rank, flush=True)
    elif how.endswith("removed"):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            mgr.load(state)
        except Exception as exc:
            print(f"refused {rank}: {type(exc).__name__}: {exc}", flush=True)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert opt.state_dict()["state"] == {}
    else:
        assert mgr.load(state) == (2 if how == "requeue" else 1)
        expected = torch.load(f"{root}/expected{rank if how == 'stages' else ''}.pt")
        got = opt.state_dict()
        assert sorted(got["state"]) == sorted(expected["opt"]["state"]), sorted(got["state"])
        assert how == "stages" or sorted(got["state"]) == [0, 1], sorted(got["state"])
        for pid, moments in expected["opt"]["state"].items():
            for name, value in moments.items():
                assert torch.equal(got["state"][pid][name], value), (pid, name)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())
        if how == "frozen":  # unfrozen now: its first step makes its moments, as for a new parameter
            model.aux(torch.randn(3, 4)).sum().backward()
            opt.step()
            assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]
        print("exact", rank, flush=True)
    dist.destroy_process_group()  # with the manager still held, as a user's script ends
""")


def _ranks(root: Path, world: int, phase: str, how: str, *extra: str) -> list[str]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(root), phase, how, *extra],
                              env=env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = collect(procs, 120)
    for r, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"{phase} on {world} ranks: rank {r} exited {p.returncode}:\n{text}"
    return outs


@pytest.mark.parametrize("how", ["unused", "frozen"])
@pytest.mark.parametrize("load_world", [2, 1])
def test_a_parameter_without_moments_does_not_stop_the_resume(tmp_path: Path, how: str, load_world: int) -> None:
    _ranks(tmp_path, 2, "save", how)
    assert (tmp_path / "step-00000001" / "dcp").is_dir()
    outs = _ranks(tmp_path, load_world, "load", how)
    assert all(f"exact {r}" in out for r, out in enumerate(outs))


@pytest.mark.parametrize("load_world", [2, 1])
def test_a_layer_removed_since_a_dcp_checkpoint_is_refused_not_dropped(tmp_path: Path, load_world: int) -> None:
    """DCP reads only what the live state asks for: a layer the model no longer has was
    dropped unseen. Refused now on every rank, naming it, as a one-process checkpoint's load
    refuses it, and the state stays as built."""
    _ranks(tmp_path, 2, "save", "removed")
    outs = _ranks(tmp_path, load_world, "load", "removed")
    for rank, out in enumerate(outs):
        said = next((line for line in out.splitlines() if line.startswith(f"refused {rank}: ")), out)
        assert "CheckpointError" in said and "step-00000001/dcp" in said, said
        assert "state['model']: aux.weight is in the checkpoint, not in the module (removed since?)" in said, said


def test_pipeline_stages_each_holding_part_of_the_model_resume(tmp_path: Path) -> None:
    """Each rank's module holds only its own stage: the checkpoint holds keys that a rank's
    module has not (another rank's stage), which is no layer removed; the resume is exact."""
    _ranks(tmp_path, 2, "save", "stages")
    outs = _ranks(tmp_path, 2, "load", "stages")
    assert all(f"exact {r}" in out for r, out in enumerate(outs))


@pytest.mark.parametrize("verify", ["verify", "noverify"])
def test_a_layer_removed_from_every_pipeline_stage_is_refused_not_the_other_stages(tmp_path: Path, verify: str) -> None:
    """Each rank's module holds its own stage, and the head every stage had is gone: each
    rank finds the other stages' layers and the head missing from its module, and only what
    no rank holds (the head) is refused, named on every rank; the state stays as built. With
    checksums the ranks agree on it entry by entry (the same checked ``.metadata``), without
    by gathering what each found."""
    _ranks(tmp_path, 2, "save", "stages-removed")
    outs = _ranks(tmp_path, 2, "load", "stages-removed", verify)
    for rank, out in enumerate(outs):
        said = next((line for line in out.splitlines() if line.startswith(f"refused {rank}: ")), out)
        assert "CheckpointError" in said and "step-00000001/dcp" in said, said
        assert "state['model']: aux.weight is in the checkpoint, not in the module (removed since?)" in said, said
        assert "aux.bias" in said and "stage" not in said, said


def test_a_requeued_jobs_fresh_optimizer_resumes_exactly_and_is_left_as_built_when_nothing_loads(tmp_path: Path) -> None:
    """A requeued job's optimizer has no state: its moments are made on a thread while the
    load finds and starts reading the newest checkpoint (it has an older one). The resume is
    exact; where every checkpoint is then skipped (each rank's state file corrupt, found as it
    is read), the optimizer is left as the script made it: no state, no gradients, its
    learning rate."""
    _ranks(tmp_path, 2, "save", "requeue")
    outs = _ranks(tmp_path, 2, "load", "requeue")
    assert all(f"exact {r}" in out for r, out in enumerate(outs))
    for step in (1, 2):
        for rank in range(2):
            path = tmp_path / f"step-{step:08d}" / f"rank-{rank:05d}.pt"
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    outs = _ranks(tmp_path, 2, "load", "requeue-broken")
    assert all(f"as built {r}" in out for r, out in enumerate(outs)), outs


_OPTIMIZERS = [("Adam", {}), ("AdamW", {"amsgrad": True}), ("SGD", {"momentum": 0.9}), ("SGD", {}),
               ("RMSprop", {"momentum": 0.5, "centered": True}), ("NAdam", {}), ("ASGD", {}), ("Adafactor", {}),
               ("Adam", {"foreach": True})]


@pytest.mark.parametrize(("name", "settings"), _OPTIMIZERS, ids=[f"{n}{s or ''}" for n, s in _OPTIMIZERS])
def test_a_fresh_optimizers_state_is_laid_out_as_dcps_own_step_makes_it_without_stepping_it(
        name: str, settings: dict) -> None:
    """A requeued job's optimizer has no state; DCP's ``get_optimizer_state_dict`` makes it by
    stepping it over every parameter. ``fresh_state`` lays out the same state (keys, shapes,
    strides, dtypes, devices, plain values) from one step of a copy over a stand-in per kind
    of parameter: the live parameters, their gradients and the optimizer's own step hooks
    are not touched. An optimizer that makes state in its constructor (Adagrad) is left to DCP."""
    import torch
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from ftkit.checkpoint.dcp import fresh_state

    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{name}")

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        model[1].weight.requires_grad_(False)  # frozen: no state
        groups = [{"params": [model[0].weight, model[2].weight]},
                  {"params": [model[0].bias, model[1].weight, model[1].bias, model[2].bias], "weight_decay": 0.0}]
        return model, cls(groups, lr=0.1, **settings)

    (_, theirs), (model, mine) = build(), build()
    before = [p.detach().clone() for p in model.parameters()]
    steps = []
    mine.register_step_pre_hook(lambda *_: steps.append(1))
    _init_optim_state(theirs)
    assert fresh_state(mine)
    assert not steps
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert [g["lr"] for g in mine.param_groups] == [0.1, 0.1]
    pairs = zip((p for g in theirs.param_groups for p in g["params"]),
                (p for g in mine.param_groups for p in g["params"]), strict=True)
    for a, b in pairs:
        expected, got = theirs.state.get(a, {}), mine.state.get(b, {})
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                laid = got[key]
                assert (laid.shape, laid.stride(), laid.dtype, laid.device) == \
                    (value.shape, value.stride(), value.dtype, value.device), key
                assert laid.data_ptr() not in {p.data_ptr() for p in model.parameters()}
            else:
                assert got[key] == value, key
    assert not mine.state or not fresh_state(mine)  # it has state now: left as it is (SGD without momentum has none)

    class Custom(torch.optim.SGD):  # not torch's: its constructor may do more than keep param groups
        pass

    custom = Custom(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    assert not fresh_state(custom) and not custom.state

    adagrad = torch.optim.Adagrad(torch.nn.Linear(2, 2).parameters())  # state from its constructor
    made = {id(p): dict(s) for p, s in adagrad.state.items()}
    assert not fresh_state(adagrad)
    assert {id(p): dict(s) for p, s in adagrad.state.items()} == made


def test_a_fresh_optimizer_is_left_as_built_when_its_only_checkpoint_turns_out_corrupt_during_the_read(
        tmp_path: Path) -> None:
    """The job's only checkpoint, each rank's modules and optimizers in host memory: read in one
    pass, what it writes over set aside and put back when a file turns out corrupt. A fresh
    optimizer's state is laid out for that read (``fresh_state``), not computed; the run then
    starts fresh (nothing older), and the optimizer is as the script made it: no state (not the
    laid-out memory, nor what the read put there), the parameters as built."""
    _ranks(tmp_path, 2, "save", "only-broken")
    path = tmp_path / "step-00000001" / "dcp" / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    outs = _ranks(tmp_path, 2, "load", "only-broken")
    assert all(f"as built {r}" in out for r, out in enumerate(outs)), outs
