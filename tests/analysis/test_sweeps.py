"""The sweep table from run directories: settings from overrides or config.yaml, numeric order, unfinished points."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from stabletrain.analysis import sweeps


def _fake_run(path, config: dict, summary: dict):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "summary.json").write_text(json.dumps(summary))


def test_summary_falls_back_to_config_yaml_and_sorts_numerically(tmp_path):
    base = {"model": {"name": "vit_test"}, "optim": {"name": "adamw2", "tau": 0.004}, "seed": 0}
    for i, (tau, status) in enumerate([(0.02, "diverged"), (0.004, "completed"), (0.01, "interrupted")]):
        cfg = {**base, "optim": {"name": "adamw2", "tau": tau}}
        _fake_run(tmp_path / f"run{i}", cfg, {"status": status, "step": 7, "total_steps": 10,
                                              "final": {"loss": 1.5, "val/acc": 0.5}})
    (tmp_path / "not_a_run").mkdir()
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns[0] == "optim.tau" and "model.name" not in columns and "final_val/acc" in columns
    assert [r["optim.tau"] for r in table] == [0.004, 0.01, 0.02]
    assert [r["diverged_at"] for r in table] == ["", "", 7]
    assert "| 0.004 | completed |" in sweeps.markdown(columns, table)


def test_a_point_that_stopped_between_evaluations_says_where_its_validation_is_from(tmp_path):
    """A point diverged at 25 has final_val/loss of step 20 beside a completed point's of step 40."""
    base = {"model": {"name": "gpt_test"}, "divergence": {"max_skips": 1}}
    _fake_run(tmp_path / "0", base, {"status": "diverged", "step": 25, "eval_step": 20, "final": {"val/loss": 5.0}})
    _fake_run(tmp_path / "1", {**base, "divergence": {"max_skips": 5}},
              {"status": "completed", "step": 40, "eval_step": 40, "final": {"val/loss": 4.0}})
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns.index("eval_step") < columns.index("final_val/loss")
    assert [(r["step"], r["eval_step"], r["final_val/loss"]) for r in table] == [(25, 20, 5.0), (40, "", 4.0)]
    _fake_run(tmp_path / "2", base, {"status": "completed", "step": 40, "eval_step": 40})
    assert "eval_step" not in sweeps.rows(sweeps.find_runs(tmp_path / "2"))[0]  # only where it tells something


def test_a_sweep_point_without_a_summary_is_listed_as_unfinished(tmp_path):
    for i, tau in enumerate([0.003, 0.004]):
        d = tmp_path / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"optim.tau={tau}"]))
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "completed", "step": 5, "diverged_at": 2}))
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert [(r["optim.tau"], r["status"]) for r in table] == [(0.003, "completed"), (0.004, "unfinished")]


def test_an_interrupted_sweep_lists_the_points_of_its_grid_that_never_started(tmp_path):
    """Only point 0 ran: the grid in multirun.yaml still gives the swept columns and every point,
    in Hydra's job order (the product of params and command-line lists, the last value of a key
    given twice)."""
    hydra = {"sweeper": {"params": {"seed": "1,2", "model": "vit_test"}},
             "overrides": {"task": ["model=vit_mini", "optim.tau=0.002,0.004", "+x=range(1,2)"]}}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra, "seed": 0}))
    points = sweeps.grid(tmp_path / "multirun.yaml")
    assert points == [{"seed": s, "model": "vit_mini", "optim.tau": t, "x": 1} for s in (1, 2) for t in (0.002, 0.004)]
    d = tmp_path / "0"
    (d / ".hydra").mkdir(parents=True)
    given = ["model=vit_mini", "optim.tau=0.002", "+x=1", "seed=1"]
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(given))
    (d / "summary.json").write_text(json.dumps({"status": "completed", "step": 5}))
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns[:2] == ["optim.tau", "seed"]
    assert [(r["optim.tau"], r["seed"], r["status"], r["run"]) for r in table] == [
        (0.002, 1, "completed", "0"), (0.002, 2, "not started", "2"),
        (0.004, 1, "not started", "1"), (0.004, 2, "not started", "3")]
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": ["lr=interval(0,1)"]}}}))
    assert sweeps.grid(tmp_path / "multirun.yaml") == []  # a search, not a grid: the started runs only


def _table(x: str, values, series=("adamw", "adamw2")) -> list[dict]:
    return [{x: v, "optim": s, "status": "diverged" if s == "adamw" and i > len(values) // 2 else "completed",
             "final_val/loss": 2.0 + 0.1 * i + 0.3 * j, "run": f"{j}_{i}"}
            for j, s in enumerate(series) for i, v in enumerate(values)]


@pytest.mark.parametrize("x,values", [
    ("optim.lr", [float(f"{v:.2g}") for v in np.geomspace(1e-5, 3e-2, 14)]),  # log x, ticks at each rate
    ("warmup", list(range(0, 2100, 100))),  # linear x, 21 points
    ("model", [f"vit_{s}_patch16_224" for s in ("tiny", "small", "base", "large", "huge", "giant")]),  # categorical
])
def test_sweep_plot_x_labels_do_not_overlap(x, values):
    import matplotlib.pyplot as plt

    fig = sweeps.figure(_table(x, values), x, "optim", "final_val/loss")
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in shown]
    first_tick = min(ax.get_xticks())
    plt.close(fig)
    assert len(shown) >= 2 and shown[0].get_position()[0] == first_tick
    overlaps = [(a.get_text(), b.get_text()) for i, (a, ba) in enumerate(zip(shown, boxes))
                for b, bb in zip(shown[i + 1:], boxes[i + 1:]) if ba.overlaps(bb)]
    assert not overlaps


def test_skips_spikes_rollbacks_and_alerts_are_columns_only_where_some_run_had_them(tmp_path):
    quiet = {"status": "completed", "step": 10, "total_steps": 10, "final": {"loss": 1.0}, "alerts": []}
    rollback = {"trigger_step": 6, "detected_step": 6, "restored_step": 4, "skipped_steps": 2, "reason": "a | b"}
    spikes = [{"step": 3, "steps": 1, "warmup": True}, {"step": 8, "steps": 2}]
    eventful = {**quiet, "skipped_steps": 3, "spikes": spikes, "rollbacks": [rollback],  # as the loop writes them
                "alerts": [{"step": 40, "layer": "blocks.2", "message": "m"},
                           {"step": 25, "layer": "blocks.1", "message": "m"}]}
    for name, tau, summary in [("a", 0.01, quiet), ("b", 0.02, eventful)]:
        _fake_run(tmp_path / name, {"optim": {"tau": tau}}, summary)
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns[columns.index("final_loss") + 1:][:5] == ["skipped_steps", "spikes", "rollbacks", "alerts",
                                                               "first_alert"]
    assert [(r["skipped_steps"], r["spikes"], r["rollbacks"], r["alerts"], r["first_alert"]) for r in table] == [
        ("", "", "", "", ""), (3, 2, 1, 2, "25:blocks.1")]
    # a spike the run ended inside is not one it passed (the run's last line says so too)
    _fake_run(tmp_path / "d", {"optim": {"tau": 0.04}}, {**quiet, "spikes": [{"step": 9, "steps": 2, "open": True}]})
    _fake_run(tmp_path / "e", {"optim": {"tau": 0.05}}, {**quiet, "spikes": [*spikes, {"step": 9, "steps": 2,
                                                                                       "open": True}]})
    _, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert [r["spikes"] for r in table] == ["", 2, "0 (+1 open)", "2 (+1 open)"]
    _fake_run(tmp_path / "c", {"optim": {"tau": 0.03}}, {**quiet, "skipped_steps": 0, "rollbacks": [], "spikes": []})
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path / "c"))
    assert not set(sweeps.EVENTS) & set(columns) and not set(sweeps.EVENTS) & set(table[0])


def test_a_refused_or_failed_point_shows_its_reason(tmp_path):
    ok = {"status": "completed", "step": 10, "total_steps": 10, "final": {"loss": 1.0}}
    diverged = {**ok, "status": "diverged", "reason": "loss stayed above 4x its mean"}  # its own column says so
    refused = {"status": "refused", "reason": "val.bin: 10 tokens, too few"}
    for name, lr, summary in [("a", 0.1, ok), ("b", 0.2, diverged), ("c", 0.3, refused)]:
        _fake_run(tmp_path / name, {"optim": {"lr": lr}}, summary)
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert "reason" in columns and [r["reason"] for r in table] == ["", "", "val.bin: 10 tokens, too few"]
    assert table[2]["status"] == "refused"


def test_labels_name_runs_by_the_settings_that_differ(tmp_path):
    dirs = []
    for i, over in enumerate([["optim=adamw2", "optim.tau=0.01"], ["optim=adamw2", "optim.tau=0.02"], ["optim=adamw"]]):
        d = tmp_path / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(over))
        dirs.append(d)
    assert sweeps.labels(dirs) == ["optim=adamw2, optim.tau=0.01", "optim=adamw2, optim.tau=0.02", "optim=adamw"]
    twin = tmp_path / "twin"
    (twin / ".hydra").mkdir(parents=True)
    (twin / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["optim=adamw"]))
    # nothing differs: directory names, a sweep point's with what its sweep gave it
    assert sweeps.labels([dirs[2], twin]) == [f"{tmp_path.name}/2 (optim=adamw)", "twin"]
    assert sweeps.labels([dirs[0], dirs[2], twin])[1:] == ["2 (optim=adamw)", "twin (optim=adamw)"]
    bare = tmp_path / "bare"
    (bare / ".hydra").mkdir(parents=True)
    (bare / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert sweeps.labels([bare, dirs[2]]) == ["bare", "2 (optim=adamw)"]  # no empty label
    (bare / "config.yaml").write_text(yaml.safe_dump({"optim": {"name": "adamw2", "tau": 0.004}}))  # what it ran
    assert sweeps.labels([bare, dirs[2]]) == ["optim=adamw2", "optim=adamw"]
    assert sweeps.labels([bare, dirs[0]]) == ["optim.tau=0.004", "optim.tau=0.01"]


def test_a_label_leaves_out_a_key_another_key_of_its_run_leaves_unread(tmp_path):
    """divergence.lr_scale_on_rollback differs, but the run that stops at a divergence never read it."""
    dirs = []
    for name, action, scale in (("stops", "stop", 1.0), ("rolls", "rollback", 0.5)):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        over = [f"divergence.action={action}"] + ([f"divergence.lr_scale_on_rollback={scale}"] if scale != 1 else [])
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(over))
        (d / "config.yaml").write_text(yaml.safe_dump({"divergence": {"enabled": True, "action": action,
                                                                      "lr_scale_on_rollback": scale}}))
        dirs.append(d)
    assert sweeps.labels(dirs) == ["divergence.action=stop",
                                   "divergence.action=rollback, divergence.lr_scale_on_rollback=0.5"]


def _lr_table(diverged: dict) -> list[dict]:
    """Two series over five rates; ``diverged`` maps (series, rate) to the run's final metric."""
    rows = []
    for j, s in enumerate(["adamw", "adamw2"]):
        for i, lr in enumerate([1e-4, 3e-4, 1e-3, 3e-3, 1e-2]):
            bad = (s, lr) in diverged
            rows.append({"optim.lr": lr, "optim": s, "status": "diverged" if bad else "completed",
                         "final_val/loss": diverged[(s, lr)] if bad else 2.0 + 0.1 * i + 0.3 * j, "run": f"{j}_{i}"})
    return rows


def _marks(ax):
    """(x, y) of the points drawn in data coordinates and of those on the frame (y in axes coordinates)."""
    data, edge = [], []
    for line in ax.get_lines():
        pts = list(zip(line.get_xdata(), line.get_ydata()))
        if line.get_transform() == ax.transData:
            data += pts
        elif line.get_transform() == ax.get_xaxis_transform():
            edge += pts
    return data, edge


def test_sweep_plot_draws_diverged_runs_only_at_values_they_reached():
    import matplotlib.pyplot as plt

    table = _lr_table({("adamw", 3e-3): 2.35, ("adamw", 1e-2): "", ("adamw2", 3e-3): 12345.0})
    fig = sweeps.figure(table, "optim.lr", "optim", "final_val/loss")
    ax = fig.axes[0]
    data, edge = _marks(ax)
    reached = {(r["optim.lr"], r["final_val/loss"]) for r in table if r["final_val/loss"] not in ("", 12345.0)}
    assert set(data) == reached  # every point in data coordinates is a value some run reached
    assert sorted(edge) == [(3e-3, 1.0), (1e-2, 1.0)]  # the one far off, the one without a value: on the top edge
    assert [t.get_text() for t in ax.texts] == ["no value", "1.234e+04"]
    healthy = [y for (lr, y) in reached if y != 2.35]
    assert max(healthy) < ax.get_ylim()[1] < 1.1 * max(healthy)  # matplotlib's limits, not 1.155 x max
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "optim=adamw", "optim=adamw2", "diverged (its last value)", "diverged, value off the axis"]
    plt.close(fig)


def test_sweep_plot_of_runs_that_all_diverged_invents_no_value():
    import matplotlib.pyplot as plt

    table = [{"optim.lr": lr, "status": "diverged", "final_val/loss": v, "run": str(lr)}
             for lr, v in ((1e-3, ""), (1e-2, float("nan")))]
    fig = sweeps.figure(table, "optim.lr", None, "final_val/loss")
    ax = fig.axes[0]
    data, edge = _marks(ax)
    assert data == [] and sorted(edge) == [(1e-3, 1.0), (1e-2, 1.0)]
    assert [t.get_text() for t in ax.texts] == ["no value", "nan"]
    assert list(ax.get_yticks()) == []  # no scale for values no run has
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["diverged, value off the axis"]
    plt.close(fig)


def test_sweep_plot_keeps_a_point_swept_to_null():
    """``debug.nan_at_step=4,null``: the completed null point was dropped from the figure, which
    then showed only the diverged one; null is a category of its own."""
    import matplotlib.pyplot as plt

    table = [{"x": 4, "status": "diverged", "final_val/loss": "", "run": "0"},
             {"x": None, "status": "completed", "final_val/loss": 5.435, "run": "1"}]
    fig = sweeps.figure(table, "x", None, "final_val/loss")
    ax = fig.axes[0]
    data, edge = _marks(ax)
    line = next(ln for ln in ax.get_lines() if ln.get_marker() == "o")
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(1.0, 5.435)] and edge == [(0.0, 1.0)]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "null"]
    plt.close(fig)


def test_the_script_writes_a_csv_for_runs_but_not_into_a_single_run(tmp_path, capsys):
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("summarize_sweep", ROOT / "scripts" / "summarize_sweep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name, lr in [("a", 0.1), ("b", 0.2)]:
        _fake_run(tmp_path / name, {"optim": {"lr": lr}}, {"status": "completed", "step": 3, "total_steps": 3})
    assert script.main([str(tmp_path / "a")]) == 0
    assert "is one run, not a sweep (no summary.csv written)" in capsys.readouterr().err
    assert not (tmp_path / "a" / "summary.csv").exists()
    assert script.main([str(tmp_path)]) == 0
    # no run diverged: no diverged_at column
    assert (tmp_path / "summary.csv").read_text().splitlines()[0] == "optim.lr,status,step,total_steps,final_loss,run"
    # one swept key: --plot takes it as x; --metric may leave out the final_ prefix
    _fake_run(tmp_path / "c", {"optim": {"lr": 0.3}}, {"status": "completed", "step": 3, "total_steps": 3,
                                                      "final": {"loss": 1.0, "val/acc": 0.5}})
    capsys.readouterr()
    assert script.main([str(tmp_path), "--metric", "val/acc", "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    # a value swept over seeds: the value is x, one line per seed (a line through both would zig-zag)
    _fake_run(tmp_path / "d", {"optim": {"lr": 0.3}, "seed": 1}, {"status": "completed", "step": 3})
    assert script.main([str(tmp_path), "--plot", str(tmp_path / "q.png")]) == 0
    assert "one line per seed (--series seed)" in capsys.readouterr().err
    # three keys: which is x is the user's to say; a key left out of the plot is said to vary
    _fake_run(tmp_path / "e", {"optim": {"lr": 0.3, "weight_decay": 0.1}, "seed": 1}, {"status": "completed"})
    assert script.main([str(tmp_path), "--plot", str(tmp_path / "r.png")]) == 2
    assert "error: --plot needs --x KEY, one of the swept keys: optim.lr, optim.weight_decay, seed" in \
        capsys.readouterr().err
    assert script.main([str(tmp_path), "--plot", str(tmp_path / "r.png"), "--x", "optim.lr"]) == 0
    assert "note: optim.weight_decay, seed also vary" in capsys.readouterr().err


def test_a_number_swept_against_options_is_the_plots_x_axis(tmp_path, capsys):
    """optim.tau against attention: the numeric key is x, one line per attention, without --x."""
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("summarize_sweep", ROOT / "scripts" / "summarize_sweep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for i, (attn, tau) in enumerate([("softmax", 0.004), ("softmax", 0.01), ("qknorm", 0.004), ("qknorm", 0.01)]):
        _fake_run(tmp_path / str(i), {"attention": {"name": attn}, "optim": {"tau": tau}},
                  {"status": "completed", "step": 3, "final": {"loss": 1.0 + i}})
    assert script.main([str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err
    assert "x axis: optim.tau, the swept key with numeric values" in err
    assert "one line per attention.name (--series attention.name)" in err


def test_a_number_given_as_0_and_read_as_0_0_is_no_difference(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / ".hydra").mkdir(parents=True)
    (a / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["warmup=0", "optim.lr=0.1"]))
    _fake_run(b, {"warmup": 0.0, "optim": {"lr": 0.2}}, {"status": "completed"})
    assert sweeps.labels([a, b]) == ["optim.lr=0.1", "optim.lr=0.2"]


def test_a_label_leaves_out_a_key_the_runs_option_does_not_read(tmp_path):
    """An AdamW run compared with an AdamW² run of tau 0.01: the AdamW run is not labelled with
    the tau it never read (it is in its config.yaml as the schema's default)."""
    _fake_run(tmp_path / "a", {"optim": {"name": "adamw", "tau": 0.004}}, {"status": "completed"})
    _fake_run(tmp_path / "b", {"optim": {"name": "adamw2", "tau": 0.01}}, {"status": "completed"})
    assert sweeps.labels([tmp_path / "a", tmp_path / "b"]) == ["optim.name=adamw", "optim.name=adamw2, optim.tau=0.01"]


def test_a_label_leaves_out_a_model_key_the_runs_family_does_not_read(tmp_path):
    """A GPT, a ViT and a Swin compared: the Swin was labelled model.depth=12, the schema's default
    in its config.yaml (it reads depths); a family of one's own keeps every key it was given."""
    for name, family, depth in (("g", "gpt", 2), ("v", "vit", 10), ("s", "swin", 12), ("m", "mine", 12)):
        _fake_run(tmp_path / name, {"model": {"name": f"{family}_test", "family": family, "depth": depth}},
                  {"status": "completed"})
    assert sweeps.labels([tmp_path / n for n in "gvsm"]) == [
        "model.depth=2, model.family=gpt, model.name=gpt_test", "model.depth=10, model.family=vit, model.name=vit_test",
        "model.family=swin, model.name=swin_test", "model.depth=12, model.family=mine, model.name=mine_test"]


def test_the_built_in_families_register_the_keys_the_analysis_knows():
    from stabletrain.config import FAMILY_KEYS
    from stabletrain.models.registry import MODELS

    assert {f: MODELS.entry(f).info["keys"] for f in FAMILY_KEYS} == FAMILY_KEYS


@pytest.mark.parametrize("values,log", [
    ([0.002, 0.004, 0.008], True),  # doubling: even in log, not in value
    ([1e-4, 3e-4, 1e-3, 3e-3], True),  # decades apart
    ([1, 2, 3, 4], False),  # even in value
    ([0.25, 0.5], False),  # two points: no series to read
    ([0, 0.5, 1], False),  # zero has no log
])
def test_a_geometric_sweep_is_drawn_on_a_log_axis(values, log):
    import matplotlib.pyplot as plt

    assert sweeps.log_spaced(values) is log
    fig = sweeps.figure(_table("optim.tau", values, series=("adamw2",)), "optim.tau", None, "final_val/loss")
    assert fig.axes[0].get_xscale() == ("log" if log else "linear")
    plt.close(fig)


def test_how_a_run_was_run_is_no_setting_that_tells_runs_apart(tmp_path):
    """A resumed run (resume=auto) beside a fresh one: labelled by what they trained with."""
    for name, given in (("a", ["optim.tau=0.002", "resume=auto", "logger=none"]), ("b", ["optim.tau=0.004"])):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(given))
    assert sweeps.labels([tmp_path / "a", tmp_path / "b"]) == ["optim.tau=0.002", "optim.tau=0.004"]


def test_a_categorical_sweep_plot_draws_points_a_little_apart_and_coinciding_series_both_show():
    import matplotlib.pyplot as plt

    table = [{"attention": a, "reparam": r, "status": "completed", "final_val/acc": 0.5, "run": f"{a}{r}"}
             for a in ("qknorm", "softmax") for r in ("none", "sigma")]
    fig = sweeps.figure(table, "attention", "reparam", "final_val/acc", title="sweep: 4 runs")
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("reparam=")]
    assert [ln.get_linestyle() for ln in lines] == ["None", "None"]  # no order between categories
    assert [list(ln.get_xdata()) for ln in lines] == [[-0.05, 0.95], [0.05, 1.05]]
    assert lines[0].get_markersize() > lines[1].get_markersize()  # the later one inside the earlier
    assert ax.get_title() == "sweep: 4 runs"
    plt.close(fig)


def test_a_run_that_kept_a_default_shows_the_value_it_ran_with_not_a_blank_cell(tmp_path):
    for name, over, norm in (("a", ["norm=stablenorm"], "stablenorm"), ("b", [], "layernorm")):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(over))
        (d / "config.yaml").write_text(yaml.safe_dump({"norm": {"name": norm}}))
        (d / "summary.json").write_text(json.dumps({"status": "completed", "step": 1}))
    cols, rows = sweeps.rows(sweeps.find_runs(tmp_path))
    assert cols[0] == "norm" and [(r["run"], r["norm"]) for r in rows] == [("b", "layernorm"), ("a", "stablenorm")]
