"""One row per run of a sweep: the swept values, status, step reached, final metrics, and the
skipped steps, rollbacks and alerts of the runs that had any.

    python scripts/summarize_sweep.py multirun/2025-01-01/12-00-00 \
        [--x optim.tau] [--series optim] [--metric final_val/loss] [--plot tau.png]

Prints a markdown table, writes SWEEP_DIR/summary.csv (not into a single run's directory), and
with --plot draws the final metric against the --x value (categorical when not numeric), one
line per --series value, diverged runs as crosses, or as triangles on the axis edge where their
value is off it. Left out, --x is the one swept key (or the one besides seed) and --series the
one swept key besides --x.
Runs are the directories below SWEEP_DIR holding a summary.json, the points Hydra started
(unfinished without one) and the points of the sweep's grid that never started.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.analysis import sweeps


def _numeric(table: list[dict], key: str) -> bool:
    values = [row.get(key) for row in table if row["status"] != "not started"]
    return bool(values) and all(sweeps.number(v) is not None and not isinstance(v, bool) for v in values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--x", help="swept key for the plot's x axis, e.g. optim.tau")
    ap.add_argument("--series", help="swept key drawn as one line per value, e.g. optim")
    ap.add_argument("--metric", help="column to plot (default: final_val/loss, else final_task_loss, else final_loss)")
    ap.add_argument("--plot", type=Path, help="write the plot here (.png, .pdf, .svg)")
    args = ap.parse_args(argv)

    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory; give a sweep's directory (hydra.sweep.dir, by default "
              f"multirun/DATE/TIME)", file=sys.stderr)
        return 1
    runs = sweeps.find_runs(args.sweep_dir)
    if not runs:
        print(f"error: no run with a summary.json under {args.sweep_dir}", file=sys.stderr)
        return 1
    columns, table = sweeps.rows(runs, args.sweep_dir)
    print(sweeps.markdown(columns, table))
    sources = sorted({m.parent for m in args.sweep_dir.rglob("multirun.yaml")})
    if len(sources) > 1:  # a day's folder, given for one sweep's
        named = ", ".join(p.relative_to(args.sweep_dir).as_posix() or "." for p in sources[:4])
        print(f"\nnote: these runs come from {len(sources)} sweeps ({named}{', ...' if len(sources) > 4 else ''}), "
              f"in one table: give one sweep's directory to compare its points alone", file=sys.stderr)
    # each row's directory: the run column is relative to SWEEP_DIR only for the runs below it
    root = args.sweep_dir.resolve()
    where = {(r.path.resolve().relative_to(root).as_posix() if root in r.path.resolve().parents else r.path.name):
             r.path.resolve() for r in runs}
    unfinished = [row["run"] for row in table if row["status"] == "unfinished" and row["run"] in where]
    # a sweep's point sits beside the sweep's multirun.yaml; a single run (a day's folder) does not
    points = [run for run in unfinished if (where[run].parent / "multirun.yaml").is_file()]
    alone = [run for run in unfinished if run not in points]
    if points:
        homes = ", ".join(sorted({str(where[run].parent) for run in points}))
        print(f"\nunfinished (no summary.json: still running, or stopped): {', '.join(points)}; a stopped sweep "
              f"goes on with its own command plus resume=auto hydra.sweep.dir={homes}", file=sys.stderr)
    if alone:
        dirs = ", ".join(str(where[run]) for run in alone)
        print(f"\nunfinished (no summary.json: still running, or stopped): {', '.join(alone)}; a stopped run goes on "
              f"with its own command plus resume=auto hydra.run.dir=<its directory> ({dirs})", file=sys.stderr)
    if [r.path.resolve() for r in runs] == [args.sweep_dir.resolve()]:
        # a run's own directory: its summary.json is the record; a csv beside it would be clutter
        print(f"\n{args.sweep_dir} is one run, not a sweep (no summary.csv written); to compare runs, give the "
              f"directory above them: a sweep's (multirun/DATE/TIME) or a day's (outputs/DATE)", file=sys.stderr)
    else:
        csv_path = args.sweep_dir / "summary.csv"
        sweeps.write_csv(csv_path, columns, table)
        waiting = sum(row["status"] == "not started" for row in table)
        count = f"{len(table)} run{'s' * (len(table) != 1)}" + (f" ({waiting} not started)" if waiting else "")
        print(f"\n{count}; table written to {csv_path}", file=sys.stderr)
    if args.plot:
        import matplotlib.pyplot as plt

        kinds = plt.gcf().canvas.get_supported_filetypes()
        plt.close()
        if args.plot.suffix.lstrip(".").lower() not in kinds:
            print(f"error: --plot {args.plot}: matplotlib writes {', '.join('.' + k for k in sorted(kinds))}; "
                  f"name the file with one of them, e.g. tau.png", file=sys.stderr)
            return 2
        swept = sweeps.varying_keys(runs)
        metric = args.metric or next(c for c in ("final_val/loss", "final_task_loss", "final_loss") if c in columns)
        if args.metric is not None and metric not in columns and f"final_{metric}" in columns:
            metric = f"final_{metric}"  # --metric val/acc: the final value is what a sweep compares
        for key in (args.x, args.series, metric):
            if key is not None and key not in columns:
                print(f"error: {key!r} is not a column; choose from: {', '.join(columns)}", file=sys.stderr)
                return 2
        if args.x is None and len(swept) == 1:
            args.x = swept[0]
        elif args.x is None and len(swept) == 2 and "seed" in swept:  # a value swept over seeds
            args.x = next(k for k in swept if k != "seed")
        elif args.x is None and len(swept) == 2 and len(numeric := [k for k in swept if _numeric(table, k)]) == 1:
            args.x = numeric[0]  # optim.tau=... against attention=...: the numbers make the axis
            print(f"x axis: {args.x}, the swept key with numeric values (--x KEY picks another)", file=sys.stderr)
        elif args.x is None:
            print(f"error: --plot needs --x KEY, one of the swept keys: {', '.join(swept) or 'none (nothing varies)'}",
                  file=sys.stderr)
            return 2
        if args.series is not None and args.series == args.x:
            rest = [k for k in swept if k != args.x]
            print(f"error: --series {args.series} is the --x key: each line would join the points of one x value; "
                  + (f"the other swept keys: {', '.join(rest)}" if rest else "leave --series out"), file=sys.stderr)
            return 2
        others = [k for k in swept if k not in (args.x, args.series)]
        if args.series is None and len(others) == 1:
            # one line through runs that differ in another key would zig-zag between them
            args.series = others[0]
            print(f"one line per {args.series} (--series {args.series})", file=sys.stderr)
        elif args.series is None and others:
            print(f"note: {', '.join(others)} also vary: points of one --x value differ in them "
                  f"(--series KEY draws one line per value)", file=sys.stderr)
        where = args.sweep_dir.resolve()
        ended = sum(row["status"] in ("completed", "diverged") for row in table)
        title = f"{where.parent.name}/{where.name}: {len(table)} runs" + (
            f", {len(table) - ended} not finished" if ended < len(table) else "")
        chance = sweeps.chance_level([r for r in runs if r.summary.get("status") != "not started"], metric)
        written = sweeps.plot(args.plot, table, args.x, args.series, metric, title, chance)
        print(f"plot written to {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
