"""A tiny GPT-2 trained by ``transformers.Trainer`` under ftkit; used by tests/test_hf.py.

    python hf_train.py OUTDIR --steps N [--pause-at K] [--mode train|launcher]

Builds the model from a config (nothing downloaded), trains on fixed random tokens with
dropout on, and on completion writes OUTDIR/final.pt (the weights) and OUTDIR/result.json.
``--pause-at K`` holds at step K (before ftkit's check) until SIGTERM arrives, writing
OUTDIR/paused first, so the test's signal lands at a known step. ``--mode launcher`` calls
plain ``trainer.train()`` (run it under ``python -m ftkit.integrations.hf``).
"""

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no tqdm bars (nor tqdm's monitor thread) while saving

_TERM: list[int] = []  # signal numbers read from the wakeup fd
_WAKE_R = -1


def _wakeup_pipe() -> int:
    global _WAKE_R
    _WAKE_R, w = os.pipe()
    os.set_blocking(w, False)
    return w


class PauseAt(TrainerCallback):
    """At step K, wait for SIGTERM. ftkit owns SIGTERM (it does not chain to a handler of ours),
    so the signal is seen through the wakeup fd, which the interpreter writes every signal's
    number to before any Python handler runs; ftkit's handler has posted once it is read."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        (self.out / "paused").write_text(str(state.global_step))
        deadline = time.monotonic() + 30
        while signal.SIGTERM not in _TERM and (left := deadline - time.monotonic()) > 0:
            if select.select([_WAKE_R], [], [], left)[0]:
                _TERM.extend(os.read(_WAKE_R, 64))


def build_trainer(out: Path, steps: int, callbacks=(), **overrides) -> Trainer:
    """The same model, data and arguments in every process: seeded, CPU, no workers."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (40, 16), generator=g)  # 40 samples / batch 4 = 10 steps an epoch
    data = [{"input_ids": t, "labels": t} for t in tokens]
    kw = dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="no", logging_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    kw.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**kw), train_dataset=data, callbacks=list(callbacks))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pause-at", type=int)
    ap.add_argument("--mode", choices=("train", "launcher"), default="train")
    a = ap.parse_args()

    wake_w = _wakeup_pipe()
    signal.set_wakeup_fd(wake_w)
    trainer = build_trainer(a.out, a.steps, [PauseAt(a.pause_at, a.out)] if a.pause_at else [])
    model = trainer.model

    if a.mode == "launcher":
        trainer.train()  # patched by python -m ftkit.integrations.hf; SystemExit(0) when stopped
        result = {"completed": True}
    else:
        from ftkit.integrations.hf import train

        run = train(trainer)
        result = {
            "completed": run.completed,
            "resumed_from": run.resumed_from,
            "step": trainer.state.global_step,
            "requeue": None if run.decision is None else run.decision.requeue,
        }
    if result["completed"]:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, a.out / "final.pt")
    (a.out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
