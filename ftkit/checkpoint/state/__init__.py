"""Training state <-> plain CPU data, and which parts of it each rank loads.

``snapshot`` (the one walk over user state: stateful objects, RNGs, allowed leaves; the
synchronous snapshot; RNG capture), ``restore`` (saved state back into the live objects in
place; the live tensors a resume reads straight into), ``keys`` (the world-size rule: which
saved keys a rank loads from a checkpoint of any world size), ``sampler`` (a sampler whose
position survives a restart). No files here: ``io`` writes what ``snapshot`` produces.
"""
