"""A sweep as a table: one row per run directory under a sweep directory.

A run is a directory with ``summary.json``; what distinguishes it from its siblings comes
from ``.hydra/overrides.yaml`` (the overrides Hydra's multirun gave it) or, where that is
missing, from the run's resolved ``config.yaml``. Only the keys whose values differ between
runs become columns. Reads files only: no torch, so it is quick on a login node.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# final_loss is the loss minimised; where a run has loss terms (LocAteR, z-loss), final_task_loss
# is its task part, the one to compare with runs without them
FIXED = ["status", "step", "total_steps", "diverged_at", "final_loss", "final_task_loss", "eval_step"]
# shown only when some run of the sweep has one: what a healthy-looking final loss may hide, and
# why a point was refused or failed
EVENTS = ["skipped_steps", "spikes", "rollbacks", "alerts", "first_alert", "reason"]


@dataclass
class Run:
    path: Path
    summary: dict
    settings: dict = field(default_factory=dict)  # key -> value, everything the run was given


def _value(text):
    """``0.01`` -> 0.01, ``1e9`` -> 1e9, ``adamw2`` -> "adamw2" (YAML reads 1e9 as a string)."""
    if not isinstance(text, str):
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if not isinstance(v, list) else str(v)
    return out


def settings(run_dir: Path) -> dict:
    """What the run was given: its overrides, else its whole resolved config, flattened. Where
    the run's own config.yaml holds another value of an overridden key, the run's wins: Hydra
    writes ``.hydra/`` when a point starts, so a point that then refused to resume another run
    (a sweep whose points moved) left the run's results under its own values."""
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return dict(resolved_config(run_dir))
    ran = resolved_config(run_dir)
    out = {}
    for line in yaml.safe_load(overrides.read_text()) or []:
        key, _, val = line.partition("=")
        key = key.lstrip("+~")
        out[key] = _value(val)
        held = ran.get(key, ran.get(f"{key}.name"))  # a group's choice (optim=adamw2) is its name there
        if held is not None and not str(held).startswith("[") and _same(held) != _same(out[key]):
            out[key] = held  # (a list is written another way there: [0.9, 0.95])
    return out


def resolved_config(run_dir: Path) -> dict:
    """The run's resolved ``config.yaml``, flattened (``optim.tau``); empty without one. Callers
    copy it before changing it."""
    config = Path(run_dir) / "config.yaml"
    return _flatten(yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}


def find_runs(sweep_dir: str | Path) -> list[Run]:
    """Every run under ``sweep_dir``: the directories with a ``summary.json``; the sweep points
    Hydra started (``.hydra/overrides.yaml``) that have none, with status ``unfinished`` (still
    running, crashed or killed); and the points of a sweep's grid (``multirun.yaml``) that never
    started, ``not started``: no point drops out of a table, and an interrupted sweep still
    shows what it sweeps."""
    root = Path(sweep_dir)
    dirs = {p.parent for p in root.rglob("summary.json")}
    dirs |= {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    runs = []
    for d in sorted(dirs):
        try:
            summary = json.loads((d / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):  # none yet, or one being written
            summary = {"status": "unfinished", "step": last_logged_step(d) if d.joinpath("metrics.jsonl").is_file()
                       else ""}  # how far a killed run got
        runs.append(Run(d, summary, settings(d)))
    for multirun in sorted(root.rglob("multirun.yaml")):
        points = grid(multirun)
        swept = [k for k in points[0] if len({_same(p[k]) for p in points}) > 1] if points else []
        started = [r for r in runs if multirun.parent in r.path.parents]
        for num, point in enumerate(points):
            if not any(all(_same(r.settings.get(k)) == _same(point[k]) for k in swept) for r in started):
                runs.append(Run(multirun.parent / str(num), {"status": "not started"}, point))
    return runs


def last_logged_step(run_dir: Path) -> int | None:
    """The step of the last record in ``run_dir/metrics.jsonl`` (read from its end: a long run's
    file is large), or None; a torn last line (a killed writer) is passed over."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - (1 << 20)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            return int(step)
    return None


def grid(multirun_yaml: Path) -> list[dict]:
    """The points of the sweep that ``multirun.yaml`` records, in Hydra's job order (the basic
    sweeper's product of the comma lists, ``range()`` and ``choice()`` sweeps of the command line
    and of ``hydra.sweeper.params``), each as the settings its run would have. Empty where the
    grid is not a product of lists (an Optuna search) or the file does not read."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra = (yaml.safe_load(multirun_yaml.read_text()) or {}).get("hydra") or {}
        given = [f"{k}={v}" for k, v in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
        given += list((hydra.get("overrides") or {}).get("task") or [])
        values: dict[str, list[str]] = {}  # a key given twice: the last value, in its first place
        for o in OverridesParser.create().parse_overrides(given):
            key = o.get_key_element().lstrip("+~")
            if not o.is_sweep_override():
                values[key] = [o.get_value_element_as_str()]
            elif o.is_discrete_sweep():
                values[key] = list(o.sweep_string_iterator())
            else:
                return []
    except Exception:  # noqa: BLE001 - a grid is a courtesy: the started runs are the table
        return []
    return [{k: _value(v) for k, v in zip(values, combo)} for combo in itertools.product(*values.values())]


def _same(v):
    """A value as compared across runs: 0 from an override and 0.0 from a config.yaml are one."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


# how a run was run, not what it trained: a resumed run beside a fresh one differs in none of them
NOT_SETTINGS = ("resume", "resume_allow_changes", "logger", "ckpt_every", "dist_timeout", "dry_run",
                "data.num_workers")


def varying_keys(runs: list[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.settings
                   if not any(k == n or k.startswith(n + ".") for n in NOT_SETTINGS)})
    missing = object()
    return [k for k in keys if len({_same(r.settings.get(k, missing)) for r in runs}) > 1]


def filled_varying_keys(runs: list[Run]) -> list[str]:
    """:func:`varying_keys`, once each run that did not override one of them has the value its
    config.yaml ran with (a default, or a group chosen by name: optim=adamw2 is optim.name)
    filled in: some keys then no longer differ, and no run's cell is left blank."""
    keys = varying_keys(runs)
    for r in runs:
        missing = [k for k in keys if k not in r.settings]
        if missing:
            full = resolved_config(r.path)
            for k in missing:
                if k in full:  # null too: a run given debug.nan_at_step=null ran as one that kept the null default
                    r.settings[k] = full[k]
                elif (v := full.get(f"{k}.name")) is not None:
                    r.settings[k] = v
    return varying_keys(runs)


def _unread(run: Run, key: str) -> bool:
    """Whether ``run`` chose none of the options that read ``key`` (optim.tau on an AdamW run), or its
    model family does not read it (model.depth on a Swin): a label naming it would read as a setting
    that run had; or where another key of the run leaves it unread (divergence.lr_scale_on_rollback
    on a run that stops at a divergence). Unknown choices count as read; so does a model key of a
    family not built in (its keys are its registration's, which this module cannot import)."""
    from omegaconf import OmegaConf

    from stabletrain.config import FAMILY_KEYS, READ_BY, READ_WHEN

    if key.startswith("model.") and key[len("model."):] not in ("name", "family", "kwargs"):
        reads = FAMILY_KEYS.get(str(resolved_config(run.path).get("model.family")))
        return reads is not None and key[len("model."):] not in reads  # Swin's model.depth: its depths
    if key in READ_WHEN:
        try:
            nested = yaml.safe_load((run.path / "config.yaml").read_text())
            return not READ_WHEN[key][0](OmegaConf.create(nested))
        except Exception:  # noqa: BLE001 - no config.yaml, or one of another version: said as read
            return False
    readers = READ_BY.get(key)
    if not readers:
        return False
    full = resolved_config(run.path)
    for reader in readers:
        group, option = reader.split("=")
        chosen = run.settings.get(group, full.get(f"{group}.name"))
        if chosen is None or str(chosen) == option:
            return False
    return True


def labels(run_dirs: list[Path]) -> list[str]:
    """A legend label per run: the settings that differ between these runs (``optim.tau=0.01``),
    which say more than a sweep point's directory name (``3``); the directory name where nothing
    differs or two runs would share a label."""
    runs = [Run(Path(d), {}, settings(Path(d))) for d in run_dirs]
    keys = filled_varying_keys(runs)
    out = [", ".join(f"{k}={_given(r.settings[k])}" for k in keys if k in r.settings and not _unread(r, k))
           for r in runs]
    if not keys or not all(out) or len(set(out)) < len(out):
        return [run_name(d) if not (o and keys) else f"{Path(d).resolve().name} ({o})" for d, o in zip(run_dirs, out)]
    return out


def run_name(run_dir: str | Path) -> str:
    """A run's name for titles and legends: its directory's, but a sweep point's number (``1``)
    says nothing, so it becomes ``<sweep>/1 (norm.kwargs.g0=2)``: the values that point was given
    among the keys its sweep varies."""
    d = Path(run_dir).resolve()
    if not d.name.isdigit() or not (d / ".hydra" / "overrides.yaml").is_file():
        return d.name
    points = [Run(p.parent.parent, {}, settings(p.parent.parent)) for p in d.parent.glob("*/.hydra/overrides.yaml")]
    swept = varying_keys(points) if len(points) > 1 else []
    mine = settings(d)
    values = ", ".join(f"{k}={_given(mine[k])}" for k in swept if k in mine)
    return f"{d.parent.name}/{d.name}" + (f" ({values})" if values else "")


def final_metrics(runs: list[Run]) -> list[str]:
    """Validation metrics some run reached, in a stable order."""
    return sorted({k for r in runs for k in (r.summary.get("final") or {}) if k.startswith(("val/", "val_ema/"))})


def _sort_key(v):
    if v is None or v == "":
        return (2, 0, "")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "")
    return (1, 0, str(v))


def _events(summary: dict) -> dict:
    """Skipped steps, loss spikes passed (their updates applied: a healthy final loss may carry
    them; those of the divergence warmup too, as the run's last line counts them; one the run
    ended inside as ``(+1 open)``), rollbacks and entropy-collapse alerts, as counts; the first
    alert as ``step:layer``. Zero counts stay empty so that a column only shows where something happened."""
    alerts = [a for a in summary.get("alerts") or [] if isinstance(a, dict)]
    first = min(alerts, key=lambda a: a.get("step", 0)) if alerts else None
    spikes = [s for s in summary.get("spikes") or [] if isinstance(s, dict)]
    passed = sum(not s.get("open") for s in spikes)
    shown = f"{passed} (+1 open)" if passed < len(spikes) else passed or ""
    return {"skipped_steps": summary.get("skipped_steps") or "", "spikes": shown,
            "rollbacks": len(summary.get("rollbacks") or []) or "",
            "alerts": len(alerts) or "",
            "first_alert": f"{first.get('step', '?')}:{first.get('layer', '?')}" if first else "",
            "reason": summary.get("reason") or "" if summary.get("status") in ("refused", "failed") else ""}


def rows(runs: list[Run], root: Path | None = None) -> tuple[list[str], list[dict]]:
    """Columns and one dict per run, sorted by the swept values; the ``run`` column is each run's
    directory below ``root`` (``tau/0``: the points of two sweeps are both ``0``), else its name."""
    keys = filled_varying_keys(runs)
    vals = final_metrics(runs)
    out = []
    for r in runs:
        s, final = r.summary, r.summary.get("final") or {}
        row = {k: r.settings.get(k, "") for k in keys}
        row.update(status=s.get("status", "?"), step=s.get("step", ""), total_steps=s.get("total_steps", ""),
                   diverged_at=s.get("diverged_at", s.get("step", "")) if s.get("status") == "diverged" else "",
                   final_loss=final.get("loss", ""), final_task_loss=final.get("task_loss", ""),
                   # the step its final_val/* come from, where it stopped between evaluations
                   eval_step=s["eval_step"] if s.get("eval_step", s.get("step")) != s.get("step") else "")
        row.update(_events(s))
        row.update({f"final_{k}": final.get(k, "") for k in vals})
        row["run"] = r.path.name
        if root is not None and Path(root).resolve() in r.path.resolve().parents:
            row["run"] = r.path.resolve().relative_to(Path(root).resolve()).as_posix()
        out.append(row)
    out.sort(key=lambda row: [_sort_key(row[k]) for k in keys] + [_sort_key(row["run"])])
    # where it diverged, and the skips, rollbacks and alerts: columns only where some run had them
    optional = ["diverged_at", "final_task_loss", "eval_step", *EVENTS]
    kept = [k for k in optional if any(row[k] != "" for row in out)]
    for row in out:
        for k in optional:
            if k not in kept:
                del row[k]
    fixed = [k for k in FIXED if k in kept or k not in optional]
    return keys + fixed + [k for k in EVENTS if k in kept] + [f"final_{k}" for k in vals] + ["run"], out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return "" if v is None else str(v)


def _given(v) -> str:
    """A setting as a label writes it: as given on the command line, ``null`` not an empty string."""
    return "null" if v is None else _cell(v)


def markdown(columns: list[str], table: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in table]
    return "\n".join(lines)


def write_csv(path: Path, columns: list[str], table: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(table)


def number(v) -> float | None:
    """``v`` as a finite float, else None (a string, a missing or non-finite value)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _place(v: float | None, healthy: list[float]) -> int:
    """Where a diverged run's value goes: 0 at the value, 1 on the top edge of the axis, -1 on
    the bottom one. On the top edge when it has no finite value (a loss gone to NaN), on an
    edge when the value lies more than the healthy runs' span beyond them (a loss of 1e4
    beside losses of 2 would flatten them)."""
    if v is None:
        return 1
    if not healthy:
        return 0
    lo, hi = min(healthy), max(healthy)
    span = max(hi - lo, 0.1 * max(abs(lo), abs(hi)), 1e-12)
    return 1 if v > hi + span else -1 if v < lo - span else 0


def figure(table: list[dict], x: str, series: str | None, metric: str, title: str | None = None,
           chance: tuple[float, str] | None = None):
    """``metric`` against ``x``, one line per value of ``series``. A diverged run is a cross in
    its series' colour at its value, or, where that value is off the chart or not finite, a
    triangle on the axis edge with the value (``nan``, ``no value``) written by it: never a
    point at a value the run did not reach. The y limits are matplotlib's, at least 2% of the
    values high (:data:`stabletrain.analysis.figure.MIN_RELATIVE_SPAN`). The x ticks are
    the swept values; a non-numeric ``x`` (``optim=adamw,adamw2``) is categorical: points
    without a line between them (the categories have no order), each series a little apart.
    Each series is drawn thinner than the one before, on top of it, so that two that coincide
    both show. ``chance`` (:func:`chance_level`: the value and how it is written) is drawn where
    it is near the runs' values: a spread of 0.002 nats among runs that all sit at chance was a
    steep curve on its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stabletrain.analysis.ticks import label_x_ticks, log_scale

    # a run swept to null (``ema.decay=null,0.999``), or not given x at all, is a category of its own
    def shown(v) -> str:
        return "null" if v is None else "(not set)" if v == "" else str(v)

    swept = sorted({r.get(x) for r in table}, key=_sort_key)
    numeric = all(number(v) is not None and not isinstance(v, bool) for v in swept)  # true/false: categories
    categories = None if numeric else list(dict.fromkeys(map(shown, swept)))

    def at(v) -> float | None:
        return float(categories.index(shown(v))) if categories is not None else number(v)

    def points(rs, diverged: bool):
        pts = [(at(r.get(x)), number(r.get(metric))) for r in rs if (r["status"] == "diverged") == diverged]
        return [(a, b) for a, b in pts if a is not None and (diverged or b is not None)]

    healthy = [b for _, b in points(table, False)]
    groups: dict = {}
    for row in table:
        groups.setdefault(row.get(series, "") if series else "", []).append(row)
    fig, ax = plt.subplots(figsize=(6, 4))
    edge = ax.get_xaxis_transform()  # x in data, y in axes coordinates: 1 is the top of the frame
    kinds = set()
    for i, (name, rs) in enumerate(sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))):
        rs = sorted(rs, key=lambda r: _sort_key(r.get(x)))
        shift = (i - (len(groups) - 1) / 2) * 0.1 if categories is not None else 0.0
        ok = [(a + shift, b) for a, b in points(rs, False)]
        line = ax.plot([a for a, _ in ok], [b for _, b in ok], "o" if categories is not None else "o-",
                       lw=max(0.8, 2.4 - 0.5 * i), markersize=max(3.0, 7.0 - 1.2 * i),
                       label=f"{series}={name}" if series else None)[0]
        color = line.get_color()
        for r in rs:
            a, b = at(r.get(x)), number(r.get(metric))
            if r["status"] != "diverged" or a is None:
                continue
            a += shift
            where = _place(b, healthy)
            if where == 0:
                ax.plot([a], [b], "x", color=color, markersize=10, mew=2)
                kinds.add("at")
                continue
            y = 1.0 if where > 0 else 0.0
            ax.plot([a], [y], "^" if where > 0 else "v", color=color, transform=edge, clip_on=False, markersize=8)
            text = _cell(b) if b is not None else "no value" if r.get(metric) in ("", None) else str(r.get(metric))
            ax.annotate(text, (a, y), xycoords=edge, xytext=(0, -7 * where), textcoords="offset points",
                        ha="center", va="top" if where > 0 else "bottom", fontsize=7, color=color,
                        annotation_clip=False)
            kinds.add("edge")
    # the y axis spans at least MIN_RELATIVE_SPAN of the values, as a run's figures do: two points
    # 0.003 nats apart filled it as a steep line
    from stabletrain.analysis.figure import MIN_RELATIVE_SPAN, _min_span

    least = MIN_RELATIVE_SPAN * max((abs(v) for v in healthy), default=0.0)
    if chance is not None and healthy:
        level, written = chance
        lo, hi = min(healthy), max(healthy)
        span = max(hi - lo, least / 2)  # chance within the axis that span gives is drawn
        if lo - span <= level <= hi + span:
            near = max(abs(v - level) for v in healthy)
            said = f": every run within {near:.2g} of it" if near < 0.01 * abs(level) else ""
            ax.axhline(level, color="gray", ls=":", lw=1.2, zorder=1, label=f"chance, {written}{said}")
        else:  # drawn, it would flatten the runs' differences: said in the legend
            ax.plot([], [], ls="", label=f"chance, {written}: {'below' if level < lo else 'above'} this axis")
        kinds.add("chance")
    if "at" in kinds:
        ax.plot([], [], "x", color="gray", markersize=10, mew=2, label="diverged (its last value)")
    if "edge" in kinds:
        ax.plot([], [], "^", ls="", color="gray", markersize=8, label="diverged, value off the axis")
        ax.margins(y=0.15)  # room between the data and the markers on the edges
    if not healthy and "at" not in kinds:  # no run has a value to scale the y axis by
        ax.set_yticks([])
    elif least > 0:
        _min_span(ax, least)
    xs = sorted({a for a, _ in points(table, False) + points(table, True)})
    logx = categories is None and log_spaced(xs)
    if logx:
        log_scale(ax, "x")
    ax.set_xlabel(f"{x} (log scale)" if logx else x)  # evenly spaced rates on it read as a linear axis
    ax.set_ylabel(metric.replace("final_", "final "))
    if title:
        ax.set_title(title)
    if series or kinds:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if xs:
        label_x_ticks(fig, ax, xs, [categories[int(a)] for a in xs] if categories is not None else None)
        fig.tight_layout()
    return fig


def log_spaced(xs: list[float]) -> bool:
    """Whether sorted swept values belong on a log axis: positive and decades apart (learning
    rates), or a geometric series (``optim.tau=0.002,0.004,0.008``: evenly spaced in log, not in
    value), which a linear axis would bunch at its left end."""
    if not xs or xs[0] <= 0:
        return False
    if xs[-1] / xs[0] >= 10:
        return True
    if len(xs) < 3:
        return False

    def unevenness(values) -> float:  # spread of the gaps relative to their mean
        gaps = [b - a for a, b in zip(values, values[1:])]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    return unevenness([math.log(v) for v in xs]) < unevenness(xs)


def chance_level(runs: list[Run], metric: str) -> tuple[float, str] | None:
    """What ``metric`` is for a model that predicts nothing (uniform over n classes or tokens):
    ln n for a loss, 1/n for an accuracy, n for a perplexity, with how it is written; None where
    the runs' configs do not say n or disagree (a folder of several sweeps)."""
    counts = set()
    for r in runs:
        cfg = resolved_config(r.path)
        key = "model.vocab_size" if cfg.get("model.family") == "gpt" else "model.num_classes"
        if number(cfg.get(key)) is None:
            return None
        counts.add(int(cfg[key]))
    if len(counts) != 1:
        return None
    n = counts.pop()
    kind = metric.rsplit("/", 1)[-1].removeprefix("final_")
    if kind in ("loss", "task_loss"):
        return math.log(n), f"ln {n} = {math.log(n):.4g}"
    if kind == "acc":
        return 1.0 / n, f"1/{n} = {1.0 / n:.3g}"
    if kind == "ppl":
        return float(n), f"{n}"
    return None


def plot(path: Path, table: list[dict], x: str, series: str | None, metric: str, title: str | None = None,
         chance: tuple[float, str] | None = None) -> Path:
    """:func:`figure` written to ``path`` (.png, .pdf, .svg)."""
    import matplotlib.pyplot as plt

    fig = figure(table, x, series, metric, title, chance)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
