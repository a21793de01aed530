"""Process facts from /proc (Linux). No torch."""

from __future__ import annotations

__all__ = ["proc_start"]


def proc_start(pid: int) -> str | None:
    """The start time (clock ticks since boot) of a live, not zombie, process; None if it is gone.

    Compare it with an earlier reading to tell the same process from a later one reusing its pid.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]
