"""save_every="auto" against a too-sparse and a too-dense fixed interval, under injected failures.

    python benchmarks/interval_goodput.py [--steps 1200] [--step-time 0.05] [--mtbf 20]
                                          [--state-mb 64] [--sparse 1000] [--dense 5] [--seed 0]

Each policy trains the same job (tests/programs/goodput_loop.py, STEPS steps of STEP_TIME
seconds, a checkpointed state of STATE_MB) in a fresh job dir, rerun after every failure until
it completes. Failures are kill -9 of the training process after an exponential time with mean
MTBF seconds of training, drawn from one seeded generator, so every policy meets the same
failure schedule. The time each policy lost is measured by the report itself
(``ftkit.report.analyse`` on the job dir's events log), and printed side by side.

``auto`` gets the MTBF from its configuration (``interval.mtbf``) and measures the checkpoint
cost itself; its first run takes a first checkpoint after ``--first-after`` seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "goodput_loop.py"


def run_policy(name: str, every: str, args: argparse.Namespace, jobdir: Path) -> dict:
    from ftkit.events import read_events
    from ftkit.report import analyse

    rng = random.Random(args.seed)  # the same failure schedule for every policy
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt in range(args.max_runs):
        die = rng.expovariate(1.0 / args.mtbf)
        cmd = [sys.executable, str(PROGRAM), str(jobdir), str(args.steps), str(args.step_time), every,
               "--die-after", f"{die:.3f}", "--state-mb", str(args.state_mb), "--mtbf", str(args.mtbf),
               "--first-after", str(args.first_after), "--progress", "1"]
        rc = subprocess.run(cmd, env=env, check=False).returncode
        if rc == 0:
            break
        print(f"  {name}: run {attempt} killed after {die:.1f} s of training", flush=True)
    report = analyse(list(read_events(jobdir / "events.jsonl")))
    report["policy"] = name
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--mtbf", type=float, default=20.0, help="mean seconds of training between failures")
    ap.add_argument("--state-mb", type=float, default=64.0)
    ap.add_argument("--sparse", type=int, default=1000, help="the too-sparse fixed interval, steps")
    ap.add_argument("--dense", type=int, default=5, help="the too-dense fixed interval, steps")
    ap.add_argument("--first-after", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-runs", type=int, default=60)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    policies = [("auto", "auto"), (f"every {args.sparse}", str(args.sparse)), (f"every {args.dense}", str(args.dense))]
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, every in policies:
            t0 = time.monotonic()
            reports.append(run_policy(name, every, args, Path(tmp) / every))
            print(f"  {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"\n{args.steps} steps of {args.step_time} s, {args.state_mb:g} MB state, failures every "
          f"{args.mtbf:g} s of training on average (seed {args.seed})\n")
    head = ("policy", "runs", "wall s", "productive", "re-done", "stalls", "restart", "exit wait", "lost s",
            "lost-restart", "goodput")
    print(("{:<12}" + "{:>11}" * (len(head) - 3) + "{:>13}{:>11}").format(*head))
    for r in reports:
        b = r["buckets"]
        lost = r["wall"] - b["productive"]
        print(("{:<12}{:>11}" + "{:>11.1f}" * 7 + "{:>13.1f}{:>10.1f}%").format(
            r["policy"], len(r["runs"]), r["wall"], b["productive"], b["redone"], b["stall"], b["restart"],
            b["exit_wait"], lost, lost - b["restart"], 100 * r["goodput"]))
    auto = [e for e in reports[0]["runs"] if e["step_time"]]
    iv = reports[0]["interval"]
    print(f"\nauto: checkpoint cost {iv['cost']:.3f} s measured, recommended interval {iv['recommended']:.2f} s"
          f" (~{iv['recommended'] / auto[-1]['step_time']:.0f} steps)" if auto and iv.get("recommended") else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
