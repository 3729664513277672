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


def test_a_sweep_point_without_a_summary_is_listed_as_unfinished(tmp_path):
    for i, tau in enumerate([0.003, 0.004]):
        d = tmp_path / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"optim.tau={tau}"]))
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "completed", "step": 5, "diverged_at": 2}))
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert [(r["optim.tau"], r["status"]) for r in table] == [(0.003, "completed"), (0.004, "unfinished")]


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


def test_skips_rollbacks_and_alerts_are_columns_only_where_some_run_had_them(tmp_path):
    quiet = {"status": "completed", "step": 10, "total_steps": 10, "final": {"loss": 1.0}, "alerts": []}
    rollback = {"trigger_step": 6, "detected_step": 6, "restored_step": 4, "skipped_steps": 2, "reason": "a | b"}
    eventful = {**quiet, "skipped_steps": 3, "rollbacks": [rollback],  # as the loop writes them
                "alerts": [{"step": 40, "layer": "blocks.2", "message": "m"},
                           {"step": 25, "layer": "blocks.1", "message": "m"}]}
    for name, tau, summary in [("a", 0.01, quiet), ("b", 0.02, eventful)]:
        _fake_run(tmp_path / name, {"optim": {"tau": tau}}, summary)
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert columns[columns.index("final_loss") + 1:][:4] == ["skipped_steps", "rollbacks", "alerts", "first_alert"]
    assert [(r["skipped_steps"], r["rollbacks"], r["alerts"], r["first_alert"]) for r in table] == [
        ("", "", "", ""), (3, 1, 2, "25:blocks.1")]
    _fake_run(tmp_path / "c", {"optim": {"tau": 0.03}}, {**quiet, "skipped_steps": 0, "rollbacks": []})
    columns, table = sweeps.rows(sweeps.find_runs(tmp_path / "c"))
    assert not set(sweeps.EVENTS) & set(columns) and not set(sweeps.EVENTS) & set(table[0])


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
    assert sweeps.labels([dirs[2], twin]) == ["2", "twin"]  # nothing differs: directory names
    assert sweeps.labels([dirs[0], dirs[2], twin])[1:] == ["2 (optim=adamw)", "twin (optim=adamw)"]
    bare = tmp_path / "bare"
    (bare / ".hydra").mkdir(parents=True)
    (bare / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert sweeps.labels([bare, dirs[2]]) == ["bare", "2 (optim=adamw)"]  # no empty label
