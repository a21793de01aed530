"""ftkit's all-reduces return only once gloo's worker thread has let go of their buffers.

A gloo worker drops its reference to a collective's tensors a moment after the caller wakes,
and that drop takes the GIL (torch touches the tensor's Python object). When the collective
was the last thing a process did, the interpreter could already be shutting down then: the
worker cannot take the GIL, and the process aborts (SIGABRT) after its work is done, which
``ftkit requeue`` reads as a crash. Measured on the 2-CPU VM before the fix: a plain
``all_reduce`` returned with the worker still holding its buffer one time in four, and a
two-rank process that loaded a checkpoint and exited aborted in 6 of 40 runs.

Two real gloo ranks: the plain ``all_reduce`` shows the race is there to be seen; the
checkpoint's agreement (``Comm.most``) and gather (``Comm.gather``), the controller's
agreement (``Collective.reduce``) and the shared helper never return while the worker holds
their tensors.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.ckpt_helpers import collect, env, free_port

PROGRAM = textwrap.dedent("""
    import os, sys, time, weakref
    import torch
    import torch.distributed as dist
    from ftkit._collective import all_reduce_max
    from ftkit.checkpoint.comm import Comm
    from ftkit.control.agreement import AgreementConfig, Collective, WIDTH

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the worker threads (started by the group) share this one CPU with the caller: the race
    # shows on a machine of many CPUs too (an H200 machine's 16 did not show it in 1000 turns)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def refs(t):
        return sys.getrefcount(t)

    # the worker holds a buffer: a C++ reference besides the tensor's own, or the reference it
    # took on the tensor's Python object (refs above what they are at rest, measured the same way)
    buf = torch.zeros(WIDTH, dtype=torch.int32)
    before = refs(buf)
    seen = 0
    for i in range(1000):  # the race: a plain all_reduce returns, now and then, while it holds it
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        seen += buf._use_count() > 1 or refs(buf) > before
    print("plain held", rank, seen, flush=True)

    passed = []  # the gather's all_gather's tensors, weakly: alive after it returns while a worker holds one
    real_all_gather = dist.all_gather
    def spy(out, tensor, group=None, async_op=False):
        passed[:] = [weakref.ref(t) for t in (tensor, *out)]
        return real_all_gather(out, tensor, group=group, async_op=async_op)
    dist.all_gather = spy

    comm = Comm(rank=rank, world_size=world)
    coll = Collective(AgreementConfig())
    comm.most(0, 0)
    coll.reduce([0] * WIDTH)
    time.sleep(0.2)  # long enough for the worker to let go: the references at rest
    flags, vec = comm._flags[2], coll._buf
    at_rest = refs(flags), refs(vec)
    late = {"most": 0, "reduce": 0, "helper": 0, "gather": 0}
    for i in range(300):
        assert comm.most(i, rank) == (i, world - 1)
        late["most"] += flags._use_count() > 1 or refs(flags) > at_rest[0]
        vector = [i + 1 if r == rank else 0 for r in range(WIDTH)]
        assert coll.reduce(vector)[:world] == [i + 1] * world
        late["reduce"] += vec._use_count() > 1 or refs(vec) > at_rest[1]
        all_reduce_max(buf)
        late["helper"] += buf._use_count() > 1 or refs(buf) > before
        said = {"rank": rank, "text": "x" * (1000 * rank + i)}  # of another size on each rank
        assert comm.gather(said) == [{"rank": r, "text": "x" * (1000 * r + i)} for r in range(world)]
        late["gather"] += any(t() is not None for t in passed)
    print("late", rank, late, flush=True)
    dist.destroy_process_group()
""")


def test_ftkits_all_reduces_return_after_gloos_worker_let_go_of_their_buffers() -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM],
                              env=env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = collect(procs, 120)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
        # the race this guards against exists here: a plain all_reduce returned while the
        # worker still held its buffer (else this test could not tell the fix from its absence)
        seen = next(line for line in out.splitlines() if line.startswith("plain held"))
        assert int(seen.split()[-1]) >= 1, out
        assert f"late {r} {{'most': 0, 'reduce': 0, 'helper': 0, 'gather': 0}}" in out, out


BOUND = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from ftkit import _collective

    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
    _collective.LET_GO_SECONDS = 0.2
    buf = torch.tensor([3, 1], dtype=torch.int32)
    keeper = torch._C.ScriptList([buf])  # a C++ reference to buf that outlives any collective
    assert buf._use_count() > 1
    _collective.all_reduce_max(buf)  # returns after the bound, and stops waiting in this process
    print("waiting", _collective._waiting[0], buf.tolist(), flush=True)
    _collective.LET_GO_SECONDS = 3600.0  # were it still waiting, the next call would hang the test
    _collective.all_reduce_max(buf)
    print("again", buf.tolist(), _collective.all_gather_objects({"a": 1}), flush=True)
    dist.destroy_process_group()
""")


def test_a_buffer_held_elsewhere_costs_one_bounded_wait_not_every_collective() -> None:
    """Something else holds a collective's buffer (a profiler, a debug wrapper, another torch):
    the wait gives up after its bound once, and the process stops waiting, so that no later
    collective pays it (with the bound raised to an hour, a second wait would hang the test)."""
    proc = subprocess.run([sys.executable, "-c", BOUND, str(free_port())], env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "waiting False [3, 1]" in proc.stdout, proc.stdout + proc.stderr
    assert "again [3, 1] [{'a': 1}]" in proc.stdout, proc.stdout + proc.stderr
