"""The papers' training-dynamics figures from a run directory (``metrics.jsonl`` + ``summary.json``).

Used by ``scripts/plot_dynamics.py``: what one run went through. Several runs side by side are
:mod:`stabletrain.analysis.compare`'s; what every figure draws with (style, saving, legends),
:mod:`stabletrain.analysis.figure`'s.
``metrics.jsonl`` holds one JSON object per line with ``step`` and any subset of the metric
names of :mod:`stabletrain.monitor.names`; metrics come at different cadences, so every
metric is its own ``(steps, values)`` series. A figure whose metrics are absent is skipped
with a printed note (``logits.png`` silently). Figures:

- ``training.png``: loss, validation metrics, lr, gradient norm, AdamW² bounded fraction;
- ``dynamics_<block>.png``: the 15 quantities of AdamW² Eq. 1 per block (000 Fig. 1);
- ``entropy.png``: attention entropy per layer (001 Fig. 2/3), the Theorem 3.1 bound, the health alerts;
- ``heads.png``: per head (``monitor.per_head=true``), entropy and sigma1(W_q^h^T W_k^h) of up to four
  blocks (those that alerted, then those whose entropy fell lowest);
- ``sec.png``: ``SEC(d_h, s)`` against ``s`` at a few steps, the step it rose most among them (000 Fig. 4);
- ``adamw2_lr.png``: AdamW²'s actual learning rate per tensor (000 App. M);
- ``token_similarity.png``: token similarity against depth and step (002);
- ``qk_spectrum.png``: LocAteR's QK eigenspectrum statistics (003 Fig. 6);
- ``logits.png``: max attention logit per block and the output ``log Z``.

Every log axis is labelled through :func:`stabletrain.analysis.ticks.log_scale`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from stabletrain.analysis.figure import (_blocks_with, _empty, _finite, _fit_legend, _line, _min_span, _save, _skip,
                                         _spans_decades, _styled, _suptitle)
from stabletrain.analysis.runs import Run, Series, load_run
from stabletrain.analysis.ticks import log_scale
from stabletrain.monitor import names as N


# quantities spanning decades (a crash multiplies them by 10-100, 000) get a log axis; the others
# get one where their run's values do span a decade
_LOG_QUANTITIES = {N.WQ_T_WK_FULL, N.WO_WV_FULL, N.W2_W1, N.ACT_X, N.ACT_GRAD_X}


def select_blocks(all_blocks: list[str], spec: str | None) -> list[str]:
    """``--blocks``: comma-separated depth positions (``0,2,4``; negative counts from the end)
    or block names. Default: every block up to 8, else 7 spread from first to last, as
    000 Fig. 1 shows blocks {0, 2, 4, 6, 8, 10, 11} of 12."""
    if not all_blocks:
        return []
    if spec:
        chosen = []
        for tok in (t.strip() for t in spec.split(",") if t.strip()):
            if re.fullmatch(r"-?\d+", tok) and -len(all_blocks) <= int(tok) < len(all_blocks):
                chosen.append(all_blocks[int(tok)])
            elif tok in all_blocks:
                chosen.append(tok)
            else:
                raise ValueError(f"--blocks: {tok!r} is not a block of this run; choose positions "
                                 f"0..{len(all_blocks) - 1} (or -1, ...) or names: {', '.join(all_blocks)}")
        return list(dict.fromkeys(chosen))
    if len(all_blocks) <= 8:
        return list(all_blocks)
    idx = np.unique(np.round(np.linspace(0, len(all_blocks) - 1, 7)).astype(int))
    return [all_blocks[i] for i in idx]


# --- drawing helpers -------------------------------------------------------------------


# the sigma1 series' own colours
_FULL_WIDTH, _PER_HEAD = "tab:blue", "tab:purple"
# a rollback's marks: a colour no curve uses (orange was the deepest block's and tab10's second head's)
_ROLLBACK = "black"


def _mark_divergence(ax, run: Run) -> None:
    """What the run went through, as vertical lines: the loss spikes it went on from (a red band), the
    step it diverged at (red, dotted), the
    steps a rollback restored (black, dashed: the curve goes on from there on other data), and
    the steps whose non-finite update was skipped (grey), and the steps a resume
    continued from (green, dash-dot). Not on a panel that drew nothing (:func:`_empty`): lines
    across its note would read as data."""
    if not ax.get_lines():
        return
    for first, steps in run.spike_spans:  # a band over the spiking steps, behind the curves
        ax.axvspan(first - 0.5, first + steps - 0.5, color="tab:red", alpha=0.12, lw=0, zorder=0)
    for step in run.restored_at:
        ax.axvline(step, color=_ROLLBACK, ls="--", lw=1)
    for step in run.resumed_at:  # over a rollback's line at the same step, which would hide it
        ax.axvline(step, color="tab:green", ls="-.", lw=0.8)
    for step in run.skipped_at:
        ax.axvline(step, color="0.6", lw=0.8)
    # what set each rollback off (a NaN, a spike, an alert): its step, under the top edge (clear of the title)
    triggers = sorted({r["trigger_step"] for r in (run.summary or {}).get("rollbacks") or []
                       if isinstance(r, dict) and isinstance(r.get("trigger_step"), (int, float))})
    if triggers:
        ax.plot(triggers, [0.97] * len(triggers), "v", color=_ROLLBACK, ms=6, transform=ax.get_xaxis_transform(),
                clip_on=False)
    step = run.diverged_step
    if step is not None:
        ax.axvline(step, color="red", ls=":", lw=1)


def _mark_nonfinite(ax, series: Series | None) -> None:
    """The records whose value is NaN or infinite, which no line can draw: red triangles on the
    panel's top edge, the first one labelled (``nan``), so that a loss that went non-finite is
    seen where it did."""
    if series is None or not ax.get_lines():
        return
    x, y = series
    bad = ~np.isfinite(y)
    if not bad.any():
        return
    edge = ax.get_xaxis_transform()
    ax.plot(x[bad], np.ones(int(bad.sum())), "^", color="red", ms=6, transform=edge, clip_on=False)
    first = int(np.argmax(bad))
    ax.annotate(f"{y[first]:g} from step {x[first]:g}" if bad.sum() > 1 else f"{y[first]:g}", (x[first], 1.0),
                xycoords=edge, xytext=(-5, -10), textcoords="offset points", color="red", fontsize=7, ha="right",
                annotation_clip=False)


def _depth_cmap():
    """Shallow to deep, dark blue through magenta to orange: viridis's first two of four blocks
    (dark purple, dark blue) looked alike, and its last (pale yellow) was faint on white."""
    from matplotlib.colors import ListedColormap

    return ListedColormap(plt.get_cmap("plasma")(np.linspace(0.0, 0.85, 256)), name="depth")


def _step_colors(n: int):
    """Early to late, light to dark green: time has its own hue, apart from depth's (a navy line
    meant step 0 in one panel and blocks.0 in the next)."""
    cmap = plt.get_cmap("Greens")
    return [cmap(0.35 + 0.6 * i / max(n - 1, 1)) for i in range(n)]


def _depth_colors(n: int):
    cmap = _depth_cmap()
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _depth_legend_or_bar(fig, ax, blocks: list[str]) -> None:
    """A legend for a few layers, a depth colour bar for many."""
    handles, labels = ax.get_legend_handles_labels()
    if len(blocks) <= 8:
        if handles:  # a panel with no curve (mean entropy not logged) has nothing to name
            ax.legend(loc="best")
        return
    extra = [(h, lab) for h, lab in zip(handles, labels) if lab not in blocks]
    if extra:  # reference lines keep their legend
        ax.legend(*zip(*extra), loc="best")
    sm = plt.cm.ScalarMappable(cmap=_depth_cmap(), norm=plt.Normalize(0, len(blocks) - 1))
    cb = fig.colorbar(sm, ax=ax, pad=0.01)
    cb.set_label(f"depth ({blocks[0]} .. {blocks[-1]})")


def _open_spikes(run: Run) -> int:
    """How many of ``run.spike_spans`` the run ended inside (at most the last)."""
    spikes = [s for s in (run.summary or {}).get("spikes") or [] if isinstance(s, dict)]
    return int(bool(spikes) and bool(spikes[-1].get("open")) and not spikes[-1].get("warmup")
               and isinstance(spikes[-1].get("step"), (int, float)))


def _title(run: Run, what: str) -> str:
    status = ""
    if run.summary:
        status = f" [{run.summary.get('status', '?')}"
        if run.diverged_step is not None:
            status += f" at step {run.diverged_step} (red, dotted)"
        # each rollback (summary.json), not each restored step: three may restore the same one
        records = run.get(N.rollback("restored_step"))
        kept = 0 if records is None else len(records[0])  # one record per rollback, at the step it restored
        rollbacks = len(run.summary.get("rollbacks") or []) or kept
        if rollbacks:
            # a rollback's record goes with the history a later rollback to an earlier step drops
            gone = f"; {rollbacks - kept} in a history a later rollback dropped" if rollbacks > kept else ""
            status += f", {rollbacks} rollback(s) (black dashed: restored step, triangle: what set it off{gone})"
        # summary.json counts every skipped step; the records only those of the history a
        # rollback kept (it drops the records after the step it restores)
        series = run.get(N.SKIPPED_STEPS)
        here = int(sum(series[1])) if series is not None else 0
        total = max(int(run.summary.get("skipped_steps") or 0), here)
        if total:
            where = ("grey" if here == total else f"grey: the {here} in the kept history" if here
                     else "all in histories rollbacks dropped")
            if here and run.skipped_at and set(run.skipped_at) <= {run.diverged_step}:
                where = "at the red line"  # drawn under it
            status += f", {total} non-finite step(s) skipped ({where})"
        spikes = run.spike_spans
        if passed := len(spikes) - _open_spikes(run):
            status += f", {passed} loss spike(s) passed (shaded)"
        if len(spikes) > passed:  # one still under watch where the run ended (summary.json's "open")
            status += ", a loss spike not passed where the run ended (shaded)"
        # drawn in the loss curve but not shaded: the run's last line names them, so does the title
        early = [s for s in run.summary.get("spikes") or [] if isinstance(s, dict) and s.get("warmup")]
        if early:
            status += (f", {len(early)} loss spike(s) in the divergence warmup (not counted: step "
                       f"{', '.join(str(s.get('step', '?')) for s in early)})")
        if run.alerts:
            status += f", {len(run.alerts)} health alert(s)"
        if run.resumed_at:
            status += f", resumed at step {', '.join(f'{s:g}' for s in run.resumed_at)} (green)"
        status += "]"
    elif run.last_step is not None:  # no summary.json: still running, or killed (a crash, a lost node)
        status = f" [unfinished: last logged step {run.last_step:g}]"
    return f"{run.name}{status}: {what}"


def _finish(fig, axes, used: int, title: str, out_dir: Path, name: str) -> Path:
    """Hide the grid's unused panels, title the figure, lay it out and save it."""
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    _suptitle(fig, title)
    fig.tight_layout()
    return _save(fig, out_dir, name)


def _few_steps(steps: np.ndarray, k: int = 5, must=()) -> list[float]:
    """Up to ``k`` steps spread over the run, the last included, and the steps of ``must`` (an
    alert's) that are among them."""
    steps = np.unique(steps)
    if len(steps) <= k:
        return list(steps)
    spread = steps[np.unique(np.round(np.linspace(0, len(steps) - 1, k)).astype(int))]
    return sorted(set(spread.tolist()) | {s for s in must if s in steps})


def _largest_rise(series: Series | None) -> float | None:
    """The step whose record rose most over the one before it; None where nothing rose."""
    if series is None or len(series[0]) < 2:
        return None
    rise = np.diff(series[1])
    i = int(np.nanargmax(np.where(np.isfinite(rise), rise, -np.inf)))
    return float(series[0][i + 1]) if np.isfinite(rise[i]) and rise[i] > 0 else None


def _value_at(series: Series, step: float) -> float:
    x, y = series
    hit = np.nonzero(x == step)[0]
    return float(y[hit[-1]]) if len(hit) else math.nan


# --- figures of one run ----------------------------------------------------------------


@_styled
def plot_training(run: Run, out_dir: Path) -> Path | None:
    terms = run.has(N.LOSS_PENALTY)  # the loss minimised holds the loss terms: not the val/loss kind
    panels = [(N.LOSS, "training loss" + (" (task + loss terms)" if terms else ""), "loss" if terms else "loss (nats)",
               True),
              (N.VAL_LOSS, "validation loss", "cross-entropy (nats)", True),
              (N.VAL_ACC, "validation accuracy", "accuracy (fraction)", False),
              (N.LR, "scheduled learning rate", "learning rate", False),
              (N.GRAD_NORM, "gradient norm (before clipping, the interval's largest)", "global L2 norm", True),
              (N.FRAC_BOUNDED, "AdamW²: fraction of tensors at the bound", "fraction of tensors", False)]
    panels = [p for p in panels if run.has(p[0])]
    if not panels:
        _skip("training.png", "no loss/lr/grad_norm/val metrics")
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    # one step axis for every panel: a run's one evaluation is a point in the run, not a panel of its own
    steps = [x for p in panels for x in (run.get(p[0])[0][:1], run.get(p[0])[0][-1:])]
    # and the step it diverged at, which may precede its first record (a NaN at step 4, logged at 10)
    steps += [np.array([float(run.diverged_step)])] if run.diverged_step is not None else []
    lo, hi = float(np.min(np.concatenate(steps))), float(np.max(np.concatenate(steps)))
    for ax, (name, title, ylabel, logy) in zip(axes.flat, panels):
        _line(ax, run.get(name), logy=logy)
        _mark_nonfinite(ax, run.get(name))
        _mark_divergence(ax, run)
        if hi > lo and ax.get_lines():
            ax.set_xlim(lo - 0.03 * (hi - lo), hi + 0.03 * (hi - lo))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    return _finish(fig, axes, len(panels), _title(run, "training curves"), out_dir, "training.png")


def _why_absent(run: Run, block: str, q: N.Quantity) -> str:
    """Why a block's norm quantity is missing: the block has no norm with gains (norm=none,
    sigmaReparam's recipe), or its norm has no bias (RMSNorm, StableNorm, a bias-free LayerNorm)."""
    if q.group != N.NORM:
        return ""
    gains = any(run.has(N.metric(N.NORM, block, g)) for g in (N.NORM1_GAMMA, N.NORM2_GAMMA))
    if not gains:
        return "\n(no norm gains in this block,\ne.g. norm=none)"
    return "\n(the norm has no bias)" if q.quantity in (N.NORM1_BETA, N.NORM2_BETA) else ""


@_styled
def plot_block_dynamics(run: Run, block: str, out_dir: Path) -> Path | None:
    """000 Fig. 1: one panel per Eq. 1 quantity of ``block`` (absent ones say so), plus the loss."""
    present = [q for q in N.FIFTEEN if run.has(N.metric(q.group, block, q.quantity))]
    if not present:
        _skip(f"dynamics of {block}", "none of the 15 quantities logged")
        return None
    fig, axes = plt.subplots(4, 4, figsize=(15, 11))
    for ax, q in zip(axes.flat, N.FIFTEEN):
        series = run.get(N.metric(q.group, block, q.quantity))
        logy = q.quantity in _LOG_QUANTITIES or _spans_decades(series)  # a crash's sigma1(W_q), x100
        ok = _line(ax, series, logy=logy, color=_FULL_WIDTH,
                   label="full width")
        # beside the paper's full-width product, the largest single head (docs/methods.md §7)
        per_head = {N.WQ_T_WK_FULL: N.WQ_T_WK_MAX, N.WO_WV_FULL: N.WO_WV_MAX}.get(q.quantity)
        if per_head and _line(ax, run.get(N.metric(q.group, block, per_head)), logy=logy,
                              color=_PER_HEAD, ls="--", label="max over heads"):
            ax.legend(loc="best")
            ok = True
        if not ok:
            _empty(ax, "not logged" + _why_absent(run, block, q))
        _mark_divergence(ax, run)
        ax.set_title(q.label)
        ax.set_xlabel("step")
    ax = axes.flat[15]
    _line(ax, run.get(N.LOSS), logy=True, color="black")
    _mark_divergence(ax, run)
    _mark_nonfinite(ax, run.get(N.LOSS))  # as training.png does: the sigma1 curves just stop there
    ax.set_title("training loss (context)")
    ax.set_xlabel("step")
    n = len({q.quantity for q in present})
    # under sigmaReparam the monitors read the weight the layer applies, not the raw one it trains
    effective = ", of the weights the layers apply, gamma W / sigma(W) (sigmaReparam)" if _reparametrised(run) else ""
    _suptitle(fig, _title(run, f"{block}, AdamW² Eq. 1 quantities ({n} of 15 logged){effective}{_qk_caveat(run)}"),
              fontsize=12)
    fig.tight_layout()
    return _save(fig, out_dir, f"dynamics_{block}.png")


def _chosen(run: Run, key: str) -> str | None:
    """A key of the run's config.yaml (``reparam.name``); None where it has none."""
    from stabletrain.analysis.sweeps import resolved_config

    try:
        value = resolved_config(run.path).get(key)
    except Exception:  # noqa: BLE001 - an unreadable config: said as unknown
        return None
    return None if value is None else str(value)


def _reparametrised(run: Run) -> bool:
    """Whether the run trained under sigmaReparam."""
    return _chosen(run, "reparam.name") == "sigma"


def _qk_caveat(run: Run) -> str:
    """Said under q/k normalisation: the weights' W_q^T W_k no longer bounds the logits."""
    attention = _chosen(run, "attention.name")
    return (f" (attention={attention} normalises q and k: these weights do not bound its logits)"
            if attention in ("qknorm", "stable") else "")


def _why_no_entropy(run: Run) -> str:
    """Why a run logged no attention entropy: no monitors, no probe pass yet, or a probe pass
    (its log Z logged) that found no attention of stabletrain's to read."""
    monitor = _chosen(run, "monitor.name")
    if monitor == "off":
        return "the run used monitor=off"
    if run.has(N.LOG_Z) and not _blocks_with(run, N.ATTN_LOGIT_MAX, None):  # the probe ran; no attention read
        family = _chosen(run, "model.family")
        return ("its probe pass ran (logits/log_z logged) but reads the entropy of stabletrain's attention only, "
                f"and this model{f' (family {family})' if family else ''} has none")
    if monitor is None:
        return "no config.yaml to say why"
    every = _chosen(run, "monitor.probe_every") or "?"
    return (f"the probe pass logs it every monitor.probe_every={every} steps and at the run's last, and "
            f"{_stopped_before_any(run)}")


@_styled
def plot_entropy(run: Run, blocks: list[str], out_dir: Path) -> Path | None:
    """001 Fig. 2/3: attention entropy per layer; Theorem 3.1's bound beside the minimum."""
    layers = _blocks_with(run, N.ENTROPY, N.ENT_MEAN) or _blocks_with(run, N.ENTROPY, N.ENT_MIN)
    if not layers:
        _skip("entropy.png", f"no entropy/<block>/mean or min metrics: {_why_no_entropy(run)}")
        return None
    bound_blocks = [b for b in blocks if run.has(N.metric(N.ENTROPY, b, N.ENT_BOUND_MIN))]
    if not bound_blocks:
        _skip("entropy.png's Theorem 3.1 panel", "no bound logged: the theorem covers softmax attention on plain "
              "q and k, not qknorm or stable attention, nor Swin's position bias and windows (docs/methods.md)")
    ncols = 3 if bound_blocks else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.0), squeeze=False)
    axes = axes[0]
    colors = _depth_colors(len(layers))
    for ax, quantity, title in ((axes[0], N.ENT_MEAN, "mean over heads"),
                                (axes[1], N.ENT_MIN, "min over heads")):
        for b, c in zip(layers, colors):
            _line(ax, run.get(N.metric(N.ENTROPY, b, quantity)), color=c, label=b)
            found = [(a["step"], a["value"]) for a in run.alerts if a.get("layer") == b and quantity == N.ENT_MIN
                     and isinstance(a.get("value"), (int, float))]
            if found:  # at the entropy that raised it, on that layer's curve
                ax.plot(*zip(*found), "v", color=c, markersize=9, markeredgecolor="crimson", ls="")
        if quantity == N.ENT_MIN and run.alerts:
            ax.plot([], [], "v", color="white", markeredgecolor="crimson", markersize=9, ls="",
                    label="health alert (entropy collapse)")
        # beneath the curves: an entropy at the uniform level (a model at init) stays visible.
        # Blocks over different numbers of keys (Swin's stages, its shifted windows' masks) each get
        # their own level, in their colour: one block's level read against another's curve misleads
        levels = {b: float(np.nanmean(ref[1])) for b in layers
                  if (ref := run.get(N.metric(N.ENTROPY, b, N.ENT_LOG_T))) is not None}
        if len({round(v, 2) for v in levels.values()}) == 1:
            ax.axhline(next(iter(levels.values())), color="gray", ls="--", lw=1, zorder=1,
                       label="uniform over each query's keys")
        elif levels:
            for b, c in zip(layers, colors):
                if b in levels:
                    ax.axhline(levels[b], color=c, ls="--", lw=1, zorder=1)
            ax.plot([], [], color="gray", ls="--", lw=1, label="uniform over each query's keys, per block")
        _mark_divergence(ax, run)
        _min_span(ax, 0.1)
        ax.set_title(f"attention entropy, {title}")
        ax.set_xlabel("step")
        ax.set_ylabel("entropy (nats)")
        _depth_legend_or_bar(fig, ax, layers)
    if bound_blocks:
        ax = axes[2]
        handles = []
        for b, c in zip(bound_blocks, _depth_colors(len(bound_blocks))):
            _line(ax, run.get(N.metric(N.ENTROPY, b, N.ENT_MIN)), color=c)
            _line(ax, run.get(N.metric(N.ENTROPY, b, N.ENT_BOUND_MIN)), color=c, ls=":")
            handles.append(Line2D([], [], color=c, label=b))
        handles += [Line2D([], [], color="gray", label="measured (min over heads)"),
                    Line2D([], [], color="gray", ls=":", label="bound (min over heads)")]
        _mark_divergence(ax, run)
        top = max(float(np.nanmax(np.abs(run.get(N.metric(N.ENTROPY, b, N.ENT_BOUND_MIN))[1]))) for b in bound_blocks)
        hi = ax.get_ylim()[1]
        if hi > 0 and top < 0.02 * hi:
            # a bound far below the measured entropy is a flat line on the axis: said in its legend
            # entry (a note inside the axes lay over the collapsed curves, also near 0)
            handles[-1].set_label(f"bound (min over heads), below {0.02 * hi:.2g} nats: near 0 here")
        ax.set_title("min entropy vs Theorem 3.1 lower bound")
        ax.set_xlabel("step")
        ax.set_ylabel("entropy (nats)")
        ax.legend(handles=handles, loc="best")
    _suptitle(fig, _title(run, "attention entropy"))
    fig.tight_layout()
    return _save(fig, out_dir, "entropy.png")


def _heads(run: Run, group: str, block: str, stem: str) -> list[Series]:
    """The per-head series ``<group>/<block>/<stem><h>`` for h = 0, 1, ... while logged."""
    out = []
    while (s := run.get(N.metric(group, block, N.head(stem, len(out))))) is not None:
        out.append(s)
    return out


HEAD_COLUMNS = 4  # blocks side by side in heads.png


def _heads_worth_showing(run: Run, blocks: list[str]) -> list[str]:
    """Up to :data:`HEAD_COLUMNS` of ``blocks``, in depth order: those that raised an alert, then
    those whose min entropy fell lowest; a deep block that collapsed is not left out for being deep."""
    if len(blocks) <= HEAD_COLUMNS:
        return blocks
    alerted = {a.get("layer") for a in run.alerts}

    def lowest(b: str) -> float:
        series = _finite(run.get(N.metric(N.ENTROPY, b, N.ENT_MIN)) or (np.array([]), np.array([])))
        return float(np.min(series[1])) if len(series[1]) else math.inf

    ranked = sorted(blocks, key=lambda b: (b not in alerted, lowest(b), blocks.index(b)))
    keep = set(ranked[:HEAD_COLUMNS])
    shown = [b for b in blocks if b in keep]
    _skip(f"{', '.join(b for b in blocks if b not in keep)} in heads.png",
          f"it has room for {HEAD_COLUMNS} blocks, those that alerted or whose entropy fell lowest "
          f"({', '.join(shown)}); --blocks names others")
    return shown


@_styled
def plot_heads(run: Run, blocks: list[str], out_dir: Path) -> Path | None:
    """Per head (``monitor.per_head=true``, as monitor=full sets): which head's entropy fell, and
    which head's sigma1(W_q^h^T W_k^h) grew. One column per block, heads coloured by index: of
    more than four blocks, the four :func:`_heads_worth_showing` picks."""
    shown = [b for b in blocks if _heads(run, N.ENTROPY, b, "head") or _heads(run, N.SIGMA1, b, N.WQ_T_WK + "_head")]
    if not shown:
        return None  # per-head metrics are opt-in: no note on every run without them
    shown = _heads_worth_showing(run, shown)
    rows = [(N.ENTROPY, "head", "attention entropy (nats)", False),
            (N.SIGMA1, N.WQ_T_WK + "_head", r"$\sigma_1(W_q^{h\top} W_k^h)$", True)]
    rows = [r for r in rows if any(_heads(run, r[0], b, r[1]) for b in shown)]
    fig, axes = plt.subplots(len(rows), len(shown), figsize=(4.2 * len(shown) + 1, 3.4 * len(rows)), squeeze=False)
    for col, b in enumerate(shown):
        for row, (group, stem, ylabel, logy) in enumerate(rows):
            ax, series = axes[row][col], _heads(run, group, b, stem)
            colors = plt.get_cmap("tab10").colors
            for h, sr in enumerate(series):
                _line(ax, sr, logy=logy, color=colors[h % 10], ls=("-", "--", ":")[h // 10 % 3], lw=1.2,
                      label=f"head {h}")
            if group == N.ENTROPY and (ref := run.get(N.metric(N.ENTROPY, b, N.ENT_LOG_T))) is not None:
                ax.axhline(float(np.nanmean(ref[1])), color="gray", ls="--", lw=1, zorder=1, label="uniform")
            found = [(a["step"], a["value"]) for a in run.alerts if a.get("layer") == b
                     and isinstance(a.get("value"), (int, float))] if group == N.ENTROPY and series else []
            if found:  # as on entropy.png: at the lowest head's entropy, which raised it
                ax.plot(*zip(*found), "v", color="white", markeredgecolor="crimson", markersize=9, ls="",
                        label="health alert (entropy collapse)")
            if not series:
                _empty(ax, "not logged")
            _mark_divergence(ax, run)
            ax.set_title(f"{b}: {'entropy' if group == N.ENTROPY else ylabel} per head")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if series and col == len(shown) - 1:
                _fit_legend(ax, *ax.get_legend_handles_labels(), loc="best")
    _suptitle(fig, _title(run, "per head"))
    fig.tight_layout()
    return _save(fig, out_dir, "heads.png")


def _sec_curve(run: Run, block: str) -> dict[int, Series]:
    out = {}
    for name, series in run.metrics.items():
        p = N.parse(name)
        if p and p.group == N.SEC and p.block == block and p.quantity and p.quantity[1:].isdigit():
            out[int(p.quantity[1:])] = series
    return dict(sorted(out.items()))


@_styled
def plot_sec(run: Run, blocks: list[str], out_dir: Path) -> Path | None:
    """000 Fig. 4: ``SEC(d_h, s)`` against ``s`` at a few steps, per selected block."""
    curves = {b: c for b in blocks if (c := _sec_curve(run, b))}
    if not curves:
        _skip("sec.png", "no sec/<block>/s<k> metrics for the selected blocks")
        return None
    n = len(curves)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.2 * rows), squeeze=False)
    for ax, (block, curve) in zip(axes.flat, curves.items()):
        sizes = list(curve)
        d_h = sizes[-1]
        alert_s = N.sec_alert_size(d_h)
        # spread steps can fall either side of the collapse: the step SEC(d_h, s*) jumped at is drawn too
        jump = _largest_rise(curve.get(alert_s))
        steps = _few_steps(np.concatenate([s[0] for s in curve.values()]),
                           must=[a["step"] for a in run.alerts if a.get("layer") == block] + [jump])
        for step, color in zip(steps, _step_colors(len(steps))):
            ys = [_value_at(curve[s], step) for s in sizes]
            label = f"step {int(step)}" + (" (largest rise)" if step == jump else "")
            ax.plot(sizes, ys, marker="o", ms=3, color=color, label=label)
        # the crash signature, where the health alert tests it: said on the axes, the legend is the steps'
        ax.axhline(0.99, color="red", ls=":", lw=1)
        ax.axvline(alert_s, color="red", ls="--", lw=0.8)
        log_scale(ax, "x", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_ylim(0, 1.03)
        ax.set_xlabel(f"s (top singular directions)\nred: the alert's test, SEC({d_h}, {alert_s}) > 0.99")
        ax.set_ylabel(f"SEC({d_h}, s)")
        ax.set_title(f"{block}: max over heads")
        ax.legend(loc="lower right")
    title = _title(run, r"spectral energy concentration of $W_q^{h\top} W_k^h$" + _qk_caveat(run))
    return _finish(fig, axes, n, title, out_dir, "sec.png")


def _split_param(param: str) -> tuple[str, str]:
    """``blocks.3.attn.qkv.weight`` -> (``blocks.3``, ``attn.qkv.weight``); at the last
    ``.<int>.`` so that ``layers.1.blocks.0.mlp.fc1.weight`` splits after ``blocks.0``."""
    m = re.match(r"^(.*\.\d+)\.(.+)$", param)
    return (m.group(1), m.group(2)) if m else ("", param)


# where sigmaReparam's parametrisation keeps the raw weight it trains: torch.nn.utils.parametrize's name
_RAW_WEIGHT = ".parametrizations.weight.original"


def _shown_kind(kind: str) -> str:
    """A kind of tensor as a panel names it: sigmaReparam's raw W by the weight's own name."""
    return kind.replace(_RAW_WEIGHT, ".weight (raw W)") if kind.endswith(_RAW_WEIGHT) else kind


def _why_no_adamw2_curves(run: Run) -> str:
    import yaml

    path = run.path / "config.yaml"
    cfg = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    optim, every = cfg.get("optim") or {}, (cfg.get("monitor") or {}).get("adamw2_every", "?")
    if optim.get("name") != "adamw2":
        return f"the run used optim={optim.get('name', '?')}" if optim else "not an AdamW² run?"
    return (f"this AdamW² run logs them every monitor.adamw2_every={every} steps and at its last, and "
            f"{_stopped_before_any(run)}")


def _stopped_before_any(run: Run) -> str:
    """``it stopped at step N before any``: the step of summary.json, else the last logged."""
    step = (run.summary or {}).get("step", run.last_step)
    if not isinstance(step, (int, float)):
        return "it logged no step"
    return f"it stopped at step {step:g} before any"


ADAMW2_PANELS = 16


@_styled
def plot_adamw2_lr(run: Run, out_dir: Path) -> Path | None:
    """000 App. M: AdamW²'s actual learning rate per bounded tensor, one panel per kind of
    tensor with a line per block, the scheduled rate dotted."""
    prefix = N.adamw2_lr_eff("")
    params = [k[len(prefix):] for k in run.metrics if k.startswith(prefix)]
    if not params:
        _skip("adamw2_lr.png", f"no adamw2/lr_eff/<param> metrics: {_why_no_adamw2_curves(run)}")
        return None
    kinds: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for p in N.natural_sorted(params):
        block, kind = _split_param(p)
        kinds[kind].append((block, p))
    # the most populated kinds first (per-block matrices), singletons (embeddings) last; a timm Swin
    # has 13 kinds, a ViT 11: past a 4 x 4 grid the rest are named, not dropped silently
    order = sorted(kinds, key=lambda k: (-len(kinds[k]), k))
    order, left = order[:ADAMW2_PANELS], order[ADAMW2_PANELS:]
    if left:
        print(f"note: adamw2_lr.png draws {len(order)} of the {len(order) + len(left)} kinds of tensor; left "
              f"out: {', '.join(left)} (their adamw2/lr_eff/* series are in metrics.jsonl)")
    cols = min(4, len(order))
    rows = math.ceil(len(order) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.1 * rows), squeeze=False)
    for ax, kind in zip(axes.flat, order):
        entries = kinds[kind]
        colors = _depth_colors(len(entries))
        for (block, p), c in zip(entries, colors):
            _line(ax, run.get(N.adamw2_lr_eff(p)), logy=True, color=c,
                  label=block or ("actual lr" if len(entries) == 1 else p))  # one tensor: its name is the title
        # dotted: a rollback's mark is black and dashed
        _line(ax, run.get(N.LR), logy=True, color="black", ls=":", lw=1.2, label="scheduled lr")
        _mark_divergence(ax, run)
        ax.set_title(_shown_kind(kind))
        ax.set_xlabel("step")
        ax.set_ylabel("actual lr")
        if len(entries) <= 6:
            ax.legend(loc="best")
        else:
            ax.text(0.02, 0.02, f"{len(entries)} blocks, dark blue = shallow, orange = deep",
                    transform=ax.transAxes, fontsize=7, color="dimgray")
    title = _title(run, "AdamW² actual learning rate per tensor")
    return _finish(fig, axes, len(order), title, out_dir, "adamw2_lr.png")


@_styled
def plot_token_similarity(run: Run, out_dir: Path) -> Path | None:
    """002: token similarity ``||PX||^2/||X||^2`` against depth at a few steps and against step."""
    layers = _blocks_with(run, N.TOKEN_SIM, None)
    if not layers:
        _skip("token_similarity.png", "no token_sim/<block> metrics")
        return None
    series = [run.get(N.metric(N.TOKEN_SIM, b)) for b in layers]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    steps = _few_steps(np.concatenate([s[0] for s in series]))
    for step, color in zip(steps, _step_colors(len(steps))):
        a0.plot(range(len(layers)), [_value_at(s, step) for s in series], marker="o", ms=3,
                color=color, label=f"step {int(step)}")
    a0.set_xticks(range(len(layers)))
    a0.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    a0.set_xlabel("block (depth)")
    a0.set_ylabel("token similarity")
    a0.set_ylim(-0.02, 1.02)
    a0.set_title("similarity vs depth")
    a0.legend(loc="best")
    for b, s, c in zip(layers, series, _depth_colors(len(layers))):
        _line(a1, s, color=c, label=b)
    _mark_divergence(a1, run)
    a1.set_ylim(-0.02, 1.02)
    a1.set_xlabel("step")
    a1.set_ylabel("token similarity")
    a1.set_title("similarity per block over training")
    _depth_legend_or_bar(fig, a1, layers)
    _suptitle(fig, _title(run, r"token similarity $\|PX\|_F^2 / \|X\|_F^2$ (1 = all tokens equal)"))
    fig.tight_layout()
    return _save(fig, out_dir, "token_similarity.png")


@_styled
def plot_qk_spectrum(run: Run, out_dir: Path) -> Path | None:
    """003 Fig. 6: the QK eigenspectrum mean ``tr(W_QK)``, scales and variance per layer."""
    layers = _blocks_with(run, N.QK_SPECTRUM, N.EIG_MEAN_TRACE)
    if not layers:
        _skip("qk_spectrum.png", "no qk_spectrum/<block>/eig_* metrics")
        return None
    panels = [(N.EIG_MEAN_TRACE, r"eigenvalue mean x d: $\sum_i \lambda_i$", r"tr($W_{QK}$)", False),
              # W_QK is not symmetric: its eigenvalues may be complex, and the sum of their squares negative
              (N.EIG_SCALE_TR2, r"$\sum_i \lambda_i^2$ (complex $\lambda$: may be < 0)", r"tr($W_{QK}^2$)", False),
              (N.EIG_SCALE_FRO2, "Frobenius scale, as LocAteR penalises it", r"tr($W_{QK}^\top W_{QK}$)", True),
              (N.EIG_VAR_D2, "eigenvalue variance x d² (may be < 0 too)",
               r"$d\,$tr($W_{QK}^2$) $-$ tr($W_{QK})^2$", False)]
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.9))
    colors = _depth_colors(len(layers))
    for ax, (q, title, ylabel, logy) in zip(axes, panels):
        for b, c in zip(layers, colors):
            _line(ax, run.get(N.metric(N.QK_SPECTRUM, b, q)), logy=logy, color=c, label=b)
        _mark_divergence(ax, run)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    _depth_legend_or_bar(fig, axes[-1], layers)
    _suptitle(fig, _title(run, r"QK eigenspectrum, $W_{QK} = W_q^{h\top} W_k^h$ summed over heads"))
    fig.tight_layout()
    return _save(fig, out_dir, "qk_spectrum.png")


@_styled
def plot_logits(run: Run, out_dir: Path) -> Path | None:
    """The max attention logit per block (log y, depth-coloured) and the output log-partition
    ``log Z`` against step. No note when both are absent: runs from before these monitors
    existed lack them, and a note on every such run would be noise."""
    layers = _blocks_with(run, N.ATTN_LOGIT_MAX, None)
    log_z = run.get(N.LOG_Z)
    if not layers and log_z is None:
        return None
    n = bool(layers) + (log_z is not None)
    fig, axes = plt.subplots(1, n, figsize=(5.6 * n, 4.0), squeeze=False)
    axes = list(axes[0])
    if layers:
        ax = axes.pop(0)
        series = [run.get(N.metric(N.ATTN_LOGIT_MAX, b)) for b in layers]
        logy = all((_finite(s)[1] > 0).all() for s in series)  # a log axis would drop the rest
        for b, s, c in zip(layers, series, _depth_colors(len(layers))):
            _line(ax, s, logy=logy, color=c, label=b)
        _mark_divergence(ax, run)
        ax.set_title("max attention logit (the softmax's input: scaled q.k, max over heads, queries, keys)")
        ax.set_xlabel("step")
        ax.set_ylabel("max logit" + ("" if logy else " (some at or below 0: linear axis)"))
        _depth_legend_or_bar(fig, ax, layers)
    if log_z is not None:
        ax = axes.pop(0)
        _line(ax, log_z, color="black")
        _mark_divergence(ax, run)
        ax.set_title(r"output log-partition $\log Z$ (mean over outputs)")
        ax.set_xlabel("step")
        ax.set_ylabel("log Z")
    _suptitle(fig, _title(run, "logit growth"))
    fig.tight_layout()
    return _save(fig, out_dir, "logits.png")


def plot_dynamics(run_dir: str | Path, blocks: str | None = None,
                  out_dir: str | Path | None = None) -> list[Path]:
    """Every figure of one run into ``RUN_DIR/plots`` (or ``out_dir``); returns the PNGs written."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    chosen = select_blocks(N.blocks_in(run.metrics), blocks)
    written = [plot_training(run, out)]
    for b in chosen:
        written.append(plot_block_dynamics(run, b, out))
    written += [plot_entropy(run, chosen, out), plot_heads(run, chosen, out), plot_sec(run, chosen, out),
                plot_adamw2_lr(run, out),
                plot_token_similarity(run, out), plot_qk_spectrum(run, out), plot_logits(run, out)]
    return [p for p in written if p is not None]
