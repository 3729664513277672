"""The sweep table from run directories: settings from overrides or config.yaml, numeric order, unfinished points."""

from __future__ import annotations

import json

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
