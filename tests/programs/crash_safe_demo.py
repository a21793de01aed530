"""``ftkit demo --async`` with the crash-safe saver: a snapshot in shared memory after every
step, persisted by a saver process per node on a save, and when a trainer of the node dies
(the newest snapshot: newer than the last checkpoint). Arguments as for ``ftkit demo``. For
the multi-node SLURM tests (node death)."""

from __future__ import annotations

import functools
import sys

import ftkit
from ftkit.checkpoint import AsyncConfig
from ftkit.cli import main

if __name__ == "__main__":
    # the demo builds its config with ftkit.AsyncConfig() when --async is given
    ftkit.AsyncConfig = functools.partial(AsyncConfig, crash_safe=True, memory_every=1)  # type: ignore[misc]
    sys.exit(main(["demo", "--async", *sys.argv[1:]]))
