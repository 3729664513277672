"""The stability benchmark's score, table and figure on hand-written run directories."""

import json
import math

import pytest
import yaml

from stabletrain.analysis import stability as S
from stabletrain.monitor import names as N


def test_lr_sensitivity_hand_computed():
    # L0 = 5; losses 3, 2, 4, diverged (None -> 5), 7 (capped at 5): capped 3, 2, 4, 5, 5
    # mean 19/5 = 3.8, min 2 -> 1.8
    assert S.lr_sensitivity([3.0, 2.0, 4.0, None, 7.0], 5.0) == pytest.approx(1.8)
    assert S.lr_sensitivity([2.0, 2.0], 5.0) == 0.0
    assert S.lr_sensitivity([None, float("nan")], 5.0) == 0.0  # nothing trained: all at L0
    assert math.isnan(S.lr_sensitivity([], 5.0))


def _run(d, lr, status=None, final=None, family="gpt", records=(), alerts=()):
    d.mkdir(parents=True)
    model = {"family": family, "vocab_size": 256} if family == "gpt" else {"family": family, "num_classes": 10}
    (d / "config.yaml").write_text(yaml.safe_dump({"model": model, "optim": {"name": "adamw", "lr": lr}}))
    if status is not None:
        (d / "summary.json").write_text(json.dumps({"status": status, "step": 10, "total_steps": 10,
                                                    "final": final or {}, "alerts": list(alerts)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_table_on_synthetic_runs(tmp_path):
    out = tmp_path / "bench"
    lz = N.LOG_Z
    _run(out / "adamw" / "lr0.001", 0.001, "completed", {"loss": 3.5, "val/loss": 3.0},
         records=[{"step": 0, "loss": 5.5}, {"step": 5, lz: 6.0, "attn_logit_max/blocks.0": 4.0,
                                               "attn_logit_max/blocks.1": 9.0}])
    _run(out / "adamw" / "lr0.01", 0.01, "completed", {"loss": 2.5},  # no val: train loss
         records=[{"step": 5, lz: 7.5, "attn_logit_max/blocks.0": float("nan")}], alerts=[{"layer": "blocks.0"}])
    _run(out / "adamw" / "lr0.1", 0.1, "diverged", {"loss": float("nan")},
         records=[{"step": 5, lz: 50.0, "attn_logit_max/blocks.0": 300.0}])
    _run(out / "adamw2" / "lr0.001", 0.001, "completed", {"val/loss": 3.2, "loss": 3.3})
    _run(out / "adamw2" / "lr0.01", 0.01, "completed", {"val/loss": 2.2, "loss": 2.3})
    _run(out / "adamw2" / "lr0.1", 0.1, None)  # unfinished: config, no summary
    (out / "adamw2" / "lr0.1" / ".hydra").mkdir()
    (out / "adamw2" / "lr0.1" / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")

    groups = S.collect(out)
    assert set(groups) == {"adamw", "adamw2"}
    columns, rows = S.table(groups, order=["adamw2", "adamw"])
    assert columns[:4] == ["fix", "lr=0.001", "lr=0.01", "lr=0.1"]
    a2, a = rows
    assert a2["fix"] == "adamw2" and a["fix"] == "adamw"
    l0 = math.log(256)
    assert a["L0"] == pytest.approx(l0)
    assert a["lr=0.001"] == 3.0 and a["lr=0.01"] == 2.5 and a["lr=0.1"] == "diverged"
    assert a["best_loss"] == 2.5
    assert a["lr_sensitivity"] == pytest.approx((3.0 + 2.5 + l0) / 3 - 2.5)
    assert (a["diverged"], a["alerted"], a["finished"]) == (1, 1, "3/3")
    assert a["max_attn_logit"] == 300.0 and a["max_log_z"] == 50.0
    assert a2["lr=0.1"] == "unfinished" and a2["finished"] == "2/3" and a2["diverged"] == 0
    assert a2["lr_sensitivity"] == pytest.approx((3.2 + 2.2) / 2 - 2.2)  # unfinished points left out
    assert a2["max_attn_logit"] == "" and a2["max_log_z"] == ""

    md, paths = S.write(out, order=["adamw", "adamw2"])
    assert md.splitlines()[2].startswith("| adamw | 3 | 2.5 | diverged |")
    assert (out / "stability.md").read_text().strip() == md
    assert (out / "stability.csv").read_text().splitlines()[0].startswith("fix,lr=0.001")
    assert paths["png"].stat().st_size > 1000


def test_l0_vision_and_first_logged_loss(tmp_path):
    _run(tmp_path / "v", 0.01, "completed", {"loss": 1.0}, family="vit")
    assert S.read_point("g", tmp_path / "v").l0 == pytest.approx(math.log(10))
    d = tmp_path / "w"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"model": {"family": "swin"}, "optim": {"lr": 0.1}}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "lr": 0.0}) + "\n" + json.dumps({"step": 1, "loss": 4.2}))
    assert S.read_point("g", d).l0 == 4.2
    assert S.read_point("g", tmp_path / "missing") is None


def test_the_figure_draws_diverged_runs_on_the_top_edge_not_at_a_loss(tmp_path):
    """A diverged run has no final loss: its cross sits on the axis' top edge (axes units), so
    no loss value is made up for it, and the limits are those of the losses that exist."""
    out = tmp_path / "bench"
    _run(out / "adamw" / "lr0.001", 0.001, "completed", {"loss": 3.5})
    _run(out / "adamw" / "lr0.01", 0.01, "completed", {"loss": 2.5})
    _run(out / "adamw" / "lr0.1", 0.1, "diverged", {"loss": float("nan")})
    fig = S.figure(S.collect(out))
    ax = fig.axes[0]
    crosses = [ln for ln in ax.get_lines() if ln.get_marker() == "x" and len(ln.get_xdata())]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [0.1]
    assert list(crosses[0].get_ydata()) == [1.0] and crosses[0].get_transform() == ax.get_xaxis_transform()
    bottom, top = ax.get_ylim()
    assert bottom < 2.5 and 3.5 < top < math.log(256) * 1.1  # L0's line and the losses, nothing higher


def test_the_figure_says_what_its_runs_trained_as_far_as_they_agree(tmp_path):
    out = tmp_path / "bench"
    for fix, lr, steps in (("adamw", 0.01, 300), ("adamw2", 0.01, 300), ("adamw2", 0.1, 200)):
        _run(out / fix / f"lr{lr}", lr, "completed", {"loss": 3.0})
        config = yaml.safe_load((out / fix / f"lr{lr}" / "config.yaml").read_text())
        config["model"]["name"], config["steps"] = "gpt_mini", steps
        (out / fix / f"lr{lr}" / "config.yaml").write_text(yaml.safe_dump(config))
    assert S.figure(S.collect(out)).axes[0].get_title() == "final loss against learning rate, gpt_mini"
    (out / "adamw2" / "lr0.1" / "config.yaml").unlink()
    assert S.figure(S.collect(out)).axes[0].get_title() == "final loss against learning rate, gpt_mini, 300 steps"


def test_a_plain_sweep_is_no_benchmark(tmp_path):
    """A plain sweep's runs (OUT/0/, OUT/1/) made a table of one 'fix' per run: they are left out."""
    _run(tmp_path / "0", 0.001, "completed", {"loss": 3.5})
    _run(tmp_path / "1", 0.01, "completed", {"loss": 2.5})
    assert S.collect(tmp_path) == {} and S.write(tmp_path) == ("", {})


def test_a_loss_above_l0_is_a_triangle_on_the_top_edge_and_the_axis_ends_at_l0(tmp_path):
    """A run that finished far above L0 (here 40 against L0 = ln 256 = 5.5) would squash the other
    curves: the axis ends just above L0 and the run is a triangle on the top edge with its value."""
    out = tmp_path / "bench"
    _run(out / "adamw" / "lr0.001", 0.001, "completed", {"loss": 3.5})
    _run(out / "adamw" / "lr0.01", 0.01, "completed", {"loss": 2.5})
    _run(out / "adamw" / "lr0.1", 0.1, "completed", {"loss": 40.0})
    fig = S.figure(S.collect(out))
    ax = fig.axes[0]
    curve = next(ln for ln in ax.get_lines() if ln.get_label() == "adamw")
    assert list(curve.get_xdata()) == [0.001, 0.01] and list(curve.get_ydata()) == [3.5, 2.5]
    tri = [ln for ln in ax.get_lines() if ln.get_marker() == "^" and len(ln.get_xdata())]
    assert len(tri) == 1 and list(tri[0].get_xdata()) == [0.1] and list(tri[0].get_ydata()) == [1.0]
    assert tri[0].get_transform() == ax.get_xaxis_transform()
    assert [t.get_text() for t in ax.texts] == ["40"]
    assert ax.get_title() == "final loss against learning rate"  # no model nor steps in these configs
    assert ax.get_xlabel() == "learning rate (log scale)"
    l0 = math.log(256)
    bottom, top = ax.get_ylim()
    assert bottom < 2.5 and l0 < top < l0 + 0.1 * (l0 - 2.5) + 1e-9
    fig.savefig(tmp_path / "s.png")


def test_a_largest_logit_of_zero_is_a_value_not_a_blank(tmp_path):
    """A run whose attention logits and log Z stayed at 0.0 shows 0.0; only a run that logged none is blank."""
    out = tmp_path / "bench"
    _run(out / "zero" / "lr0.001", 0.001, "completed", {"loss": 3.0},
         records=[{"step": 5, N.LOG_Z: 0.0, "attn_logit_max/blocks.0": 0.0}])
    _, (row,) = S.table(S.collect(out))
    assert row["max_attn_logit"] == 0.0 and row["max_log_z"] == 0.0
