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

__all__ = ["Heartbeat", "culprit", "describe", "frame_facts", "last_incident", "suspicion"]

STALE_BEATS = 3  # a heartbeat older than this many intervals means the process is not running

# Paths (with "/" separators) whose frames mean "waiting for the other ranks".
_COLLECTIVE = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/", "/ftkit/control/agreement.py")
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

    Returns ``rank``, ``host``, ``step``, ``last_step_wall``, ``frame``, ``file`` (its stack
    dump, when it could write one), ``running``, ``evidence`` (which rule named it, in words),
    ``declared_by`` (the first rank to fire), ``time`` (when) and ``others`` (every other
    rank's facts). See the module docstring for the rule.
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
    return {
        "rank": pick.rank, "host": pick.host, "step": pick.step, "last_step_wall": pick.last_step_wall,
        "frame": pick.frame, "file": files.get(pick.rank), "running": pick.running, "evidence": evidence,
        "declared_by": int(first.get("rank", 0)), "time": first.get("time"),
        "others": [b.to_json() for b in facts if b.rank != pick.rank],
    }


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
            f"steps first (last step {found.get('step')}{at}), {where}: {found['evidence']}"
            + (f"; {waiting} other rank(s) waited on it" if waiting else "")
            + (f"; stacks: {found['file']}" if found.get("file") else ""))
