"""What every figure draws with, one run's (:mod:`stabletrain.analysis.plots`) or several runs'
side by side (:mod:`stabletrain.analysis.compare`): the style, a series drawn as its finite points
(a log axis labelled through :func:`stabletrain.analysis.ticks.log_scale`), a figure saved with no
axis flattened below :data:`MIN_RELATIVE_SPAN` and no legend over a curve, a legend fitted inside
its panel. In one place so that a run's figures and a comparison of runs read alike, and a fix
to how figures are saved or legends placed reaches both.
"""

from __future__ import annotations

import functools
import math
import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import numpy as np

from stabletrain.analysis.runs import Run, Series
from stabletrain.analysis.ticks import log_scale
from stabletrain.monitor import names as N


# no "+2.548" offsets: entropy barely leaving log T reads better as 2.5485 than as 0.0005
_STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3,
          "legend.fontsize": 7, "figure.dpi": 110, "axes.formatter.useoffset": False}


def _styled(fn):
    """Draw under this module's style without changing the importer's matplotlib defaults."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with plt.rc_context(_STYLE):
            return fn(*args, **kwargs)
    return wrapper


def _finite(series: Series) -> Series:
    x, y = series
    ok = np.isfinite(y)
    return x[ok], y[ok]


def _line(ax, series: Series | None, logy: bool = False, **kw) -> bool:
    """Plot the finite (and, on a log axis, positive) points; False when nothing is left."""
    if series is None:
        return False
    x, y = _finite(series)
    if logy:
        keep = y > 0
        x, y = x[keep], y[keep]
    if len(x) == 0:
        return False
    style = {"marker": "." if len(x) < 30 else None, "ms": 3 if len(x) > 1 else 6, "lw": 1.2}
    ax.plot(x, y, **{**style, **kw})
    if logy and (len(x) > 1 or ax.get_yscale() == "log"):  # one point (a single evaluation): a linear axis
        log_scale(ax)
    return True


def _spans_decades(series: Series | None, ratio: float = 10.0) -> bool:
    """Whether a series' finite values are all positive and span at least ``ratio`` (max / min):
    on a linear axis its early, small values would lie flat on the axis."""
    if series is None:
        return False
    y = _finite(series)[1]
    return len(y) > 1 and bool(y.min() > 0) and float(y.max() / y.min()) >= ratio


def _empty(ax, why: str) -> None:
    """Say why a panel has no line, without a meaningless 0..1 frame of ticks."""
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _min_span(ax, span: float) -> None:
    """A y axis at least ``span`` high: entropies that move by 1e-4 nats would otherwise fill
    the panel and read as a steep fall."""
    lo, hi = ax.get_ylim()
    if hi - lo < span:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - span / 2, mid + span / 2)


def _suptitle(fig, text: str, fontsize: float | None = None) -> None:
    """The figure's title, wrapped at the figure's width: a run's status, rollbacks and skipped
    steps made a title longer than a three-panel figure, cut at both sides."""
    size = fontsize or plt.rcParams["figure.titlesize"]
    size = size if isinstance(size, (int, float)) else 12.0
    chars = max(40, int(fig.get_figwidth() * 72 / (0.55 * size)))  # a character is about 0.55 em wide
    fig.suptitle(_wrap(text, chars), **({"fontsize": fontsize} if fontsize else {}))


def _wrap(text: str, chars: int) -> str:
    """``text`` in lines of at most ``chars`` characters, never broken inside ``$...$`` (mathtext
    is one piece) nor inside a word."""
    if len(text) <= chars:
        return text
    parts = re.split(r"(\$[^$]*\$)", text)
    glued = "".join(p.replace(" ", "\0") if p.startswith("$") else p for p in parts)
    return "\n".join(textwrap.wrap(glued, chars, break_long_words=False)).replace("\0", " ")


def _titles_fit(fig) -> None:
    """A panel's title wider than its panel (a colour bar narrowed it, or it landed in the last
    column) is wrapped to the panel's width, and the figure laid out again: it was cut at the
    figure's edge or ran over its neighbour's."""
    renderer = fig.canvas.get_renderer()
    wrapped = False
    for ax in fig.axes:
        text = ax.get_title()
        if not (text and ax.get_visible()):
            continue
        room = ax.get_window_extent(renderer).width
        lines = text.split("\n")  # the title's own line breaks stay; the widest line sets the measure
        chars = max(map(len, lines))
        for _ in range(4):  # characters differ in width: narrower until it fits
            width = ax.title.get_window_extent(renderer).width
            if width <= room * 1.02 or chars <= 12:
                break
            chars = max(12, min(chars - 1, int(chars * room / width)))
            ax.title.set_text("\n".join(_wrap(line, chars) for line in lines))
            wrapped = True
    if wrapped:
        fig.tight_layout()


def _over_lines(ax, leg, renderer) -> bool:
    """Whether the legend covers a curve. The run's marks (a rollback's or a skip's full-height line,
    a triangle on the top edge) are placed in axes height, not data: they cross every corner, and
    counted, they sent a legend out of the panel onto its depth colour bar."""
    box = leg.get_window_extent(renderer)
    return any(line.get_visible() and len(line.get_xdata())
               and line.get_transform().contains_branch_seperately(ax.transData)[1]
               and line.get_transform().transform_path(line.get_path()).intersects_bbox(box, filled=False)
               for line in ax.get_lines())


def _legends_off_lines(fig) -> None:
    """A legend that ``loc="best"`` could only put over a line (a crowded entropy panel has no
    free corner) gets room above the curves: the y axis is raised by the legend's height. Where
    that is more than half the panel, it moves to the right of the panel, and the figure is laid
    out again (that panel then narrows)."""
    renderer = fig.canvas.get_renderer()  # tight_layout has placed the panels: no draw needed
    moved = False
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None or not ax.get_visible() or not _over_lines(ax, leg, renderer):
            continue
        share = leg.get_window_extent(renderer).height / ax.get_window_extent(renderer).height + 0.05
        if share < 0.5:
            lo, hi = ax.get_ylim()
            if ax.get_yscale() == "log" and lo > 0:
                ax.set_ylim(lo, lo * (hi / lo) ** (1 / (1 - share)))
            elif ax.get_yscale() == "linear":
                ax.set_ylim(lo, lo + (hi - lo) / (1 - share))
            leg.set_loc("upper right")
            if not _over_lines(ax, leg, renderer):
                continue
            leg.set_loc("upper left")
            if not _over_lines(ax, leg, renderer):
                continue
            ax.set_ylim(lo, hi)
        leg.set_loc("upper left")
        leg.set_bbox_to_anchor((1.01, 1.0), transform=ax.transAxes)
        moved = True
    if moved:
        fig.tight_layout()


# A linear y axis spans at least this fraction of its largest value: a loss that moves from 2.310 to
# 2.319, or a sigma1 that moves in its fourth digit, would otherwise fill the panel as a steep change.
MIN_RELATIVE_SPAN = 0.02


def _save(fig, out_dir: Path, name: str) -> Path:
    for ax in fig.axes:
        if ax.get_xlabel() == "step" and isinstance(ax.xaxis.get_major_locator(), mticker.AutoLocator):
            # no step 22.5; AutoLocator's own spacing (every 100000, not 80000) otherwise
            ax.xaxis.set_major_locator(mticker.MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))
            lo, hi = ax.get_xlim()
            if hi - lo < 1:  # one step logged: fewer than two whole steps in view, the locator gives 0.98, 1.00, ...
                mid = round((lo + hi) / 2)
                ax.set_xlim(mid - 1, mid + 1)
        if not (ax.get_visible() and ax.axison and ax.get_lines()):
            continue
        lo, hi = ax.get_ylim()
        if ax.get_yscale() == "linear":
            _min_span(ax, MIN_RELATIVE_SPAN * max(abs(lo), abs(hi)))
        elif ax.get_yscale() == "log" and 0 < lo < hi < lo * (1 + 2 * MIN_RELATIVE_SPAN):
            mid = math.sqrt(lo * hi)  # the same fraction, about the geometric middle
            ax.set_ylim(mid / math.sqrt(1 + 2 * MIN_RELATIVE_SPAN), mid * math.sqrt(1 + 2 * MIN_RELATIVE_SPAN))
    _titles_fit(fig)
    _legends_off_lines(fig)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path)  # every figure calls tight_layout; a "tight" bbox would draw it twice
    plt.close(fig)
    return path


def _skip(what: str, why: str) -> None:
    print(f"note: skipping {what}: {why}")


def _blocks_with(run: Run, group: str, quantity: str | None) -> list[str]:
    return [b for b in N.blocks_in(run.metrics) if run.has(N.metric(group, b, quantity))]


def _wrapped(label: str, width: int) -> str:
    """``label`` in lines of at most ``width`` characters, broken at spaces and after the commas of
    a sweep's ``a=1,b=2``: never inside a setting ("deescalate.alp" / "ha=0" reads as two). A word
    longer than ``width`` keeps its own line, wider than asked: the legend then tries a smaller font."""
    lines: list[str] = []
    for para in label.split("\n"):
        line = ""
        for word in para.split(" "):
            for j, part in enumerate(p for p in re.split(r"(?<=,)", word) if p):
                sep = " " if j == 0 and line else ""
                if line and len(line) + len(sep) + len(part) > width:
                    lines.append(line)
                    line = part
                else:
                    line += sep + part
        lines.append(line)
    return "\n".join(lines)


_MIN_WRAP = 20  # characters: a legend column narrower than this is slivers of words


def _fit_legend(ax, handles, labels: list[str], **kw):
    """A legend of ``labels`` inside ``ax``'s box (past the figure's edge otherwise): long
    labels wrapped at spaces, more columns when the rows overflow the height, then a smaller
    font; as a last resort the smallest font in one column, running past the bottom."""
    renderer = ax.figure.canvas.get_renderer()
    room = ax.get_window_extent(renderer)
    size = kw.pop("fontsize", plt.rcParams["legend.fontsize"])
    size = size if isinstance(size, (int, float)) else 7
    for font in sorted({size, *(f for f in (7, 6, 5) if f < size)}, reverse=True):
        for ncol in range(1, 4):
            leg, fits = _wrapped_legend(ax, handles, labels, room, renderer, ncol, font, kw)
            if fits and leg.get_window_extent(renderer).height <= room.height:
                return leg
    return _wrapped_legend(ax, handles, labels, room, renderer, 1, font, kw)[0]


def _wrapped_legend(ax, handles, labels, room, renderer, ncol, font, kw):
    """The legend with its labels wrapped at the widest width that fits ``room``; whether it fits."""
    width = max(map(len, labels))
    while True:
        leg = ax.legend(handles, [_wrapped(lab, width) for lab in labels], ncol=ncol, fontsize=font, **kw)
        box = leg.get_window_extent(renderer)
        if box.width <= room.width:
            return leg, True
        if width <= _MIN_WRAP:
            return leg, False
        width = max(_MIN_WRAP, min(width - 1, int(width * room.width / box.width)))
