"""Asynchronous checkpoints: the training loop pays only for a copy into host memory.

``config`` (``AsyncConfig``) -> ``manager`` (``AsyncCheckpointer``: memory snapshots every N
steps, persists every M) -> ``buffers`` (the copy into reused host buffers: the stall) ->
``thread`` (the background writer of ``crash_safe=False``) -> ``plan`` / ``commit`` (several
ranks: local DCP plans, rank 0's merge, and the commit over files in the step directory, which
ends in ``format.commit``). ``crash_safe=True`` hands the buffers to ``crashsafe`` instead.
"""
