"""A run directory read back: ``metrics.jsonl`` as one ``(steps, values)`` series per metric
(metrics come at different cadences), ``summary.json``, and the steps where the run was
resumed, rolled back, skipped a step or alerted. No matplotlib and no torch: a notebook or a
script of one's own reads runs through :func:`load_run` as the figures do."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stabletrain.analysis import sweeps
from stabletrain.monitor import names as N

Series = tuple[np.ndarray, np.ndarray]  # steps, values (sorted by step)


@dataclass
class Run:
    name: str
    path: Path
    metrics: dict[str, Series]
    summary: dict | None

    def has(self, name: str) -> bool:
        return name in self.metrics

    def get(self, name: str) -> Series | None:
        return self.metrics.get(name)

    @property
    def diverged_step(self) -> int | None:
        """Where a diverged run went bad (``diverged_at``: its first non-finite step, or the end of
        its sustained spike), which may precede the step it stopped at; None otherwise."""
        s = self.summary or {}
        return s.get("diverged_at", s.get("step")) if s.get("status") == "diverged" else None

    @property
    def last_step(self) -> float | None:
        """The last step any metric was logged at: how far a run without summary.json got."""
        return max((float(x[-1]) for x, _ in self.metrics.values() if len(x)), default=None)

    @property
    def restored_at(self) -> list[float]:
        """The steps rollbacks restored (each logged at the step it restored)."""
        series = self.get(N.rollback("restored_step"))
        return [] if series is None else sorted(set(series[0].tolist()))

    @property
    def resumed_at(self) -> list[float]:
        """The steps the run was resumed from (a requeued job's, an interrupted run's)."""
        series = self.get(N.RESUMED_AT)
        return [] if series is None else sorted(set(series[1].tolist()))

    @property
    def alerts(self) -> list[dict]:
        """The run's health alerts (summary.json): ``step``, ``layer`` and the min entropy ``value``;
        not those of a history a rollback abandoned, whose steps are on no curve drawn."""
        return [a for a in (self.summary or {}).get("alerts") or []
                if isinstance(a, dict) and "step" in a and not a.get("rolled_back")]

    @property
    def spike_spans(self) -> list[tuple[int, int]]:
        """``(first step, steps)`` of the loss spikes the run counted (summary.json; not those of the
        divergence warmup, before its loss average means anything); the last may be one the run
        ended inside (``"open"``)."""
        return [(s["step"], s.get("steps", 1)) for s in (self.summary or {}).get("spikes") or []
                if isinstance(s, dict) and isinstance(s.get("step"), (int, float)) and not s.get("warmup")]

    @property
    def skipped_at(self) -> list[float]:
        """The steps whose non-finite update was skipped; where a log interval skipped more than
        its steps' own records say (a run, or the part of a run resumed by newer code, recorded
        before each skipped step had a record of its own), that interval's log step."""
        own = self.get(N.SKIPPED_STEP)
        marks = set() if own is None else {float(x) for x, n in zip(*own) if n > 0}
        intervals = self.get(N.SKIPPED_STEPS)
        if intervals is not None:
            start = -math.inf
            for x, n in zip(*intervals):
                if n > 0 and sum(start < m <= x for m in marks) < n:
                    marks.add(float(x))
                start = max(start, float(x))
        return sorted(marks)


_NONFINITE = ("nan", "inf", "-inf")


def read_metrics(path: Path) -> dict[str, Series]:
    """``metrics.jsonl`` as one series per metric; unreadable lines (a crash mid-write) and
    non-numeric values are skipped, NaN/Inf kept (plots mask them)."""
    raw: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("step"), (int, float)):
                continue
            step = obj["step"]
            for key, value in obj.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    raw[key].append((step, float(value)))
                elif key != "step" and value in _NONFINITE:  # how metrics.jsonl writes NaN/inf
                    raw[key].append((step, float(value)))
    out = {}
    for key, pts in raw.items():
        arr = np.array(sorted(pts, key=lambda p: p[0]), dtype=float)
        out[key] = (arr[:, 0], arr[:, 1])
    return out


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        runs = sorted(p.parent.name for p in run_dir.glob("*/metrics.jsonl"))
        if runs:  # a sweep's directory
            listed = ", ".join(runs[:4]) + (", ..." if len(runs) > 4 else "")
            raise FileNotFoundError(f"{run_dir} holds runs ({listed}), not one: plot one of them, or overlay them "
                                    f"with scripts/compare_runs.py {run_dir}")
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} a run directory?")
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    except ValueError as e:  # torn or edited by hand
        raise ValueError(f"{summary_path} is not readable JSON ({e}): move it aside to plot the run's "
                         f"records") from None
    return Run(sweeps.run_name(run_dir), run_dir, read_metrics(metrics_path), summary)
