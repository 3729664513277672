"""The plot scripts on a tiny synthetic run directory."""

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from stabletrain.monitor import names as N
from stabletrain.analysis import compare as C
from stabletrain.analysis import figure as F
from stabletrain.analysis import plots as P
from stabletrain.analysis.runs import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [f"blocks.{i}" for i in range(4)]
D_H = 8
STEPS = np.array([0.0, 10.0])  # two logged steps, for hand-written metrics


@pytest.fixture(autouse=True)
def _close_figures():
    """Tests that keep figures (``_save`` patched) close them after: pyplot holds every open one."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _write_run(run_dir: Path, crash: bool = True, steps: int = 300) -> Path:
    """A 4-block run whose blocks.2 crashes at the end: sparse cadences, a torn last line."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(0, steps + 1, 10):
        f = step / steps
        boom = 60.0 ** (f**6) if crash else 1.0
        row = {"step": step, "loss": 4.0 * math.exp(-2 * f) * (boom if f > 0.9 else 1.0),
               "lr": 1e-3 * 0.5 * (1 + math.cos(math.pi * f)), "grad_norm": 1.0 + f}
        if step % 20 == 0:
            for i, b in enumerate(BLOCKS):
                g = boom if i == 2 else 1.0
                row.update({
                    N.metric("sigma1", b, "wq"): 1.0 + f, N.metric("sigma1", b, "wk"): 1.1 + f,
                    N.metric("sigma1", b, "wv"): 1.0, N.metric("sigma1", b, "wo"): 0.9,
                    N.metric("sigma1", b, "w1"): 1.5, N.metric("sigma1", b, "w2"): 1.4 + f,
                    N.metric("sigma1", b, "w2_w1"): 2.0 + f,
                    N.metric("sigma1", b, "wq_t_wk_full"): 5.0 * (1 + f) * g,
                    N.metric("sigma1", b, "wq_t_wk_max"): 2.0 * (1 + f) * g,
                    N.metric("sigma1", b, "wq_t_wk_mean"): 1.5 * (1 + f) * g,
                    N.metric("sigma1", b, "wo_wv_full"): 3.0, N.metric("sigma1", b, "wo_wv_max"): 1.2,
                    N.metric("norm", b, "norm1_gamma"): 5.0 + f, N.metric("norm", b, "norm1_beta"): f,
                    N.metric("norm", b, "norm2_gamma"): 5.0, N.metric("norm", b, "norm2_beta"): 0.1 * f,
                })
                conc = min(0.999, 0.3 + 0.7 * f**4) if i == 2 and crash else 0.3
                for s in N.sec_sizes(D_H):
                    row[N.metric("sec", b, f"s{s}")] = min(1.0, conc + (1 - conc) * (s - 1) / (D_H - 1))
                for q, v in ((N.EIG_MEAN_TRACE, 0.1 - f), (N.EIG_SCALE_TR2, 2 * f * g),
                             (N.EIG_SCALE_FRO2, 3 + f * g), (N.EIG_VAR_D2, 10 * f)):
                    row[N.metric("qk_spectrum", b, q)] = v
        if step % 50 == 0:
            for i, b in enumerate(BLOCKS):
                ent = 2.0 * (1 - f) ** (4 if i == 2 and crash else 0.3)
                row.update({N.metric("entropy", b, "mean"): ent + 0.2, N.metric("entropy", b, "min"): ent,
                            N.metric("entropy", b, "log_T"): math.log(17),
                            N.metric("entropy", b, "bound_min"): 0.5 * ent,
                            N.metric("token_sim", b): 0.1 + 0.2 * i * f,
                            N.metric("norm", b, "x"): 10.0 * (1 + i), N.metric("norm", b, "grad_x"): 0.1 / (1 + f)})
            row[N.FRAC_BOUNDED] = 1 - f
            for i, b in enumerate(BLOCKS):
                for kind in ("attn.qkv.weight", "mlp.fc2.weight", "norm1.weight"):
                    p = f"{b}.{kind}"
                    row[N.adamw2_lr_eff(p)] = row["lr"] * min(1.0, (f + 0.05) * (2 + i))
                    row[N.adamw2_lr_ratio(p)] = min(1.0, (f + 0.05) * (2 + i))
            row[N.adamw2_lr_eff("pos_embed")] = row["lr"]
        if step % 100 == 0:
            row["val/loss"] = row["loss"] + 0.1
            row["val/acc"] = 0.1 + 0.5 * f
        lines.append(json.dumps(row))
    text = "\n".join(lines) + '\n{"step": 310, "loss": 1.'  # a crash mid-write
    (run_dir / "metrics.jsonl").write_text(text)
    summary = {"status": "diverged", "step": steps, "reason": "loss spike"} if crash else {"status": "completed"}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def _check_pngs(paths):
    for p in paths:
        assert p.exists() and p.stat().st_size > 5000, p
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.01  # not a blank canvas


def _figures(monkeypatch) -> dict:
    """The figures the plots draw, by file name (``_save`` patched where one run's figures and
    compare.png look it up: nothing is written)."""
    figures: dict = {}
    for module in (P, C):
        monkeypatch.setattr(module, "_save", lambda fig, out, name: figures.setdefault(name, fig) and out / name)
    return figures


def _run_dir(path, records: list[dict], summary: dict | None = None):
    """A run directory of the given records (and summary.json, if given)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_plot_dynamics_script_writes_every_figure(tmp_path):
    run = _write_run(tmp_path / "crash_run")
    res = subprocess.run([sys.executable, str(ROOT / "scripts/plot_dynamics.py"), str(run),
                          "--blocks", "0,-1"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    names = {p.name for p in (run / "plots").iterdir()}
    assert names == {"training.png", "dynamics_blocks.0.png", "dynamics_blocks.3.png", "entropy.png", "sec.png",
                     "adamw2_lr.png", "token_similarity.png", "qk_spectrum.png"}
    _check_pngs(sorted((run / "plots").iterdir()))


def test_absent_metrics_are_skipped_with_a_note(tmp_path, capsys):
    run = tmp_path / "loss_only"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": 3.0 / (1 + s)})
                                                for s in range(0, 100, 10)))
    paths = P.plot_dynamics(run)
    assert [p.name for p in paths] == ["training.png"]
    out = capsys.readouterr().out
    for fig in ("entropy.png", "sec.png", "adamw2_lr.png", "token_similarity.png", "qk_spectrum.png"):
        assert f"skipping {fig}" in out
    assert "logits" not in out  # older runs lack these monitors: no note for them
    _check_pngs(paths)


@pytest.mark.parametrize("config,why", [
    ("optim:\n  name: adamw\n", "the run used optim=adamw"),
    ("optim:\n  name: adamw2\nmonitor:\n  adamw2_every: 50\n",
     "this AdamW² run logs them every monitor.adamw2_every=50 steps and at its last, and it stopped at step 4 "
     "before any"),
    (None, "not an AdamW² run?"),
])
def test_a_missing_adamw2_figure_says_why(tmp_path, capsys, config, why):
    """An AdamW² run that diverged before its first per-tensor record is not told it is no AdamW² run."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 3.0}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "diverged", "step": 4}))
    if config:
        (tmp_path / "config.yaml").write_text(config)
    P.plot_adamw2_lr(P.load_run(tmp_path), tmp_path)
    assert capsys.readouterr().out.strip() == f"note: skipping adamw2_lr.png: no adamw2/lr_eff/<param> metrics: {why}"


def test_a_run_that_logged_nothing_is_told_so_not_step_question_mark(tmp_path, capsys):
    """An empty metrics.jsonl and no summary.json: the note said "it stopped at step ? before any"."""
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "config.yaml").write_text("optim:\n  name: adamw2\nmonitor:\n  name: standard\n  probe_every: 10\n"
                                          "  adamw2_every: 5\n")
    run = P.load_run(tmp_path)
    P.plot_adamw2_lr(run, tmp_path)
    P.plot_entropy(run, [], tmp_path)
    out = capsys.readouterr().out
    assert "?" not in out and out.count("and it logged no step") == 2, out


@pytest.mark.parametrize("steps", [[1], [4, 5]])
def test_a_one_step_run_has_whole_step_ticks(tmp_path, monkeypatch, steps):
    """One logged step: MaxNLocator(integer=True) found fewer than two integers in matplotlib's
    +-0.04 around it and fell back to 0.96, 0.98, 1.00, ..."""
    run = _run_dir(tmp_path / "r", [{"step": s, "loss": 3.0, "lr": 1e-3} for s in steps],
                   {"status": "completed", "step": steps[-1]})
    figures = _figures(monkeypatch)
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig) and F._save(fig, out, name))
    P.plot_dynamics(run)
    ax = figures["training.png"].axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    assert lo < steps[0] and steps[-1] < hi  # no logged step on the panel's edge (two steps were moved onto it)


@pytest.mark.parametrize("config,records,why", [
    ("monitor:\n  name: 'off'\n", [], "the run used monitor=off"),
    ("monitor:\n  name: standard\n  probe_every: 200\nmodel:\n  family: mine\n", [{"logits/log_z": 5.5}],
     "its probe pass ran (logits/log_z logged) but reads the entropy of stabletrain's attention only, and this "
     "model (family mine) has none"),
    ("monitor:\n  name: standard\n  probe_every: 200\n", [],
     "the probe pass logs it every monitor.probe_every=200 steps and at the run's last, and it stopped at step 4 "
     "before any"),
    (None, [], "no config.yaml to say why"),
])
def test_a_missing_entropy_figure_says_why(tmp_path, capsys, config, records, why):
    """A model of other blocks is told its attention is not read, not only that the metrics are absent."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": 4, "loss": 3.0, **r}) + "\n"
                                                    for r in records or [{}]))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "diverged", "step": 4}))
    if config:
        (tmp_path / "config.yaml").write_text(config)
    P.plot_entropy(P.load_run(tmp_path), [], tmp_path)
    note = capsys.readouterr().out.strip()
    assert note == f"note: skipping entropy.png: no entropy/<block>/mean or min metrics: {why}"


def test_read_metrics_keeps_sparse_series_and_skips_torn_lines(tmp_path):
    run = P.load_run(_write_run(tmp_path / "r"))
    steps, _ = run.metrics["loss"]
    assert steps[-1] == 300 and len(steps) == 31
    assert len(run.metrics["entropy/blocks.0/min"][0]) == 7
    assert run.diverged_step == 300  # a summary without diverged_at: where it stopped
    run.summary["diverged_at"] = 290  # the first non-finite step, before the run stopped
    assert run.diverged_step == 290
    assert P.select_blocks(BLOCKS, None) == BLOCKS
    many = [f"blocks.{i}" for i in range(12)]
    assert P.select_blocks(many, None) == [f"blocks.{i}" for i in (0, 2, 4, 6, 7, 9, 11)]
    assert P.select_blocks(many, "blocks.5,-1") == ["blocks.5", "blocks.11"]
    for bad in ("12", "foo"):
        with pytest.raises(ValueError, match=rf"--blocks: '{bad}' is not a block of this run; choose positions 0..11"):
            P.select_blocks(many, bad)


def test_compare_runs_script_overlays_runs(tmp_path):
    a = _write_run(tmp_path / "adamw_nowarmup")
    b = _write_run(tmp_path / "adamw2", crash=False)
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(a), str(b),
                          "--out", str(out)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert "replaced" not in res.stderr
    _check_pngs([out / "compare.png"])
    again = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(a), "--out", str(out)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0 and f"replaced the earlier {out / 'compare.png'}" in again.stderr
    qk = C.over_blocks(P.load_run(a), "sigma1", "wq_t_wk_full")
    assert qk[1][-1] == max(P.load_run(a).metrics[f"sigma1/{b}/wq_t_wk_full"][1][-1] for b in BLOCKS)


def test_compare_runs_labels_sweep_points_by_their_swept_values(tmp_path, monkeypatch):
    dirs = []
    for i, tau in enumerate([0.01, 0.02]):
        d = _write_run(tmp_path / str(i), crash=False)
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(f"- optim.tau={tau}\n")
        dirs.append(d)
    legends = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: legends.extend(
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()))
    C.compare_runs(dirs, tmp_path / "cmp")
    assert legends and set(legends) == {"optim.tau=0.01", "optim.tau=0.02"}


def test_compare_runs_script_takes_a_sweep_directory(tmp_path):
    for i in range(2):
        _write_run(tmp_path / "sweep" / str(i), crash=False)
    (tmp_path / "sweep" / "multirun.yaml").write_text("{}\n")  # what Hydra leaves beside the points
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(tmp_path / "sweep")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    _check_pngs([tmp_path / "sweep" / "plots" / "compare.png"])
    assert "sweeps" not in res.stderr
    _write_run(tmp_path / "other" / "0", crash=False)
    (tmp_path / "other" / "multirun.yaml").write_text("{}\n")
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compare_runs.py"), str(tmp_path), "--out",
                          str(tmp_path / "both")], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and ("note: these 3 runs come from 2 sweeps (other, sweep): give one sweep's "
                                    "directory to compare its points alone") in res.stderr, res.stderr


def test_training_curves_mark_rollbacks_and_skipped_steps(tmp_path, monkeypatch):
    """A rollback restores step 4 (NaN at 6, one skip allowed); a lone NaN at 3 is skipped."""
    from tests.helpers import train

    gpt = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "steps=8"]
    train(tmp_path / "rb", *gpt, "divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4",
          "debug.nan_at_step=6")
    train(tmp_path / "skip", *gpt, "debug.nan_at_step=3")
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig))
    # the rollback drops the records after step 4, its skip at 6 with them
    for name, orange, grey in [("rb", [4.0], []), ("skip", [], [3.0])]:
        run = P.load_run(tmp_path / name)
        assert (run.restored_at, run.skipped_at) == (orange, grey)
        P.plot_training(run, tmp_path / "plots")
        ax = figures[-1].axes[0]
        marks = {(float(line.get_xdata()[0]), line.get_color()) for line in ax.get_lines()
                 if len(set(line.get_xdata())) == 1}
        # the skipped step's loss is NaN: a red triangle on the edge, at the grey line; what set a
        # rollback off (the NaN of step 6), a black triangle on the edge
        triggers = {(6.0, "black")} if orange else set()
        assert marks == {(x, "black") for x in orange} | {(x, c) for x in grey for c in ("0.6", "red")} | triggers
        assert ("rollback(s)" in figures[-1]._suptitle.get_text()) == bool(orange)
        # the title counts every skipped step (summary.json), the dropped history's too
        title = figures[-1]._suptitle.get_text().replace("\n", " ")  # wrapped at the figure's width
        assert title.endswith("1 non-finite step(s) skipped (all in histories rollbacks dropped)]: training curves"
                              if name == "rb" else "1 non-finite step(s) skipped (grey)]: training curves"), title


def test_training_curves_mark_a_resume_and_put_a_lone_evaluation_on_the_runs_step_axis(tmp_path, monkeypatch):
    """An interrupted run resumed at step 3 is marked there (green) and said in the title; its one
    evaluation, at the last step, sits on the step axis of the loss, not alone in a panel of its own."""
    from stabletrain.build import build_trainer
    from tests.engine.test_loop import _run_until
    from tests.helpers import make_cfg, train

    gpt = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "steps=8", "logger=none",
           "monitor=off"]
    _run_until(build_trainer(make_cfg(*gpt), tmp_path), 3)
    assert train(tmp_path, *gpt, "resume=auto")["status"] == "completed"
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig))
    run = P.load_run(tmp_path)
    assert run.resumed_at == [3.0]
    P.plot_training(run, tmp_path / "plots")
    (fig,) = figures
    assert "resumed at step 3 (green)" in fig._suptitle.get_text().replace("\n", " ")
    loss_ax, val_ax = fig.axes[0], next(ax for ax in fig.axes if ax.get_title() == "validation loss")
    marks = {(float(line.get_xdata()[0]), line.get_color()) for line in loss_ax.get_lines()
             if len(set(line.get_xdata())) == 1}
    assert marks == {(3.0, "tab:green")}
    assert val_ax.get_xlim() == loss_ax.get_xlim() and val_ax.get_xlim()[0] < 1 < 8 < val_ax.get_xlim()[1]


def test_a_long_figure_title_is_wrapped_within_the_figure_and_never_inside_mathtext():
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(6, 3))
    text = "run [diverged at step 60, 2 rollback(s), 22 non-finite step(s) skipped]: " + \
        r"token similarity $\|PX\|_F^2 / \|X\|_F^2$ (1 = all tokens equal)"
    F._suptitle(fig, text)
    lines = fig._suptitle.get_text().split("\n")
    assert len(lines) > 1 and " ".join(lines) == text
    assert all(line.count("$") % 2 == 0 for line in lines)
    fig.canvas.draw()  # mathtext parses, and the title fits the figure
    box = fig._suptitle.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width
    plt.close(fig)


def test_a_panel_title_wider_than_its_panel_is_wrapped_and_steps_are_whole(tmp_path):
    """logits.png's title under a colour bar, training.png's in the last column: cut at the figure's
    edge before. And a step axis of 20..40 is ticked at whole steps (22.5 read as a step)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax in axes:
        ax.plot([20, 40], [1.0, 2.0])
        ax.set_xlabel("step")
    title = "gradient norm (before clipping, the interval's largest, over every parameter)"
    axes[2].set_title(title)
    fig.tight_layout()
    F._save(fig, tmp_path, "t.png")
    fig.canvas.draw()
    box, panel = axes[2].title.get_window_extent(), axes[2].get_window_extent()
    assert "\n" in axes[2].get_title() and axes[2].get_title().replace("\n", " ") == title
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.width <= panel.width * 1.02
    ticks = [t for t in axes[0].get_xticks() if 20 <= t <= 40]
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks)


def test_a_title_of_several_lines_keeps_its_breaks_and_fits_its_panel(tmp_path):
    """compare.png's two-line entropy title grew wider when wrapped as one line of its whole length."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax in axes.flat:
        ax.plot([0, 1], [0, 1])
    title = ("min over blocks and heads of attention entropy\nover log T (1 = uniform attention over the keys, "
             r"0 = one key; $H / \log T$ where runs attend over different numbers of keys)")
    axes[0, 2].set_title(title)
    fig.tight_layout()
    F._save(fig, tmp_path, "t.png")
    fig.canvas.draw()
    shown = axes[0, 2].get_title()
    assert shown.startswith("min over blocks and heads of attention entropy\n")  # its own break kept
    assert shown.replace("\n", " ") == title.replace("\n", " ")
    assert axes[0, 2].title.get_window_extent().width <= axes[0, 2].get_window_extent().width * 1.02


def test_a_sigma1_that_spans_decades_gets_a_log_axis_and_reparams_raw_weight_its_own_name(tmp_path, monkeypatch):
    """A crash's sigma1(W_q) from 0.2 to 30 lay flat on a linear axis for most of the run; a
    sigmaReparam run's AdamW² panels were titled by the parametrisation's internal path."""
    raw = "blocks.0.attn.qkv.parametrizations.weight.original"
    run = _run_dir(tmp_path / "r", [{"step": s, "loss": 3.0, "lr": 1e-3, N.adamw2_lr_eff(raw): 1e-3,
                                     N.metric("sigma1", "blocks.0", "wq"): 0.2 * 1.5 ** s,
                                     N.metric("sigma1", "blocks.0", "wv"): 1.0 + 0.01 * s} for s in range(0, 14)])
    figures = _figures(monkeypatch)
    P.plot_dynamics(run)
    wq, wv = figures["dynamics_blocks.0.png"].axes[0], figures["dynamics_blocks.0.png"].axes[2]
    assert (wq.get_yscale(), wv.get_yscale()) == ("log", "linear")
    assert figures["adamw2_lr.png"].axes[0].get_title() == "attn.qkv.weight (raw W)"


def test_a_spike_the_run_ended_inside_is_shaded_but_not_counted_as_passed(tmp_path, monkeypatch):
    """summary.json marks the spike still under watch where the run ended "open"; the title counted it
    among those passed."""
    records = [{"step": s, "loss": 9.0 if s in (10, 18, 19) else 3.0, "lr": 1e-3} for s in range(0, 20)]
    run = _run_dir(tmp_path / "r", records, {"status": "completed", "step": 19, "spikes": [
        {"step": 10, "steps": 1}, {"step": 18, "steps": 2, "open": True}]})
    figures = _figures(monkeypatch)
    P.plot_dynamics(run)
    fig = figures["training.png"]
    title = " ".join(fig._suptitle.get_text().split())  # wrapped to the figure's width
    assert "[completed, 1 loss spike(s) passed (shaded), a loss spike not passed where the run ended (shaded)]" in title
    assert [p.get_x() for p in fig.axes[0].patches] == [9.5, 17.5]
    alone = _run_dir(tmp_path / "s", records, {"status": "completed", "step": 19, "spikes": [
        {"step": 18, "steps": 2, "open": True}]})
    figures.clear()
    P.plot_dynamics(alone)
    title = " ".join(figures["training.png"]._suptitle.get_text().split())
    assert "[completed, a loss spike not passed where the run ended (shaded)]" in title


def test_a_spike_the_run_went_on_from_is_a_band_on_every_panel_and_in_the_title(tmp_path, monkeypatch):
    """summary.json lists the spikes; the figures said only [completed], and the spike showed in the
    loss curve alone. The divergence warmup's spike is not one the run counted."""
    records = [{"step": s, "loss": 9.0 if s in (30, 31, 32) else 3.0, "lr": 1e-3} for s in range(0, 60)]
    run = _run_dir(tmp_path / "r", records, {"status": "completed", "step": 59, "spikes": [
        {"step": 2, "steps": 1, "warmup": True}, {"step": 30, "steps": 3}], "alerts": [{"step": 40, "layer": "b"}]})
    figures = _figures(monkeypatch)
    P.plot_dynamics(run)
    fig = figures["training.png"]
    title = " ".join(fig._suptitle.get_text().split())  # wrapped to the figure's width
    assert ("[completed, 1 loss spike(s) passed (shaded), 1 loss spike(s) in the divergence warmup (not counted: "
            "step 2), 1 health alert(s)]") in title, title
    for ax in (a for a in fig.axes if a.get_lines()):
        bands = [p.get_x() for p in ax.patches]
        assert bands == [29.5], bands  # steps 30-32: from 29.5, 3 wide
        assert ax.patches[0].get_width() == 3.0


def test_read_metrics_reads_back_nonfinite_values(tmp_path):
    """metrics.jsonl stores NaN/inf as strings (JSON has none); they come back as floats."""
    import numpy as np

    from stabletrain.metrics import _clean  # the writer's encoding

    lines = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan"), "grad_norm": float("inf")},
             {"step": 3, "note": "text", "loss": float("-inf")}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(_clean(x)) + "\n" for x in lines))
    m = read_metrics(tmp_path / "metrics.jsonl")
    steps, loss = m["loss"]
    assert list(steps) == [1, 2, 3] and loss[0] == 2.0 and np.isnan(loss[1]) and loss[2] == -np.inf
    assert m["grad_norm"][1][0] == np.inf and "note" not in m


def _visible_y_labels(ax) -> list[tuple[float, str]]:
    """(position, text) of the y tick labels drawn inside the view, minor ones included."""
    ax.figure.canvas.draw()
    lo, hi = sorted(ax.get_ylim())
    return [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
            if t.get_visible() and t.get_text() and lo <= t.get_position()[1] <= hi]


@pytest.mark.parametrize("lo,hi", [(0.18, 0.22), (0.05, 0.3), (1.2, 3.0), (0.999, 1.001), (3.0, 40.0), (1e-5, 1e-3),
                                   (1e-8, 1e2)])
def test_log_axis_labels_are_distinct_and_true(lo, hi):
    """A log axis spanning less than a decade once printed ``2e-01`` at six ticks."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    F._line(ax, (np.arange(50.0), np.geomspace(lo, hi, 50)), logy=True)
    shown = _visible_y_labels(ax)
    plt.close(fig)
    texts = [t for _, t in shown]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    for y, t in shown:
        assert math.isclose(float(t.replace("\N{MINUS SIGN}", "-")), y, rel_tol=1e-6), (y, t)


def test_a_curve_beyond_the_last_labelled_decade_has_a_number_by_it():
    """||dL/dx|| from 0.5 down to 0.006: labels 0.01 and 0.1 only left its first point above the
    top label with no number by it."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    F._line(ax, (np.arange(5.0), np.array([0.5, 0.006, 0.012, 0.027, 0.009])), logy=True)
    shown = [y for y, _ in _visible_y_labels(ax)]
    plt.close(fig)
    assert 0.01 in shown and 0.1 in shown and max(shown) > 0.1 and min(shown) >= 0.01 * 0.5


def test_logits_figure_is_drawn_from_its_monitors(tmp_path, capsys):
    run = tmp_path / "logits_run"
    run.mkdir()
    rows = [{"step": s, "loss": 3.0 / (1 + s), N.LOG_Z: 4.0 + 0.01 * s,
             **{N.metric(N.ATTN_LOGIT_MAX, b): (1 + i) * 5.0 * 1.01**s for i, b in enumerate(BLOCKS)}}
            for s in range(0, 200, 20)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    paths = P.plot_dynamics(run)
    assert [p.name for p in paths] == ["training.png", "logits.png"]
    _check_pngs(paths)
    assert "logits" not in capsys.readouterr().out
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": r["step"], N.LOG_Z: r[N.LOG_Z]}) for r in rows))
    assert [p.name for p in P.plot_dynamics(run, out_dir=tmp_path / "log_z_only")] == ["logits.png"]


def test_a_legend_with_no_free_corner_moves_beside_its_panel():
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    x = np.linspace(0, 1, 50)
    for k in range(8):  # lines through every corner
        ax.plot(x, (x * (k + 1)) % 1.0, label=f"blocks.{k}")
    ax.legend(loc="best")
    fig.tight_layout()
    F._legends_off_lines(fig)
    fig.canvas.draw()
    box = ax.get_legend().get_window_extent()
    assert box.x0 >= ax.get_window_extent().x1  # right of the panel, off every line
    plt.close(fig)


def test_a_legend_stays_in_its_panel_over_the_runs_step_marks():
    """A rollback's or skip's full-height line and a trigger's triangle on the top edge cross every
    corner: counted as curves, they sent the legend out of the panel, onto its depth colour bar."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    x = np.linspace(0, 100, 50)
    ax.plot(x, 3 - x / 100, label="blocks.0")
    ax.axhline(3.4, color="gray", ls="--", label="uniform")
    for step in (10, 30, 50, 70, 90):
        ax.axvline(step, color="black", ls="--")
    ax.plot([20, 80], [0.97, 0.97], "v", transform=ax.get_xaxis_transform())
    ax.legend(loc="lower left")
    fig.tight_layout()
    F._legends_off_lines(fig)
    fig.canvas.draw()
    box, panel = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert panel.x0 <= box.x0 and box.x1 <= panel.x1  # inside: no curve under it
    plt.close(fig)


def _data_lines(ax):
    """The curves of a panel, without the vertical step marks."""
    return [line for line in ax.get_lines() if len(set(line.get_xdata())) > 1]


def test_compare_runs_draws_the_chosen_sigma1_and_entropy_on_labelled_axes(tmp_path, monkeypatch):
    import numpy as np

    a, b = _write_run(tmp_path / "a"), _write_run(tmp_path / "b", crash=False)
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([a, b], tmp_path / "cmp", labels=["first", "second"], qk=N.WQ_T_WK_MAX,
                   entropy_block="blocks.2")
    panels = {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}
    # one schedule for both, and AdamW²'s telemetry: the lr panel gives way to the bound's share
    assert set(panels) == {"training loss", "validation acc",
                           "AdamW²: fraction of tensors at the bound\n(the runs share one scheduled lr)",
                           r"max over blocks and heads of $\sigma_1(W_q^{h\top} W_k^h)$",
                           "attention entropy of blocks.2, min over heads"}
    for title, ax in panels.items():
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), title
    assert panels["training loss"].get_yscale() == "log" and panels["training loss"].get_ylabel() == "loss (nats)"
    sigma = _data_lines(panels[r"max over blocks and heads of $\sigma_1(W_q^{h\top} W_k^h)$"])
    entropy = _data_lines(panels["attention entropy of blocks.2, min over heads"])
    for run_dir, s, e in zip([a, b], sigma, entropy):
        run = P.load_run(run_dir)
        np.testing.assert_allclose(s.get_ydata(), C.over_blocks(run, N.SIGMA1, N.WQ_T_WK_MAX)[1])
        np.testing.assert_allclose(e.get_ydata(), run.metrics[N.metric(N.ENTROPY, "blocks.2", N.ENT_MIN)][1])
    legends = [ax.get_legend() for ax in figures[0].axes if ax.get_legend()]
    assert len(legends) == 1  # one for every panel: a run has one colour throughout
    assert [t.get_text() for t in legends[0].get_texts()] == [
        "first (diverged at step 300)", "second", "dotted: where the run of that colour diverged"]


def test_compare_runs_wraps_long_labels_inside_the_figure(tmp_path, monkeypatch):
    dirs = []
    for i, corpus in enumerate(["web", "code"]):
        d = _write_run(tmp_path / str(i), crash=False)
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(
            f"- data.path=/datasets/shared/tokenized/{corpus}_corpus_gpt2_tokenizer_train_split.bin\n"
            f"- model.attention_kind=scaled_dot_product_with_qk_layer_norm_{i}\n- optim.betas=[0.9,0.9{i}5]\n")
        dirs.append(d)
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs(dirs, tmp_path / "cmp")
    fig = figures[0]
    holders = [ax for ax in fig.axes if ax.get_legend()]
    assert len(holders) == 1
    legend = holders[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    expected = [f"data.path=/datasets/shared/tokenized/{c}_corpus_gpt2_tokenizer_train_split.bin, "
                f"model.attention_kind=scaled_dot_product_with_qk_layer_norm_{i}, optim.betas=[0.9,0.9{i}5]"
                for i, c in enumerate(["web", "code"])]
    assert ["".join(t.split()) for t in texts] == ["".join(e.split()) for e in expected]
    assert all("\n" in t for t in texts)  # too long for one line of the panel
    fig.canvas.draw()
    box, room = legend.get_window_extent(), holders[0].get_window_extent()
    assert room.x0 - 1 <= box.x0 and box.x1 <= room.x1 + 1 and room.y0 - 1 <= box.y0 and box.y1 <= room.y1 + 1
    panels = [ax for ax in fig.axes if ax.get_visible() and ax is not holders[0]]
    assert not any(box.overlaps(ax.get_window_extent()) for ax in panels)


def test_compare_runs_never_wraps_a_label_inside_a_setting(tmp_path, monkeypatch):
    """Twenty sweep points: the legend wrapped "deescalate.alpha=0" as "deescalate.alp" / "ha=0"
    at the larger font rather than take a smaller one; a line now breaks only at spaces and commas."""
    run = tmp_path / "r"  # a loss and an lr: the legend's panel is as large as it gets
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5 - s / 50, "lr": 1e-3}) + "\n"
                                               for s in range(0, 200, 10)))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "step": 190}))
    labels = [f"optim.tau={0.001 * (i + 1):g},deescalate.alpha={0.05 * (i % 5):g}" for i in range(20)]
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([run] * 20, tmp_path / "cmp", labels=labels)
    holder = next(ax for ax in figures[0].axes if ax.get_legend())
    texts = [t.get_text() for t in holder.get_legend().get_texts()]
    assert [t.replace("\n", "") for t in texts] == labels
    assert all(part.count("=") == 1 for t in texts for line in t.splitlines() for part in line.split(",") if part)
    figures[0].canvas.draw()
    box, room = holder.get_legend().get_window_extent(), holder.get_window_extent()
    assert room.x0 - 1 <= box.x0 and box.x1 <= room.x1 + 1 and room.y0 - 1 <= box.y0 and box.y1 <= room.y1 + 1


def test_a_label_breaks_after_the_commas_of_a_sweeps_settings():
    """A sweep point's label 'a=1,b=2' wraps after its commas (and at spaces), never inside a setting."""
    from stabletrain.analysis.figure import _wrapped

    assert _wrapped("optim.tau=0.001,deescalate.alpha=0.05 seed=1", 20) == \
        "optim.tau=0.001,\ndeescalate.alpha=0.05\nseed=1"
    assert _wrapped("a=1,b=2 c=3", 20) == "a=1,b=2 c=3"


def test_compare_runs_draws_adamw2s_bound_when_the_runs_share_one_schedule(tmp_path, monkeypatch):
    """A sweep of tau: the scheduled-lr panel was one line for every run, and nothing showed what tau
    changed. With one schedule it draws the share of tensors at the bound; an lr sweep keeps its lr."""
    def run(name, lr, frac):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "lr": lr, "adamw2/frac_bounded":
                                                             frac}) + "\n" for s in range(0, 50, 10)))
        (d / "summary.json").write_text(json.dumps({"status": "completed", "step": 40}))
        return d

    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([run("t1", 1e-3, 0.9), run("t2", 1e-3, 0.2)], tmp_path / "cmp", labels=["tau 0.01", "tau 1"])
    ax = figures[-1].axes[2]
    assert ax.get_title().startswith("AdamW²: fraction of tensors at the bound")
    assert sorted(line.get_ydata()[0] for line in ax.get_lines()) == [0.2, 0.9]
    C.compare_runs([run("l1", 1e-3, 0.5), run("l2", 3e-3, 0.5)], tmp_path / "cmp", labels=["lr 1e-3", "lr 3e-3"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


def _lr_run(path, lr, frac=None, steps=50):
    """A run of a constant lr, with AdamW²'s share of tensors at the bound where ``frac`` is given."""
    path.mkdir()
    extra = {} if frac is None else {"adamw2/frac_bounded": frac}
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "lr": lr, **extra}) + "\n"
                                                      for s in range(0, steps, 10)))
    path.joinpath("summary.json").write_text(json.dumps({"status": "completed", "step": steps - 10}))
    return path


def test_a_run_that_stopped_early_shares_the_others_schedule(tmp_path, figures):
    """A tau sweep with one blow-up: the diverged run logged a prefix of the others' lr, and the
    panel still draws the share at the bound (it fell back to three equal scheduled-lr lines)."""
    runs = [_lr_run(tmp_path / "a", 1e-3, 0.9), _lr_run(tmp_path / "b", 1e-3, 0.2),
            _lr_run(tmp_path / "c", 1e-3, 0.5, steps=30)]
    C.compare_runs(runs, tmp_path / "cmp", labels=["a", "b", "c"])
    assert figures[-1].axes[2].get_title().startswith("AdamW²: fraction of tensors at the bound")
    _lr_run(tmp_path / "d", 3e-3, 0.5, steps=30)  # another lr over the shared steps: lr is what differs
    C.compare_runs([*runs[:2], tmp_path / "d"], tmp_path / "cmp", labels=["a", "b", "d"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


@pytest.fixture
def figures(monkeypatch):
    """Every figure compare_runs draws, in order (``_save`` patched: nothing is written)."""
    out = []
    monkeypatch.setattr(C, "_save", lambda fig, where, name: out.append(fig))
    return out


def test_compare_draws_in_the_style_of_a_runs_own_figures(tmp_path, figures):
    """compare.png reads as plot_dynamics' figures do: their font sizes and grid, not matplotlib's
    defaults, and the importer's defaults are left as they were."""
    import matplotlib

    before = matplotlib.rcParams["axes.titlesize"]
    C.compare_runs([_lr_run(tmp_path / "a", 1e-3, 0.5)], tmp_path / "cmp", labels=["a"])
    ax = figures[-1].axes[0]
    assert ax.title.get_fontsize() == F._STYLE["axes.titlesize"] and ax.xaxis.get_gridlines()[0].get_visible()
    assert matplotlib.rcParams["axes.titlesize"] == before


def test_one_run_keeps_its_lr_panel(tmp_path, figures):
    """The bound's share replaces the lr panel only where several runs share one schedule: a run
    alone with AdamW²'s telemetry still draws its scheduled lr."""
    C.compare_runs([_lr_run(tmp_path / "a", 1e-3, 0.5)], tmp_path / "cmp", labels=["a"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


def test_runs_without_adamw2s_telemetry_keep_the_lr_panel(tmp_path, figures):
    """Two AdamW runs with one schedule log no bound: the panel stays the scheduled lr, not an
    empty 'fraction of tensors at the bound'."""
    C.compare_runs([_lr_run(tmp_path / "a", 1e-3), _lr_run(tmp_path / "b", 1e-3)], tmp_path / "cmp",
                   labels=["a", "b"])
    assert figures[-1].axes[2].get_title() == "scheduled lr"


def test_a_run_lacking_the_bound_is_said_to_lack_the_bound(tmp_path, figures):
    """Where the bound's panel replaced the lr's, a run without AdamW²'s telemetry is said not to
    log 'bound' (it logged its lr, which the figure does not draw)."""
    C.compare_runs([_lr_run(tmp_path / "a", 1e-3, 0.5), _lr_run(tmp_path / "b", 1e-3)], tmp_path / "cmp",
                   labels=["with", "without"])
    assert figures[-1].axes[2].get_title().startswith("AdamW²: fraction of tensors at the bound")
    slot = next(ax for ax in figures[-1].axes if ax.get_legend() is not None)
    texts = [" ".join(t.get_text().split()) for t in slot.get_legend().get_texts()]
    assert texts[0].startswith("with") and "not logged" in texts[1], texts
    logged = texts[1].split("not logged: ")[1]
    assert "bound" in logged and "lr" not in logged.replace("validation", ""), texts


def test_compare_runs_says_which_run_a_panel_lacks(tmp_path, monkeypatch):
    full = _write_run(tmp_path / "full", crash=False)
    bare = tmp_path / "loss_only"
    bare.mkdir()
    rows = [{"step": s, "loss": 3.0 / (1 + s)} for s in range(0, 300, 10)]
    (bare / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    (bare / "summary.json").write_text(json.dumps({"status": "completed"}))
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([full, bare], tmp_path / "cmp", labels=["full", "bare"])
    assert not [ax for ax in figures[0].axes if ax.get_title() and ax.get_legend()]  # no panel squeezed by notes
    slot = next(ax for ax in figures[0].axes if ax.get_legend() is not None)
    assert [" ".join(t.get_text().split()) for t in slot.get_legend().get_texts()] == [
        "full", r"bare (not logged: validation loss, lr, $\sigma_1$, entropy)"]


def test_compare_runs_marks_the_steps_rollbacks_restored(tmp_path, monkeypatch):
    """plot_dynamics marked them and compare_runs did not: a curve's jump back read as a glitch."""
    run = _write_run(tmp_path / "rb", crash=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 40, "rollback/restored_step": 40}) + "\n")
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([run, _write_run(tmp_path / "plain", crash=False)], tmp_path / "cmp", labels=["rb", "plain"])
    loss_ax = next(ax for ax in figures[0].axes if ax.get_title().startswith("training loss"))
    dashed = [ln for ln in loss_ax.get_lines() if ln.get_linestyle() == "--" and set(ln.get_xdata()) == {40}]
    assert len(dashed) == 1  # the one run's rollback, in its colour
    legend = [t.get_text().replace("\n", " ") for ax in figures[0].axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]  # wrapped to the legend's panel
    assert "dashed: the step a rollback of the run of that colour restored" in legend


def test_compare_runs_marks_the_spikes_and_the_skipped_steps_of_each_run(tmp_path, monkeypatch):
    """A run that skipped a NaN, and one that went on from a loss spike, looked like the healthy
    run beside them: the run figures marked both, compare.png neither."""
    spiked, skipped = (_write_run(tmp_path / n, crash=False) for n in ("spiked", "skipped"))
    summary = json.loads((spiked / "summary.json").read_text())
    (spiked / "summary.json").write_text(json.dumps({**summary, "spikes": [{"step": 50, "steps": 2}]}))
    with open(skipped / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 70, N.SKIPPED_STEP: 1}) + "\n")
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([spiked, skipped], tmp_path / "cmp", labels=["spiked", "skipped"])
    loss_ax = next(ax for ax in figures[0].axes if ax.get_title().startswith("training loss"))
    colours = [ln.get_color() for ln in loss_ax.get_lines()[:1]]  # the first run's curve
    assert [(p.get_x(), p.get_width()) for p in loss_ax.patches] == [(49.5, 2.0)]
    from matplotlib.colors import to_rgb

    assert loss_ax.patches[0].get_facecolor()[:3] == to_rgb(colours[0])
    ticks = [list(ln.get_xdata()) for ln in loss_ax.get_lines() if ln.get_marker() == "|"]
    assert ticks == [[70.0]]
    legend = [t.get_text().replace("\n", " ") for ax in figures[0].axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert "band on the loss panel: a loss spike of the run of that colour" in legend
    assert "tick under the loss panel: a non-finite step the run of that colour skipped" in legend


def test_compare_runs_marks_a_resume_and_an_unfinished_run(tmp_path, monkeypatch):
    """A resumed run's record at its resume step is one step's loss beside intervals' means: a dip
    against its uninterrupted twin, unmarked; a killed run (no summary.json) read as a short
    finished one, in the legend and in plot_dynamics' titles."""
    run = _write_run(tmp_path / "resumed", crash=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 30, N.RESUMED_AT: 30}) + "\n")
    killed = _write_run(tmp_path / "killed", crash=False)
    (killed / "summary.json").unlink()
    last = 300  # the last whole record: the next one is torn
    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig))
    C.compare_runs([run, killed], tmp_path / "cmp", labels=["resumed", "killed"])
    loss_ax = next(ax for ax in figures[0].axes if ax.get_title().startswith("training loss"))
    marks = [ln for ln in loss_ax.get_lines() if ln.get_linestyle() == "-." and set(ln.get_xdata()) == {30}]
    assert len(marks) == 1
    legend = [t.get_text().replace("\n", " ") for ax in figures[0].axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert "dash-dot: where the run of that colour was resumed" in legend
    assert f"killed (unfinished: last logged step {last})" in legend, legend
    title = P._title(P.load_run(killed), "training curves")
    assert title == f"killed [unfinished: last logged step {last}]: training curves"


def test_repro_warmup_figure_draws_what_its_table_reports(tmp_path, monkeypatch):
    """The figure's sigma1 and entropy panels are the table's columns against step."""
    import runpy

    figures = []
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.append(fig) or out / name)
    monkeypatch.setattr(sys, "argv", [
        "repro_warmup.py", "--out", str(tmp_path), "--steps", "4", "--warmup", "2", "--lrs", "1e-2", "--batch", "4",
        "--extra", "model.depth=2", "model.block_size=32", "eval_every=4", "eval_batches=1",
        "monitor.weight_every=2", "monitor.probe_every=2", "logger.log_every=2", "logger.progress=false"])
    runpy.run_path(str(ROOT / "scripts" / "repro_warmup.py"), run_name="__main__")
    table = [[c.strip() for c in line.strip("|").split("|")]
             for line in (tmp_path / "results.md").read_text().splitlines()[2:]]
    panels = {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}
    sigma = _data_lines(panels[r"max over blocks and heads of $\sigma_1(W_q^{h\top} W_k^h)$"])
    entropy = _data_lines(panels["attention entropy of blocks.0, min over heads"])
    assert len(table) == len(sigma) == len(entropy) == 3
    for row, s, e in zip(table, sigma, entropy):
        assert (f"{max(s.get_ydata()):.3g}", f"{min(e.get_ydata()):.3g}") == (row[5], row[6])
    for title, ax in panels.items():
        assert ax.get_ylabel(), title
    assert "scheduled lr" in panels
    assert [t.get_text() for t in figures[0].axes[5].get_legend().get_texts()] == [
        "AdamW, no warmup", "AdamW, 2-step warmup", "AdamW² (tau 0.01), no warmup"]


def test_no_two_lines_of_a_panel_share_colour_and_dashes(tmp_path, monkeypatch):
    """A rollback's mark (orange, dashed) once looked like the per-head sigma1 beside it."""
    from matplotlib.colors import to_rgba

    run_dir = _write_run(tmp_path / "r")
    head, torn = (run_dir / "metrics.jsonl").read_text().rsplit("\n", 1)
    events = [{"step": 100, N.rollback("restored_step"): 100}, {"step": 150, N.SKIPPED_STEPS: 1}]
    (run_dir / "metrics.jsonl").write_text("\n".join([head, *map(json.dumps, events), torn]))
    run = P.load_run(run_dir)
    assert (run.restored_at, run.skipped_at, run.diverged_step) == ([100.0], [150.0], 300)
    figures = {}
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig))
    P.plot_dynamics(run_dir, blocks="0,2")
    assert {"training.png", "dynamics_blocks.0.png", "dynamics_blocks.2.png", "entropy.png"} <= set(figures)
    for name, fig in figures.items():
        for ax in fig.axes:
            styles = [(to_rgba(line.get_color()), line.get_linestyle()) for line in ax.get_lines()]
            assert len(set(styles)) == len(styles), (name, ax.get_title())


def test_a_sweep_directory_given_as_a_run_says_what_to_do(tmp_path):
    for name in ("0", "1"):
        _write_run(tmp_path / name, crash=False, steps=20)
    with pytest.raises(FileNotFoundError, match=r"holds runs \(0, 1\), not one: plot one of them, or overlay them "
                                                r"with scripts/compare_runs.py"):
        P.load_run(tmp_path)


def test_compare_runs_puts_learning_rates_a_decade_apart_on_a_log_axis():
    """lr 1e-3 beside lr 3 lay flat on zero on a linear axis; one run's decay to zero is no reason for a log axis."""
    import numpy as np

    steps = np.arange(0, 100, 10, dtype=float)
    cosine = (steps, 3.0 * 0.5 * (1 + np.cos(np.pi * steps / 100)))
    assert C._decades_apart([cosine, (steps, cosine[1] / 3000)])
    assert not C._decades_apart([cosine, (steps, cosine[1] / 3)]) and not C._decades_apart([cosine, None])


def test_health_alerts_are_marked_where_they_fired(tmp_path, monkeypatch):
    """entropy.png marks each alert on its layer's min-entropy curve, at the value that raised it;
    compare.png marks the run's alert steps on the entropy panel's top edge, in the run's colour."""
    import matplotlib.pyplot as plt

    run = _write_run(tmp_path / "run")
    ent = 2.0 * (1 - 250 / 300) ** 4  # blocks.2's min entropy at step 250
    summary = json.loads((run / "summary.json").read_text())
    summary["alerts"] = [{"step": 250, "layer": "blocks.2", "value": ent, "message": "m"}]
    (run / "summary.json").write_text(json.dumps(summary))
    figs = {}
    for module in (P, C):  # entropy.png, compare.png
        monkeypatch.setattr(module, "_save", lambda fig, out, name: figs.setdefault(name, fig) and out / name)
    P.plot_entropy(P.load_run(run), BLOCKS, tmp_path)
    ax = figs["entropy.png"].axes[1]
    marks = [ln for ln in ax.get_lines() if ln.get_marker() == "v" and len(ln.get_xdata())]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [250] and list(marks[0].get_ydata()) == [ent]
    assert "health alert (entropy collapse)" in [t.get_text() for t in ax.get_legend().get_texts()]
    C.compare_runs([run, _write_run(tmp_path / "quiet", crash=False)], tmp_path / "cmp")
    ax = next(a for a in figs["compare.png"].axes if "entropy" in a.get_title())
    edge = [ln for ln in ax.get_lines() if ln.get_marker() == "v" and len(ln.get_xdata())]
    assert len(edge) == 1 and list(edge[0].get_xdata()) == [250] and list(edge[0].get_ydata()) == [1.0]
    plt.close("all")


def test_the_title_counts_rollbacks_not_restored_steps(tmp_path):
    run = _write_run(tmp_path / "run", crash=False)
    back = {"trigger_step": 50, "detected_step": 50, "restored_step": 40, "skipped_steps": 10, "reason": "r"}
    (run / "summary.json").write_text(json.dumps({"status": "diverged", "step": 300, "rollbacks": [back] * 3}))
    with open(run / "metrics.jsonl", "a") as f:  # the three rollback records, all at step 40
        f.write("\n" + "\n".join(json.dumps({"step": 40, N.rollback("restored_step"): 40}) for _ in range(3)))
    assert "3 rollback(s)" in P._title(P.load_run(run), "x")


def test_the_sec_figure_keeps_an_alerts_step():
    import numpy as np

    assert P._few_steps(np.arange(0, 70, 10)) == [0, 20, 30, 40, 60]  # five spread: step 50 left out
    assert P._few_steps(np.arange(0, 70, 10), must=[50, 55]) == [0, 20, 30, 40, 50, 60]  # 55 was not logged


def test_an_entropy_panel_is_at_least_a_tenth_of_a_nat_high():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 10], [2.83308, 2.83320])
    F._min_span(ax, 0.1)
    lo, hi = ax.get_ylim()
    assert hi - lo == pytest.approx(0.1) and lo < 2.83308 and 2.83320 < hi
    ax.set_ylim(0, 2)
    F._min_span(ax, 0.1)
    assert ax.get_ylim() == (0, 2)  # a wide axis is left as it is
    plt.close(fig)


def test_a_tiny_change_is_drawn_small_on_linear_and_log_axes(tmp_path):
    """A loss from 2.310 to 2.319, or a sigma1 in its fourth digit, does not fill its panel:
    every axis spans at least 2% of its largest value; a wide axis is left as it is."""
    import matplotlib.pyplot as plt

    fig, (lin, log, wide) = plt.subplots(1, 3)
    lin.plot([0, 10], [0.3439, 0.3438])
    log.plot([0, 10], [2.310, 2.319])
    log.set_yscale("log")
    wide.plot([0, 10], [0.0, 1.0])
    before = wide.get_ylim()
    F._save(fig, tmp_path, "f.png")
    lo, hi = lin.get_ylim()
    assert hi - lo == pytest.approx(F.MIN_RELATIVE_SPAN * 0.3439, rel=0.02) and lo < 0.3438 and 0.3439 < hi
    lo, hi = log.get_ylim()
    assert hi / lo == pytest.approx(1 + 2 * F.MIN_RELATIVE_SPAN) and lo < 2.310 and 2.319 < hi
    assert wide.get_ylim() == before


def test_runs_that_coincide_stay_visible_and_a_sweep_point_is_named_by_its_values(tmp_path, monkeypatch):
    from stabletrain.analysis.sweeps import run_name

    dirs = []
    for i, tau in enumerate([0.01, 0.02]):
        d = _write_run(tmp_path / "sweep" / str(i), crash=False)  # the same curves
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(f"- model=vit_test\n- optim.tau={tau}\n")
        dirs.append(d)
    assert run_name(dirs[1]) == "sweep/1 (optim.tau=0.02)"  # not "1"
    assert run_name(tmp_path / "sweep") == "sweep"
    figures = {}
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figures.setdefault(name, fig))
    C.compare_runs(dirs, tmp_path / "cmp")
    loss = next(ax for ax in figures["compare.png"].axes if ax.get_title() == "training loss")
    first, second = loss.get_lines()[:2]
    assert first.get_linewidth() > second.get_linewidth() + 0.5  # the later, thinner, on top


def test_a_bound_far_below_the_entropy_is_said_and_the_uniform_line_lies_beneath(tmp_path, monkeypatch):
    run_dir = _write_run(tmp_path / "r", crash=False)
    recs = (run_dir / "metrics.jsonl").read_text().splitlines()
    tiny = []
    for line in recs:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            tiny.append(line)  # the torn last line, kept as it is
            continue
        tiny.append(json.dumps({k: (1e-7 if k.endswith("/bound_min") else v) for k, v in r.items()}))
    (run_dir / "metrics.jsonl").write_text("\n".join(tiny))
    figures = {}
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig))
    P.plot_entropy(P.load_run(run_dir), BLOCKS, tmp_path / "plots")
    mean_ax, _, bound_ax = figures["entropy.png"].axes[:3]
    # in its legend entry: a note inside the axes lay over the collapsed curves near 0
    assert not bound_ax.texts and any(t.get_text().startswith("bound (min over heads), below ")
                                      for t in bound_ax.get_legend().get_texts())
    uniform = next(ln for ln in mean_ax.get_lines() if ln.get_label() == "uniform over each query's keys")
    assert all(uniform.get_zorder() < ln.get_zorder() for ln in mean_ax.get_lines() if ln is not uniform)


def test_blocks_over_different_numbers_of_keys_each_get_their_uniform_level(tmp_path, monkeypatch):
    """Swin's stages attend over different windows: one block's uniform level drawn for all would
    read another's entropy against the wrong reference."""
    import numpy as np
    steps = np.array([0.0, 10.0])
    metrics = {}
    for b, level in (("layers.0.blocks.0", 3.89), ("layers.1.blocks.0", 2.77)):
        metrics[f"entropy/{b}/mean"] = metrics[f"entropy/{b}/min"] = (steps, np.array([level - 0.1, level - 0.5]))
        metrics[f"entropy/{b}/log_T"] = (steps, np.array([level, level]))
    figures = {}
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig))
    P.plot_entropy(P.Run("r", tmp_path, metrics, None), [], tmp_path)
    mean_ax = figures["entropy.png"].axes[0]
    dashed = [ln for ln in mean_ax.get_lines() if ln.get_linestyle() == "--" and len(ln.get_xdata())]
    levels = sorted(ln.get_ydata()[0] for ln in dashed)
    assert np.allclose(levels, [2.77, 3.89])
    assert "uniform over each query's keys, per block" in [t.get_text() for t in mean_ax.get_legend().get_texts()]


def _entropy_metrics(levels: dict[str, float | None]) -> dict:
    """Each block's mean and min entropy near its uniform level, and that level (log_T) unless None."""
    metrics = {}
    for b, level in levels.items():
        base = 3.0 if level is None else level
        metrics[f"entropy/{b}/mean"] = metrics[f"entropy/{b}/min"] = (STEPS, np.array([base - 0.1, base - 0.5]))
        if level is not None:
            metrics[f"entropy/{b}/log_T"] = (STEPS, np.array([level, level]))
    return metrics


def _dashed(ax) -> list[float]:
    """The levels of a panel's dashed horizontal lines."""
    return sorted(float(ln.get_ydata()[0]) for ln in ax.get_lines()
                  if ln.get_linestyle() == "--" and len(ln.get_xdata()))


def test_entropy_png_of_a_run_without_log_t_draws_no_uniform_level(tmp_path, monkeypatch):
    """A run recorded before log_T was logged: its entropy.png is drawn, without a uniform line
    (not a StopIteration from an empty set of levels)."""
    figures = _figures(monkeypatch)
    P.plot_entropy(P.Run("r", tmp_path, _entropy_metrics({"blocks.0": None, "blocks.1": None}), None), [], tmp_path)
    assert _dashed(figures["entropy.png"].axes[0]) == []


def test_entropy_png_tells_windows_of_49_and_36_keys_apart(tmp_path, monkeypatch):
    """log 49 = 3.89 and log 36 = 3.58 are two levels (Swin windows of 7x7 and 6x6), not one."""
    figures = _figures(monkeypatch)
    levels = {"layers.0.blocks.0": float(np.log(49)), "layers.1.blocks.0": float(np.log(36))}
    P.plot_entropy(P.Run("r", tmp_path, _entropy_metrics(levels), None), [], tmp_path)
    assert np.allclose(_dashed(figures["entropy.png"].axes[0]), sorted(levels.values()))


def test_a_title_says_which_rollbacks_a_later_rollback_dropped_from_the_records(tmp_path):
    """Two rollbacks, the second to an earlier step: the first one's record went with the history
    it dropped, so one orange line is drawn, and the title says why there are not two."""
    import numpy as np

    restored = (np.array([0.0]), np.array([0.0]))
    run = P.Run("r", tmp_path, {"rollback/restored_step": restored},
                {"status": "completed", "rollbacks": [{"restored_step": 10}, {"restored_step": 0}]})
    assert ("2 rollback(s) (black dashed: restored step, triangle: what set it off; 1 in a history a later rollback "
            "dropped)") in P._title(run, "x")
    twice = (np.array([4.0, 4.0]), np.array([4.0, 4.0]))  # two rollbacks to one step: both records kept
    run = P.Run("r", tmp_path, {"rollback/restored_step": twice},
                {"status": "completed", "rollbacks": [{"restored_step": 4}, {"restored_step": 4}]})
    assert "2 rollback(s) (black dashed: restored step, triangle: what set it off)]" in P._title(run, "x")


def test_a_title_says_a_skipped_step_at_the_divergence_lies_under_its_red_line(tmp_path):
    import numpy as np

    skipped = (np.array([80.0, 90.0]), np.array([0.0, 1.0]))
    run = P.Run("r", tmp_path, {"train/skipped_steps": skipped}, {"status": "diverged", "diverged_at": 90,
                                                                  "skipped_steps": 1})
    assert P._title(run, "x") == ("r [diverged at step 90 (red, dotted), 1 non-finite step(s) skipped "
                                  "(at the red line)]: x")
    skipped = (np.array([80.0, 90.0]), np.array([1.0, 1.0]))
    run = P.Run("r", tmp_path, {"train/skipped_steps": skipped}, {"status": "diverged", "diverged_at": 90,
                                                                  "skipped_steps": 2})
    assert "2 non-finite step(s) skipped (grey)]" in P._title(run, "x")


def test_heads_figure_draws_each_heads_logged_series(tmp_path, monkeypatch):
    """monitor.per_head=true logs entropy and sigma1(W_q^h^T W_k^h) per head: heads.png draws
    them, one line per head at its logged values; a run without them gets no figure."""
    import numpy as np

    steps = np.array([0.0, 10.0, 20.0])
    metrics = {f"entropy/blocks.0/head{h}": (steps, np.array([2.0, 1.5 - h, 1.0 - h / 2])) for h in range(2)}
    metrics |= {f"sigma1/blocks.0/wq_t_wk_head{h}": (steps, np.array([0.1, 0.2, 0.4]) * (h + 1)) for h in range(2)}
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append((name, fig)) or out / name)
    P.plot_heads(P.Run("r", tmp_path, metrics, None), ["blocks.0"], tmp_path)
    (name, fig), = figures
    ent, sig = fig.axes
    assert name == "heads.png" and ent.get_title() == "blocks.0: entropy per head"
    for ax, group in ((ent, "entropy/blocks.0/head"), (sig, "sigma1/blocks.0/wq_t_wk_head")):
        lines = {ln.get_label(): ln.get_ydata() for ln in ax.get_lines()}
        for h in range(2):
            np.testing.assert_allclose(lines[f"head {h}"], metrics[f"{group}{h}"][1])
    assert sig.get_yscale() == "log"
    assert P.plot_heads(P.Run("r", tmp_path, {"loss": (steps, steps)}, None), ["blocks.0"], tmp_path) is None


def test_sec_marks_where_the_health_alert_tests_it(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "r", crash=True)
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig) or out / name)
    P.plot_sec(P.load_run(run), BLOCKS, tmp_path)
    ax = figures[0].axes[0]
    s = N.sec_alert_size(D_H)
    assert any(list(ln.get_xdata()) == [s, s] for ln in ax.get_lines())  # the dashed line at s*
    assert any(list(ln.get_ydata()) == [0.99, 0.99] for ln in ax.get_lines())
    assert ax.get_xlabel().endswith(f"red: the alert's test, SEC({D_H}, {s}) > 0.99")


def test_sec_draws_the_step_where_concentration_jumped(tmp_path, monkeypatch):
    """Five spread steps of 21 records miss step 70, where SEC(d_h, s*) rose from 0.3 to 0.999
    without an alert: the figure draws that step too, and its legend says why."""
    import numpy as np

    steps = np.arange(0.0, 210.0, 10.0)
    s_star = N.sec_alert_size(D_H)
    metrics = {}
    for s in N.sec_sizes(D_H):
        low = np.where(steps < 70, 0.3, 0.999)
        metrics[N.metric("sec", "blocks.0", f"s{s}")] = (steps, np.minimum(1.0, low + (1 - low) * (s - 1) / (D_H - 1)))
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig) or out / name)
    P.plot_sec(P.Run("r", tmp_path, metrics, None), ["blocks.0"], tmp_path)
    labels = figures[0].axes[0].get_legend_handles_labels()[1]
    assert "step 70 (largest rise)" in labels and 70 not in P._few_steps(steps)
    assert P._largest_rise(metrics[N.metric("sec", "blocks.0", f"s{s_star}")]) == 70
    flat = (steps, np.full(len(steps), 0.5))
    assert P._largest_rise(flat) is None and P._largest_rise(None) is None


def test_sec_png_marks_the_rise_of_the_alerts_size_not_that_of_another_size(tmp_path, monkeypatch):
    """The step drawn as the largest rise is where SEC(d_h, s*) jumped, s* the size the health
    alert tests (4 at d_h = 64): SEC(64, 1) rose most at step 30, SEC(64, 4) at step 130."""
    d_h, steps = 64, np.arange(0.0, 210.0, 10.0)
    assert N.sec_alert_size(d_h) == 4
    levels = {1: (0.1, 0.5, 0.6), 2: (0.2, 0.52, 0.9), 4: (0.3, 0.55, 0.999), 8: (0.4, 0.6, 0.9995),
              16: (0.5, 0.7, 0.9997), 32: (0.6, 0.8, 0.9999), 64: (1.0, 1.0, 1.0)}
    assert list(levels) == N.sec_sizes(d_h)
    metrics = {N.metric("sec", "blocks.0", f"s{s}"): (steps, np.where(steps < 30, a, np.where(steps < 130, b, c)))
               for s, (a, b, c) in levels.items()}
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig) or out / name)
    P.plot_sec(P.Run("r", tmp_path, metrics, None), ["blocks.0"], tmp_path)
    labels = figures[0].axes[0].get_legend_handles_labels()[1]
    assert [lb for lb in labels if "largest rise" in lb] == ["step 130 (largest rise)"], labels


def test_the_largest_rise_of_short_or_unfinished_sec_records():
    """Two records that rose: the second step; one record: none (not an error on an empty
    difference); records whose every rise is NaN (a diverged run's): none, not an error."""
    two = (np.array([0.0, 10.0]), np.array([0.2, 0.999]))
    assert P._largest_rise(two) == 10
    assert P._largest_rise((np.array([0.0]), np.array([0.5]))) is None
    assert P._largest_rise((np.array([0.0, 10.0, 20.0]), np.array([np.nan, 0.5, np.nan]))) is None
    assert P._largest_rise((np.array([0.0, 10.0, 20.0]), np.array([0.2, np.nan, 0.9]))) is None


def test_titles_say_what_a_runs_config_changes_in_the_weights_read(tmp_path):
    """Under q/k normalisation W_q^T W_k bounds no logit; under sigmaReparam the weights read are
    the applied ones: both from the run's config.yaml, nothing where it has none."""
    run = P.Run("r", tmp_path, {}, None)
    assert P._qk_caveat(run) == "" and not P._reparametrised(run)
    (tmp_path / "config.yaml").write_text("attention:\n  name: stable\nreparam:\n  name: sigma\n")
    assert P._qk_caveat(run).startswith(" (attention=stable normalises q and k") and P._reparametrised(run)


def test_a_panel_that_drew_nothing_gets_no_event_lines(tmp_path):
    import matplotlib.pyplot as plt

    run = P.Run("r", tmp_path, {}, {"status": "diverged", "diverged_at": 5})
    fig, (empty, drawn) = plt.subplots(1, 2)
    F._empty(empty, "not logged")
    drawn.plot([0, 10], [1, 2])
    P._mark_divergence(empty, run)
    P._mark_divergence(drawn, run)
    assert not empty.get_lines() and [list(ln.get_xdata()) for ln in drawn.get_lines()][1:] == [[5, 5]]
    plt.close(fig)


def test_training_curves_show_a_loss_that_went_non_finite_and_where_the_run_diverged(tmp_path, monkeypatch):
    """SGD at lr 30 diverged at step 4 and logged at steps 10 (loss 3264) and 20 (nan): the panel's
    x axis was 10..20, so the red line at step 4 was off it, and the nan was drawn nowhere."""
    run_dir = tmp_path / "blowup"
    run_dir.mkdir()
    rows = [{"step": 10, "loss": 3264.0, "lr": 29.7}, {"step": 20, "loss": "nan", "lr": 28.8}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"status": "diverged", "step": 20, "diverged_at": 4}))
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.append(fig))
    P.plot_training(P.load_run(run_dir), tmp_path / "plots")
    loss_ax = next(ax for ax in figures[0].axes if ax.get_title() == "training loss")
    assert loss_ax.get_xlim()[0] < 4 < 20 < loss_ax.get_xlim()[1]
    red = [ln for ln in loss_ax.get_lines() if ln.get_marker() == "^" and ln.get_color() == "red"]
    assert len(red) == 1 and list(red[0].get_xdata()) == [20.0]
    assert [t.get_text() for t in loss_ax.texts] == ["nan"]
    lr_ax = next(ax for ax in figures[0].axes if ax.get_title() == "scheduled learning rate")
    assert not [ln for ln in lr_ax.get_lines() if ln.get_marker() == "^"]  # every lr finite


def test_a_blocks_figure_marks_the_loss_that_went_non_finite(tmp_path, monkeypatch):
    """Its sigma1 curves just stop where the weights went NaN; the loss panel beside them said
    nothing (training.png marked the nan)."""
    wq = N.metric("sigma1", "blocks.0", "wq")
    rows = [{"step": 10, "loss": 3.0, wq: 1.0}, {"step": 20, "loss": 2.5, wq: 1.1}, {"step": 25, "loss": "nan"}]
    run = _run_dir(tmp_path / "r", rows, {"status": "diverged", "step": 25, "diverged_at": 25})
    figures = _figures(monkeypatch)
    P.plot_block_dynamics(P.load_run(run), "blocks.0", tmp_path)
    loss_ax = next(ax for ax in figures["dynamics_blocks.0.png"].axes if ax.get_title() == "training loss (context)")
    red = [ln for ln in loss_ax.get_lines() if ln.get_marker() == "^" and ln.get_color() == "red"]
    assert len(red) == 1 and list(red[0].get_xdata()) == [25.0]


def test_compare_keeps_every_runs_alert_visible_when_they_share_a_step(tmp_path, monkeypatch):
    """Runs of a sweep alert at the same probe steps: their triangles on the entropy panel's top
    edge must not sit on one another, or only the last run's colour shows."""
    runs = []
    for name in ("a", "b"):
        run = _write_run(tmp_path / name)
        summary = json.loads((run / "summary.json").read_text())
        summary["alerts"] = [{"step": 250, "layer": "blocks.2", "value": 0.01, "message": "m"}]
        (run / "summary.json").write_text(json.dumps(summary))
        runs.append(run)
    figs = {}
    monkeypatch.setattr(C, "_save", lambda fig, out, name: figs.setdefault(name, fig) and out / name)
    C.compare_runs(runs, tmp_path / "cmp")
    ax = next(a for a in figs["compare.png"].axes if "entropy" in a.get_title())
    edge = [ln for ln in ax.get_lines() if ln.get_marker() == "v" and len(ln.get_xdata())]
    assert len(edge) == 2
    assert {tuple(ln.get_xdata()) for ln in edge} == {(250,)}
    assert len({tuple(ln.get_ydata()) for ln in edge}) == 2  # two rows, not one triangle on the other
    assert len({ln.get_color() for ln in edge}) == 2


def _ent_records(blocks: dict[str, tuple[float, float | None]]) -> list[dict]:
    """Three steps; each block's min entropy and, unless None, its log_T."""
    out = []
    for s in (0, 10, 20):
        rec = {"step": s, "loss": 3.0 - 0.01 * s, "lr": 1e-3}
        for b, (ent, log_t) in blocks.items():
            rec[f"entropy/{b}/min"] = ent
            if log_t is not None:
                rec[f"entropy/{b}/log_T"] = log_t
        out.append(rec)
    return out


def _entropy_panel(figures):
    return next(a for a in figures["compare.png"].axes if "attention entropy" in a.get_title())


def _curves(ax) -> list[list[float]]:
    return [list(ln.get_ydata()) for ln in ax.get_lines() if len(ln.get_xdata()) == 3]


def test_compare_leaves_a_block_without_log_t_out_of_the_fractions(tmp_path, monkeypatch):
    """Relative entropy: a block with no log_T has no fraction; its nats are not one of them."""
    a = _run_dir(tmp_path / "a", _ent_records({"blocks.0": (2.6, 5.2), "blocks.1": (0.1, None)}))
    b = _run_dir(tmp_path / "b", _ent_records({"blocks.0": (1.9, 3.8)}))
    figures = _figures(monkeypatch)
    C.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"])
    assert np.allclose(_curves(_entropy_panel(figures)), [[0.5] * 3, [0.5] * 3])


def test_compare_of_one_block_sets_runs_over_different_numbers_of_keys_on_one_scale(tmp_path, monkeypatch):
    """--entropy-block: that block's entropy over its own log T, as the min over blocks is."""
    a = _run_dir(tmp_path / "a", _ent_records({"blocks.0": (2.6, 5.2)}))
    b = _run_dir(tmp_path / "b", _ent_records({"blocks.0": (1.9, 3.8)}))
    figures = _figures(monkeypatch)
    C.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"], entropy_block="blocks.0")
    ax = _entropy_panel(figures)
    assert "over log T" in ax.get_title() and ax.get_ylabel() == "entropy / uniform entropy"
    assert np.allclose(_curves(ax), [[0.5] * 3, [0.5] * 3])


def test_compare_reads_every_blocks_uniform_level_not_the_first_ones(tmp_path, monkeypatch):
    """Two runs whose first blocks attend over as many keys, their later ones not: different scales."""
    a = _run_dir(tmp_path / "a", _ent_records({"blocks.0": (2.6, 5.2), "blocks.1": (2.6, 5.2)}))
    b = _run_dir(tmp_path / "b", _ent_records({"blocks.0": (2.6, 5.2), "blocks.1": (1.5, 3.0)}))
    figures = _figures(monkeypatch)
    C.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"])
    assert _entropy_panel(figures).get_ylabel() == "entropy / uniform entropy"


def test_compare_puts_the_first_alerted_runs_triangles_on_the_top_edge(tmp_path, monkeypatch):
    """A run without alerts takes no row: the first alerted run's triangles sit on the top edge,
    the next one's one row lower."""
    alert = {"status": "completed", "alerts": [{"step": 10, "layer": "blocks.0", "value": 0.1, "message": "m"}]}
    recs = _ent_records({"blocks.0": (2.0, None)})
    dirs = [_run_dir(tmp_path / "calm", recs, {"status": "completed"}),
            _run_dir(tmp_path / "x", recs, alert), _run_dir(tmp_path / "y", recs, alert)]
    figures = _figures(monkeypatch)
    C.compare_runs(dirs, tmp_path / "cmp", labels=["calm", "x", "y"])
    rows = [float(ln.get_ydata()[0]) for ln in _entropy_panel(figures).get_lines()
            if ln.get_marker() == "v" and len(ln.get_xdata())]
    assert rows == pytest.approx([1.0, 1.0 - 0.045])


def test_heads_png_shows_the_blocks_that_alerted_or_fell_lowest_and_names_the_rest(tmp_path, monkeypatch, capsys):
    """Of six blocks, four columns: not the first four, which left out the deep blocks that collapsed."""
    import numpy as np
    steps = np.array([0.0, 10.0])
    metrics = {}
    lowest = {0: 3.0, 1: 2.9, 2: 0.5, 3: 2.8, 4: 0.2, 5: 2.7}  # blocks.5 alerted, blocks.2 and 4 fell lowest
    for i, low in lowest.items():
        metrics[f"entropy/blocks.{i}/min"] = (steps, np.array([3.4, low]))
        metrics[f"entropy/blocks.{i}/head0"] = (steps, np.array([3.4, low]))
    summary = {"status": "completed", "alerts": [{"step": 10, "layer": "blocks.5", "value": 2.7}]}
    figures = {}
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig))
    P.plot_heads(P.Run("r", tmp_path, metrics, summary), [f"blocks.{i}" for i in range(6)], tmp_path)
    titles = [ax.get_title() for ax in figures["heads.png"].axes if ax.get_title()]
    assert [t.split(":")[0] for t in titles] == ["blocks.2", "blocks.3", "blocks.4", "blocks.5"]
    assert "note: skipping blocks.0, blocks.1 in heads.png" in capsys.readouterr().out
    # the alert is marked where it was raised, as on entropy.png (the title counted it; no panel showed it)
    marks = {ax.get_title().split(":")[0]: [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()
                                            if ln.get_marker() == "v"] for ax in figures["heads.png"].axes}
    assert marks["blocks.5"] == [([10], [2.7])] and marks["blocks.4"] == []


def _head_metrics(lowest: dict[int, float]) -> dict:
    """Blocks whose min entropy (and head 0's) falls from 3.4 to ``lowest[i]``."""
    metrics = {}
    for i, low in lowest.items():
        metrics[f"entropy/blocks.{i}/min"] = metrics[f"entropy/blocks.{i}/head0"] = (STEPS, np.array([3.4, low]))
    return metrics


def _head_titles(figures) -> list[str]:
    """The blocks heads.png shows, by its panels' titles."""
    return [ax.get_title().split(":")[0] for ax in figures["heads.png"].axes if ax.get_title()]


def test_heads_png_of_four_blocks_shows_them_all_without_a_note(tmp_path, monkeypatch, capsys):
    """Four blocks fit heads.png: each is shown, and no block is said to be left out."""
    figures = _figures(monkeypatch)
    P.plot_heads(P.Run("r", tmp_path, _head_metrics({0: 3.0, 1: 2.0, 2: 1.0, 3: 0.5}), None),
                 [f"blocks.{i}" for i in range(4)], tmp_path)
    assert _head_titles(figures) == [f"blocks.{i}" for i in range(4)]
    assert "heads.png" not in capsys.readouterr().out


def test_heads_png_puts_a_block_that_alerted_before_one_whose_entropy_fell_lower(tmp_path, monkeypatch):
    """blocks.0 alerted (a threshold of its own, or a collapse between probes) though its entropy
    stayed the highest: it is shown, the highest-entropy of the others left out."""
    figures = _figures(monkeypatch)
    summary = {"status": "completed", "alerts": [{"step": 10, "layer": "blocks.0", "value": 3.3}]}
    lowest = {0: 3.3, 1: 2.0, 2: 1.0, 3: 0.5, 4: 0.4, 5: 3.0}
    P.plot_heads(P.Run("r", tmp_path, _head_metrics(lowest), summary), [f"blocks.{i}" for i in range(6)], tmp_path)
    assert _head_titles(figures) == ["blocks.0", "blocks.2", "blocks.3", "blocks.4"]


def test_plot_dynamics_gives_heads_png_the_deep_block_that_collapsed(tmp_path, monkeypatch):
    """plot_dynamics hands heads.png every chosen block (it picks four), not the first four."""
    lowest = {0: 3.0, 1: 2.9, 2: 2.8, 3: 2.7, 4: 2.6, 5: 0.1}
    records = [{"step": int(s), "loss": 3.0 - 0.01 * s,
                **{k: float(v[1][j]) for k, v in _head_metrics(lowest).items()}} for j, s in enumerate(STEPS)]
    run = _run_dir(tmp_path / "run", records, {"status": "completed", "step": 10})
    figures = _figures(monkeypatch)
    P.plot_dynamics(run, out_dir=tmp_path / "plots")
    assert "blocks.5" in _head_titles(figures)


def test_a_missing_norm_panel_says_why(tmp_path, monkeypatch):
    """norm=none has no gains at all: its panels said "e.g. no norm bias", a gain being no bias."""
    import numpy as np
    steps = np.array([0.0, 10.0])
    base = {"sigma1/blocks.0/wq": (steps, np.array([1.0, 2.0]))}
    gains = {"norm/blocks.0/norm1_gamma": (steps, np.array([1.0, 1.1])),
             "norm/blocks.0/norm2_gamma": (steps, np.array([1.0, 1.1]))}
    notes, figures = {}, []
    monkeypatch.setattr(P, "_save", lambda fig, out, n: figures.append(fig))
    for name, metrics in (("none", base), ("rms", {**base, **gains})):
        P.plot_block_dynamics(P.Run("r", tmp_path, metrics, None), "blocks.0", tmp_path)
        notes[name] = {ax.get_title(): " ".join(t.get_text() for t in ax.texts) for ax in figures[-1].axes}
    assert "no norm gains in this block" in notes["none"][r"$\|\gamma_1\|_2$"]
    assert "bias" not in notes["none"][r"$\|\gamma_1\|_2$"]
    assert "the norm has no bias" in notes["rms"][r"$\|\beta_1\|_2$"]


def test_a_missing_norm_panel_names_both_norms_bias_and_a_block_with_one_norms_gains_has_gains(tmp_path, monkeypatch):
    """Both beta panels of a bias-free norm say so (not only beta_1's); a block that logged the
    gains of one norm is not said to have no norm gains."""
    figures = []
    monkeypatch.setattr(P, "_save", lambda fig, out, n: figures.append(fig))
    notes = {}
    for name, gains in (("both", ("norm1_gamma", "norm2_gamma")), ("first", ("norm1_gamma",))):
        metrics = {"sigma1/blocks.0/wq": (STEPS, np.array([1.0, 2.0]))}
        metrics.update({f"norm/blocks.0/{g}": (STEPS, np.array([1.0, 1.1])) for g in gains})
        P.plot_block_dynamics(P.Run("r", tmp_path, metrics, None), "blocks.0", tmp_path)
        notes[name] = {ax.get_title(): " ".join(t.get_text() for t in ax.texts) for ax in figures[-1].axes}
    assert "the norm has no bias" in notes["both"][r"$\|\beta_1\|_2$"]
    assert "the norm has no bias" in notes["both"][r"$\|\beta_2\|_2$"]
    assert "not logged" in notes["first"][r"$\|\gamma_2\|_2$"]
    assert "no norm gains" not in notes["first"][r"$\|\gamma_2\|_2$"]


def test_adamw2_lr_draws_every_kind_of_a_swin_and_names_what_a_bigger_model_leaves_out(tmp_path, monkeypatch,
                                                                                        capsys):
    """A timm Swin logs 13 kinds of bounded tensor (the patch embedding sorted last): all are drawn.
    Past 16 panels the figure names the kinds it leaves out."""
    swin = [f"layers.0.blocks.{b}.{k}" for b in range(2) for k in ("attn.qkv.weight", "attn.proj.weight",
                                                                   "mlp.fc1.weight", "mlp.fc2.weight",
                                                                   "norm1.weight", "norm2.weight",
                                                                   "attn.relative_position_bias_table")]
    swin += ["layers.1.downsample.norm.weight", "layers.1.downsample.reduction.weight", "head.fc.weight",
             "norm.weight", "patch_embed.norm.weight", "patch_embed.proj.weight"]
    for name, params, drawn in (("swin", swin, 13), ("wide", [f"extra{i}.weight" for i in range(20)], 16)):
        figures = _figures(monkeypatch)
        run = _run_dir(tmp_path / name, [{"step": s, "lr": 1e-3, **{N.adamw2_lr_eff(p): 1e-3 for p in params}}
                                         for s in (10, 20)])
        P.plot_adamw2_lr(P.load_run(run), tmp_path)
        titles = [ax.get_title() for ax in figures["adamw2_lr.png"].axes if ax.get_visible()]
        assert len(titles) == drawn, titles
        note = capsys.readouterr().out
        if name == "swin":
            assert "patch_embed.proj.weight" in titles and note == ""
        else:
            assert note.strip() == ("note: adamw2_lr.png draws 16 of the 20 kinds of tensor; left out: extra6.weight, "
                                    "extra7.weight, extra8.weight, extra9.weight (their adamw2/lr_eff/* series are in "
                                    "metrics.jsonl)")
