"""Which rank stopped first: the culprit of a hang, from the events log alone.

When one rank stops, every other rank soon waits in a collective it never joins, so every
watchdog fires and the log holds N ``hang`` events, or fewer: the culprit may be unable to
write one (SIGSTOPped, killed, its node lost) and the launcher tears the others down as soon
as the first one exits. Each ``hang`` event therefore carries the firing rank's own facts and
a snapshot of its peers' heartbeats (``peers``); :func:`culprit` merges them and applies
this rule, strongest evidence first:

1. A rank whose process was not running when a peer declared the hang (its heartbeat older
   than three heartbeat intervals, or no heartbeat and no event at all) stopped first: a rank
   that does not run joins no collective, and every other rank waits for it.
2. Else the rank with the lowest last completed step: in a data-parallel loop a rank cannot
   complete a step whose collectives a peer has not joined, so the ranks ahead are waiting
   on the one behind.
3. Else, among ranks at that step, the one whose main thread is not inside a collective
   (``torch.distributed``, DDP, autograd's backward, ftkit's agreement) while the others are:
   the one stuck in a data loader, a file read or a kernel.
4. Else the rank whose last step finished earliest (weak: reported as such).

The culprit's step. A rank's own ``hang`` event, and a heartbeat written while its step was
already overdue (it carries the main thread's frame), give its last completed step exactly.
A rank that wrote neither (SIGSTOPped, killed, its node lost) is known only from its last
heartbeat, written up to a heartbeat interval (10 s: hundreds of short steps) before it
stopped: a lower bound, never its last step. The ranks that wait for it bound it from above:
they record their own last step exactly, and a rank cannot have completed a step whose
collective they never got past (a rank ahead of them would not be the one they wait on). And
where they wait in a step's gradient all-reduce (DDP's, in autograd's backward: one every
step), they completed step N only after it joined step N's all-reduce, so it completed at
least N - 1. Hence ``step`` (the lowest step it surely completed), ``step_max`` (the highest
it may have) and ``step_exact``; :func:`hang_step` is the one number that does not move with
the heartbeats' timing, for "hung again at step N" between runs.

Also the record types the watchdog writes (:class:`Heartbeat`), so writer and readers share
one definition of the fields.
"""

from __future__ import annotations

import os
import sysconfig
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from types import FrameType
from typing import Any

__all__ = ["Heartbeat", "culprit", "describe", "frame_facts", "hang_step", "last_incident", "step_range", "suspicion"]

STALE_BEATS = 3  # a heartbeat older than this many intervals means the process is not running

# Paths (with "/" separators) whose frames mean "waiting for the other ranks".
_COLLECTIVE = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/", "/ftkit/control/agreement.py")
# Paths whose frames mean "inside a step's gradient all-reduce" (DDP's hooks run in autograd's
# backward): a collective every step, so the ranks move in lockstep.
_GRADIENT = ("/torch/nn/parallel/", "/torch/autograd/")
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]).replace(os.sep, "/") + "/"


@dataclass(kw_only=True, slots=True)
class Heartbeat:
    """What one rank last published about itself (``JOBDIR/heartbeats/rank{R}.json``), as
    written by its watchdog thread and as copied into a peer's ``hang`` event."""

    rank: int
    host: str | None = None
    pid: int | None = None
    job: str = ""
    """SLURM job id or torchrun run id ("" outside both): heartbeats of another job are ignored."""
    step: int | None = None
    """Last completed step (None: no step boundary yet)."""
    last_step_wall: float | None = None
    """UNIX time that step completed."""
    written: float = 0.0
    """UNIX time the heartbeat was written."""
    interval: float = 10.0
    """Seconds between this rank's heartbeats (judges staleness)."""
    frame: str | None = None
    """The main thread's innermost frame outside the standard library, while the step is overdue."""
    waiting: bool | None = None
    """Whether the main thread was inside a collective (None: not looked at)."""
    phase: str | None = None
    """A save or ``allow()`` block in progress."""
    age: float | None = None
    """Seconds since ``written`` when a peer read it (set by :meth:`seen`)."""
    running: bool | None = None
    """Whether the process was running when a peer read it (set by :meth:`seen`)."""

    def seen(self, now: float) -> Heartbeat:
        """This heartbeat as judged by a peer at UNIX time ``now``."""
        age = max(now - self.written, 0.0)
        return replace(self, age=round(age, 3), running=age <= STALE_BEATS * self.interval)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Heartbeat:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def suspicion(b: Heartbeat) -> tuple[bool, int, bool, float]:
    """Sort key, most suspect first: not running, lowest step, outside a collective, earliest."""
    return (b.running is not False, -1 if b.step is None else b.step, b.waiting is not False,
            b.last_step_wall or 0.0)


def frame_facts(frame: FrameType | None) -> tuple[str | None, bool | None]:
    """(innermost frame outside the standard library as ``file:line in func``, whether the
    stack is inside a collective) for a thread's current frame; (None, None) without one."""
    if frame is None:
        return None, None
    stack = traceback.extract_stack(frame)
    names = [s.filename.replace(os.sep, "/") for s in stack]
    waiting = any(marker in name for name in names for marker in _COLLECTIVE)
    pick = next((s for s, n in zip(reversed(stack), reversed(names), strict=True)
                 if not _stdlib(n)), stack[-1] if stack else None)
    if pick is None:
        return None, waiting
    return f"{pick.filename}:{pick.lineno} in {pick.name}", waiting


def _stdlib(name: str) -> bool:
    return name.startswith(_STDLIB) and "-packages/" not in name


def last_incident(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``hang`` events of the newest run that had any (a ``start`` after hangs begins a
    new run)."""
    current: list[dict[str, Any]] = []
    latest: list[dict[str, Any]] = []
    for e in events:
        kind = e.get("event")
        if kind == "start" and current:
            latest, current = current, []
        elif kind == "hang":
            current.append(e)
    return current or latest


def culprit(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank that stopped completing steps first in the newest hang, or None (no hang).

    Returns ``rank``, ``host``, ``step`` (the last step it surely completed), ``step_max``
    (the newest it may have completed; None: no bound), ``step_exact`` (the two are its own
    record), ``heartbeat_step`` (what its last heartbeat said, where the step comes from one),
    ``last_step_wall`` (when ``heartbeat_step``, or the exact step, completed), ``frame``,
    ``file`` (its stack dump, when it could write one), ``running``, ``evidence`` (which rule
    named it, in words), ``declared_by`` (the first rank to fire), ``time`` (when) and
    ``others`` (every other rank's facts). See the module docstring for the rule and the step.
    """
    hangs = last_incident(events)
    if not hangs:
        return None
    ranks: dict[int, Heartbeat] = {}
    files: dict[int, str] = {}
    for e in hangs:
        r = int(e.get("rank", 0))
        files.setdefault(r, e.get("file"))
        ranks.setdefault(r, Heartbeat(rank=r, host=e.get("host"), pid=e.get("pid"), step=e.get("step"),
                                      last_step_wall=e.get("last_step_wall"), written=e.get("time", 0.0),
                                      frame=e.get("frame"), waiting=e.get("waiting"), phase=e.get("phase"),
                                      running=True))
    fired = set(ranks)
    for e in hangs:
        for data in e.get("peers") or []:
            try:
                beat = Heartbeat.from_json(data)
            except (TypeError, ValueError):
                continue
            known = ranks.get(beat.rank)
            if beat.rank not in fired and (known is None or beat.written > known.written):
                ranks[beat.rank] = beat
    world = max([int(e.get("world_size") or 1) for e in hangs] + [r + 1 for r in ranks])
    for r in range(world):  # no heartbeat and no event: exited, or never reached its first step
        ranks.setdefault(r, Heartbeat(rank=r, running=False))
    facts = sorted(ranks.values(), key=lambda b: b.rank)
    first = min(hangs, key=lambda e: e.get("time", 0.0))
    pick, evidence = _apply_rule(facts, int(first.get("rank", 0)))
    low, high, exact = _step_bounds(pick, facts, fired)
    return {
        "rank": pick.rank, "host": pick.host, "step": low, "step_max": high, "step_exact": exact,
        "heartbeat_step": None if exact else pick.step, "last_step_wall": pick.last_step_wall,
        "frame": pick.frame, "file": files.get(pick.rank), "running": pick.running, "evidence": evidence,
        "declared_by": int(first.get("rank", 0)), "time": first.get("time"),
        "others": [b.to_json() for b in facts if b.rank != pick.rank],
    }


def _step_bounds(pick: Heartbeat, facts: list[Heartbeat], fired: set[int]) -> tuple[int | None, int | None, bool]:
    """(the lowest step ``pick`` surely completed, the newest it may have, whether that is
    exact): see the module docstring."""
    if pick.rank in fired or (pick.frame is not None and pick.step is not None):
        return pick.step, pick.step, True  # its own event, or a heartbeat written while stuck
    if pick.host is None:  # no heartbeat, no event: it exited or never reached a step
        return None, None, False
    waiters = [b for b in facts if b.rank in fired and b.rank != pick.rank and b.step is not None]
    high = min((b.step for b in waiters), default=None)
    if high is None or (pick.step is not None and high < pick.step):  # none waits behind it: no bound
        return pick.step, None, False
    lockstep = any(b.step == high and b.waiting and b.frame and any(m in b.frame.replace(os.sep, "/")
                                                                    for m in _GRADIENT) for b in waiters)
    low = pick.step
    if lockstep:
        low = high - 1 if low is None else max(low, high - 1)
    if low == high:
        return low, high, True
    return low, high, False


def hang_step(found: dict[str, Any] | None) -> int | None:
    """The step a hang is recorded at (``runs.json``'s ``hang_step``; "hung again at step N"
    compares it between runs): the culprit's last completed step where that is known exactly,
    else the newest step it may have completed, which the ranks waiting for it recorded
    themselves. Never a stale heartbeat's step, which moves with the heartbeats' timing."""
    if found is None:
        return None
    if found.get("step_exact") or found.get("step_max") is None:
        return found.get("step")
    return found.get("step_max")


def _apply_rule(facts: list[Heartbeat], observer: int) -> tuple[Heartbeat, str]:
    if len(facts) == 1:
        return facts[0], "the only rank"
    stopped = [b for b in facts if b.running is False]
    if stopped:
        b = min(stopped, key=lambda b: (b.step is not None, b.step or 0, b.last_step_wall or 0.0))
        if b.host is None:
            return b, (f"its process was not running when rank {observer} declared the hang "
                       "(no heartbeat and no hang event: it exited or never reached its first step)")
        return b, (f"its process was not running when rank {observer} declared the hang (last heartbeat "
                   f"{b.age:.0f} s old: stopped, killed, or its node was lost)")
    steps = [b.step for b in facts if b.step is not None]
    low = min(steps, default=None)
    at_low = [b for b in facts if b.step == low]
    if low is not None and len(at_low) < len(facts):
        b = min(at_low, key=lambda b: b.last_step_wall or 0.0)
        return b, f"it completed step {low}, behind the others (up to step {max(steps)}), which waited for it"
    free = [b for b in at_low if b.waiting is False]
    if free and len(free) < len(at_low):
        b = min(free, key=lambda b: b.last_step_wall or 0.0)
        return b, "it was not inside a collective while the others waited in one"
    b = min(at_low or facts, key=lambda b: b.last_step_wall or 0.0)
    return b, "weak evidence: every rank was at the same step; its last step finished first"


def describe(found: dict[str, Any] | None) -> str:
    """One line for ``ftkit status`` and logs: who stopped first, where, and why we think so."""
    if found is None:
        return "no hang recorded"
    when = found.get("last_step_wall")
    at = "" if when is None else time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(when))
    where = f"in {found['frame']}" if found.get("frame") else "no stack (it wrote none)"
    waiting = sum(1 for o in found.get("others", []) if o.get("host") is not None)
    return (f"hang: rank {found['rank']} on {found.get('host') or 'an unknown host'} stopped completing "
            f"steps first ({_last_step(found, at)}), {where}: {found['evidence']}"
            + (f"; {waiting} other rank(s) waited on it" if waiting else "")
            + (f"; stacks: {found['file']}" if found.get("file") else ""))


def step_range(found: dict[str, Any]) -> str:
    """The culprit's last completed step in words: ``7``, ``6 or 7``, ``5 to 7``, ``5 or later``."""
    low, high = found.get("step"), found.get("step_max", found.get("step"))
    if found.get("step_exact", True) or low == high:
        return str(low)
    if high is None:
        return f"{low} or later"
    if low is None:
        return f"{high} or earlier"
    return f"{low} or {high}" if high - low == 1 else f"{low} to {high}"


def _last_step(found: dict[str, Any], at: str) -> str:
    if found.get("step_exact", True):
        return f"last step {found.get('step')}{at}"
    text = f"last step {step_range(found)}"
    if found.get("step_max") is not None:
        text += f": the ranks waiting for it completed step {found['step_max']}"
    beat = found.get("heartbeat_step")
    return text + (f"; its last heartbeat said {beat}{at}" if beat is not None else "")
