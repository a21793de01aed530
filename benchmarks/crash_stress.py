"""Kill -9 a process (or two ranks) in the middle of saving checkpoints, then resume.

Each trial forks saver process(es) that save checkpoints step 1, 2, 3, ... in a loop
(every tensor of step s is filled with s; rank 0 appends s to ``committed.log`` with
fsync once ``save`` returns), kills them with SIGKILL after a random delay, then resumes
(in new forked processes for two ranks) and checks:

* partial_loaded: a checkpoint was loaded whose content is not exactly step s's content,
  or whose files do not match their manifest checksums;
* lost: the newest committed step (per the log) or one of the last keep_last-1 committed
  steps is no longer valid, or resume picked an older step than the newest committed one;
* leftovers: incomplete directories older than the newest valid that remain after the
  next successful save (single process only).

Usage: python3 benchmarks/crash_stress.py --trials 200 [--world-size 2] [--json]
Exit status 1 if any partial checkpoint was loaded or any valid checkpoint was lost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import ftkit.checkpoint.dcp
import ftkit.checkpoint.manager  # noqa: F401
from ftkit.checkpoint import CheckpointConfig, make_manager, validate_dir

KEEP_LAST = 2


def _state(numel: int):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(numel))
    model.b = torch.nn.Parameter(torch.zeros(numel // 4))
    return {"model": model, "extra": {"step": 0}, "tail": torch.zeros(1024)}


def _fill(state, step: int) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.fill_(float(step))
    state["tail"].fill_(float(step))
    state["extra"]["step"] = step


def _matches(state, step: int) -> bool:
    tensors = [*state["model"].parameters(), state["tail"]]
    return state["extra"]["step"] == step and all(bool((t == float(step)).all()) for t in tensors)


def _init_dist(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


VERBOSE = False


def _fork(fn, *args, quiet: bool = False) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            fn(*args)
        except BaseException:
            if VERBOSE or not quiet:
                traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def _saver(root: Path, rank: int, world: int, port: int, numel: int) -> None:
    if world > 1:
        _init_dist(rank, world, port)
    mgr = make_manager(
        CheckpointConfig(root=root, keep_last=KEEP_LAST), rank=rank, world_size=world
    )
    state = _state(numel)
    log = root.parent / "committed.log"
    (root.parent / f"ready-{rank}").touch()
    step = 0
    while True:
        step += 1
        _fill(state, step)
        mgr.save(step, state, reason="stress")
        if rank == 0:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, f"{step}\n".encode())
            os.fsync(fd)
            os.close(fd)


def _loader(root: Path, rank: int, world: int, port: int, numel: int, out: Path) -> None:
    if world > 1:
        _init_dist(rank, world, port)
    mgr = make_manager(
        CheckpointConfig(root=root, keep_last=KEEP_LAST), rank=rank, world_size=world
    )
    state = _state(numel)
    _fill(state, -1)
    step = mgr.load(state)
    ok = step is None or _matches(state, step)
    result = {"step": step, "content_ok": ok, "leftovers": 0}
    if world == 1 and step is not None:
        _fill(state, step + 1_000_000)
        mgr.save(step + 1_000_000, state)
        newest = step + 1_000_000
        result["leftovers"] = sum(1 for i in mgr.list() if not i.valid and i.step < newest)
    out.write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(pids: list[int], timeout: float = 60.0) -> list[int]:
    statuses = []
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses.append(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
    return statuses


def trial(base: Path, world: int, rng: random.Random, numel: int, max_delay: float) -> dict:
    root = base / "checkpoints"
    port = _free_port()
    # with two ranks, the rank killed second often fails first in a collective (peer reset): quiet
    pids = [_fork(_saver, root, r, world, port, numel, quiet=world > 1) for r in range(world)]
    deadline = time.monotonic() + 30
    while (
        not all((base / f"ready-{r}").exists() for r in range(world))
        and time.monotonic() < deadline
    ):
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, max_delay))
    order = list(range(world))
    rng.shuffle(order)
    for r in order:
        os.kill(pids[r], signal.SIGKILL)
        if world > 1 and rng.random() < 0.5:
            time.sleep(rng.uniform(0, 0.02))
    statuses = _wait_all(pids)
    crashed = [s for s in statuses if not (os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL)]
    log = base / "committed.log"
    committed = [int(x) for x in log.read_text().split()] if log.exists() else []
    incomplete_after_kill = (
        sum(1 for p in root.glob("step-*") if not validate_dir(p).valid) if root.exists() else 0
    )
    # every committed step retention must still keep is valid, checksums included
    lost = any(
        not validate_dir(root / f"step-{s:08d}", checksums=True).valid
        for s in committed[-max(KEEP_LAST - 1, 1) :]
    )
    # resume in fresh processes
    port = _free_port()
    outs = [base / f"load-{r}.json" for r in range(world)]
    statuses = _wait_all(
        [_fork(_loader, root, r, world, port, numel, outs[r]) for r in range(world)], timeout=120
    )
    if any(s != 0 for s in statuses) or not all(o.exists() for o in outs):
        return {"error": f"loader failed: statuses {statuses}", "committed": committed}
    results = [json.loads(o.read_text()) for o in outs]
    step = results[0]["step"]
    partial = not all(r["content_ok"] for r in results) or any(r["step"] != step for r in results)
    if step is not None and not validate_dir(root / f"step-{step:08d}", checksums=True).valid:
        partial = True
    if committed and (step is None or step < committed[-1]):
        lost = True
    return {
        "committed": committed,
        "loaded": step,
        "partial": partial,
        "lost": lost,
        "incomplete_after_kill": incomplete_after_kill,
        "leftovers": sum(r["leftovers"] for r in results),
        "saver_errors": len(crashed) if world == 1 else 0,
        "peer_failed": len(crashed) if world > 1 else 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--world-size", type=int, default=1, choices=(1, 2))
    ap.add_argument(
        "--max-delay", type=float, default=None, help="kill after up to this many seconds"
    )
    ap.add_argument("--mib", type=float, default=2.0, help="model size in MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON line")
    ap.add_argument(
        "-v", "--verbose", action="store_true", help="show ftkit's warnings (skipped checkpoints)"
    )
    a = ap.parse_args(argv)
    global VERBOSE
    VERBOSE = a.verbose
    logging.basicConfig(level=logging.WARNING if a.verbose else logging.ERROR)
    torch.set_num_threads(1)
    max_delay = a.max_delay if a.max_delay is not None else (0.4 if a.world_size == 1 else 0.8)
    numel = int(a.mib * 2**20 / 4 / 1.25)
    rng = random.Random(a.seed)
    scratch = Path(a.dir or tempfile.mkdtemp(prefix="ftkit-crash-"))
    counts = {
        "trials": 0,
        "world_size": a.world_size,
        "partial_loaded": 0,
        "valid_lost": 0,
        "fresh_starts": 0,
        "resumed": 0,
        "killed_mid_save": 0,
        "leftovers_after_cleanup": 0,
        "errors": 0,
        "commits": 0,
        "peer_failed_before_kill": 0,
    }
    started = time.monotonic()
    try:
        for i in range(a.trials):
            base = scratch / f"trial-{i:04d}"
            base.mkdir(parents=True)
            r = trial(base, a.world_size, rng, numel, max_delay)
            counts["trials"] += 1
            if "error" in r or r.get("saver_errors"):
                counts["errors"] += 1
                print(f"trial {i}: {r}", file=sys.stderr)
            else:
                counts["partial_loaded"] += r["partial"]
                counts["valid_lost"] += r["lost"]
                counts["fresh_starts"] += r["loaded"] is None
                counts["resumed"] += r["loaded"] is not None
                counts["killed_mid_save"] += r["incomplete_after_kill"] > 0
                counts["leftovers_after_cleanup"] += r["leftovers"]
                counts["commits"] += len(r["committed"])
                counts["peer_failed_before_kill"] += r["peer_failed"] > 0
                if r["partial"] or r["lost"]:
                    print(f"trial {i}: FAILED {r} (kept in {base})", file=sys.stderr)
                    continue
            shutil.rmtree(base, ignore_errors=True)
    finally:
        if (
            a.dir is None
            and counts["partial_loaded"] == counts["valid_lost"] == counts["errors"] == 0
        ):
            shutil.rmtree(scratch, ignore_errors=True)
    counts["seconds"] = round(time.monotonic() - started, 1)
    if a.json:
        print(json.dumps(counts))
    else:
        print(
            f"{counts['trials']} trials (world size {a.world_size}, {counts['seconds']}s): "
            f"partial checkpoints loaded: {counts['partial_loaded']}, valid checkpoints lost: "
            f"{counts['valid_lost']}, killed mid-save: {counts['killed_mid_save']}, resumed: "
            f"{counts['resumed']}, fresh starts: {counts['fresh_starts']}, commits: {counts['commits']}, "
            f"leftovers after cleanup: {counts['leftovers_after_cleanup']}, errors: {counts['errors']}"
        )
    bad = (
        counts["partial_loaded"]
        or counts["valid_lost"]
        or counts["errors"]
        or counts["leftovers_after_cleanup"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
