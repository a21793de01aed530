"""Benchmark results as one table and one picture: the docs' docs/img/benchmarks.png.

    python3 benchmarks/plot_results.py [--checkpoint-json FILE] [--steps N] [--no-ranks]
                                       [--json OUT] [--png OUT]

Measures the per-step cost of ``ft.check(step)`` (``benchmarks/check_overhead.py``: one
process, and two gloo ranks at agreement cadence 1 and the default) and, with
``--checkpoint-json``, reads what ``benchmarks/checkpoint_speed.py --json FILE`` measured:
per variant and state size, how long the training loop waits (stall) and how long until the
checkpoint is durable (persist). Prints both as tables; ``--json`` writes them, ``--png``
draws them (needs matplotlib: ``pip install matplotlib``, part of the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_overhead  # the measurement itself lives there

# checkpoint_speed.py's variants, in the order the picture shows them
VARIANTS = ("copy", "ftkit-async", "ftkit-shm", "torch.save", "dcp", "dcp-async", "raw-write")


def measure_checks(steps: int, ranks: bool) -> list[dict]:
    """Rows of (setting, µs per check, µs per empty iteration, overhead µs)."""
    rows = [("1 process", *check_overhead.measure(steps, 1))]
    if ranks:
        from ftkit.control.agreement import AgreementConfig

        default = AgreementConfig().every
        for every in sorted({1, default}):
            label = f"2 ranks, every={every}" + (" (default)" if every == default else "")
            rows.append((label, *check_overhead.measure_ranks(max(steps // 10, 1000), every)))
    return [{"setting": label, "check_us": round(check, 3), "empty_us": round(empty, 3),
             "overhead_us": round(max(check - empty, 0.0), 3)} for label, check, empty in rows]


def checkpoint_rows(path: Path) -> list[dict]:
    """Stall and persist seconds per (size, variant) from checkpoint_speed.py's JSON."""
    data = json.loads(path.read_text())
    rows = []
    for size, variants in data["results"].items():
        for name in VARIANTS:
            r = variants.get(name, {})
            if "error" in r or not ({"stall_s", "persist_s"} & r.keys()):
                continue
            rows.append({"size_gb": float(size), "variant": name, "bytes": r.get("bytes"),
                         "stall_s": r.get("stall_s"), "persist_s": r.get("persist_s"),
                         "load_s": r.get("load_s")})
    return rows


def print_tables(checks: list[dict], ckpt: list[dict]) -> None:
    print(f"{'setting':<28} {'check µs':>9} {'empty µs':>9} {'overhead µs':>12} {'% of 100 ms step':>17}")
    for r in checks:
        share = r["overhead_us"] / (check_overhead.STEP_MS * 1e3) * 100
        print(f"{r['setting']:<28} {r['check_us']:>9.2f} {r['empty_us']:>9.2f} {r['overhead_us']:>12.2f} {share:>16.4f}%")
    if ckpt:
        print(f"\n{'state':>7} {'variant':<12} {'stall s':>8} {'persist s':>10} {'load s':>7}")

        def fmt(x):
            return "-" if x is None else f"{x:.3f}"

        for r in ckpt:
            print(f"{r['size_gb']:>5g}GB {r['variant']:<12} {fmt(r['stall_s']):>8} "
                  f"{fmt(r['persist_s']):>10} {fmt(r['load_s']):>7}")


def plot(checks: list[dict], ckpt: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: python3 -m pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if ckpt else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.4), squeeze=False)
    ax = axes[0][0]
    labels = [r["setting"] for r in checks][::-1]
    values = [r["overhead_us"] for r in checks][::-1]
    ax.barh(labels, values, color="#4477aa")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f} µs", va="center", fontsize=8)
    ax.set_xlabel("µs per ft.check(step), minus an empty loop")
    ax.set_title("Cost of the between-steps check", fontsize=10)
    ax.set_xlim(0, max([*values, 1.0]) * 1.35)
    if ckpt:
        ax = axes[0][1]
        sizes = sorted({r["size_gb"] for r in ckpt})
        names = [v for v in VARIANTS if any(r["variant"] == v for r in ckpt)]
        width = 0.8 / len(sizes)
        for i, size in enumerate(sizes):
            by = {r["variant"]: r for r in ckpt if r["size_gb"] == size}
            ys = [n + (i - (len(sizes) - 1) / 2) * width for n in range(len(names))]
            stall = [(by.get(v) or {}).get("stall_s") or 0 for v in names]
            persist = [(by.get(v) or {}).get("persist_s") or 0 for v in names]
            ax.barh(ys, persist, height=width, color="#dddddd", edgecolor="#999999",
                    label="until durable" if i == 0 else None)
            ax.barh(ys, stall, height=width * 0.6, color="#cc6677",
                    label="training loop waits" if i == 0 else None)
            for y, p in zip(ys, persist, strict=True):
                ax.text(p, y, f" {size:g} GB", va="center", fontsize=7, color="#555555")
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per checkpoint")
        ax.set_title("Checkpoint stall vs time to durable", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
             fontsize=6, color="#777777")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint-json", type=Path, metavar="FILE",
                    help="JSON written by benchmarks/checkpoint_speed.py --json FILE")
    ap.add_argument("--steps", type=int, default=20000, help="checks per measurement (default 20000)")
    ap.add_argument("--no-ranks", action="store_true", help="skip the two-rank (gloo) measurements")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the measurements to OUT")
    ap.add_argument("--png", type=Path, metavar="OUT", help="draw them into OUT (needs matplotlib)")
    args = ap.parse_args()

    checks = measure_checks(args.steps, ranks=not args.no_ranks)
    ckpt = checkpoint_rows(args.checkpoint_json) if args.checkpoint_json else []
    print_tables(checks, ckpt)
    if args.json:
        args.json.write_text(json.dumps({"checks": checks, "checkpoints": ckpt}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        plot(checks, ckpt, args.png)
        print(f"wrote {args.png} ({args.png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
