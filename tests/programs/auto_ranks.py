"""Two gloo ranks under save_every="auto" whose steps take different (fake) times.

    RANK=R WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python auto_ranks.py JOBDIR STEPS

Rank R's fake clock advances R+1 seconds per step and 2 s per checkpoint snapshot, so alone
the ranks would pick different intervals in steps. Writes JOBDIR/saves-rankR.json: the steps
at which this rank saved.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

import ftkit
from ftkit.control.interval import IntervalConfig


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class CostlyState:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.value = 0

    def state_dict(self) -> dict:
        self.clock.t += 2.0
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def main() -> int:
    jobdir, steps = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    clock = Clock()
    cfg = ftkit.Config(save_every="auto", save_at_end=False, budget=ftkit.BudgetConfig(enabled=False),
                       interval=IntervalConfig(mtbf=3600.0, first_after=50.0))
    saves = []
    try:
        with ftkit.FaultTolerance(jobdir, state={"s": CostlyState(clock)}, config=cfg, clock=clock,
                                  wallclock=lambda: 1.7e9 + clock.t) as ft:
            for _step in ft.range(steps):
                clock.t += rank + 1.0
                if ft.last_saved_step is not None and ft.last_saved_step not in saves:
                    saves.append(ft.last_saved_step)
    finally:
        dist.destroy_process_group()
    (jobdir / f"saves-rank{rank}.json").write_text(json.dumps(saves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
