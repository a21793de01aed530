"""``ftkit report``: what interruptions cost a job, read from its events log.

:mod:`.runs` groups the log into runs, :mod:`.goodput` cuts their wall time into buckets and
computes goodput and the checkpoint-interval advice, :mod:`.plot` draws the timeline
(matplotlib, the ``plot`` extra). Nothing here imports torch.
"""

from __future__ import annotations

from .goodput import BUCKETS, RESTART_PARTS, analyse
from .runs import Run, parse_runs

__all__ = ["BUCKETS", "RESTART_PARTS", "Run", "analyse", "parse_runs"]
