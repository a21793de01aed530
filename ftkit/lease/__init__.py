"""One run per job dir: the lease rank 0 holds for a run's life.

Two runs writing one job dir at once remove each other's checkpoints as "leftovers" and
leave a mix of both. So the first run to start takes the job dir's lease and a second one
stops before it touches anything (:class:`JobDirBusyError`, exit code 86, never requeued).

Two files, both in the job dir:

``lease.lock``
    The lock: rank 0 holds an ``fcntl`` byte-range lock on byte 0 for the run's life.
    fcntl locks (unlike ``flock``) are seen across nodes on NFS (NLM/NFSv4) and on Lustre
    mounted with ``-o flock``, and the kernel drops them when the process dies (``kill -9``
    included). Byte 1 is a short mutex held while a run decides and writes the record, so
    two runs starting together cannot both win.
``lease.json``
    The record (:class:`LeaseRecord`): who holds the lease (SLURM job id and restart count,
    host, pid, world size), since when, and the last heartbeat, which a daemon thread rewrites
    every ``LeaseConfig.heartbeat`` seconds (atomically: readers never see half a record).
    ``released`` is set when the run closes.

A held lock means busy, with two exceptions: a record of an earlier restart of the same
SLURM job (SLURM runs one instance of a job at a time, so that holder is gone: a lock still
held belongs to a node that died) and a record without a heartbeat for ``stale_after`` from
another host (a node lost with its lock not yet reclaimed by the file server). Then the lock
file is replaced by a new one, which the old holder's lock does not cover. A free lock does
not by itself mean the holder is gone (``localflock`` Lustre mounts only see locks of the same
node), so the record decides: a released record, a holder on this host whose pid is gone, or
an earlier restart of the same SLURM job are taken over at once; any other holder only once
its heartbeat is ``stale_after`` old. Every takeover is logged (``lease-takeover`` event).

The decision is the pure function :func:`judge`; :class:`Lease` performs it. The heartbeat
thread also checks that the lease is still this run's; if another run took it over (this
run looked stale), it logs ``lease-lost`` and calls ``on_lost`` (the controller then exits
without saving and without a requeue).
"""

from __future__ import annotations

from ._holder import Lease, agree_refused, take_lease
from ._record import (
    JobDirBusyError,
    LeaseConfig,
    LeaseRecord,
    Verdict,
    describe_lease,
    judge,
    lease_status,
    live_holder,
    pid_alive,
)

__all__ = [
    "JobDirBusyError",
    "Lease",
    "LeaseConfig",
    "LeaseRecord",
    "Verdict",
    "agree_refused",
    "describe_lease",
    "judge",
    "lease_status",
    "live_holder",
    "pid_alive",
    "take_lease",
]
