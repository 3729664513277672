"""What the analysis code promises its readers, on small hand-written run directories: the sweep
table's columns and values, which grid points never started, labels, the sweep and stability
figures' diverged and unfinished runs, the stability table's filters, and what the plots read."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import yaml

from stabletrain.analysis import compare as C
from stabletrain.analysis import plots as P
from stabletrain.analysis.runs import read_metrics
from stabletrain.analysis import stability as S
from stabletrain.analysis import sweeps
from stabletrain.analysis.ticks import distinct_labels
from stabletrain.monitor import names as N
from tests.helpers import ROOT


def _run(path, config: dict | None = None, summary: dict | None = None, overrides: list[str] | None = None,
         records: list[dict] | None = None):
    """A run directory: config.yaml, summary.json, .hydra/overrides.yaml, metrics.jsonl (each if given)."""
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if records is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the sweep table ------------------------------------------------------------------------


def test_the_sweep_table_hand_computed(tmp_path):
    """Columns: swept keys, status, step, total_steps, diverged_at, final_loss, final_task_loss,
    the events, the final val metrics (val_ema/ too), run; diverged_at is where the run went bad
    (summary's diverged_at), not where it stopped; final_loss is the loss minimised, not the task's."""
    _run(tmp_path / "0", summary={"status": "completed", "step": 10, "total_steps": 10,
                                  "final": {"loss": 3.0, "task_loss": 2.5, "val/loss": 2.75, "val_ema/loss": 2.7}},
         overrides=["optim.tau=0.002"])
    _run(tmp_path / "1", summary={"status": "diverged", "step": 7, "total_steps": 10, "diverged_at": 5,
                                  "final": {"loss": 9.0}, "skipped_steps": 2},
         overrides=["optim.tau=0.004"])
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns == ["optim.tau", "status", "step", "total_steps", "diverged_at", "final_loss", "final_task_loss",
                       "skipped_steps", "final_val/loss", "final_val_ema/loss", "run"]
    assert [[row[c] for c in columns] for row in table] == [
        [0.002, "completed", 10, 10, "", 3.0, 2.5, "", 2.75, 2.7, "0"],
        [0.004, "diverged", 7, 10, 5, 9.0, "", 2, "", "", "1"]]


def test_a_run_that_diverged_at_step_0_keeps_its_diverged_at_column(tmp_path):
    """A NaN at the very first step: diverged_at is 0, a value, not an empty cell."""
    _run(tmp_path / "a", {"optim": {"lr": 1.0}}, {"status": "diverged", "step": 0, "diverged_at": 0})
    _run(tmp_path / "b", {"optim": {"lr": 0.1}}, {"status": "completed", "step": 5})
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert "diverged_at" in columns and [r["diverged_at"] for r in table] == ["", 0]


def test_a_failed_point_shows_its_reason_too(tmp_path):
    """Not only a refused point: one that failed (an OOM) says why in the reason column."""
    _run(tmp_path / "a", {"optim": {"lr": 0.1}}, {"status": "completed", "step": 5})
    _run(tmp_path / "b", {"optim": {"lr": 0.2}}, {"status": "failed", "step": 3, "reason": "OutOfMemoryError: CUDA"})
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert "reason" in columns and [r["reason"] for r in table] == ["", "OutOfMemoryError: CUDA"]


def test_the_markdown_table_shows_four_significant_digits(tmp_path):
    """README's tables: 2.497, 4.206e+05; a float cell keeps four significant digits."""
    assert sweeps.markdown(["a", "b", "c"], [{"a": 2.34567, "b": 420612.0, "c": float("nan")}]).splitlines()[2] == \
        "| 2.346 | 4.206e+05 | nan |"


def test_grids_of_two_sweeps_under_one_directory_are_matched_each_to_its_own_runs(tmp_path):
    """A day's directory holding two sweeps of the same grid, only the first of which ran: the
    second's points are not started, even though the first sweep has runs with their values."""
    task = {"hydra": {"overrides": {"task": ["optim.tau=0.002,0.004"]}}}
    for sweep in ("a", "b"):
        (tmp_path / sweep).mkdir()
        (tmp_path / sweep / "multirun.yaml").write_text(yaml.safe_dump(task))
    for i, tau in enumerate((0.002, 0.004)):
        _run(tmp_path / "a" / str(i), summary={"status": "completed", "step": 5}, overrides=[f"optim.tau={tau}"])
    runs = sweeps.find_runs(tmp_path)
    assert sorted((r.path.parent.name, r.path.name, r.summary["status"]) for r in runs) == [
        ("a", "0", "completed"), ("a", "1", "completed"), ("b", "0", "not started"), ("b", "1", "not started")]


def test_a_sweep_continued_with_resume_auto_matches_the_points_its_first_launch_ran(tmp_path):
    """docs/distributed.md: a stopped sweep continues with its own command plus ``resume=auto``;
    multirun.yaml then holds resume=auto, which point 1 (run by the first launch, not yet again)
    was not given. Only the swept values match a run to its point: none is listed twice."""
    hydra = {"hydra": {"overrides": {"task": ["optim.tau=0.002,0.004", "resume=auto"]}}}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump(hydra))
    _run(tmp_path / "0", summary={"status": "completed", "step": 5}, overrides=["optim.tau=0.002", "resume=auto"])
    _run(tmp_path / "1", summary={"status": "completed", "step": 5}, overrides=["optim.tau=0.004"])
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert [(r["optim.tau"], r["status"], r["run"]) for r in table] == [(0.002, "completed", "0"),
                                                                          (0.004, "completed", "1")]


def test_a_run_given_null_and_one_that_kept_the_null_default_do_not_differ(tmp_path):
    """filled_varying_keys: a run's config.yaml fills the keys it did not override, a null one
    too; the key then no longer differs and is no column, and no label says ``key=``."""
    for name, tau, over in (("a", 0.01, ["debug.nan_at_step=null"]), ("b", 0.02, [])):
        _run(tmp_path / name, {"optim": {"tau": tau}, "debug": {"nan_at_step": None}}, {"status": "completed"},
             overrides=[f"optim.tau={tau}", *over])
    columns, _ = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns[0] == "optim.tau" and "debug.nan_at_step" not in columns
    assert sweeps.labels([tmp_path / "a", tmp_path / "b"]) == ["optim.tau=0.01", "optim.tau=0.02"]


def test_a_label_writes_a_null_setting_as_null(tmp_path):
    """``debug.nan_at_step=4,null``: the null point's label says null, not ``debug.nan_at_step=``."""
    dirs = [_run(tmp_path / str(i), {"debug": {"nan_at_step": v}}, {"status": "completed"},
                 overrides=[f"debug.nan_at_step={'null' if v is None else v}"]) for i, v in enumerate((4, None))]
    assert sweeps.labels(dirs) == ["debug.nan_at_step=4", "debug.nan_at_step=null"]
    assert sweeps.run_name(dirs[1]) == f"{tmp_path.name}/1 (debug.nan_at_step=null)"


def test_labels_write_integers_as_given(tmp_path):
    """``steps=10000`` is labelled so, not ``steps=1e+04``; the csv's seed is 1, not 1.0."""
    dirs = [_run(tmp_path / str(i), summary={"status": "completed"}, overrides=[f"steps={s}", f"seed={i + 1}"])
            for i, s in enumerate((10000, 20000))]
    assert sweeps.labels(dirs) == ["seed=1, steps=10000", "seed=2, steps=20000"]
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    sweeps.write_csv(tmp_path / "s.csv", columns, table)
    assert (tmp_path / "s.csv").read_text().splitlines()[1].startswith("1,10000,completed,")


def test_how_a_run_logged_is_no_setting_either(tmp_path):
    """``logger.log_every`` (under ``logger``, as ``data.num_workers`` is how data was read) does
    not tell runs apart: the labels name what they trained with."""
    a = _run(tmp_path / "a", overrides=["optim.tau=0.002", "logger.log_every=5"])
    b = _run(tmp_path / "b", overrides=["optim.tau=0.004", "logger.log_every=50"])
    assert sweeps.labels([a, b]) == ["optim.tau=0.002", "optim.tau=0.004"]


# --- the sweep figure --------------------------------------------------------------------------


def _marks(ax):
    data, edge = [], []
    for line in ax.get_lines():
        pts = list(zip(line.get_xdata(), line.get_ydata()))
        if line.get_transform() == ax.transData:
            data += [(float(a), float(b)) for a, b in pts]
        elif line.get_transform() == ax.get_xaxis_transform():
            edge += [(float(a), float(b)) for a, b in pts]
    return data, edge


def test_a_diverged_run_just_above_the_healthy_ones_is_drawn_at_its_value():
    """Within the healthy runs' span beyond them, a diverged run's value is on the chart: a cross
    at it, not a triangle on the edge."""
    import matplotlib.pyplot as plt

    table = [{"optim.lr": lr, "status": "completed", "final_loss": v, "run": str(i)}
             for i, (lr, v) in enumerate(((1e-3, 2.0), (1e-2, 2.1), (1e-1, 2.2)))]
    table.append({"optim.lr": 1.0, "status": "diverged", "final_loss": 2.25, "run": "3"})
    fig = sweeps.figure(table, "optim.lr", None, "final_loss")
    data, edge = _marks(fig.axes[0])
    plt.close(fig)
    assert (1.0, 2.25) in data and edge == []


def test_unfinished_and_not_started_points_are_not_drawn_as_diverged():
    """A point still running or never started has no value yet: no cross, no triangle, no
    'diverged' in the legend; one interrupted with a value is a point of its line."""
    import matplotlib.pyplot as plt

    table = [{"optim.lr": 1e-3, "status": "completed", "final_loss": 2.0, "run": "0"},
             {"optim.lr": 1e-2, "status": "completed", "final_loss": 2.1, "run": "1"},
             {"optim.lr": 1e-1, "status": "unfinished", "final_loss": "", "run": "2"},
             {"optim.lr": 1.0, "status": "not started", "final_loss": "", "run": "3"},
             {"optim.lr": 3.0, "status": "interrupted", "final_loss": 2.2, "run": "4"}]
    fig = sweeps.figure(table, "optim.lr", None, "final_loss")
    ax = fig.axes[0]
    data, edge = _marks(ax)
    plt.close(fig)
    assert sorted(data) == [(1e-3, 2.0), (1e-2, 2.1), (3.0, 2.2)] and edge == [] and not ax.texts
    assert ax.get_legend() is None


def test_two_rates_a_decade_apart_are_drawn_on_a_log_axis():
    """'positive and decades apart': lr 0.1 and 1 are a decade apart."""
    assert sweeps.log_spaced([0.1, 1.0]) and not sweeps.log_spaced([0.2, 1.0])


@pytest.mark.parametrize("values,label", [((0.004, 0.01, 0.03), "optim.tau (log scale)"),
                                          ((1, 2, 3), "optim.tau"), (("a", "b"), "optim.tau")])
def test_the_sweep_figure_says_when_its_x_axis_is_logarithmic(values, label):
    """Rates evenly spaced on a log axis look like a linear one: the axis label says which it is."""
    import matplotlib.pyplot as plt

    table = [{"status": "completed", "optim.tau": v, "final_loss": 1.0 + i} for i, v in enumerate(values)]
    fig = sweeps.figure(table, "optim.tau", None, "final_loss")
    assert fig.axes[0].get_xlabel() == label
    plt.close(fig)


# --- the summarize_sweep script -----------------------------------------------------------------


def test_the_script_counts_the_points_not_started_and_writes_a_one_point_sweeps_csv(tmp_path, capsys):
    """A sweep of which one point ran: its csv is written (it is a sweep, not a run's own
    directory), and the count says how many points never started."""
    script = _script("summarize_sweep.py")
    hydra = {"hydra": {"overrides": {"task": ["optim.tau=0.002,0.004,0.008"]}}}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump(hydra))
    _run(tmp_path / "0", summary={"status": "completed", "step": 5}, overrides=["optim.tau=0.002"])
    assert script.main([str(tmp_path)]) == 0
    assert "3 runs (2 not started); table written to" in capsys.readouterr().err
    only = tmp_path / "only"
    _run(only / "0", summary={"status": "completed", "step": 5}, overrides=["optim.tau=0.002"])
    assert script.main([str(only)]) == 0
    assert (only / "summary.csv").is_file() and "1 run; table written to" in capsys.readouterr().err


def test_the_script_plots_val_loss_by_default_and_titles_diverged_runs_as_finished(tmp_path, monkeypatch):
    """--metric left out: final_val/loss where some run has it; the title counts the runs not
    finished, and a diverged run has finished."""
    script = _script("summarize_sweep.py")
    for i, (lr, status) in enumerate(((0.1, "completed"), (0.2, "diverged"), (0.3, "unfinished"))):
        final = {"loss": 2.0 + i, "val/loss": 2.5 + i} if status != "unfinished" else {}
        _run(tmp_path / str(i), {"optim": {"lr": lr}}, {"status": status, "step": 3, "final": final})
    calls = []
    monkeypatch.setattr(sweeps, "plot", lambda path, table, x, series, metric, title=None, chance=None:
                        calls.append((x, series, metric, title)) or path)
    assert script.main([str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 0
    (x, series, metric, title), = calls
    assert (x, series, metric) == ("optim.lr", None, "final_val/loss")
    assert title.endswith(": 3 runs, 1 not finished")


def test_a_killed_point_shows_how_far_it_got_and_how_to_go_on(tmp_path, capsys):
    """A point killed at step 30 (no summary.json) showed an empty step, like one never started,
    and nothing said how to continue it."""
    script = _script("summarize_sweep.py")
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    _run(tmp_path / "0", summary={"status": "completed", "step": 60}, overrides=["optim.tau=0.01"])
    _run(tmp_path / "1", overrides=["optim.tau=0.03"],
         records=[{"step": 10, "loss": 3.0}, {"step": 30, "loss": 2.5}])
    with open(tmp_path / "1" / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # killed mid-write
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert [(row["status"], row["step"]) for row in table] == [("completed", 60), ("unfinished", 30)]
    assert script.main([str(tmp_path)]) == 0
    assert (f"unfinished (no summary.json: still running, or stopped): 1; a stopped sweep goes on with its own "
            f"command plus resume=auto hydra.sweep.dir={tmp_path}") in capsys.readouterr().err


def test_a_killed_single_run_in_a_days_folder_is_told_its_own_resume(tmp_path, capsys):
    """outputs/DATE holds single runs, no multirun.yaml: a killed one was told to go on as a sweep
    (hydra.sweep.dir=), which it is not."""
    script = _script("summarize_sweep.py")
    day = tmp_path / "outputs" / "2026-11-27"
    _run(day / "10-00-00", summary={"status": "completed", "step": 60}, overrides=["optim.tau=0.01"])
    _run(day / "11-00-00", overrides=["optim.tau=0.03"], records=[{"step": 10, "loss": 3.0}])
    assert script.main([str(day)]) == 0
    err = capsys.readouterr().err
    assert ("unfinished (no summary.json: still running, or stopped): 11-00-00; a stopped run goes on with its own "
            f"command plus resume=auto hydra.run.dir=<its directory> ({day / '11-00-00'})") in err
    assert "hydra.sweep.dir" not in err
    assert script.main([str(day / "11-00-00")]) == 0  # the run's own directory: not <dir>/<dir>
    assert f"hydra.run.dir=<its directory> ({day / '11-00-00'})" in capsys.readouterr().err


def test_a_folder_of_several_sweeps_names_each_row_and_says_so(tmp_path, capsys):
    """A day's folder given for one sweep: the run column repeated 0, 1, 0, 1, and nothing said the
    table mixed two sweeps."""
    script = _script("summarize_sweep.py")
    for sweep, key in (("tau", "optim.tau"), ("lr", "optim.lr")):
        (tmp_path / sweep).mkdir()
        (tmp_path / sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": []}}}))
        for i, v in enumerate((0.1, 0.2)):
            _run(tmp_path / sweep / str(i), summary={"status": "completed", "step": 5}, overrides=[f"{key}={v}"])
    assert script.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert sorted(row.rsplit("|", 2)[1].strip() for row in out.splitlines()[2:] if row.startswith("|")) == [
        "lr/0", "lr/1", "tau/0", "tau/1"]
    assert "note: these runs come from 2 sweeps (lr, tau), in one table: give one sweep's directory" in err


def test_a_run_s_own_config_wins_over_a_hydra_record_rewritten_by_a_refused_point(tmp_path):
    """A point that refused to resume another run had its .hydra/ rewritten with its own values
    first: the table showed the tau=0.01 run's results as tau=0.005's."""
    _run(tmp_path / "1", {"optim": {"name": "adamw2", "tau": 0.01, "betas": [0.9, 0.95]}},
         {"status": "completed", "step": 60, "final": {"loss": 2.0}},
         overrides=["optim.tau=0.005", "optim=adamw2", "optim.betas=[0.9,0.95]"])
    assert sweeps.settings(tmp_path / "1") == {"optim.tau": 0.01, "optim": "adamw2", "optim.betas": "[0.9,0.95]"}


def test_the_sweep_figure_shows_chance_beside_runs_that_sit_at_it(tmp_path):
    """Three ViTs at 2.301..2.304 nats on 10 classes (chance ln 10 = 2.3026) were a steep curve on
    an axis of their own: the figure now draws chance among them, and says where it is when it
    would flatten them."""
    import matplotlib.pyplot as plt

    for i, (lam, loss, acc) in enumerate(((0, 2.3036, 0.114), (0.5, 2.3030, 0.117), (1, 2.3014, 0.120))):
        _run(tmp_path / str(i), {"model": {"family": "vit", "num_classes": 10}},
             {"status": "completed", "step": 40, "final": {"val/loss": loss, "val/acc": acc}},
             overrides=[f"deescalate.lambda_={lam}"])
    runs = sweeps.find_runs(tmp_path)
    assert sweeps.chance_level(runs, "final_val/loss") == (math.log(10), "ln 10 = 2.303")
    assert sweeps.chance_level(runs, "final_val/acc") == (0.1, "1/10 = 0.1")
    assert sweeps.chance_level(runs, "final_val/ppl") == (10.0, "10")
    _, table = sweeps.rows(runs)
    fig = sweeps.figure(table, "deescalate.lambda_", None, "final_val/loss",
                        chance=sweeps.chance_level(runs, "final_val/loss"))
    (ax,) = fig.axes
    level = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert len(level) == 1 and level[0].get_ydata()[0] == pytest.approx(math.log(10))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "chance, ln 10 = 2.303: every run within 0.0012 of it"]
    plt.close(fig)
    fig = sweeps.figure(table, "deescalate.lambda_", None, "final_val/acc",
                        chance=sweeps.chance_level(runs, "final_val/acc"))
    (ax,) = fig.axes
    assert ax.get_ylim()[0] > 0.1 and not [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["chance, 1/10 = 0.1: below this axis"]
    plt.close(fig)
    _run(tmp_path / "gpt", {"model": {"family": "gpt", "vocab_size": 256}}, {"status": "completed", "step": 4},
         overrides=["deescalate.lambda_=2"])
    assert sweeps.chance_level(sweeps.find_runs(tmp_path), "final_val/loss") is None  # 10 classes and 256 tokens


def test_the_sweep_figure_does_not_stretch_a_tiny_spread_to_fill_its_axis(tmp_path):
    """Two points 0.003 nats apart, 0.006 above chance: the y axis ran from 2.3089 to 2.3119, a
    steep line, with chance "below this axis". The axis spans at least 2% of the values (as the
    run figures do), and chance, within it, is drawn."""
    import matplotlib.pyplot as plt

    for i, (tau, loss) in enumerate(((0.004, 2.3089), (0.05, 2.3119))):
        _run(tmp_path / str(i), {"model": {"family": "vit", "num_classes": 10}},
             {"status": "completed", "step": 40, "final": {"val/loss": loss}}, overrides=[f"optim.tau={tau}"])
    runs = sweeps.find_runs(tmp_path)
    _, table = sweeps.rows(runs)
    fig = sweeps.figure(table, "optim.tau", None, "final_val/loss", chance=sweeps.chance_level(runs, "final_val/loss"))
    (ax,) = fig.axes
    lo, hi = ax.get_ylim()
    assert hi - lo >= 0.0199 * 2.3119 and lo <= 2.3089 and hi >= 2.3119
    assert [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]  # chance is on the axis
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "chance, ln 10 = 2.303: every run within 0.0093 of it"]
    plt.close(fig)


def test_series_and_x_must_differ(tmp_path, capsys):
    script = _script("summarize_sweep.py")
    for i, (tau, alpha) in enumerate(((0.1, 0.2), (0.1, 0.3), (0.2, 0.2), (0.2, 0.3))):
        _run(tmp_path / str(i), summary={"status": "completed", "step": 5, "final": {"loss": 1.0}},
             overrides=[f"optim.tau={tau}", f"norm.alpha={alpha}"])
    plot = ["--plot", str(tmp_path / "p.png")]
    assert script.main([str(tmp_path), "--x", "optim.tau", "--series", "optim.tau", *plot]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: --series optim.tau is the --x key: each line would join the points of one x value; the other swept "
        "keys: norm.alpha")


# --- the stability benchmark ----------------------------------------------------------------------


def _point(d, lr, status=None, final=None, records=(), alerts=()):
    model = {"family": "gpt", "vocab_size": 256}
    summary = None if status is None else {"status": status, "final": final or {}, "alerts": list(alerts)}
    return _run(d, {"model": model, "optim": {"name": "adamw", "lr": lr}}, summary, records=list(records))


def test_a_diverged_run_has_no_final_loss_even_where_its_last_loss_was_finite(tmp_path):
    """A run stopped for a sustained spike has a finite last loss; it is still diverged: not the
    best loss, and L0 in the LR sensitivity."""
    out = tmp_path / "bench"
    _point(out / "adamw" / "lr0.001", 0.001, "completed", {"loss": 3.0})
    _point(out / "adamw" / "lr0.01", 0.01, "completed", {"loss": 2.5})
    _point(out / "adamw" / "lr0.1", 0.1, "diverged", {"loss": 1.0})
    _, (row,) = S.table(S.collect(out))
    l0 = math.log(256)
    assert row["lr=0.1"] == "diverged" and row["best_loss"] == 2.5
    assert row["lr_sensitivity"] == pytest.approx((3.0 + 2.5 + l0) / 3 - 2.5)


def test_l0_is_the_first_loss_logged(tmp_path):
    """Where config.yaml gives no vocabulary or classes, L0 is the first loss in metrics.jsonl."""
    d = _run(tmp_path / "r", {"model": {"family": "swin"}, "optim": {"lr": 0.1}}, {"status": "completed"},
             records=[{"step": 0, "lr": 0.0}, {"step": 1, "loss": 4.2}, {"step": 2, "loss": 3.1}])
    assert S.read_point("g", d).l0 == 4.2


def test_write_keeps_the_groups_and_rates_asked_for_and_no_earlier_run(tmp_path):
    """``only`` and ``lrs`` keep those groups and rates; a point's old run set aside
    (``lr0.1.previous``) is no point of the table."""
    out = tmp_path / "bench"
    for group in ("adamw", "mine"):
        for lr in (0.001, 0.01, 0.1):
            _point(out / group / f"lr{lr}", lr, "completed", {"loss": 3.0 - lr})
    _point(out / "adamw" / "lr0.1.previous", 0.1, "diverged", {"loss": float("nan")})
    assert [p.status for p in S.collect(out)["adamw"]] == ["completed"] * 3
    md, paths = S.write(out, only=["adamw"], lrs=[0.001, 0.01])
    lines = md.splitlines()
    assert lines[0].startswith("| fix | lr=0.001 | lr=0.01 | best_loss |") and len(lines) == 3
    assert lines[2].startswith("| adamw | 2.999 | 2.99 | 2.99 |") and "| 2/2 | 0 | 0 |" in lines[2]


def test_a_learning_rate_column_names_three_significant_digits(tmp_path):
    """README's grid: lr=0.00562, lr=0.0316, lr=0.178."""
    out = tmp_path / "bench"
    for lr in (0.001, 0.00562, 0.0316, 0.178):
        _point(out / "adamw" / f"lr{lr}", lr, "completed", {"loss": 3.0})
    columns, _ = S.table(S.collect(out))
    assert columns[1:5] == ["lr=0.001", "lr=0.00562", "lr=0.0316", "lr=0.178"]


def test_an_unfinished_run_is_no_cross_and_its_alert_still_counts(tmp_path):
    """Only diverged runs are crosses on the figure's top edge; a run stopped part-way that raised
    an alert is counted among the alerted runs."""
    out = tmp_path / "bench"
    _point(out / "adamw" / "lr0.001", 0.001, "completed", {"loss": 3.0})
    _point(out / "adamw" / "lr0.01", 0.01, "interrupted", alerts=[{"step": 3, "layer": "blocks.0"}])
    _point(out / "adamw" / "lr0.1", 0.1)  # started, no summary yet
    (out / "adamw" / "lr0.1" / ".hydra").mkdir()
    (out / "adamw" / "lr0.1" / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")
    groups = S.collect(out)
    _, (row,) = S.table(groups)
    assert (row["lr=0.01"], row["lr=0.1"], row["alerted"], row["diverged"]) == ("unfinished", "unfinished", 1, 0)
    import matplotlib.pyplot as plt

    fig = S.figure(groups)
    crosses = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "x" and len(ln.get_xdata())]
    plt.close(fig)
    assert crosses == []


# --- ticks ------------------------------------------------------------------------------------------


def test_tick_labels_are_positional_down_to_1e_4():
    """'positional when every value lies in [1e-4, 1e5)': 0.0002 rather than 2e-4."""
    assert distinct_labels([0.0002, 0.0005, 0.001]) == ["0.0002", "0.0005", "0.001"]
    assert distinct_labels([0.00002, 0.001]) == ["2e-5", "1e-3"]


# --- what the plots read ----------------------------------------------------------------------------


def test_read_metrics_orders_by_step_and_skips_booleans(tmp_path):
    """Each series is sorted by step whatever the order of the lines; a boolean is no number."""
    lines = [{"step": 20, "loss": 1.0}, {"step": 0, "loss": 3.0, "eval": True}, {"step": 10, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = read_metrics(tmp_path / "metrics.jsonl")
    assert list(m["loss"][0]) == [0, 10, 20] and list(m["loss"][1]) == [3.0, 2.0, 1.0] and "eval" not in m


def test_a_run_has_no_alerts_of_a_history_a_rollback_dropped(tmp_path):
    run = P.Run("r", tmp_path, {}, {"status": "completed", "alerts": [
        {"step": 30, "layer": "blocks.0", "rolled_back": True}, {"step": 50, "layer": "blocks.1"}]})
    assert [a["step"] for a in run.alerts] == [50]


def test_a_step_a_series_did_not_log_has_no_value():
    steps = (np.array([0.0, 10.0, 10.0]), np.array([1.0, 2.0, 3.0]))
    assert P._value_at(steps, 10.0) == 3.0 and math.isnan(P._value_at(steps, 5.0))


def test_the_title_counts_skipped_steps_the_records_show_when_the_summary_has_none(tmp_path):
    skipped = (np.array([10.0, 20.0]), np.array([1.0, 1.0]))
    run = P.Run("r", tmp_path, {N.SKIPPED_STEPS: skipped}, {"status": "completed"})
    assert "2 non-finite step(s) skipped (grey)]" in P._title(run, "x")


def test_a_skipped_step_is_marked_at_its_own_step_not_its_intervals_log_step(tmp_path):
    per_interval = (np.array([10.0, 20.0]), np.array([2.0, 0.0]))
    own = (np.array([7.0, 9.0]), np.array([1.0, 1.0]))
    run = P.Run("r", tmp_path, {N.SKIPPED_STEPS: per_interval, N.SKIPPED_STEP: own}, {"status": "completed"})
    assert run.skipped_at == [7.0, 9.0]
    older = P.Run("r", tmp_path, {N.SKIPPED_STEPS: per_interval}, {"status": "completed"})
    assert older.skipped_at == [10.0]  # a run recorded before: its interval's log step, the best it has


def test_the_largest_sigma1_over_blocks_leaves_out_a_blocks_non_finite_value(tmp_path):
    steps = np.array([0.0, 10.0])
    run = P.Run("r", tmp_path, {"sigma1/blocks.0/wq_t_wk_full": (steps, np.array([1.0, np.nan])),
                                "sigma1/blocks.1/wq_t_wk_full": (steps, np.array([2.0, 3.0]))}, None)
    got = C.over_blocks(run, N.SIGMA1, N.WQ_T_WK_FULL)
    assert list(got[0]) == [0.0, 10.0] and list(got[1]) == [2.0, 3.0]


def _two_runs(tmp_path, first: dict, second: dict):
    steps = range(0, 30, 10)
    dirs = []
    for name, extra in (("a", first), ("b", second)):
        recs = [{"step": s, "loss": 3.0 - 0.1 * s / 10, "lr": 1e-3, **{k: v(s) for k, v in extra.items()}}
                for s in steps]
        dirs.append(_run(tmp_path / name, records=recs))
    return dirs


def _compare(tmp_path, monkeypatch, dirs):
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig) or out / name)
    C.compare_runs(dirs, tmp_path / "cmp", labels=["a", "b"])
    return {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}


def test_compare_runs_shows_val_loss_when_only_some_runs_have_accuracy(tmp_path, monkeypatch):
    """A GPT (val/loss) beside a ViT (val/loss, val/acc): they share val/loss, which is drawn."""
    dirs = _two_runs(tmp_path, {"val/loss": lambda s: 2.0}, {"val/loss": lambda s: 1.5, "val/acc": lambda s: 0.5})
    panels = _compare(tmp_path, monkeypatch, dirs)
    assert "validation loss" in panels and "validation acc" not in panels


def test_compare_runs_draws_the_smallest_entropy_over_blocks(tmp_path, monkeypatch):
    ent = {f"entropy/blocks.{i}/min": (lambda s, i=i: 2.0 - i - 0.01 * s) for i in range(2)}
    dirs = _two_runs(tmp_path, ent, ent)
    panels = _compare(tmp_path, monkeypatch, dirs)
    ax = panels["min over blocks and heads of attention entropy"]
    curves = [ln for ln in ax.get_lines() if len(set(ln.get_xdata())) > 1]
    assert [list(ln.get_ydata()) for ln in curves] == [[1.0, 0.9, 0.8]] * 2


def test_compare_runs_sets_runs_over_different_numbers_of_keys_on_one_scale(tmp_path, monkeypatch):
    """A ViT (uniform log 197) beside a Swin (log 49): each block's entropy over its own log_T, the
    min over blocks of those fractions; runs over the same keys keep their nats."""
    vit = {"entropy/blocks.0/min": lambda s: 2.6, "entropy/blocks.0/log_T": lambda s: 5.2,
           "entropy/blocks.1/min": lambda s: 4.0 - 0.1 * s, "entropy/blocks.1/log_T": lambda s: 5.2}
    swin = {"entropy/layers.0.blocks.0/min": lambda s: 1.9, "entropy/layers.0.blocks.0/log_T": lambda s: 3.8,
            "entropy/layers.0.blocks.1/min": lambda s: 3.0, "entropy/layers.0.blocks.1/log_T": lambda s: 3.0}
    panels = _compare(tmp_path / "mixed", monkeypatch, _two_runs(tmp_path / "mixed", vit, swin))
    title = next(t for t in panels if t.startswith("min over blocks and heads of attention entropy"))
    assert "over log T" in title and panels[title].get_ylabel() == "entropy / uniform entropy"
    curves = [ln.get_ydata() for ln in panels[title].get_lines() if len(ln.get_xdata()) == 3]
    assert np.allclose(curves[0], [0.5, 0.5, 2.0 / 5.2]) and np.allclose(curves[1], [0.5] * 3)
    same = _compare(tmp_path / "same", monkeypatch, _two_runs(tmp_path / "same", vit, vit))
    assert same["min over blocks and heads of attention entropy"].get_ylabel() == "entropy (nats)"


def test_compare_runs_sets_task_losses_side_by_side_when_one_run_has_loss_terms(tmp_path, monkeypatch):
    """A run with a z-loss beside one without: the task's loss of each, the terms left out."""
    dirs = _two_runs(tmp_path, {"loss/penalty": lambda s: 0.5}, {})
    panels = _compare(tmp_path, monkeypatch, dirs)
    ax = panels["training loss of the task (loss terms left out)"]
    curves = [ln for ln in ax.get_lines() if len(set(ln.get_xdata())) > 1]
    assert np.allclose(curves[0].get_ydata(), [2.5, 2.4, 2.3]) and np.allclose(curves[1].get_ydata(), [3.0, 2.9, 2.8])


# --- the compare_runs script ------------------------------------------------------------------------


def test_compare_runs_script_finds_the_runs_of_a_days_sweeps_and_fails_on_nothing_drawn(tmp_path, capsys):
    """A day's directory (outputs/DATE/TIME/<point>) is searched all the way down; runs that logged
    none of the panels' metrics draw nothing, and the script says so by its exit status."""
    script = _script("compare_runs.py")
    for sweep in ("12-00-00", "13-00-00"):
        _run(tmp_path / "day" / sweep / "0", records=[{"step": s, "loss": 3.0 - s} for s in (0, 1)])
    assert script.sweep_runs(tmp_path / "day") == [tmp_path / "day" / s / "0" for s in ("12-00-00", "13-00-00")]
    bare = _run(tmp_path / "bare", records=[{"step": 0, "grad_norm": 1.0}])
    assert script.main([str(bare), "--out", str(tmp_path / "o")]) == 1
    assert "skipping compare.png" in capsys.readouterr().out


def test_a_boolean_sweep_is_categorical():
    """``ema.enabled=true,false`` is not numeric: two categories, named, with no line between
    them (it was drawn as 0 and 1 on a numeric axis, joined by a line)."""
    import matplotlib.pyplot as plt

    table = [{"ema.enabled": v, "status": "completed", "final_loss": 2.0 + i, "run": str(i)}
             for i, v in enumerate((True, False))]
    fig = sweeps.figure(table, "ema.enabled", None, "final_loss")
    ax = fig.axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_marker() == "o")
    labels = [t.get_text() for t in ax.get_xticklabels()]
    plt.close(fig)
    assert labels == ["False", "True"] and line.get_linestyle() == "None"
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(0.0, 3.0), (1.0, 2.0)]


def test_finished_counts_out_of_the_whole_grid(tmp_path):
    """A fix with a point that never started (no config.yaml) has finished 2 of the 3 rates."""
    out = tmp_path / "bench"
    for lr in (0.001, 0.01, 0.1):
        _point(out / "adamw" / f"lr{lr}", lr, "completed", {"loss": 3.0})
    for lr in (0.001, 0.01):
        _point(out / "mine" / f"lr{lr}", lr, "completed", {"loss": 3.0})
    _, rows = S.table(S.collect(out))
    assert [(r["fix"], r["finished"], r["lr=0.1"]) for r in rows] == [("adamw", "3/3", 3.0), ("mine", "2/3", "")]


def test_crowded_x_labels_keep_the_first():
    """Too many labels for the axis even turned vertical: every k-th is kept, the first always."""
    import matplotlib.pyplot as plt

    from stabletrain.analysis.ticks import label_x_ticks

    fig, ax = plt.subplots(figsize=(2.5, 2.0))
    values = list(range(40))
    ax.plot(values, values)
    label_x_ticks(fig, ax, values, [f"value_{v}" for v in values])
    texts = [t.get_text() for t in ax.get_xticklabels()]
    plt.close(fig)
    assert texts[0] == "value_0" and 1 < sum(map(bool, texts)) < len(values)


def test_minor_ticks_are_linear_on_a_log_axis_spanning_less_than_a_decade():
    """1.2 .. 3: linear minor ticks (1.4, 1.6, ...), not the log ones (2, 3) that leave 1.2 .. 2 bare."""
    from stabletrain.analysis.ticks import MinorLogTicks

    ticks = MinorLogTicks().tick_values(1.2, 3.0)
    assert any(1.2 < t < 2.0 for t in ticks)
