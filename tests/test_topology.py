"""Resume on another number of ranks, exactly, and never drop state silently (issue 15).

The multi-rank tests run ``tests/programs/topology_train.py`` (DDP or FSDP2 over gloo, Adam,
StepLR, a ResumableSampler, ``ft.range`` with ``save_every=5``) as real processes, one job
directory resumed by runs of different sizes in a chain. Each run dumps hashes of the
canonical model, optimizer, scheduler, sampler, step and RNG state right after resuming and
after its last step (= its last checkpoint); the next run must start from exactly those.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

PROGRAM = Path(__file__).parent / "programs" / "topology_train.py"
REPLICATED = ("step", "model", "optimizer", "param_groups", "scheduler", "sampler", "counter")


def _run(jobdir: Path, world: int, total: int, out: Path, *flags: str, timeout: float = 180) -> list[dict]:
    """One run of ``world`` ranks to step ``total``; every rank's report."""
    from tests.ckpt_helpers import collect, env, free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROGRAM), str(jobdir), "--total", str(total), "--out", str(out), *flags],
            env=env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = collect(procs, timeout)
    for r, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"{world} ranks to step {total}: rank {r} exited {p.returncode}:\n{text}"
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
    for report in reports:
        report["log"] = outs[report["rank"]]
    return reports


def _assert_resumed(before: list[dict], after: list[dict]) -> None:
    """``after`` (W' ranks) starts exactly where ``before`` (W ranks) saved its last checkpoint."""
    saved = before[0]["final"]
    for rep in before[1:]:  # replicated state really was the same on every saving rank
        assert {k: rep["final"][k] for k in REPLICATED} == {k: saved[k] for k in REPLICATED}
    hop = f"{len(before)} -> {len(after)} ranks"
    for rep in after:
        got = rep["resumed"]
        for key in REPLICATED:
            assert got[key] == saved[key], f"{hop}: rank {rep['rank']}'s {key} differs from the saved one"
        if rep["rank"] < len(before):  # its own RNG stream
            assert got["rng"] == before[rep["rank"]]["final"]["rng"], (hop, rep["rank"])
    extra = [rep["resumed"]["rng"] for rep in after if rep["rank"] >= len(before)]
    saved_rngs = {rep["final"]["rng"] for rep in before}
    assert len(set(extra)) == len(extra) and not set(extra) & saved_rngs, f"{hop}: derived RNG streams {extra}"
    for rep in after:  # training went on
        assert rep["losses"] and all(math.isfinite(v) for v in rep["losses"]), rep["losses"]
        assert rep["final"]["step"] == rep["resumed"]["step"] + len(rep["losses"])
    rule = [rep for rep in after if "was saved by" in rep["log"]]
    assert [rep["rank"] for rep in rule] == [0], f"{hop}: the rule is logged once, by rank 0"
    # the job's log says where it went on from, at Python's default logging (warnings), once
    said = [rep["rank"] for rep in after if f"ftkit resume: step {saved['step']} from " in rep["log"]]
    assert said == [0] and f"written by {len(before)} rank(s)" in after[0]["log"], (hop, after[0]["log"])
    assert all("is not in the checkpoint" not in rep["log"] for rep in after)


def _chain(tmp_path: Path, runs: list[tuple[int, int]], *flags: str, jobdir: Path | None = None) -> list[list[dict]]:
    jobdir = jobdir or tmp_path / "job"
    reports = []
    for i, (world, total) in enumerate(runs):
        reports.append(_run(jobdir, world, total, tmp_path / f"run{i}-{world}", *flags))
        if i:
            _assert_resumed(reports[-2], reports[-1])
        else:  # a fresh job dir: said as plainly
            said = [rep["rank"] for rep in reports[-1] if "ftkit resume: no valid checkpoint in " in rep["log"]]
            assert said == [0], reports[-1][0]["log"]
    return reports


def _assert_epochs_covered(reports: list[list[dict]], length: int) -> list[int]:
    """Every epoch the chain finished: each index once, but for the padding of its last stretch."""
    by_epoch: dict[int, list[tuple[int, list[int]]]] = {}
    for run in reports:
        for rep in run:
            for epoch, idx in rep["indices"].items():
                by_epoch.setdefault(int(epoch), []).append((len(run), idx))
    last = max(int(e) for rep in reports[-1] for e in rep["indices"])
    done = []
    for epoch, parts in sorted(by_epoch.items()):
        if epoch >= last:
            continue
        seen = Counter(i for _, idx in parts for i in idx)
        assert sorted(seen) == list(range(length)), f"epoch {epoch}: indices skipped"
        assert sum(seen.values()) == length, f"epoch {epoch}: indices seen twice {[i for i, n in seen.items() if n > 1]}"
        done.append(epoch)
    return done


def _events(jobdir: Path, name: str) -> list[dict]:
    from ftkit.events import read_events

    return [e for e in read_events(jobdir / "events.jsonl") if e["event"] == name]


# ---------------------------------------------------------------- real processes
# 3 -> 2 -> 3 -> 1 -> 2 -> 1 ranks: every hop the issue names (1->2, 2->1, 2->3, 3->2) and 2->3->1
# in the middle of epoch 1 (30 samples, 3 per rank and step: epoch 0 ends at step 4, epoch 1 at 10)
CHAIN = [(3, 4), (2, 6), (3, 7), (1, 12), (2, 15), (1, 17)]
# asynchronous saves: the four hops in five runs (epoch 0 on 2 then 1 rank, epoch 1 on 2 then 3)
ASYNC_CHAIN = [(2, 4), (1, 6), (2, 7), (3, 10), (2, 12)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_on_other_world_sizes_is_exact(tmp_path, mode):
    from ftkit.checkpoint import validate_dir

    chain = CHAIN if mode == "sync" else ASYNC_CHAIN
    reports = _chain(tmp_path, chain, *(["--async"] if mode == "async" else []))
    jobdir = tmp_path / "job"
    resumes = [(e["world_size"], e["saved_world_size"], e["step"]) for e in _events(jobdir, "resume") if e["rank"] == 0]
    expected = [(chain[0][0], None, None)]
    expected += [(w, prev_w, prev_t) for (prev_w, prev_t), (w, _) in itertools.pairwise(chain)]
    assert resumes == expected
    for world, total in chain[-2:]:  # kept by retention: the manifest records who saved it
        info = validate_dir(jobdir / "checkpoints" / f"step-{total:08d}", checksums=True)
        assert info.valid and info.world_size == world and info.kind == ("single" if world == 1 else "dcp")
    assert _assert_epochs_covered(reports, 30) == [0, 1]
    if mode == "sync":  # epoch 1 runs on 2, then 3, then 1 rank
        assert [len(run) for run in reports if "1" in run[0]["indices"]] == [2, 3, 1]


def test_fsdp_shards_saved_by_two_ranks_resume_on_one_and_three(tmp_path):
    import shutil

    saved = _run(tmp_path / "job", 2, 4, tmp_path / "fsdp2", "--fsdp")
    shutil.copytree(tmp_path / "job" / "checkpoints", tmp_path / "job3" / "checkpoints")
    on3 = _run(tmp_path / "job3", 3, 6, tmp_path / "fsdp3", "--fsdp")  # DCP reshards 2 -> 3
    _assert_resumed(saved, on3)
    one = _run(tmp_path / "job", 1, 6, tmp_path / "plain1")  # no process group, no wrapper
    _assert_resumed(saved, one)
    back = _run(tmp_path / "job", 2, 8, tmp_path / "fsdp2b", "--fsdp")  # one-process file -> shards
    _assert_resumed(one, back)
    # FSDP2 on one process: DCP's shards into it, then its own (one-file) checkpoint, whole,
    # back into two ranks' shards (its save raised, and a one-file load into it crashed)
    solo = _run(tmp_path / "job", 1, 10, tmp_path / "fsdp1", "--fsdp")
    _assert_resumed(back, solo)
    again = _run(tmp_path / "job", 2, 12, tmp_path / "fsdp2c", "--fsdp")
    _assert_resumed(solo, again)
    solo2 = _run(tmp_path / "job", 1, 14, tmp_path / "fsdp1b", "--fsdp")  # DCP -> FSDP2 on one, twice
    _assert_resumed(again, solo2)


# ---------------------------------------------------------------- in one process
def _state(extra: bool = False):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "counter": 5}
    if extra:
        state["ema"] = torch.nn.Linear(4, 3)
    return state


def test_a_module_missing_from_the_checkpoint_fails_the_resume_unless_allowed(tmp_path, caplog):
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager
    from ftkit.errors import CheckpointError

    class Events:
        def __init__(self):
            self.seen = []

        def emit(self, event, **fields):
            self.seen.append((event, fields))

    make_manager(CheckpointConfig(root=tmp_path)).save(3, _state())
    state = _state(extra=True)
    with torch.no_grad():
        state["model"].weight.zero_()
    state["counter"] = 0
    ema = state["ema"].weight.clone()
    with pytest.raises(CheckpointError) as err:
        make_manager(CheckpointConfig(root=tmp_path)).load(state)
    assert "state['ema']" in str(err.value) and str(tmp_path / "step-00000003") in str(err.value)
    assert "allow_missing" in str(err.value) and "strict=False" in str(err.value)
    assert not state["model"].weight.any() and state["counter"] == 0, "restored before refusing"

    for config in (CheckpointConfig(root=tmp_path, allow_missing=("ema",)), CheckpointConfig(root=tmp_path, strict=False)):
        events = Events()
        caplog.clear()
        assert make_manager(config, events=events).load(state) == 3
        assert torch.equal(state["model"].weight, _state()["model"].weight) and state["counter"] == 5
        assert torch.equal(state["ema"].weight, ema)
        assert ("missing-state", {"step": 3, "path": str(tmp_path / "step-00000003"), "keys": ["ema"]}) in events.seen
        assert any("state['ema']" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)

    plain = _state()  # a plain value is state too
    plain["epoch"] = 0
    with pytest.raises(CheckpointError, match=r"state\['epoch'\]"):
        make_manager(CheckpointConfig(root=tmp_path, allow_missing=("ema",))).load(plain)


def test_strictness_settings_are_checked(tmp_path):
    from ftkit.checkpoint import CheckpointConfig
    from ftkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint\.strict"):
        CheckpointConfig(root=tmp_path, strict="no")
    with pytest.raises(ConfigError, match=r"checkpoint\.allow_missing"):
        CheckpointConfig(root=tmp_path, allow_missing="ema")
    assert CheckpointConfig(root=tmp_path, allow_missing=["a", "b"]).allow_missing == ("a", "b")


def test_a_model_saved_inside_ddp_loads_without_it(tmp_path):
    import torch

    from ftkit.checkpoint import CheckpointConfig, make_manager

    class Wrapper(torch.nn.Module):  # DDP's naming: the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    saved = _state()
    make_manager(CheckpointConfig(root=tmp_path)).save(1, {**saved, "model": Wrapper(saved["model"])})
    state = _state()
    with torch.no_grad():
        state["model"].weight.zero_()
    assert make_manager(CheckpointConfig(root=tmp_path)).load(state) == 1
    assert torch.equal(state["model"].weight, saved["model"].weight)


def _consume(samplers, steps: int, batch: int) -> list[int]:
    """``steps`` batches from every rank's sampler, in lockstep, as DataLoaders hand them out."""
    out = []
    iters = [iter(s) for s in samplers]
    for _ in range(steps):
        for it in iters:
            out.extend(next(it) for _ in range(batch))
    return out


@pytest.mark.parametrize("length", [48, 47])
def test_sampler_position_is_global_across_world_sizes(length):
    from ftkit.checkpoint import ResumableSampler

    def ranks(world, saved=None):
        samplers = [ResumableSampler(length, seed=3, rank=r, world_size=world) for r in range(world)]
        for r, s in enumerate(samplers):
            if saved is not None:
                s.load_state_dict(saved[r] if r < len(saved) else saved[0])
        return samplers

    two = ranks(2)
    seen = _consume(two, 4, 2)  # 16 of the epoch
    three = ranks(3, [s.state_dict() for s in two])
    assert [s.start for s in three] == [16] * 3 and three[0].global_position == 16
    seen += _consume(three, 3, 2)  # 18 more
    one = ranks(1, [s.state_dict() for s in three])
    assert one[0].global_position == 34 and len(one[0]) == length - 34
    seen += list(one[0])  # the rest of the epoch
    assert one[0].epoch == 1 and one[0].start == 0 and one[0].position == 0
    assert sorted(seen) == list(range(length))  # every index once: no repeat, none skipped

    # the last stretch pads like DistributedSampler: 47 - 34 = 13 on 2 ranks -> 14 (one repeat)
    one = ranks(1, [s.state_dict() for s in three])
    two = ranks(2, [s.state_dict() for s in one])
    rest = [i for s in two for i in s]
    assert sorted(set(seen[:34] + rest)) == list(range(length))
    assert len(rest) == 2 * math.ceil((length - 34) / 2)

    # the same world size continues exactly, also mid-stretch; old states (no world_size) too
    again = ranks(3, [s.state_dict() for s in three])
    assert [list(a) for a in again] == [list(b) for b in three]
    legacy = ResumableSampler(length, seed=3, rank=1, world_size=2)
    legacy.load_state_dict({"epoch": 0, "position": 5, "seed": 3, "length": length})
    assert (legacy.start, legacy.position) == (0, 5)
