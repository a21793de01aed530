"""What users put in their state beside a model and an optimizer, and what a resume makes of it:
values no save could write, tensors the script holds references to (in a tuple, a list, alone),
a tensor whose shape or dtype the script changed, a scheduler that moves the momentum."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from ftkit.errors import CheckpointError, ConfigError
from ftkit.events import EventLog, read_events
from tests.ckpt_helpers import collect, env, free_port, make_mgr


@pytest.mark.parametrize("value", ["torch-generator", "numpy-generator", "dataclass"])
def test_a_value_no_save_could_write_is_refused_before_the_first_step(tmp_path, value):
    """A ``torch.Generator`` (or numpy's, or a dataclass) put in the state as it is: every save
    would fail, so the run refuses it at its start, naming the key, before a step is trained
    (not at its first save, with the steps since lost; nor with warnings while it trains on)."""
    import numpy as np

    import ftkit

    if value == "torch-generator":
        odd = torch.Generator()
    elif value == "numpy-generator":
        odd = np.random.default_rng(0)
    else:
        from dataclasses import dataclass

        @dataclass
        class Position:
            epoch: int = 0

        odd = Position()
    model = torch.nn.Linear(2, 2)
    trained = []
    with pytest.raises(ConfigError, match=r"cannot checkpoint state\['extra'\]\['gen'\]: a .* is neither") as err, \
            ftkit.FaultTolerance(tmp_path / "job", state={"model": model, "extra": {"gen": odd}},
                                 config=ftkit.Config(save_every=1)) as ft:
        for step in ft.range(5):
            trained.append(step)
    assert trained == []
    assert ("get_state()" in str(err.value)) == (value == "torch-generator")
    assert not list((tmp_path / "job" / "checkpoints").glob("step-*"))


def test_a_save_of_a_value_that_cannot_be_written_raises_at_once_with_its_event(tmp_path):
    """A value added to the state after the run's start (so past the start's check): the save
    raises a ConfigError at once, with its ``save-failed`` event, not a warning the loop trains
    on past."""
    import ftkit

    state = {"model": torch.nn.Linear(2, 2)}
    steps = []
    with pytest.raises(ConfigError, match=r"cannot checkpoint state\['late'\]"), \
            ftkit.FaultTolerance(tmp_path / "job", state=state, config=ftkit.Config(save_every=3)) as ft:
        for step in ft.range(10):
            steps.append(step)
            state["late"] = torch.Generator()
    assert steps == [0, 1, 2]
    failed = [e for e in read_events(tmp_path / "job" / "events.jsonl") if e["event"] == "save-failed"]
    assert [e["step"] for e in failed] == [3] and "ConfigError: cannot checkpoint" in failed[0]["error"]


def _script_state():
    """A model and tensors the script updates in place through its own references."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ema_w, ema_b, stats = torch.zeros(1, 3), torch.zeros(1), torch.zeros(4)
    return model, ema_w, ema_b, stats


def test_tensors_in_a_tuple_are_restored_into_the_scripts_own(tmp_path):
    """``state['ema'] = (ema_w, ema_b)``, updated in place by the loop: a load copies the saved
    values into those very tensors (as it does in a list), so the loop goes on from them; the
    state keeps the same tuple."""
    model, ema_w, ema_b, _ = _script_state()
    ema_w.fill_(0.25)
    ema_b.fill_(-2.0)
    make_mgr(tmp_path).save(7, {"model": model, "ema": (ema_w, ema_b), "n": (1, "a")})
    _, w2, b2, _ = _script_state()
    pair = (w2, b2)
    state = {"model": torch.nn.Linear(3, 1), "ema": pair, "n": (0, "b")}
    assert make_mgr(tmp_path).load(state) == 7
    assert state["ema"] is pair and torch.equal(w2, torch.full((1, 3), 0.25)) and torch.equal(b2, torch.tensor([-2.0]))
    assert state["n"] == (1, "a")  # plain values in a tuple: the saved ones


def test_a_plain_tensor_whose_shape_changed_refuses_the_checkpoint_and_loads_nothing(tmp_path):
    """The script's running statistics went from 4 to 6 entries: restored, the saved tensor
    would replace the live one in the state while the loop updates its own (from zeros),
    silently. The load refuses it, naming the key and both shapes, before anything of it
    reaches the state (the model keeps its values)."""
    model, _, _, stats = _script_state()
    stats += 3
    make_mgr(tmp_path).save(5, {"model": model, "stats": stats})
    fresh = torch.nn.Linear(3, 1)
    torch.nn.init.zeros_(fresh.weight)
    six = torch.zeros(6)
    with pytest.raises(CheckpointError, match=r"state\['stats'\] is \[4\] float32 in the checkpoint, "
                                              r"\[6\] float32 in the state .*Nothing of the checkpoint was loaded"):
        make_mgr(tmp_path).load({"model": fresh, "stats": six})
    assert torch.count_nonzero(fresh.weight) == 0 and torch.count_nonzero(six) == 0


def test_a_plain_tensor_whose_dtype_changed_is_converted_in_place_and_an_empty_one_replaced(tmp_path):
    """Only the dtype changed (float32 saved, float64 live): the values are copied into the
    live tensor with a conversion, as a module's parameter takes them. An empty live tensor is
    a placeholder for what the checkpoint holds: the saved one takes its place."""
    model, _, _, stats = _script_state()
    stats += torch.arange(4.0)
    make_mgr(tmp_path).save(5, {"model": model, "stats": stats, "history": torch.arange(3.0)})
    wide = torch.zeros(4, dtype=torch.float64)
    state = {"model": torch.nn.Linear(3, 1), "stats": wide, "history": torch.empty(0)}
    assert make_mgr(tmp_path).load(state) == 5
    assert state["stats"] is wide and wide.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert state["history"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_a_scheduler_that_cycles_the_momentum_is_not_said_to_replace_settings(tmp_path, caplog, scheduler):
    """OneCycleLR and CyclicLR (``cycle_momentum``) set ``betas``/``momentum`` at every step, as
    schedulers set the learning rate: a resume that gets the saved ones back replaced nothing
    of the script's. A setting the script did change (``weight_decay``) is still named."""
    def build(wd: float):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        if scheduler == "OneCycleLR":
            opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=wd)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=wd)
            sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=5)
        return {"model": model, "optimizer": opt, "scheduler": sched}

    state = build(0.0)
    for _ in range(4):
        state["model"](torch.randn(2, 3)).sum().backward()
        state["optimizer"].step()
        state["scheduler"].step()
    make_mgr(tmp_path / "ck").save(4, state)
    key = "betas" if scheduler == "OneCycleLR" else "momentum"
    for wd in (0.0, 0.1):
        caplog.clear()
        events = EventLog(tmp_path / f"events-{wd}.jsonl")
        with caplog.at_level(logging.WARNING, logger="ftkit"):
            assert make_mgr(tmp_path / "ck", events=events).load(build(wd)) == 4
        said = [e["settings"] for e in read_events(events.path) if e["event"] == "settings-replaced"]
        if wd == 0.0:
            assert said == [] and not [r for r in caplog.records if "replace the script's" in r.getMessage()]
        else:
            assert said == [["state['optimizer'] param group 0: weight_decay 0.1 -> 0.0"]], said
            assert key not in said[0][0]


def test_a_sampler_refusing_its_saved_position_names_the_key_and_the_checkpoint(tmp_path):
    """The dataset grew from 200 to 210 items: the ResumableSampler refuses the saved position
    (another order's), and the error says which key of the state, which checkpoint, and how to
    go on; the checkpoint is kept."""
    from ftkit.checkpoint import ResumableSampler

    make_mgr(tmp_path).save(3, {"sampler": ResumableSampler(200, seed=3)})
    with pytest.raises(ConfigError) as err:
        make_mgr(tmp_path).load({"sampler": ResumableSampler(210, seed=3)})
    text = str(err.value)
    assert f"checkpoint {tmp_path / 'step-00000003'}: state['sampler']: ResumableSampler" in text
    assert "length=200" in text and "allow_missing" in text
    assert (tmp_path / "step-00000003" / "manifest.json").exists()


_TWO_RANKS = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.errors import CheckpointError
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    mgr = make_manager(CheckpointConfig(root=sys.argv[1]), rank=rank, world_size=2)
    if sys.argv[2] == "save":
        mgr.save(2, {"model": model, "stats": torch.ones(4)})
    else:
        with torch.no_grad():
            model.module.weight.zero_()
        try:
            mgr.load({"model": model, "stats": torch.zeros(6)})
            print("loaded")
        except CheckpointError as exc:
            print("refused", int(torch.count_nonzero(model.module.weight)), exc)
    mgr.close()
    dist.destroy_process_group()
""")


def test_two_ranks_refuse_a_plain_tensor_of_another_shape_before_dcp_sets_anything(tmp_path):
    """The same change on two ranks, with the model in DCP's files: every rank refuses the
    checkpoint, naming the tensor, and the model is left as it was (DCP set nothing)."""
    program = tmp_path / "two.py"
    program.write_text(_TWO_RANKS)
    root = tmp_path / "ck"
    for what in ("save", "load"):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(program), str(root), what], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=env(RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                 for r in range(2)]
        outs = collect(procs, 120)
        assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        last = out.strip().splitlines()[-1]
        assert last.startswith("refused 0 ") and "state['stats'] is [4] float32 in the checkpoint" in last, out
