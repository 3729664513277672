"""Overlay the health curves of several runs, labelled by the settings that differ between them.

    python scripts/compare_runs.py outputs/run_a outputs/run_b ... [--out DIR]   # default run_a/plots
    python scripts/compare_runs.py multirun/2025-01-01/12-00-00                  # every point of a sweep

Panels: training loss, validation metric, learning rate (AdamW²'s share of tensors at the
bound when every run has one schedule, as in a sweep of tau), max over blocks of
sigma1(W_q^T W_k), min over blocks of the attention entropy; a diverged run's step is marked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.analysis.compare import compare_runs


def sweep_runs(path: Path) -> list[Path]:
    """``path`` itself, or the runs below a sweep directory (any without metrics.jsonl of its own)."""
    if not path.is_dir() or (path / "metrics.jsonl").exists():
        return [path]
    found = sorted({r.parent for r in path.rglob("metrics.jsonl")})
    return found or [path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl, or sweep directories")
    ap.add_argument("--out", default=None, help="output folder (default: the first run's plots/, a sweep's own)")
    args = ap.parse_args(argv)
    runs = [r for d in args.run_dirs for r in sweep_runs(Path(d))]
    sweeps = sorted({m.parent for d in args.run_dirs if Path(d).is_dir() for m in Path(d).rglob("multirun.yaml")})
    if len(sweeps) > 1:  # a day's folder given for a sweep's: the legend holds every key any two differ in
        named = ", ".join(p.name for p in sweeps[:4]) + (", ..." if len(sweeps) > 4 else "")
        print(f"note: these {len(runs)} runs come from {len(sweeps)} sweeps ({named}): give one sweep's directory "
              f"to compare its points alone", file=sys.stderr)
    out = Path(args.out or Path(args.run_dirs[0]) / "plots")
    earlier = (out / "compare.png").exists()
    try:
        paths = compare_runs(runs, out)
    except (FileNotFoundError, ValueError) as e:  # no such run; an unreadable summary.json
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    if paths and earlier:  # a second comparison from the same first run lands in the same file
        print(f"note: replaced the earlier {out / 'compare.png'}; --out DIR keeps a comparison apart", file=sys.stderr)
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())
