"""Stability benchmark: learning-rate sensitivity of every fix, one table, one figure.

    python scripts/stability_bench.py --out runs/stab --preset tiny       # 2-core CPU, < 15 min
    python scripts/stability_bench.py --out runs/stab --preset gpu --launcher slurm \\
        --extra hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1
    python scripts/stability_bench.py --summarize-only runs/stab           # table + figure again

Grid: log-spaced learning rates (``--lr-min``, ``--lr-max``, ``--lr-points``; default 3e-4 to
3e-1, 7 points) x fixes (``--fixes``, plus any ``--fix name="override override"``) x optional
model widths (``--widths``). Design: **one Hydra multirun per fix (and width)**,
``python train.py -m <preset> <fix> optim.lr=a,b,c hydra.sweep.dir=OUT/<fix>``, each point in
``OUT/<fix>/lr<lr>/`` (Hydra cannot zip override bundles, and a sweep per fix keeps a fix's
overrides in one place). ``--launcher slurm`` adds ``hydra/launcher=slurm``: the same sweeps
become job arrays. Resumable: a rerun launches only the learning rates whose run directory has
no completed/diverged ``summary.json`` (an interrupted point resumes from its ``last.pt``), and
those that ran with other settings (``--extra``, the preset), whose old run moves to
``lr<lr>.previous/``.

The fixes (``{warmup}`` is the preset's warmup). Every row but the warmup baseline
(``adamw_warmup``) runs **without** warmup, the setting that breaks at high learning rates,
so that each row shows what that one fix buys over the ``adamw`` row:

    adamw_warmup   optim=adamw warmup={warmup}
    adamw          optim=adamw warmup=0
    adamw2         optim=adamw2 optim.tau=0.01 warmup=0     (tau: the GPT value, 000 Table 2)
    sigma          optim=adamw warmup=0 reparam=sigma
    qknorm         optim=adamw warmup=0 attention=qknorm
    stable         optim=adamw warmup=0 norm=stablenorm attention=stable init=stable
    zloss          optim=adamw warmup=0 regularizer=zloss

Then writes OUT/stability.md, OUT/stability.csv and OUT/stability.png of this invocation's fixes
and learning rates (``--summarize-only``: of every run under OUT, whatever settings each ran with)
(stabletrain/analysis/stability.py defines the final loss, L0 and the LR-sensitivity score).

Presets (``--preset``; every key can still be overridden with ``--extra``):
  tiny  byte-level GPT, 2 layers, width 64, context 64, batch 16, 300 steps, lr 1e-3 to 1
        (5 points), no clipping: 35 runs for the 7 default fixes. Measured: 6.7 min for the full
        grid on a 2-core CPU with OMP_NUM_THREADS=1 (README "Stability benchmark").
  cpu   (default) gpt_mini (4 layers, width 128, context 128), batch 32, 1000 steps, lr 3e-4 to 3e-1.
  gpu   the scale of Wortsman et al. (2023)'s small models: pre-LN GPT, width 512 (8 heads of 64),
        depth 8, context 512, batch 256, 10k steps, warmup 5k for adamw_warmup, AdamW betas
        (0.9, 0.95), weight decay 1e-4, no clipping, bf16; widths 256,512,1024 with
        ``--widths``. Documented, not run here.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stabletrain.analysis import stability  # noqa: E402
from stabletrain.metrics import previous_name  # noqa: E402

FIXES = {
    "adamw_warmup": "optim=adamw warmup={warmup}",
    "adamw": "optim=adamw warmup=0",
    "adamw2": "optim=adamw2 optim.tau=0.01 warmup=0",
    "sigma": "optim=adamw warmup=0 reparam=sigma",
    "qknorm": "optim=adamw warmup=0 attention=qknorm",
    "stable": "optim=adamw warmup=0 norm=stablenorm attention=stable init=stable",
    "zloss": "optim=adamw warmup=0 regularizer=zloss",
}

COMMON = ["logger=none", "logger.progress=false", "optim.betas=[0.9,0.95]", "resume=auto"]
PRESETS = {
    "tiny": dict(lr_min=1e-3, lr_max=1.0, lr_points=5, warmup=30, overrides=[
        "model=gpt_test", "model.embed_dim=64", "model.num_heads=2", "model.depth=2", "model.block_size=64",
        "batch_size=16", "steps=300", "eval_every=300", "eval_batches=4", "ckpt_every=1000",
        "optim.weight_decay=0.1", "monitor=standard", "monitor.weight_every=100", "monitor.probe_every=50",
        "logger.log_every=25"]),
    "cpu": dict(lr_min=3e-4, lr_max=3e-1, lr_points=7, warmup=100, overrides=[
        "model=gpt_mini", "batch_size=32", "steps=1000", "eval_every=500", "eval_batches=8", "ckpt_every=500",
        "optim.weight_decay=0.1", "monitor=standard", "monitor.weight_every=100", "monitor.probe_every=100",
        "logger.log_every=50"]),
    "gpu": dict(lr_min=3e-4, lr_max=3e-1, lr_points=7, warmup=5000, overrides=[
        "model=gpt_mini", "model.embed_dim=512", "model.num_heads=8", "model.depth=8", "model.block_size=512",
        "batch_size=256", "steps=10000", "eval_every=1000", "eval_batches=20", "ckpt_every=1000",
        "optim.weight_decay=1e-4", "precision=bf16", "monitor=standard", "monitor.weight_every=500",
        "monitor.probe_every=500", "logger.log_every=50"]),
}


def log_grid(lo: float, hi: float, n: int) -> list[float]:
    """``n`` log-spaced values from ``lo`` to ``hi``, 3 significant digits."""
    if n == 1:
        return [lo]
    return [float(f"{lo * (hi / lo) ** (i / (n - 1)):.3g}") for i in range(n)]


def parse_fix(text: str) -> tuple[str, str]:
    name, sep, overrides = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--fix wants NAME=\"override override\", got {text!r}")
    return name, overrides


def done_lrs(group_dir: Path, overrides: list[str]) -> tuple[list[float], dict[float, Path]]:
    """Learning rates of ``group_dir`` whose run ended (completed or diverged) with these
    ``overrides``, and those that ended with others (an earlier call's ``--extra``, preset or
    warmup), with their directories: a rerun must not take those for this benchmark's points."""
    import yaml

    def settings(ovs) -> dict:  # as Hydra records them: the last value of a key, false as False
        out = {}
        for o in ovs:
            key, _, val = o.partition("=")
            out[key] = yaml.safe_load(val) if val else val
        out.pop("optim.lr", None)
        return out

    done, other = [], {}
    for d in sorted(group_dir.glob("*/")) if group_dir.is_dir() else []:
        p = stability.read_point(group_dir.name, d)
        if p is None or p.status not in stability.DONE:
            continue
        given = d / ".hydra" / "overrides.yaml"
        ran = settings(yaml.safe_load(given.read_text()) or []) if given.is_file() else None
        if ran is None or ran == settings(overrides):
            done.append(p.lr)
        else:
            other[p.lr] = d
    return done, other


def sweep_command(group_dir: Path, overrides: list[str], lrs: list[float], launcher: str | None) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *overrides, "optim.lr=" + ",".join(repr(x) for x in lrs),
           f"hydra.sweep.dir={group_dir}", "hydra.sweep.subdir=lr${optim.lr}"]
    if launcher:
        cmd.append(f"hydra/launcher={launcher}")
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="benchmark directory (one subdirectory per fix)")
    ap.add_argument("--summarize-only", type=Path, metavar="OUT", help="only write the table and figure of OUT")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--fixes", help=f"comma-separated subset of {','.join(FIXES)} (default: all)")
    ap.add_argument("--fix", action="append", type=parse_fix, default=[], metavar='NAME="OVERRIDES"',
                    help="an extra fix: its name and its overrides ({warmup} is the preset's warmup)")
    ap.add_argument("--lr-min", type=float)
    ap.add_argument("--lr-max", type=float)
    ap.add_argument("--lr-points", type=int)
    ap.add_argument("--lrs", help="explicit comma-separated learning rates (replaces the log grid)")
    ap.add_argument("--warmup", type=float, help="warmup of the *_warmup fixes (default: the preset's)")
    ap.add_argument("--widths", help="comma-separated model.embed_dim values; one sweep per fix and width")
    ap.add_argument("--vision", action="store_true", help="ViT on the embedded digits instead of the text GPT "
                    "(model=vit_mini; tiny preset: model=vit_test)")
    ap.add_argument("--launcher", help="a hydra/launcher option, e.g. slurm")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--dry-run", action="store_true", help="print the sweeps, run nothing")
    a = ap.parse_args(argv)

    if a.summarize_only is not None:
        return summarize(a.summarize_only, None)
    if a.out is None:
        ap.error("--out is required (or --summarize-only OUT)")

    preset = PRESETS[a.preset]
    base = [*COMMON, *preset["overrides"]]
    if a.vision:
        base = [o for o in base if not o.startswith("model")] + [
            "model=vit_test" if a.preset == "tiny" else "model=vit_mini", "data=digits"]
    try:
        lrs = ([float(x) for x in a.lrs.split(",") if x.strip()] if a.lrs else
               log_grid(a.lr_min or preset["lr_min"], a.lr_max or preset["lr_max"],
                        a.lr_points or preset["lr_points"]))
    except ValueError as e:
        ap.error(f"--lrs {a.lrs}: {e}; give comma-separated numbers, e.g. --lrs 1e-3,1e-2")
    if not lrs or min(lrs) <= 0:
        ap.error("the learning rates must be positive")
    warmup = a.warmup if a.warmup is not None else preset["warmup"]
    names = a.fixes.split(",") if a.fixes else list(FIXES)
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        ap.error(f"unknown fix {', '.join(unknown)}; choose from {', '.join(FIXES)} or give --fix NAME=\"...\"")
    fixes = {n: FIXES[n] for n in names} | dict(a.fix)
    widths = [int(w) for w in a.widths.split(",")] if a.widths else [None]

    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    order, failed = [], []
    for name, bundle in fixes.items():
        for width in widths:
            group = name if width is None else f"{name}-w{width}"
            order.append(group)
            group_dir = out / group
            overrides = [*base, *shlex.split(bundle.format(warmup=warmup)),
                         *([f"model.embed_dim={width}"] if width else []), *a.extra]
            ended, other = done_lrs(group_dir, overrides)
            todo = [lr for lr in lrs if not any(math.isclose(lr, e, rel_tol=1e-9) for e in ended)]
            stale = {lr: d for lr, d in other.items() if any(math.isclose(lr, t, rel_tol=1e-9) for t in todo)}
            if stale and not a.dry_run:  # resume=auto would continue them: they start afresh, the old kept aside
                for d in stale.values():
                    d.rename(previous_name(d))
            if stale:
                print(f"[{group}] lr {', '.join(f'{x:g}' for x in stale)} ran with other settings: running again "
                      f"(the earlier runs moved to <dir>.previous)", file=sys.stderr)
            if not todo:
                print(f"[{group}] all {len(lrs)} learning rates done, skipped", file=sys.stderr)
                continue
            cmd = sweep_command(group_dir, overrides, todo, a.launcher)
            print(f"[{group}] {len(todo)} of {len(lrs)} learning rates: {shlex.join(cmd)}", file=sys.stderr)
            if a.dry_run:
                continue
            group_dir.mkdir(parents=True, exist_ok=True)
            with open(group_dir / "launch.log", "a") as log:
                start = log.tell()
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "WANDB_MODE": "disabled"}).returncode
            if rc != 0:
                failed.append(group)
                why = last_error(group_dir / "launch.log", start)
                print(f"[{group}] sweep exited with {rc}{': ' + why if why else ''}; see {group_dir / 'launch.log'}",
                      file=sys.stderr)
    if a.dry_run:
        return 0
    rc = summarize(out, order, lrs)
    if failed:
        print(f"sweeps that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return rc


def last_error(log: Path, start: int) -> str | None:
    """The last ``error: ...`` line a launch wrote to ``log`` from byte ``start``: the reason a
    sweep never started (no SLURM here, a refused setting), said where the bench is read."""
    with open(log, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return errors[-1] if errors else None


def summarize(out: Path, order: list[str] | None, lrs: list[float] | None = None) -> int:
    """The table and figure of OUT: of this run's fixes and learning rates (``order``, ``lrs``),
    or, for --summarize-only (None), of every run under it."""
    md, paths = stability.write(out, order, only=order, lrs=lrs)
    if order is not None:
        rest = sorted({p.group for pts in stability.collect(out).values() for p in pts} - set(order))
        if rest:
            print(f"note: left out of the table, as runs of other invocations whose settings this one did not "
                  f"check: {', '.join(rest)} (--summarize-only {out} tabulates every run)", file=sys.stderr)
    if not md:
        plain = any(p.parent.parent == out for p in out.glob("*/summary.json"))
        print(f"error: no benchmark run under {out}" + (
            f" (it holds a plain sweep's runs, {out}/<n>/, not the benchmark's {out}/<fix>/lr<lr>/: "
            f"scripts/summarize_sweep.py {out} tabulates those)" if plain else ""), file=sys.stderr)
        return 1
    print(md)
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
