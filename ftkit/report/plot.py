"""The timeline picture of ``ftkit report --plot``: one lane per run, colored by bucket.

matplotlib is imported here only (the ``plot`` extra), with the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

__all__ = ["COLORS", "plot_timeline"]

COLORS = {
    "restart": "#9467bd",
    "productive": "#2ca02c",
    "stall": "#d62728",
    "redone": "#ff7f0e",
    "exit_wait": "#8c564b",
    "between": "#c7c7c7",
}


def plot_timeline(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw ``report`` (from :func:`ftkit.report.analyse`) into ``path`` (PNG, SVG, PDF)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ConfigError("ftkit report --plot needs matplotlib: pip install 'ftkit[plot]'") from exc
    runs = report["runs"]
    if not runs:
        raise ConfigError("ftkit report --plot: the events log holds no run to draw")
    t0 = runs[0]["start"]
    span = max(r["end"] for r in runs) - t0
    scale, unit = (60.0, "min") if span > 600 else (1.0, "s")

    def x(t: float) -> float:
        return (t - t0) / scale

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(runs)))
    h = 0.6
    for r in runs:
        y = len(runs) - 1 - r["run"]
        loop_from = r["loop_start"] + r["restart_parts"]["warmup"]

        def bar(a: float, b: float, kind: str, yy: float = y, hh: float = h) -> None:
            if b > a:
                ax.broken_barh([(x(a), (b - a) / scale)], (yy - hh / 2, hh), color=COLORS[kind], linewidth=0)

        bar(r["start"], loop_from, "restart")
        bar(loop_from, r["loop_end"], "productive")
        if r["redone_from"] is not None:
            bar(r["redone_from"], r["loop_end"], "redone")
        for s in r["stalls"]:
            kind = "exit_wait" if s["exiting"] else "stall"
            bar(s["time"] - s["stall"], s["time"], kind)
        bar(r["loop_end"], r["end"], "exit_wait")
        if r["between_next"]:
            bar(r["end"], r["end"] + r["between_next"], "between", yy=y - 0.5, hh=0.12)
        saves = [s["time"] for s in r["saves"]]
        ax.plot([x(t) for t in saves], [y + h / 2 + 0.08] * len(saves), "v", color="black", markersize=5)
        label = r["cause"] if r["end_known"] else f"{r['cause']}"
        ax.annotate(label, (x(r["end"]), y), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8, color="#d62728" if r["unplanned"] else "black")
    ax.set_yticks(range(len(runs)))
    ax.set_yticklabels([f"run {r['run']}\n{r['job_id'] or '-'}/{r['restart_count']}" for r in reversed(runs)],
                       fontsize=8)
    ax.set_xlabel(f"time since the first run started ({unit})")
    ax.set_xlim(0, span / scale * 1.22)
    handles = [Patch(color=COLORS[k], label=k.replace("_", " ")) for k in COLORS]
    handles.append(plt.Line2D([], [], marker="v", color="black", linestyle="", label="checkpoint durable"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(runs)), ncol=7,
              fontsize=8, frameon=False)
    gp = report.get("goodput")
    ax.set_title(f"goodput {100 * gp:.1f} % of {report['wall'] / scale:.1f} {unit} in {len(runs)} runs"
                 if gp is not None else "timeline", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
