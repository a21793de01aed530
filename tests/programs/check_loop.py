"""A training-shaped loop that only asks ftkit what to do; used by trigger tests.

    python check_loop.py JOBDIR STEPS STEP_SECONDS [--every N] [--max-seconds S|none]

Writes JOBDIR/ready once handlers are installed, records every non-empty decision in
JOBDIR/decisions.jsonl, and exits when a decision says so. Under torch.distributed
(RANK/WORLD_SIZE set) it joins a gloo group first.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import ftkit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobdir", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("step_seconds", type=float)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--max-seconds", type=lambda v: None if v == "none" else float(v), default=5.0)
    ap.add_argument("--polling", action="store_true")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    config = ftkit.Config(
        agreement=ftkit.AgreementConfig(every=args.every, max_seconds=args.max_seconds),
        watch=ftkit.WatchConfig(mode="polling" if args.polling else "auto", poll_interval=0.1),
    )
    out = args.jobdir / f"decisions-rank{rank}.jsonl"
    with ftkit.FaultTolerance(args.jobdir, config=config) as ft:
        (args.jobdir / f"ready-rank{rank}").write_text(str(os.getpid()))
        for step in range(1, args.steps + 1):
            time.sleep(args.step_seconds)  # the "training step"
            decision = ft.check(step)
            if decision:
                with open(out, "a") as f:
                    f.write(json.dumps({"step": step, "action": decision.action.name,
                                        "requeue": decision.requeue,
                                        "sources": sorted(s.value for s in decision.sources),
                                        "reasons": list(decision.reasons)}) + "\n")
                    f.flush()
            if decision.exit:
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
