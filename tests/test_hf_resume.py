"""Hugging Face Trainer: what a script hands to ``resume_from_checkpoint`` and what the CLI
reads back, on the paths that do not go through ``train()``'s own choice.

The model is tests/programs/hf_train.py's 2-layer GPT-2 (nothing downloaded), trained on CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import ftkit  # noqa: E402
from ftkit.checkpoint.format.layout import SENTINEL  # noqa: E402
from ftkit.events import EventLog, read_events  # noqa: E402
from ftkit.integrations._hf_checkpoints import arm, checked_resume, commit, inspect  # noqa: E402
from ftkit.integrations.hf import FtkitCallback, latest_valid_checkpoint, train  # noqa: E402
from tests.test_hf import QUIET, _env, _weights, program  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _config(save_every=None) -> ftkit.Config:
    return ftkit.Config(signals=QUIET.signals, watch=QUIET.watch, budget=QUIET.budget, save_every=save_every)


class _StopAt(program.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = control.should_training_stop or state.global_step == self.step


def _first_run(out: Path, steps: int, stop: int) -> None:
    """A run of ``steps`` steps (its learning-rate schedule) that ends after step ``stop``,
    sealed checkpoint-``stop`` saved (a time limit, say)."""
    train(program.build_trainer(out, steps, [_StopAt(stop)]), config=_config(save_every=stop))
    assert inspect(out / f"checkpoint-{stop}", checksums=True).valid


def _crashed_save(out: Path, step: int, like: Path) -> Path:
    """What a save killed halfway leaves: ftkit's sentinel, the weights written, a truncated
    optimizer.pt, no trainer_state.json (Trainer writes it last)."""
    crashed = arm(out / f"checkpoint-{step}")
    shutil.copy(like / "model.safetensors", crashed / "model.safetensors")
    data = (like / "optimizer.pt").read_bytes()
    (crashed / "optimizer.pt").write_bytes(data[: len(data) // 3])
    return crashed


def _fake(output_dir: Path, step: int, *, seal: bool = True) -> Path:
    path = output_dir / f"checkpoint-{step}"
    if seal:
        arm(path)
    else:
        path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if seal:
        commit(path, step=step)
    return path


def test_checked_resume_uses_a_path_as_given_unless_ftkit_knows_it_is_broken(tmp_path):
    out = tmp_path / "run"
    events = EventLog(tmp_path / "events.jsonl")
    valid = _fake(out, 2)
    unsealed = _fake(out, 3, seal=False)  # Trainer's own, written without ftkit
    assert checked_resume(valid, out, events=events) == str(valid)
    assert checked_resume(unsealed, out, events=events) == str(unsealed)
    assert checked_resume(out / "checkpoint-99", out) == str(out / "checkpoint-99")  # Trainer's error says so
    crashed = arm(out / "checkpoint-4")  # a save that never finished
    assert checked_resume(crashed, out, events=events) == str(unsealed)  # the newest a resume=True takes
    corrupt = _fake(out, 5)
    (corrupt / "model.safetensors").write_bytes(b"short")
    assert checked_resume(str(corrupt), str(out), events=events) == str(unsealed)
    skips = [(e["step"], e["status"]) for e in read_events(tmp_path / "events.jsonl") if e["event"] == "skip"]
    assert (4, "incomplete") in skips and (5, "corrupt") in skips

    # nothing valid in the output dir: start fresh, as resume=True would
    empty = tmp_path / "empty"
    assert checked_resume(arm(empty / "checkpoint-1"), empty) is None
    # a broken checkpoint outside the output dir: nothing to fall back to that the script asked for
    other = arm(tmp_path / "pretrain" / "checkpoint-7")
    with pytest.raises(ftkit.CheckpointError, match=r"checkpoint-7 is not a checkpoint to resume from.*ftkit verify"):
        checked_resume(other, out)


SCRIPT = """\
    # HF's run_clm.py resume idiom, in an unchanged script run under the launcher
    import importlib.util, os, sys
    import torch
    from transformers.trainer_utils import get_last_checkpoint
    spec = importlib.util.spec_from_file_location("hf_train_program", {program!r})
    program = importlib.util.module_from_spec(spec); spec.loader.exec_module(program)
    out, steps = sys.argv[1], int(sys.argv[2])
    last_checkpoint = get_last_checkpoint(out) if os.path.isdir(out) else None
    print("get_last_checkpoint:", last_checkpoint, flush=True)
    trainer = program.build_trainer(out, steps)
    trainer.train(resume_from_checkpoint=last_checkpoint)
    torch.save(trainer.model.state_dict(), os.path.join(out, "final.pt"))
"""


def test_launcher_with_get_last_checkpoint_never_loads_a_crashed_save(tmp_path):
    """checkpoint-6's save was killed halfway (sentinel, truncated optimizer.pt): the script's
    get_last_checkpoint names it, the launcher resumes from checkpoint-3 instead with a warning
    naming checkpoint-6 and why, deletes the leftover before Trainer looks, saves step 6 anew,
    and ends bit for bit where an uninterrupted run ends."""
    out = tmp_path / "run"
    _first_run(out, 6, 3)
    _crashed_save(out, 6, like=out / "checkpoint-3")
    script = tmp_path / "clm_like.py"
    script.write_text(textwrap.dedent(SCRIPT.format(program=str(ROOT / "tests" / "programs" / "hf_train.py"))))
    reference = program.build_trainer(tmp_path / "reference", 6)
    reference.train()

    done = subprocess.run([sys.executable, "-m", "ftkit.integrations.hf", str(script), str(out), "6"],
                          env=_env(FTKIT_SAVE_EVERY="3"), capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert f"get_last_checkpoint: {out / 'checkpoint-6'}" in said, said
    assert f"resume_from_checkpoint={out / 'checkpoint-6'} is not a checkpoint to resume from (incomplete" in said
    assert f"resuming from {out / 'checkpoint-3'} instead" in said, said
    assert f"ftkit resume: step 3 from {out / 'checkpoint-3'}" in said, said
    events = list(read_events(out / "events.jsonl"))
    assert [e.get("path") for e in events if e["event"] == "resume"][-1] == str(out / "checkpoint-3")
    assert any(e["event"] == "skip" and e["step"] == 6 for e in events)
    assert [(e["step"], e["status"]) for e in events if e["event"] == "delete"] == [(6, "incomplete")]
    assert inspect(out / "checkpoint-6", checksums=True).valid  # saved again by this run
    got = torch.load(out / "final.pt")
    for name, tensor in _weights(reference).items():
        assert torch.equal(got[name], tensor), name


def test_callbacks_list_resume_true_and_a_crashed_path_resume_from_the_newest_valid(tmp_path):
    """Trainer(callbacks=[FtkitCallback()]) without the launcher: resume_from_checkpoint=True
    (Trainer's own pick would be the crashed checkpoint-6) and the crashed path itself both
    resume from checkpoint-3; the crashed directory is deleted before Trainer looks."""
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "run"
    _first_run(out, 5, 3)
    reference = program.build_trainer(tmp_path / "reference", 5)
    reference.train()
    for resume in (True, "crashed path"):
        crashed = _crashed_save(out, 6, like=out / "checkpoint-3")
        assert get_last_checkpoint(str(out)) == str(crashed)
        trainer = program.build_trainer(out, 5, [FtkitCallback(config=_config())])
        trainer.train(resume_from_checkpoint=True if resume is True else get_last_checkpoint(str(out)))
        assert trainer.state.global_step == 5
        assert not crashed.exists(), resume
        for name, tensor in _weights(reference).items():
            assert torch.equal(_weights(trainer)[name], tensor), (resume, name)
        resumes = [e for e in read_events(out / "events.jsonl") if e["event"] == "resume"]
        assert resumes[-1]["step"] == 3 and resumes[-1]["path"] == str(out / "checkpoint-3"), resumes[-1]
        exit_ = [e for e in read_events(out / "events.jsonl") if e["event"] == "exit"][-1]
        assert exit_["completed"] is True, exit_


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftkit", *args], env=_env(), capture_output=True, text=True,
                          timeout=60)


def test_the_callback_on_its_own_records_where_trainers_checkpoints_are(tmp_path):
    """The documented "callback on its own" path, the job dir apart from the output dir: the
    FaultTolerance starts before the callback sees the Trainer (its start event names
    JOBDIR/checkpoints), yet after a run that made no save the CLI finds output_dir's valid
    checkpoint-4, and `ftkit report` says the run resumed from step 4."""
    job, out = tmp_path / "job", tmp_path / "run"

    def run(steps: int, save_every: int | None) -> None:
        trainer = program.build_trainer(out, steps)
        args = trainer.args
        with ftkit.FaultTolerance(job, config=_config(save_every)) as ft:  # the docs' snippet
            FtkitCallback(ft).attach(trainer)
            trainer.train(resume_from_checkpoint=latest_valid_checkpoint(args.output_dir, events=ft.events))

    run(4, save_every=4)
    run(6, save_every=None)  # resumes from checkpoint-4, saves nothing
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]

    status = _cli("status", str(job), "--json")
    assert status.returncode == 0, status.stderr
    said = json.loads(status.stdout)
    assert said["verdict"] == "if the job dies now, it resumes from step 4", said["verdict"]
    assert [(c["step"], c["status"]) for c in said["checkpoints"]] == [(4, "valid")]
    verify = _cli("verify", str(job))
    assert verify.returncode == 0 and "all 1 checkpoint(s) valid" in verify.stdout, verify.stdout + verify.stderr
    listed = _cli("ls", str(job))
    assert listed.returncode == 0 and str(out) in listed.stdout and "valid" in listed.stdout, listed.stdout
    report = _cli("report", str(job), "--json")
    assert report.returncode == 0, report.stderr
    runs = json.loads(report.stdout)["runs"]
    assert [r["resumed_from"] for r in runs] == [None, 4], runs
    assert runs[1]["resumed"] is True
    resume = [e for e in read_events(job / "events.jsonl") if e["event"] == "resume"][-1]
    assert resume["checkpoint_root"] == str(out.absolute()) and resume["seconds"] > 0, resume
    assert not os.path.lexists(out / "checkpoint-4" / SENTINEL)

    # a fresh run on that path that saves nothing: its resume event names the output dir all the same
    job2, out2 = tmp_path / "job2", tmp_path / "run2"
    trainer = program.build_trainer(out2, 2)
    with ftkit.FaultTolerance(job2, config=_config(None)) as ft:
        FtkitCallback(ft).attach(trainer)
        trainer.train(resume_from_checkpoint=latest_valid_checkpoint(trainer.args.output_dir, events=ft.events))
    status = _cli("status", str(job2), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["checkpoint_root"]["path"] == str(out2.absolute()), status.stdout
