"""Crash-safe checkpoints: snapshots in shared memory, persisted by a per-node saver process.

``shm`` (the segment layout under ``/dev/shm``) <- ``client`` (the trainer side: slots, starting
or joining the node's saver) <-> ``saver`` (``python -m ftkit.checkpoint.crashsafe.saver``: it
outlives a crashed trainer and persists its last snapshot) ; ``args`` (the saver's command line,
one type for the client, the saver and ``find``) ; ``find`` (the saver processes of a job dir on
this node, which ``ftkit requeue`` waits for, and the leftovers in ``/dev/shm`` of runs whose
trainer and saver both died, which the next saver's start removes; no torch).
"""
