"""The AdamW² paper's claim, reproduced on the embedded text: without warmup AdamW
collapses at a high learning rate, AdamW² at the same rate trains like AdamW with warmup.

    python scripts/repro_warmup.py --out runs/repro            # on a GPU: a few minutes
    python scripts/repro_warmup.py --steps 20 --warmup 5 --lrs 1e-2 --extra model.depth=2 --out /tmp/r   # smoke: 1 min

Runs a byte-level GPT on the Python standard library's sources for each learning rate with
(a) AdamW, no warmup, (b) AdamW with linear warmup, (c) AdamW² (tau 0.01, the GPT value of
000 Table 2), no warmup; then writes ``results.md`` (final val loss, alerts, the largest
per-head sigma1(Wq^h^T Wk^h) of any block and step, block 0's smallest attention entropy)
and overlays the curves with ``compare_runs`` in ``OUT/compare_lr<lr>/compare.png``, whose
sigma1 and entropy panels draw those same two quantities against step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabletrain.cli import checked_config  # noqa: E402
from stabletrain.analysis.compare import compare_runs  # noqa: E402
from stabletrain.metrics import read_records  # noqa: E402
from stabletrain.monitor import names as N  # noqa: E402
from stabletrain.run import run  # noqa: E402

# gpt_mini made 6 x 256, named by its shape (gpt_6x256) in the runs' start lines and config.yaml
MODEL = ["model=gpt_mini", "model.depth=6", "model.embed_dim=256", "model.num_heads=4", "model.block_size=256"]
VARIANTS = {
    "adamw_nowarmup": ["optim=adamw", "warmup=0"],
    "adamw_warmup": ["optim=adamw"],  # warmup filled in from --warmup
    "adamw2_nowarmup": ["optim=adamw2", "optim.tau=0.01", "warmup=0"],
}
# the first layer is where entropy collapses without warmup; table and figure both show it
ENTROPY_BLOCK = "blocks.0"


def last(recs: list[dict], key: str):
    vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
    return vals[-1] if vals else float("nan")


def extreme(recs: list[dict], suffix: str, pick):
    vals = [v for r in recs for k, v in r.items() if k.endswith(suffix) and isinstance(v, (int, float))]
    return pick(vals) if vals else float("nan")


def label(variant: str, warmup: int) -> str:
    """A variant as the README's table names it."""
    return {"adamw_nowarmup": "AdamW, no warmup", "adamw_warmup": f"AdamW, {warmup}-step warmup",
            "adamw2_nowarmup": "AdamW² (tau 0.01), no warmup"}[variant]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/repro_warmup", help="one run directory per lr and variant, the "
                    "results.md table and compare_lr<lr>/compare.png (default %(default)s)")
    ap.add_argument("--lrs", default="3e-3,1e-2", help="comma-separated peak learning rates (default %(default)s)")
    ap.add_argument("--steps", type=int, default=1500, help="steps per run (default %(default)s; over an hour "
                    "a run on a 2-core CPU, where --steps 100 --extra model.depth=2 is a quick look)")
    ap.add_argument("--warmup", type=int, default=150, help="the warmed-up AdamW run's linear warmup steps "
                    "(default %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default %(default)s)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        sys.exit(f"error: --out {out} is a file; give a folder for the runs and results.md")
    lrs = [lr.strip() for lr in a.lrs.split(",") if lr.strip()]
    for lr in lrs:
        try:
            ok = float(lr) > 0
        except ValueError:
            ok = False
        if not ok:
            sys.exit(f"error: --lrs {lr} is not a learning rate: give positive numbers, e.g. --lrs 3e-3,1e-2")

    def overrides(lr: str, name: str) -> list[str]:
        over = VARIANTS[name] + ([f"warmup={a.warmup}"] if name == "adamw_warmup" else [])
        return MODEL + over + [f"optim.lr={lr}", f"steps={a.steps}", f"batch_size={a.batch}",
                               "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]", "grad_clip=1.0",
                               "logger=none", "monitor=standard", "monitor.weight_every=50",
                               "monitor.probe_every=100", "eval_every=250", "logger.log_every=50", *a.extra]

    # every run checked before the first starts: a bad --extra or lr is one line, not an hour in
    configs = {(lr, name): checked_config(overrides(lr, name)) for lr in lrs for name in VARIANTS}
    rows = []
    for lr in lrs:
        dirs, labels = [], []
        for name in VARIANTS:
            cfg = configs[(lr, name)]
            cfg.model.name = f"gpt_{cfg.model.depth}x{cfg.model.embed_dim}"
            d = out / f"lr{lr}_{name}"
            s = run(cfg, d)
            if s["status"] == "interrupted":  # Ctrl-C stops the script, not this one run
                print(f"interrupted at lr {lr}, {label(name, a.warmup)}: the runs under {out} so far are kept; "
                      f"run the script again to start over", file=sys.stderr)
                sys.exit(128 + int(s.get("signal", 2)))
            recs = read_records(d / "metrics.jsonl")  # torn lines dropped
            rows.append((lr, name, s["status"], last(recs, N.VAL_LOSS), len(s.get("alerts", [])),
                         extreme(recs, f"/{N.WQ_T_WK_MAX}", max),
                         extreme(recs, N.metric(N.ENTROPY, ENTROPY_BLOCK, N.ENT_MIN), min)))
            dirs.append(d)
            labels.append(label(name, a.warmup))
        compare_runs(dirs, out / f"compare_lr{lr}", labels=labels,
                     title=f"lr {lr}: AdamW without and with warmup, AdamW² without",
                     qk=N.WQ_T_WK_MAX, entropy_block=ENTROPY_BLOCK)
    lines = ["| lr | optimizer | status | final val loss | alerts | max sigma1(Wq^h^T Wk^h) "
             "| min entropy, block 0 (nats) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {lr} | {n} | {st} | {vl:.3f} | {al} | {qk:.3g} | {en:.3g} |" for lr, n, st, vl, al, qk, en in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {out / 'results.md'}, " + ", ".join(str(out / f"compare_lr{lr}" / "compare.png") for lr in lrs))


if __name__ == "__main__":
    main()
