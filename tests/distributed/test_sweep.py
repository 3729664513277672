"""A local Hydra multirun over tau x alpha, summarized by scripts/summarize_sweep.py."""

from __future__ import annotations

import csv
import sys

from tests.distributed.common import GPT, run
from tests.helpers import ROOT

# lr=30 wrecks an unbounded AdamW within a few steps (the loss jumps ~1000x); tau=0.01 caps
# every update at 1% of the weight's spectral norm and the same lr trains. A short spike
# window makes "diverged" a matter of 5 steps.
SWEEP = ["optim=adamw2", "optim.tau=0.01,1e9", "norm=stablenorm", "norm.alpha=0.25,0.5", "optim.lr=30",
         "steps=12", "batch_size=8", "schedule=constant", "eval_every=6",
         "divergence.warmup_steps=2", "divergence.window=3", "divergence.spike_factor=2"]


def test_multirun_over_tau_and_alpha_shows_completed_and_diverged(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # Numbered subdirs: the default name spells out every override and outgrows NAME_MAX.
    run([sys.executable, str(ROOT / "train.py"), "-m", *GPT, *SWEEP, f"hydra.sweep.dir={sweep_dir}",
         "hydra.sweep.subdir=${hydra.job.num}"], cwd=tmp_path)
    plot = tmp_path / "tau.png"
    out = run([sys.executable, str(ROOT / "scripts" / "summarize_sweep.py"), str(sweep_dir),
               "--x", "optim.tau", "--series", "norm.alpha", "--plot", str(plot)], cwd=tmp_path)

    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    table = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    assert header[:2] == ["norm.alpha", "optim.tau"]  # only the swept keys, not the fixed ones
    assert [(r["norm.alpha"], r["optim.tau"], r["status"]) for r in table] == [
        ("0.25", "0.01", "completed"), ("0.25", "1e+09", "diverged"),
        ("0.5", "0.01", "completed"), ("0.5", "1e+09", "diverged")]
    for r in table:
        assert (r["diverged_at"] != "") == (r["status"] == "diverged")
        assert r["step"] == ("12" if r["status"] == "completed" else r["diverged_at"])
    assert all(r["final_val/loss"] for r in table if r["status"] == "completed")
    with open(sweep_dir / "summary.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["completed", "diverged", "completed", "diverged"]
    assert plot.stat().st_size > 10_000
