"""Tick labels a reader can tell apart: every log axis of the figures goes through :func:`log_scale`,
and the sweep plot's x ticks through :func:`label_x_ticks`."""

from __future__ import annotations

import math

import matplotlib.ticker as mticker
import numpy as np

MAX_LABELS = 6  # per axis: a 3-inch panel holds about this many 9-pt numbers without crowding


def short(x: float, digits: int, positional: bool = True) -> str:
    """``x`` to ``digits`` significant digits, positional (``30``, ``0.00012``) or as a trimmed
    exponent (``1e-5``, ``2.5e6``)."""
    if positional:
        return np.format_float_positional(float(f"{x:.{digits}g}"), trim="-")
    mantissa, _, exponent = f"{x:.{digits - 1}e}".partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _true_to(label: str, x: float) -> bool:
    return math.isclose(float(label), x, rel_tol=1e-6, abs_tol=1e-300)


def distinct_labels(values) -> list[str]:
    """The values with the fewest significant digits that keep every label different and true
    to its value (``0.18, 0.19, 0.2`` rather than ``2e-01`` three times); positional when every
    value lies in [1e-4, 1e5), else all as exponents, so one axis uses one style."""
    values = [float(v) for v in values]
    positional = all(1e-4 <= abs(v) < 1e5 or v == 0 for v in values)
    for digits in range(1, 8):
        labels = [short(v, digits, positional) for v in values]
        if all(map(_true_to, labels, values)) and len(set(labels)) == len(labels):
            return labels
    return labels


class LogTickLabels(mticker.Formatter):
    """Major and minor formatter of a log axis. Decades are labelled; minor ticks where fewer
    than two decades are in view (else the axis would have no numbers), or beyond the first and
    last labelled decade, the roundest first, each at least 1/:data:`MAX_LABELS` of the axis
    from any other label. Both sets are
    labelled together, so no minor label repeats a major one. Plain text: mathtext tick
    labels are slow to lay out.

    Why not matplotlib's own: on an axis spanning less than a decade its minor locator falls
    back to linear ticks (0.18, 0.19, ...) that ``LogFormatter`` rounds to one digit, so the
    same label (``2e-01``) prints at every tick."""

    def __call__(self, x, pos=None):
        return self.fix_minus(f"{x:.3g}")  # cursor read-outs; ticks are labelled in format_ticks

    def format_ticks(self, values):
        lo, hi = sorted(self.axis.get_view_interval())
        if not 0 < lo < hi:
            return [self(v) for v in values]

        def in_view(locs):
            return [float(v) for v in locs if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]

        shown = in_view(self.axis.get_majorticklocs())
        gap = math.log10(hi / lo) / MAX_LABELS
        # fewer than two decades: minor labels anywhere; else only beyond the outer decades, where
        # a curve running 0.1 .. 0.5 above the top label would otherwise have no number by it
        outer = (lambda v: True) if len(shown) < 2 else (lambda v: v < min(shown) or v > max(shown))
        for v in sorted(in_view(self.axis.get_minorticklocs()), key=_roundness):
            if outer(v) and all(abs(math.log10(v / s)) >= gap for s in shown):
                shown.append(v)
        shown.sort()
        text = dict(zip(shown, distinct_labels(shown)))
        out = []
        for v in values:
            hit = [s for s in shown if math.isclose(s, v, rel_tol=1e-9)]
            out.append(self.fix_minus(text[hit[0]]) if hit else "")
        return out


def _roundness(x: float) -> int:
    """Significant digits ``x`` needs: 0.2 -> 1, 0.25 -> 2."""
    return next((d for d in range(1, 7) if _true_to(short(x, d), x)), 7)


class MinorLogTicks(mticker.LogLocator):
    """Minor ticks of a log axis; linear ones when the view spans less than a decade, where the
    log ones (2..9 x 10^k) leave stretches such as 1..2 bare and the lower values unlabelled."""

    def __init__(self, base: float = 10):
        super().__init__(base=base, subs="auto")

    def tick_values(self, vmin, vmax):
        lo, hi = sorted((vmin, vmax))
        if 0 < lo and hi / lo < self._base:
            return mticker.AutoLocator().tick_values(lo, hi)
        return super().tick_values(vmin, vmax)


def log_scale(ax, axis: str = "y", base: float = 10) -> None:
    """A log scale on ``ax``'s ``axis`` ("x" or "y") with :class:`MinorLogTicks` and :class:`LogTickLabels`."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log", base=base)
    which = ax.yaxis if axis == "y" else ax.xaxis
    which.set_minor_locator(MinorLogTicks(base))
    which.set_major_formatter(LogTickLabels())
    which.set_minor_formatter(LogTickLabels())


def _overlapping(fig, ax) -> bool:
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer).expanded(1.05, 1.0) for t in ax.get_xticklabels() if t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def label_x_ticks(fig, ax, values, labels: list[str] | None = None) -> None:
    """Ticks at exactly ``values`` (a sweep's points), labelled (default :func:`distinct_labels`),
    no minor ticks. Labels that would overlap are turned vertical (the narrowest they get),
    then every k-th one kept, the first always. Call after ``tight_layout`` (label spacing
    depends on the axes' final width) and lay out again for the taller labels."""
    values = list(values)
    labels = labels if labels is not None else distinct_labels(values)
    ax.xaxis.set_major_locator(mticker.FixedLocator(values))
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.xaxis.set_major_formatter(mticker.FixedFormatter(labels))
    fig.canvas.draw()
    if not _overlapping(fig, ax):
        return
    ax.tick_params(axis="x", labelrotation=90)
    for k in range(1, len(values) + 1):
        kept = [lab if i % k == 0 else "" for i, lab in enumerate(labels)]
        ax.xaxis.set_major_formatter(mticker.FixedFormatter(kept))
        fig.canvas.draw()
        if not _overlapping(fig, ax):
            return

