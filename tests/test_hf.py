"""Hugging Face Trainer integration: real signals to real processes, real checkpoint files.

The model is a 2-layer GPT-2 built from a config (nothing downloaded), trained on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import ftkit  # noqa: E402
from ftkit.checkpoint.format.layout import MANIFEST, SENTINEL  # noqa: E402
from ftkit.events import EventLog, read_events  # noqa: E402
from ftkit.integrations._hf_checkpoints import arm, commit, inspect  # noqa: E402
from ftkit.integrations.hf import FtkitCallback, latest_valid_checkpoint, train  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "hf_train.py"

_spec = importlib.util.spec_from_file_location("hf_train_program", PROGRAM)
program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(program)

QUIET = ftkit.Config(
    signals=ftkit.SignalConfig(enabled=False),
    watch=ftkit.WatchConfig(mode="off"),
    budget=ftkit.BudgetConfig(enabled=False),
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTKIT_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), FTKIT_WATCH="off", HF_HUB_OFFLINE="1", **extra)
    return env


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_import_ftkit_stays_free_of_transformers():
    code = ("import sys, ftkit, ftkit.integrations, ftkit.integrations.env; "
            "sys.exit('transformers' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=60)


def test_import_without_transformers_says_what_to_install():
    """Without the hf extra, importing the integration (or running the launcher) names the
    package to install, as a ModuleNotFoundError still."""
    code = ("import sys\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n"
            "    import ftkit.integrations.hf\n"
            "except ModuleNotFoundError as exc:\n"
            "    print(exc)\n"
            "    sys.exit(0 if exc.name == 'transformers' else 3)\n"
            "sys.exit(2)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip install 'ftkit[hf]'" in done.stdout, done.stdout


def test_sigterm_then_resume_in_a_new_process_matches_uninterrupted(tmp_path):
    """SIGTERM at step 5 -> checkpoint-5 sealed, exit; a new process (the launcher, plain
    ``trainer.train()``) resumes and ends bit for bit where an uninterrupted run ends.
    12 steps over 10-step epochs with dropout on: data order and RNG state both must resume."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(PROGRAM), str(out), "--steps", "12", "--pause-at", "5"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reference = program.build_trainer(tmp_path / "reference", 12)
        reference.train()  # plain Trainer, never interrupted (runs while the child starts up)
        expected = _weights(reference)
        wait_for(lambda: (out / "paused").exists() or proc.poll() is not None, timeout=60, what="step 5")
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log
    assert json.loads((out / "result.json").read_text())["completed"] is False
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-5"]
    assert inspect(out / "checkpoint-5", checksums=True).valid
    assert not (out / "checkpoint-5" / SENTINEL).exists()
    events = list(read_events(out / "events.jsonl"))
    assert [(e["event"], e.get("step")) for e in events if e["event"] in ("decision", "save", "exit")] == [
        ("decision", 5), ("save", 5), ("exit", 5)]
    # the CLI finds Trainer's checkpoint-N dirs from the events log (an absolute path, whatever
    # the cwd the job ran in) and says what a resume takes, from another directory too
    assert [e["path"] for e in events if e["event"] == "save"] == [str((out / "checkpoint-5").absolute())]
    status = subprocess.run([sys.executable, "-m", "ftkit", "status", str(out), "--json"], env=_env(),
                            capture_output=True, text=True, timeout=60, cwd=tmp_path.parent)
    assert status.returncode == 0, status.stderr
    said = json.loads(status.stdout)
    assert said["verdict"] == "if the job dies now, it resumes from step 5", said["verdict"]
    assert [(c["step"], c["status"]) for c in said["checkpoints"]] == [(5, "valid")]
    verify = subprocess.run([sys.executable, "-m", "ftkit", "verify", str(out)], env=_env(),
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "all 1 checkpoint(s) valid" in verify.stdout, verify.stdout + verify.stderr

    resumed = subprocess.run([sys.executable, "-m", "ftkit.integrations.hf", str(PROGRAM), str(out),
                              "--steps", "12", "--mode", "launcher"],
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    events = list(read_events(out / "events.jsonl"))
    assert [e.get("path") for e in events if e["event"] == "resume"][-1] == str(out / "checkpoint-5")
    assert f"ftkit resume: step 5 from {out / 'checkpoint-5'}" in resumed.stderr, resumed.stderr
    assert events[-1]["event"] == "exit" and events[-1]["completed"] is True

    got = torch.load(out / "final.pt")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _fake_checkpoint(output_dir: Path, step: int) -> Path:
    path = arm(output_dir / f"checkpoint-{step}")
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    commit(path, step=step)
    return path


def test_latest_valid_checkpoint_skips_broken_ones(tmp_path):
    for step in (1, 2, 3, 4, 5, 6):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-6" / SENTINEL).touch()  # leftover sentinel
    (tmp_path / "checkpoint-5" / MANIFEST).write_text("{garbled")
    with open(tmp_path / "checkpoint-4" / "model.safetensors", "r+b") as f:
        f.truncate(100)  # truncated: size mismatch
    blob = tmp_path / "checkpoint-3" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[10] ^= 0xFF  # same size, one byte flipped: only the checksum sees it
    blob.write_bytes(bytes(data))
    (tmp_path / "checkpoint-7").mkdir()  # never got a manifest
    (tmp_path / "checkpoint-8").symlink_to(tmp_path / "checkpoint-1")  # links are never followed

    events = EventLog(tmp_path / "events.jsonl")
    assert latest_valid_checkpoint(tmp_path, events=events) == str(tmp_path / "checkpoint-2")
    assert latest_valid_checkpoint(tmp_path, checksums=False) == str(tmp_path / "checkpoint-3")
    skipped = {e["step"]: e["reason"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "skip"}
    assert sorted(skipped) == [3, 4, 5, 6, 7]
    assert SENTINEL in skipped[6] and "JSON" in skipped[5] and "size" in skipped[4]
    assert "checksum" in skipped[3] and "manifest" in skipped[7]
    assert latest_valid_checkpoint(tmp_path / "missing") is None


def test_retention_keeps_the_newest_and_trainers_best_model_checkpoint(tmp_path):
    """keep_last=2 over six valid checkpoints: 5 and 6 stay, and so does the best model's (2),
    given as Trainer names it (a path, here through a symlink); the rest go, with events."""
    from ftkit.integrations._hf_checkpoints import retain

    for step in range(1, 7):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "best").symlink_to(tmp_path / "checkpoint-2")
    events = EventLog(tmp_path / "events.jsonl")
    deleted = retain(tmp_path, keep_last=2, protect=[str(tmp_path / "best")], events=events)
    assert sorted(p.name for p in deleted) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5", "checkpoint-6"]
    assert sorted(e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "delete") == [1, 3, 4]


def test_resume_skips_a_corrupted_newer_checkpoint(tmp_path):
    """Real Trainer: periodic saves at 3 and 6, checkpoint-6's weights truncated; the next
    run resumes from checkpoint-3, logs why, and ftkit's retention keeps the newest two."""
    out = tmp_path / "run"
    config = ftkit.Config(signals=QUIET.signals, watch=QUIET.watch, budget=QUIET.budget, save_every=3,
                          checkpoint=ftkit.CheckpointConfig(root=tmp_path / "unused", keep_last=2))
    first = train(program.build_trainer(out, 6), config=config)
    assert first.completed and first.resumed_from is None
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    weights = out / "checkpoint-6" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)

    second = train(program.build_trainer(out, 9), config=config)
    assert second.completed and second.resumed_from == str(out / "checkpoint-3")
    events = list(read_events(out / "events.jsonl"))
    assert any(e["event"] == "skip" and e["step"] == 6 and "size" in e["reason"] for e in events)
    # saves at 6 (re-done, sealed again) and 9; retention deleted 3, the oldest valid one
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-9"]
    assert all(inspect(p, checksums=True).valid for p in out.glob("checkpoint-*"))


def test_save_switch_saves_keeps_training_and_is_removed(tmp_path):
    out = tmp_path / "run"
    ft = ftkit.FaultTolerance(out, config=ftkit.Config(
        signals=QUIET.signals, budget=QUIET.budget, watch=ftkit.WatchConfig(mode="polling", poll_interval=0.02)))

    class TouchAt2(program.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                ft.job.save_switch.touch()
                wait_for(lambda: ft.box.pending, timeout=10, what="the save-switch to be seen")

    trainer = program.build_trainer(out, 4, [TouchAt2()])
    with ft:
        callback = FtkitCallback(ft).attach(trainer)
        trainer.train()
        callback.detach(trainer)
    assert callback.completed and callback.decision is None
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    assert inspect(out / "checkpoint-2", checksums=True).valid
    assert not ft.job.save_switch.exists()
    assert any(e["event"] == "switch-removed" for e in read_events(out / "events.jsonl"))


def test_kill_switch_present_at_start_trains_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "kill-switch").touch()
    trainer = program.build_trainer(out, 4)
    before = _weights(trainer)
    run = train(trainer, config=QUIET)
    assert run.stopped and not run.completed and run.output is None
    assert trainer.state.global_step == 0 and not list(out.glob("checkpoint-*"))
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())


def test_a_sigterm_at_max_steps_completes_the_run_and_its_ending_runs(tmp_path):
    """SIGTERM decided at step 5 of 5 (the launcher): the checkpoint is sealed, and the run is
    complete, not stopped: the script's own ending runs (final.pt) and nothing asks for a requeue
    that would train nothing (Trainer resumed at max_steps trains one step more)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ftkit.integrations.hf", str(PROGRAM), str(out), "--steps", "5",
                             "--pause-at", "5", "--mode", "launcher"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (out / "paused").exists() or proc.poll() is not None, timeout=60, what="step 5")
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log
    assert (out / "final.pt").exists(), log  # SystemExit(0) of a stopped run would have skipped it
    assert inspect(out / "checkpoint-5", checksums=True).valid
    exit_ = [e for e in read_events(out / "events.jsonl") if e["event"] == "exit"][-1]
    assert exit_["completed"] is True and exit_["step"] == 5, exit_
    requeue = subprocess.run([sys.executable, "-m", "ftkit", "requeue", "--dry-run", str(out),
                              "--exit-code", "0"], env=_env(), capture_output=True, text=True, timeout=60)
    assert "completed" in requeue.stdout + requeue.stderr, requeue.stdout + requeue.stderr


def test_trainer_checkpoints_from_before_ftkit_are_resumed_and_never_deleted(tmp_path):
    """A user adds ftkit to a run whose output dir holds Trainer's own checkpoints (no sentinel,
    no manifest): the next run resumes from the newest of them, not from scratch, and ends bit
    for bit where an uninterrupted run ends; retention (keep_last=1) deletes none of them, and
    the CLI lists them as unsealed, not as saves that never finished."""
    out = tmp_path / "run"

    class StopAt6(program.TrainerCallback):  # the job that ended (a time limit) before ftkit was added
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 6

    before = program.build_trainer(out, 9, [StopAt6()], save_strategy="steps", save_steps=3)
    before.train()  # plain Trainer, no ftkit: checkpoint-3 and checkpoint-6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert inspect(out / "checkpoint-6").status == "unsealed"
    reference = program.build_trainer(tmp_path / "reference", 9)
    reference.train()

    config = ftkit.Config(signals=QUIET.signals, watch=QUIET.watch, budget=QUIET.budget, save_every=9,
                          checkpoint=ftkit.CheckpointConfig(root=tmp_path / "unused", keep_last=1))
    trainer = program.build_trainer(out, 9)
    run = train(trainer, config=config)
    assert run.completed and run.resumed_from == str(out / "checkpoint-6")
    for name, tensor in _weights(reference).items():
        assert torch.equal(_weights(trainer)[name], tensor), name
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    assert inspect(out / "checkpoint-9", checksums=True).valid
    status = subprocess.run([sys.executable, "-m", "ftkit", "status", str(out), "--json"], env=_env(),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert [(c["step"], c["status"]) for c in json.loads(status.stdout)["checkpoints"]] == [
        (9, "valid"), (6, "unsealed"), (3, "unsealed")]
    verify = subprocess.run([sys.executable, "-m", "ftkit", "verify", str(out)], env=_env(),
                            capture_output=True, text=True, timeout=60)
    said = " ".join((verify.stdout + verify.stderr).split())
    assert verify.returncode == 0 and "all 1 checkpoint(s) valid; 2 unsealed" in said, said


def test_a_crashed_saves_leftovers_are_not_sealed_into_the_next_save(tmp_path):
    """checkpoint-4 as a save killed during it leaves it (ftkit's sentinel, a half-written temp
    file): the next run deletes it before training, so its save of step 4 seals only what
    Trainer wrote then."""
    out = tmp_path / "run"
    crashed = arm(out / "checkpoint-4")
    (crashed / ".tmpWBLnZe").write_bytes(b"\0" * 4096)  # what a kill -9 during a write leaves
    config = ftkit.Config(signals=QUIET.signals, watch=QUIET.watch, budget=QUIET.budget, save_every=4)
    run = train(program.build_trainer(out, 4), config=config)
    assert run.completed and run.resumed_from is None
    info = inspect(out / "checkpoint-4", checksums=True)
    assert info.valid and ".tmpWBLnZe" not in info.files and not (out / "checkpoint-4" / ".tmpWBLnZe").exists()
    deletes = [e for e in read_events(out / "events.jsonl") if e["event"] == "delete"]
    assert [(e["step"], e["status"]) for e in deletes] == [(4, "incomplete")], deletes


def test_the_cli_finds_trainers_checkpoints_before_a_runs_first_save_and_in_a_copied_job_dir(tmp_path):
    """A run that found the kill-switch at start saved nothing, yet `ftkit verify` checks the
    output dir's checkpoint-N (its start event names it); a copy of the job dir is verified
    as the copy, not as the directory its events log names."""
    out = tmp_path / "run"
    config = ftkit.Config(signals=QUIET.signals, watch=QUIET.watch, budget=QUIET.budget, save_every=2)
    assert train(program.build_trainer(out, 4), config=config).completed
    (out / "kill-switch").touch()
    assert train(program.build_trainer(out, 6), config=config).stopped
    verify = subprocess.run([sys.executable, "-m", "ftkit", "verify", str(out)], env=_env(),
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "all 2 checkpoint(s) valid" in verify.stdout, verify.stdout + verify.stderr
    # the requeue helper sees the progress in Trainer's output dir (a crash after progress is
    # not one "with no newer checkpoint")
    from ftkit.slurm.env import SlurmEnv
    from ftkit.slurm.requeue_facts import gather

    assert gather(out, exit_code=1, env=SlurmEnv.from_env({})).end_step == 4
    pin = subprocess.run([sys.executable, "-m", "ftkit", "pin", str(out), "4"], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert pin.returncode == 2 and "which ftkit does not pin" in pin.stderr, pin.stdout + pin.stderr

    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)
    blob = copy / "checkpoint-4" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    verify = subprocess.run([sys.executable, "-m", "ftkit", "verify", str(copy)], env=_env(),
                            capture_output=True, text=True, timeout=60)
    said = verify.stdout + verify.stderr
    assert verify.returncode == ftkit.CheckpointError.exit_code and str(copy) in said and "not valid" in said, said


def test_launcher_settings_and_mistakes_a_user_makes(tmp_path):
    """FTKIT_KEEP_LAST without FTKIT_JOBDIR under the launcher (the job dir is the output dir);
    train(resume_from_checkpoint=...) and a second FtkitCallback are refused before anything
    starts, saying what to do instead."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "ftkit.integrations.hf", str(PROGRAM), str(out), "--steps", "2",
                           "--mode", "launcher"], env=_env(FTKIT_KEEP_LAST="1", FTKIT_SAVE_EVERY="1"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]

    trainer = program.build_trainer(tmp_path / "other", 2)
    with pytest.raises(TypeError, match="pass resume="):
        train(trainer, config=QUIET, resume_from_checkpoint=True)
    trainer.add_callback(FtkitCallback())
    with pytest.raises(ftkit.ConfigError, match="already has an FtkitCallback"):
        train(trainer, config=QUIET)
    assert not (tmp_path / "other" / "events.jsonl").exists()
