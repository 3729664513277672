"""Draw the papers' training-dynamics figures of one run into RUN_DIR/plots.

    python scripts/plot_dynamics.py outputs/<run> [--blocks 0,2,4] [--out DIR]

Reads RUN_DIR/metrics.jsonl (and summary.json if present); figures whose metrics the run did
not log are skipped with a note. See stabletrain/analysis/plots.py for the list of figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.analysis.plots import plot_dynamics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    ap.add_argument("--blocks", default=None,
                    help="comma-separated block positions in depth order (0,2,-1) or names "
                         "(blocks.3); default: all up to 8, else 7 spread over the depth")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = ap.parse_args(argv)
    try:
        paths = plot_dynamics(args.run_dir, blocks=args.blocks, out_dir=args.out)
    except (FileNotFoundError, ValueError) as e:  # no such run; a block it does not have
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())
