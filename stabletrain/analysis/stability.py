"""The stability benchmark's table, score and figure (``scripts/stability_bench.py``).

A benchmark directory ``OUT`` holds one Hydra multirun per fix (and width), ``OUT/<group>/``,
whose points are ``OUT/<group>/lr<lr>/`` run directories (``config.yaml``, ``summary.json``,
``metrics.jsonl``). ``<group>`` is the fix's name, ``<fix>-w<width>`` when widths are swept.

**Final loss** of a run: ``final["val/loss"]`` when the run evaluated, else its final training
loss. A diverged run has no final loss (it counts as ``L0`` in the score, below); a run with no
completed/diverged ``summary.json`` is *unfinished* and left out of the score.

**LR sensitivity** (Wortsman et al. 2023, Sec. 3.1): over the grid of learning rates,
``mean_lr min(loss(lr), L0) - min_lr loss(lr)``, with ``L0`` the loss at initialisation:
**decision** ``ln(model.vocab_size)`` for text (GPT) and ``ln(model.num_classes)`` for vision,
the loss of a uniform prediction; where ``config.yaml`` gives neither, the first ``loss``
logged in ``metrics.jsonl``. Lower is better; 0 means every learning rate reached the best loss.

The table also counts diverged runs and runs that raised a health alert, and gives the largest
``attn_logit_max/<block>`` and ``logits/log_z`` any run of the fix logged (over blocks, steps
and learning rates; finite values only). Reads files only: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from stabletrain.analysis import sweeps
from stabletrain.monitor import names as N

DONE = ("completed", "diverged")


@dataclass
class Point:
    """One run of the benchmark: a (fix, width) group at one learning rate."""

    group: str
    lr: float
    status: str  # completed | diverged | unfinished (anything else reads as unfinished)
    loss: float | None  # final loss (val if present), None when diverged, unfinished or non-finite
    l0: float | None
    alerted: bool = False
    logit_max: float | None = None
    log_z: float | None = None
    path: Path | None = None


def lr_sensitivity(losses: Sequence[float | None], l0: float) -> float:
    """``mean_i min(losses[i], l0) - min_i min(losses[i], l0)``; a ``None`` or non-finite loss
    (a diverged run) counts as ``l0``."""
    if not losses:
        return math.nan
    capped = [min(v, l0) if v is not None and math.isfinite(v) else l0 for v in losses]
    return sum(capped) / len(capped) - min(capped)


def _records(run_dir: Path):
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue


def _max(values) -> float | None:
    vals = [x for v in values if (x := sweeps.number(v)) is not None]
    return max(vals) if vals else None


def _blank(v: float | None) -> float | str:
    """None as an empty cell; a value of 0.0 stays a value."""
    return "" if v is None else v


def initial_loss(config: dict, run_dir: Path | None = None) -> float | None:
    """``L0``: ln(vocab) for GPT, ln(classes) for vision; else the first logged loss."""
    model = config.get("model") or {}
    k = model.get("vocab_size") if model.get("family") == "gpt" else model.get("num_classes")
    if isinstance(k, (int, float)) and k > 1:
        return math.log(k)
    for rec in _records(run_dir) if run_dir is not None else ():
        if (v := sweeps.number(rec.get(N.LOSS))) is not None:
            return v
    return None


def read_point(group: str, run_dir: Path) -> Point | None:
    """The run in ``run_dir``; None when it has no ``config.yaml`` (never started)."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except OSError:
        return None
    lr = sweeps.number((config.get("optim") or {}).get("lr"))
    if lr is None:
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {}
    status = summary.get("status") if summary.get("status") in DONE else "unfinished"
    final = summary.get("final") or {}
    loss = sweeps.number(final.get(N.VAL_LOSS, final.get(N.LOSS))) if status == "completed" else None
    recs = list(_records(run_dir))
    return Point(group, lr, status, loss, initial_loss(config, run_dir), bool(summary.get("alerts")),
                 _max(v for r in recs for k, v in r.items() if k.startswith(N.ATTN_LOGIT_MAX + "/")),
                 _max(r.get(N.LOG_Z) for r in recs), run_dir)


def collect(out_dir: str | Path) -> dict[str, list[Point]]:
    """Every run below ``out_dir``, by group (the first directory under ``out_dir``), by lr. Runs
    directly under ``out_dir`` (a plain sweep's ``0/``, ``1/``) belong to no fix and are left out."""
    root = Path(out_dir)
    groups: dict[str, list[Point]] = {}
    for run in sweeps.find_runs(root):
        rel = run.path.relative_to(root).parts
        if len(rel) < 2 or ".previous" in rel[-1]:  # a point run again with other settings: its old run
            continue
        p = read_point(rel[0], run.path)
        if p is not None:
            groups.setdefault(p.group, []).append(p)
    for pts in groups.values():
        pts.sort(key=lambda p: p.lr)
    return groups


def lr_label(lr: float) -> str:
    return f"{lr:.3g}"


def table(groups: dict[str, list[Point]], order: Sequence[str] | None = None) -> tuple[list[str], list[dict]]:
    """Columns and one row per group: the final loss at each lr ("diverged", "unfinished"),
    best loss, LR sensitivity, diverged / alerted counts, max attention logit, max log Z."""
    lrs = sorted({p.lr for pts in groups.values() for p in pts})
    names = [g for g in (order or []) if g in groups] + sorted(g for g in groups if g not in (order or []))
    lr_cols = [f"lr={lr_label(lr)}" for lr in lrs]
    columns = ["fix", *lr_cols, "best_loss", "lr_sensitivity", "finished", "diverged", "alerted",
               "max_attn_logit", "max_log_z", "L0"]
    rows = []
    for g in names:
        pts = groups[g]
        by_lr = {p.lr: p for p in pts}
        done = [p for p in pts if p.status in DONE]
        l0s = [p.l0 for p in pts if p.l0 is not None]
        l0 = l0s[0] if l0s else math.nan
        row: dict = {"fix": g}
        for lr, col in zip(lrs, lr_cols):
            p = by_lr.get(lr)
            row[col] = ("" if p is None else "diverged" if p.status == "diverged"
                        else "unfinished" if p.status != "completed" else p.loss if p.loss is not None else "nan")
        finite = [p.loss for p in done if p.loss is not None]
        row.update(best_loss=min(finite) if finite else "",
                   lr_sensitivity=lr_sensitivity([p.loss for p in done], l0) if done and l0s else "",
                   finished=f"{len(done)}/{len(lrs)}",
                   diverged=sum(p.status == "diverged" for p in pts), alerted=sum(p.alerted for p in pts),
                   max_attn_logit=_blank(_max(p.logit_max for p in pts)), max_log_z=_blank(_max(p.log_z for p in pts)),
                   L0=l0 if l0s else "")
        rows.append(row)
    return columns, rows


def markdown(columns: list[str], rows: list[dict]) -> str:
    return sweeps.markdown(columns, rows)


def figure(groups: dict[str, list[Point]], order: Sequence[str] | None = None):
    """Final loss against learning rate (log axis, ticks at the grid), one curve per group, the
    dashed line ``L0``; the axis ends just above it. Diverged runs are crosses on the top edge, runs
    that finished above ``L0`` triangles there, with their loss written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stabletrain.analysis.ticks import label_x_ticks, log_scale

    names = [g for g in (order or []) if g in groups] + sorted(g for g in groups if g not in (order or []))
    l0s = [p.l0 for g in names for p in groups[g] if p.l0 is not None]
    # A final loss above L0 is no better than not training (the sensitivity caps it there too); drawn at
    # its value it would squash every other curve, so the axis ends just above L0 and such a run is a
    # triangle on the top edge with its value written by it.
    ceiling = l0s[0] if l0s else math.inf
    fig, ax = plt.subplots(figsize=(7, 4.5))
    edge = ax.get_xaxis_transform()  # x in data, y in axes units: 1 is the top of the frame
    kinds = set()
    for g in names:
        ok = [(p.lr, p.loss) for p in groups[g] if p.loss is not None and p.loss <= ceiling]
        line = ax.plot([a for a, _ in ok], [b for _, b in ok], "o-", label=g)[0]
        color = line.get_color()
        for p in groups[g]:
            if p.loss is not None and p.loss > ceiling:
                ax.plot([p.lr], [1.0], "^", color=color, markersize=8, clip_on=False, transform=edge)
                ax.annotate(f"{p.loss:.3g}", (p.lr, 1.0), xycoords=edge, xytext=(0, -9), textcoords="offset points",
                            ha="center", va="top", fontsize=7, color=color, annotation_clip=False)
                kinds.add("above")
        bad = [p.lr for p in groups[g] if p.status == "diverged"]
        if bad:  # on the top edge as well: a diverged run has no loss to draw
            ax.plot(bad, [1.0] * len(bad), "x", color=color, markersize=10, mew=2, clip_on=False, transform=edge)
            kinds.add("diverged")
    if "diverged" in kinds:
        ax.plot([], [], "x", color="gray", markersize=10, mew=2, label="diverged")
    if "above" in kinds:
        ax.plot([], [], "^", ls="", color="gray", markersize=8, label="final loss above L0 (value written)")
    if l0s:
        ax.axhline(l0s[0], color="gray", ls="--", lw=1, label="L0 (init)")
        shown = [p.loss for g in names for p in groups[g] if p.loss is not None and p.loss <= ceiling]
        low = min(shown, default=ceiling)
        ax.set_ylim(top=ceiling + 0.08 * max(ceiling - low, 0.1 * abs(ceiling)))
    xs = sorted({p.lr for g in names for p in groups[g]})
    log_scale(ax, "x")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("final loss (val if evaluated)")
    ax.set_title(_title([p for g in names for p in groups[g]]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    if xs:
        label_x_ticks(fig, ax, xs)
        fig.tight_layout()
    return fig


def _title(points: list[Point]) -> str:
    """What the benchmark trained, as far as its runs agree: ``final loss against learning rate,
    gpt_mini, 300 steps``."""
    configs = [sweeps.resolved_config(p.path) for p in points if p.path is not None]
    shared = []
    for key, shown in (("model.name", "{}"), ("steps", "{} steps")):
        values = {str(c.get(key)) for c in configs}
        if len(values) == 1 and None not in (c.get(key) for c in configs):
            shared.append(shown.format(values.pop()))
    return ", ".join(["final loss against learning rate", *shared])


def write(out_dir: str | Path, order: Sequence[str] | None = None, only: Sequence[str] | None = None,
          lrs: Sequence[float] | None = None) -> tuple[str, dict[str, Path]]:
    """Writes ``stability.md``, ``stability.csv`` and ``stability.png`` into ``out_dir``;
    returns the markdown table and the paths. Nothing to write when no run is found. ``only``
    and ``lrs``: the groups and learning rates kept (a benchmark run keeps its own grid: the
    other runs under ``out_dir`` may have run with other settings)."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    groups = collect(out)
    if only is not None:
        groups = {g: pts for g, pts in groups.items() if g in only}
    if lrs is not None:
        groups = {g: [p for p in pts if any(math.isclose(p.lr, lr, rel_tol=1e-9) for lr in lrs)]
                  for g, pts in groups.items()}
        groups = {g: pts for g, pts in groups.items() if pts}
    if not groups:
        return "", {}
    columns, rows = table(groups, order)
    md = markdown(columns, rows)
    paths = {"md": out / "stability.md", "csv": out / "stability.csv", "png": out / "stability.png"}
    paths["md"].write_text(md + "\n")
    sweeps.write_csv(paths["csv"], columns, rows)
    fig = figure(groups, order)
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return md, paths
