"""Several runs side by side, ``compare.png`` (``scripts/compare_runs.py``, ``scripts/repro_warmup.py``).
Apart from one run's figures (:mod:`stabletrain.analysis.plots`) because it asks another question,
how runs differ rather than what one run went through: it reduces each run to one curve per panel
(over blocks, a task loss without loss terms, entropy over the uniform level where runs attend over
different numbers of keys) so that runs unlike each other share an axis.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from stabletrain.analysis import sweeps
from stabletrain.analysis.figure import (_STYLE, _blocks_with, _empty, _finite, _fit_legend, _line, _min_span, _save,
                                         _skip, _styled, _suptitle)
from stabletrain.analysis.runs import Run, Series, load_run
from stabletrain.monitor import names as N


def _entropy(run: Run, block: str, relative: bool = False, quantity: str = N.ENT_MIN) -> Series | None:
    """A block's entropy; ``relative``: over its uniform entropy ``log_T`` at the same steps
    (none where the block logged no ``log_T``)."""
    ent = run.get(N.metric(N.ENTROPY, block, quantity))
    if not relative or ent is None:
        return ent
    ref = run.get(N.metric(N.ENTROPY, block, N.ENT_LOG_T))
    if ref is None:
        return None
    steps, at_ent, at_ref = np.intersect1d(ent[0], ref[0], return_indices=True)
    return steps, ent[1][at_ent] / ref[1][at_ref]


def _uniform_entropy(run: Run) -> float | None:
    """The run's uniform entropy, mean over blocks and steps (None when it logged none)."""
    levels = [np.nanmean(ref[1]) for b in _blocks_with(run, N.ENTROPY, N.ENT_LOG_T)
              if (ref := run.get(N.metric(N.ENTROPY, b, N.ENT_LOG_T))) is not None]
    return float(np.mean(levels)) if levels else None


def over_blocks(run: Run, group: str, quantity: str, reduce=np.max, relative: bool = False) -> Series | None:
    """Per step, ``reduce`` over the blocks that logged ``group/<block>/quantity`` then;
    ``relative`` (entropy only): each block's value over its uniform entropy."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for b in _blocks_with(run, group, quantity):
        series = _entropy(run, b, relative, quantity) if relative else run.get(N.metric(group, b, quantity))
        if series is None:
            continue
        for x, y in zip(*_finite(series)):
            by_step[x].append(y)
    if not by_step:
        return None
    steps = np.array(sorted(by_step))
    return steps, np.array([reduce(by_step[s]) for s in steps])


def _one_schedule(runs: list[Run]) -> bool:
    """Whether the runs logged one and the same lr curve (more than one run), at the steps they
    share: a run that diverged or was stopped early logged a prefix of the others' schedule."""
    series = [r.get(N.LR) for r in runs]
    if len(series) < 2 or any(x is None for x in series):
        return False
    shared = functools.reduce(np.intersect1d, [x[0] for x in series])
    if len(shared) < 2:
        return False
    # a step logged twice (rolled back to, resumed from): its last value, the one the run went on with
    last = [dict(zip(x[0].tolist(), x[1].tolist())) for x in series]
    at = [np.array([values[s] for s in shared.tolist()]) for values in last]
    return all(np.allclose(v, at[0], rtol=1e-9, atol=0.0, equal_nan=True) for v in at[1:])


def _decades_apart(series: list[Series | None]) -> bool:
    """Whether the peaks of ``series`` (one run's lr each) are a factor of ten apart or more; a
    schedule's own decay to zero does not count."""
    peaks = [float(np.nanmax(s[1])) for s in series if s is not None and len(s[1]) and np.nanmax(s[1]) > 0]
    return len(peaks) > 1 and max(peaks) >= 10 * min(peaks)


def _task_loss(run: Run) -> Series | None:
    """The loss minimised less the loss terms' share logged beside it, at the steps that have both."""
    loss, penalty = run.get(N.LOSS), run.get(N.LOSS_PENALTY)
    if loss is None or penalty is None:
        return loss
    shared, at_loss, at_penalty = np.intersect1d(loss[0], penalty[0], return_indices=True)
    return shared, loss[1][at_loss] - penalty[1][at_penalty]


@_styled
def compare_runs(run_dirs: list[str | Path], out_dir: str | Path, labels: list[str] | None = None,
                 title: str | None = None, qk: str | None = None, entropy_block: str | None = None) -> list[Path]:
    """Overlay loss, validation metric, scheduled lr (AdamW²'s share of tensors at the bound
    instead when every run has the same schedule), the largest sigma1(W_q^T W_k) and the
    smallest attention entropy (as a fraction of each block's uniform entropy log T when the runs
    attend over different numbers of keys) of several runs in ``out_dir/compare.png``, with one legend for
    every panel (a run has one colour throughout).

    ``labels``: the runs' names (default: the settings that differ between them, else their
    directory names). ``qk``: which sigma1 to draw, max over blocks: ``wq_t_wk_full`` (the
    full-width product) or ``wq_t_wk_max`` (the largest head); default the full width where a
    run logged it. ``entropy_block``: that block's entropy (min over heads) instead of the
    min over blocks, so that a figure can show what a table of one block reports."""
    runs = [load_run(d) for d in run_dirs]
    names = list(labels) if labels is not None else sweeps.labels([r.path for r in runs])
    if len(names) != len(runs):
        raise ValueError(f"compare_runs: {len(names)} labels for {len(runs)} runs")
    if qk is None:
        qk = (N.WQ_T_WK_FULL if any(_blocks_with(r, N.SIGMA1, N.WQ_T_WK_FULL) for r in runs)
              else N.WQ_T_WK_MAX)
    qk_title = {N.WQ_T_WK_FULL: r"max over blocks of $\sigma_1(W_q^\top W_k)$ (full width)",
                N.WQ_T_WK_MAX: r"max over blocks and heads of $\sigma_1(W_q^{h\top} W_k^h)$"
                }.get(qk, f"max over blocks of sigma1/<block>/{qk}")
    # a ViT's 197 keys beside a Swin's 49-token windows or a GPT's causal rows: their nats are not on
    # one scale (uniform is log T), so such runs are compared as a fraction of their uniform entropy
    relative = len({round(u, 2) for r in runs if (u := _uniform_entropy(r)) is not None}) > 1
    if entropy_block is None:
        ent_title, ent = ("min over blocks and heads of attention entropy",
                          lambda r: over_blocks(r, N.ENTROPY, N.ENT_MIN, np.min, relative))
    else:
        ent_title, ent = (f"attention entropy of {entropy_block}, min over heads",
                          lambda r: _entropy(r, entropy_block, relative))
    if relative:
        ent_title += "\nover log T (the runs attend over different numbers of keys)"
    # accuracy only when every run has it: a GPT beside a ViT shares val/loss, not val/acc
    val = N.VAL_ACC if all(r.has(N.VAL_ACC) for r in runs) or not any(r.has(N.VAL_LOSS) for r in runs) else N.VAL_LOSS
    # runs with loss terms (LocAteR's can be 100x the task's) beside runs without: their task losses
    task = any(r.has(N.LOSS_PENALTY) for r in runs)
    bound_panel = _one_schedule(runs) and any(r.has(N.FRAC_BOUNDED) for r in runs)
    panels = [  # title, y label, log y, series
        ("training loss" + (" of the task (loss terms left out)" if task else ""), "loss (nats)", True,
         _task_loss if task else lambda r: r.get(N.LOSS)),
        (f"validation {val.split('/')[1]}", "cross-entropy (nats)" if val == N.VAL_LOSS else "accuracy (fraction)",
         val == N.VAL_LOSS, lambda r: r.get(val)),
        # the schedule times any rollback's scale: AdamW²'s per-tensor rates differ (adamw2_lr.png);
        # runs at rates a decade apart or more share a log axis, or the smaller lie flat on zero.
        # One schedule for all (a sweep of tau): its panel would be one line, the bound's share says more
        ("AdamW²: fraction of tensors at the bound\n(the runs share one scheduled lr)", "fraction of tensors", False,
         lambda r: r.get(N.FRAC_BOUNDED)) if bound_panel else
        ("scheduled lr", "scheduled learning rate", _decades_apart([r.get(N.LR) for r in runs]),
         lambda r: r.get(N.LR)),
        (qk_title, r"$\sigma_1$ (largest singular value)", True, lambda r: over_blocks(r, N.SIGMA1, qk, np.max)),
        (ent_title, "entropy / uniform entropy" if relative else "entropy (nats)", False, ent),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = plt.get_cmap("tab10").colors
    # past ten runs the colours repeat: the dashes tell those runs apart (dotted marks divergence)
    # each run drawn thinner than the one before, on top of it: two runs that coincide (the same
    # seed, a setting that changed nothing) show as a thin line inside a thick one, not as one run
    styles = [{"color": colors[i % 10], "ls": ("-", "--", "-.")[i // 10 % 3], "lw": max(0.8, 3.2 - i)}
              for i in range(len(runs))]
    labelled = [name + (f" (diverged at step {run.diverged_step})" if run.diverged_step is not None else
                        f" (unfinished: last logged step {run.last_step:g})" if run.summary is None
                        and run.last_step is not None else "")
                for run, name in zip(runs, names)]
    missing_in: list[list[str]] = [[] for _ in runs]
    drawn = 0
    short = ("training loss", panels[1][0], "bound" if bound_panel else "lr", r"$\sigma_1$",
             "entropy")  # how the legend names a panel
    for k, (ax, (panel, ylabel, logy, get)) in enumerate(zip(axes.flat, panels)):
        missing = []
        for i, run in enumerate(runs):
            if not _line(ax, get(run), logy=logy, **styles[i]):
                missing.append(i)
            if run.diverged_step is not None:
                ax.axvline(run.diverged_step, color=styles[i]["color"], ls=":", lw=1)
            for step in run.restored_at:  # where a rollback took the run back to: its curve goes on from there
                ax.axvline(step, color=styles[i]["color"], ls="--", lw=1)
            for step in run.resumed_at:  # its record there is one step's, beside intervals' means: a dip
                ax.axvline(step, color=styles[i]["color"], ls="-.", lw=1)
            if k == 0:  # the loss panel: the spikes the run went on from, the non-finite steps it skipped
                for first, steps in run.spike_spans:
                    ax.axvspan(first - 0.5, first + steps - 0.5, color=styles[i]["color"], alpha=0.12, lw=0, zorder=0)
                if run.skipped_at:  # on the bottom edge: a run that skipped a NaN looked like a healthy one
                    ax.plot(run.skipped_at, [0.0] * len(run.skipped_at), "|", color=styles[i]["color"],
                            markersize=10, mew=2, ls="", transform=ax.get_xaxis_transform(), clip_on=False)
            if run.alerts and get is ent:  # whichever block raised it: on the panel's top edge
                steps = sorted({a["step"] for a in run.alerts})
                # runs alert at the same probe steps: each alerted run's triangles one row lower
                # than the previous one's, so that one run's cannot hide another's
                row = sum(1 for r in runs[:i] if r.alerts)
                ax.plot(steps, [1.0 - 0.045 * row] * len(steps), "v", color=styles[i]["color"], markersize=8,
                        ls="", transform=ax.get_xaxis_transform(), clip_on=False)
        if len(missing) < len(runs):
            drawn += 1
            ax.set_ylabel(ylabel)
            if get is ent:
                _min_span(ax, 0.1)
            for i in missing:  # said with the run, so that it is not mistaken for a hidden line
                missing_in[i].append(short[k])
        else:
            _empty(ax, "not logged by any run")
        # the alert triangles sit on the top edge: the title a little higher, clear of them
        ax.set_title(panel, pad=12 if get is ent and any(r.alerts for r in runs) else 6)
        ax.set_xlabel("step")
    if drawn == 0:
        plt.close(fig)
        _skip("compare.png", "none of the runs logged loss, lr, val, sigma1 or entropy")
        return []
    if title is None:
        parents = {r.path.resolve().parent for r in runs}
        title = (f"{len(runs)} runs in {parents.pop()}" if len(parents) == 1 and len(runs) > 1
                 else runs[0].name if len(runs) == 1 else f"{len(runs)} runs")
    _suptitle(fig, title)
    fig.tight_layout()
    # the free sixth panel holds the one legend: five copies of it would cover the curves
    slot = axes.flat[5]
    slot.axis("off")
    handles = [Line2D([], [], **style) for style in styles]
    labelled = [lab + (f" (not logged: {', '.join(gone)})" if gone else "") for lab, gone in zip(labelled, missing_in)]
    if any(r.diverged_step is not None for r in runs):
        handles.append(Line2D([], [], color="gray", ls=":", lw=1))
        labelled.append("dotted: where the run of that colour diverged")
    if any(r.restored_at for r in runs):
        handles.append(Line2D([], [], color="gray", ls="--", lw=1))
        labelled.append("dashed: the step a rollback of the run of that colour restored")
    if any(r.resumed_at for r in runs):
        handles.append(Line2D([], [], color="gray", ls="-.", lw=1))
        labelled.append("dash-dot: where the run of that colour was resumed")
    if any(r.spike_spans for r in runs):
        handles.append(Patch(color="gray", alpha=0.25, lw=0))
        labelled.append("band on the loss panel: a loss spike of the run of that colour")
    if any(r.skipped_at for r in runs):
        handles.append(Line2D([], [], color="gray", marker="|", markersize=10, mew=2, ls=""))
        labelled.append("tick under the loss panel: a non-finite step the run of that colour skipped")
    if any(r.alerts for r in runs):
        handles.append(Line2D([], [], color="gray", marker="v", ls=""))
        labelled.append("triangle on the entropy panel: a health alert of the run of that colour")
    _fit_legend(slot, handles, labelled, loc="upper left", borderaxespad=0.0, fontsize=_STYLE["font.size"])
    return [_save(fig, Path(out_dir), "compare.png")]
