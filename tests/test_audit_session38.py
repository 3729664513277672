"""Promises of the changes since b3ea0ce that no test held (a mutation audit, session 38): each
test here fails on one deliberate bug in stabletrain/ that the rest of the suite let through."""

from __future__ import annotations

import json
import math
import re
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from stabletrain.analysis import plots as P
from stabletrain.errors import ConfigError
from tests.helpers import forget_own_code, make_cfg, model_of, train

GPT = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1"]

STEPS = np.array([0.0, 10.0])


def _figures(monkeypatch) -> dict:
    figures: dict = {}
    monkeypatch.setattr(P, "_save", lambda fig, out, name: figures.setdefault(name, fig) and out / name)
    return figures


def _run_dir(path, records: list[dict], summary: dict | None = None):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


# --- block dynamics: why a norm panel is empty ---------------------------------------------------

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


# --- entropy.png: the uniform level ----------------------------------------------------------------

def _entropy_metrics(levels: dict[str, float | None]) -> dict:
    metrics = {}
    for b, level in levels.items():
        base = 3.0 if level is None else level
        metrics[f"entropy/{b}/mean"] = metrics[f"entropy/{b}/min"] = (STEPS, np.array([base - 0.1, base - 0.5]))
        if level is not None:
            metrics[f"entropy/{b}/log_T"] = (STEPS, np.array([level, level]))
    return metrics


def _dashed(ax) -> list[float]:
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


# --- heads.png: which blocks ---------------------------------------------------------------------

def _head_metrics(lowest: dict[int, float]) -> dict:
    metrics = {}
    for i, low in lowest.items():
        metrics[f"entropy/blocks.{i}/min"] = metrics[f"entropy/blocks.{i}/head0"] = (STEPS, np.array([3.4, low]))
    return metrics


def _head_titles(figures) -> list[str]:
    return [ax.get_title().split(":")[0] for ax in figures["heads.png"].axes if ax.get_title()]


def test_heads_png_of_four_blocks_shows_them_all_without_a_note(tmp_path, monkeypatch, capsys):
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


# --- compare.png: entropy on one scale, alert rows -------------------------------------------------

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
    P.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"])
    assert np.allclose(_curves(_entropy_panel(figures)), [[0.5] * 3, [0.5] * 3])


def test_compare_of_one_block_sets_runs_over_different_numbers_of_keys_on_one_scale(tmp_path, monkeypatch):
    """--entropy-block: that block's entropy over its own log T, as the min over blocks is."""
    a = _run_dir(tmp_path / "a", _ent_records({"blocks.0": (2.6, 5.2)}))
    b = _run_dir(tmp_path / "b", _ent_records({"blocks.0": (1.9, 3.8)}))
    figures = _figures(monkeypatch)
    P.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"], entropy_block="blocks.0")
    ax = _entropy_panel(figures)
    assert "over log T" in ax.get_title() and ax.get_ylabel() == "entropy / uniform entropy"
    assert np.allclose(_curves(ax), [[0.5] * 3, [0.5] * 3])


def test_compare_reads_every_blocks_uniform_level_not_the_first_ones(tmp_path, monkeypatch):
    """Two runs whose first blocks attend over as many keys, their later ones not: different scales."""
    a = _run_dir(tmp_path / "a", _ent_records({"blocks.0": (2.6, 5.2), "blocks.1": (2.6, 5.2)}))
    b = _run_dir(tmp_path / "b", _ent_records({"blocks.0": (2.6, 5.2), "blocks.1": (1.5, 3.0)}))
    figures = _figures(monkeypatch)
    P.compare_runs([a, b], tmp_path / "cmp", labels=["a", "b"])
    assert _entropy_panel(figures).get_ylabel() == "entropy / uniform entropy"


def test_compare_puts_the_first_alerted_runs_triangles_on_the_top_edge(tmp_path, monkeypatch):
    """A run without alerts takes no row: the first alerted run's triangles sit on the top edge,
    the next one's one row lower."""
    alert = {"status": "completed", "alerts": [{"step": 10, "layer": "blocks.0", "value": 0.1, "message": "m"}]}
    recs = _ent_records({"blocks.0": (2.0, None)})
    dirs = [_run_dir(tmp_path / "calm", recs, {"status": "completed"}),
            _run_dir(tmp_path / "x", recs, alert), _run_dir(tmp_path / "y", recs, alert)]
    figures = _figures(monkeypatch)
    P.compare_runs(dirs, tmp_path / "cmp", labels=["calm", "x", "y"])
    rows = [float(ln.get_ydata()[0]) for ln in _entropy_panel(figures).get_lines()
            if ln.get_marker() == "v" and len(ln.get_xdata())]
    assert rows == pytest.approx([1.0, 1.0 - 0.045])


# --- the trainer: the first step's output check ----------------------------------------------------

@pytest.fixture
def own_code_is_forgotten(monkeypatch):
    yield from forget_own_code(monkeypatch)


OWN_VISION = """
    from torch import nn
    from stabletrain.models.registry import MODELS

    class OneRow(nn.Module):  # one row of logits for the whole batch
        def __init__(self, m):
            super().__init__()
            self.head = nn.Linear(m.in_chans * m.img_size ** 2, m.num_classes)

        def forward(self, x):
            return self.head(x.flatten(1)).mean(0, keepdim=True)

    @MODELS.register("{name}", kind="vision")
    def build(m, components):
        return OneRow(m)
"""
OWN_TEXT = """
    from torch import nn
    from stabletrain.models.registry import MODELS

    class Lm(nn.Module):
        def __init__(self, m, extra, drop):
            super().__init__()
            self.emb, self.out, self.drop = nn.Embedding(m.vocab_size, 8), nn.Linear(8, m.vocab_size + extra), drop

        def forward(self, x):
            logits = self.out(self.emb(x))
            return logits[:, :-1] if self.drop else logits

    @MODELS.register("{name}", kind="text", data="pytext")
    def build(m, components):
        return Lm(m, {extra}, {drop})
"""


def _own_trainer(tmp_path, name: str, body: str, model: str):
    from stabletrain.build import build_trainer

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    cfg = make_cfg(f"imports=[{path}]", model, f"model.family={name}", "steps=1", "batch_size=4", "monitor=off",
                   "logger=none", "optim=adamw")
    return build_trainer(cfg, tmp_path / "run")


@pytest.mark.usefixtures("own_code_is_forgotten")
@pytest.mark.parametrize("name, body, model, needle", [
    ("one_row_own", OWN_VISION, "model=vit_test", r"output has shape \(1, 10\) for an input of \(4, "),
    ("short_own", OWN_TEXT.replace("{extra}", "0").replace("{drop}", "True"), "model=gpt_test",
     r"output has shape \(4, \d+, \d+\) .* the loss needs \(batch, sequence, at least \d+\)"),
], ids=["vision_batch", "text_sequence"])
def test_logits_for_another_batch_or_sequence_are_one_line(tmp_path, name, body, model, needle):
    """The right number of classes is not enough: logits of another batch size (a head that pools
    over the batch) or a shorter sequence fail the first step's check, not the loss."""
    trainer = _own_trainer(tmp_path, name, body.replace("{name}", name), model)
    with pytest.raises(ConfigError, match=needle):
        trainer.fit()


@pytest.mark.usefixtures("own_code_is_forgotten")
def test_a_language_model_with_a_padded_vocabulary_trains(tmp_path):
    """Logits over more ids than the data has (a vocabulary padded to a multiple of 64, as GPT-2's
    50304): "at least" model.vocab_size, as the check says."""
    body = OWN_TEXT.replace("{name}", "padded_own").replace("{extra}", "64").replace("{drop}", "False")
    s = _own_trainer(tmp_path, "padded_own", body, "model=gpt_test").fit()
    assert s["status"] == "completed"


# --- the trainer: a spike with a skipped step inside --------------------------------------------

def test_a_run_dates_a_spike_with_a_skipped_step_inside_from_its_first_step(tmp_path, capsys):
    """A spike at step 5, a NaN step at 6: the progress line at 6 and the spike's record date it
    from step 5, not counted back from the last step over the skipped one."""
    s = train(tmp_path, *GPT, "steps=10", "divergence.warmup_steps=2", "debug.spike_at_step=5",
              "debug.nan_at_step=6", quiet=False)
    lines = {int(m.group(1)): x for x in capsys.readouterr().err.splitlines()
             if (m := re.search(r"step (\d+)/10 \|", x))}
    assert "| spike since step 5, " in lines[6], lines[6]
    assert s["spikes"][0]["step"] == 5, s["spikes"]


def test_a_run_that_ends_inside_a_spike_with_skips_inside_dates_it_from_its_first_step():
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=5, warmup_steps=5, spike_factor=2.0)))
    for s in range(10):
        w.update(s, 1.0)
    for s, loss, skipped in ((10, 5.0, False), (11, math.nan, True), (12, 5.0, False), (13, math.nan, True)):
        assert w.update(s, loss, skipped) is None
    assert "above 2x its running mean at step 10 and the last 1 step(s)" in w.unresolved_at_end(13)
    assert w.onset == 10


# --- the trainer: why no rollback ---------------------------------------------------------------

def test_no_rollback_names_the_last_ring_step_before_the_onset_not_the_onset(tmp_path):
    """Trouble from step 6, ckpt_every=2, the ring holding 6 and 8: step 6 is no checkpoint from
    before the trouble (ring_before is strict), step 4 is, and ckpt.keep=3 would have kept it."""
    from stabletrain.engine.loop import Trainer
    from stabletrain.topology import DistInfo

    (tmp_path / "checkpoints").mkdir()
    for step in (6, 8):
        (tmp_path / "checkpoints" / f"step_{step}.pt").write_bytes(b"")
    fake = SimpleNamespace(run_dir=tmp_path, info=DistInfo(), settings=SimpleNamespace(ckpt_every=2, ckpt_keep=2))
    line = Trainer._no_checkpoint_before(fake, 6, "spike")
    assert line == ("no ring checkpoint before step 6 to roll back to: the ring holds step(s) 6, 8 (ckpt.keep=2); "
                    "ckpt.keep=3 would have kept step 4")


# --- the monitors ------------------------------------------------------------------------------

def test_a_diverged_run_stopped_between_weight_passes_reports_its_last_weights(tmp_path):
    """The trainer hands the monitors the step it stopped at: a NaN step 3 stops the run
    (max_skips=1) with finite weights, which the forensics describe at step 3, not step 0."""
    s = train(tmp_path, *GPT, "steps=6", "debug.nan_at_step=3", "divergence.max_skips=1", "monitor=standard",
              "monitor.weight_every=100")
    assert s["status"] == "diverged" and s["step"] == 3, (s["status"], s["step"], s["reason"])
    assert s["forensics"]["last_finite_snapshot"]["step"] == 3


def _vit_runner(*overrides):
    from stabletrain.monitor.runner import MonitorRunner

    cfg = make_cfg("model=vit_test", "monitor=standard", "monitor.probe_every=100000", "monitor.alerts=false",
                   *overrides)
    torch.manual_seed(0)
    model = model_of(cfg)
    batch = (torch.randn(2, 3, cfg.model.img_size, cfg.model.img_size), torch.randint(0, 10, (2,)))
    runner = MonitorRunner(model, cfg.monitor, batch, device=torch.device("cpu"))
    runner.attach(SimpleNamespace(log=lambda step, values: None, message=lambda text: None))
    return runner


def test_no_extra_forensic_pass_on_non_finite_weights_nor_at_a_step_already_weighed():
    runner = _vit_runner("monitor.weight_every=10")
    runner.after_step(-1)
    runner.after_step(29)  # a scheduled pass at step 30
    assert [h["step"] for h in runner.history] == [0, 30]
    runner.summary("diverged", 30)
    assert [h["step"] for h in runner.history] == [0, 30]  # not weighed twice
    with torch.no_grad():
        next(runner.model.parameters()).fill_(math.nan)
    forensics = runner.summary("diverged", 35)["forensics"]
    assert [h["step"] for h in runner.history] == [0, 30]  # weights no longer finite: no pass at 35
    assert forensics["last_finite_snapshot"]["step"] == 30


def test_monitor_runner_refuses_a_probe_every_of_zero():
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    with pytest.raises(ValueError, match="monitor.probe_every=0 must be >= 1"):
        MonitorRunner(nn.Linear(2, 2), MonitorConfig(probe_every=0), (torch.zeros(1, 2), torch.zeros(1)),
                      device="cpu")


class _Attention(nn.Module):
    """``fused``: a qkv of 2 x d rows (q and k only), which no 3 x heads split reads; else
    separate q, k, v: neither stabletrain's nor timm's layout."""

    def __init__(self, d: int, fused: bool):
        super().__init__()
        self.num_heads = 2
        if fused:
            self.qkv = nn.Linear(d, 2 * d)
        else:
            self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.proj = nn.Linear(d, d)


class _OtherBlock(nn.Module):
    def __init__(self, fused: bool, d: int = 8):
        super().__init__()
        self.norm1, self.norm2, self.attn = nn.LayerNorm(d), nn.LayerNorm(d), _Attention(d, fused)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)


@pytest.mark.parametrize("fused", [False, True])
def test_blocks_of_another_layout_are_said_to_be_read_by_neither_pass(fused):
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    model = nn.Sequential(_OtherBlock(fused), _OtherBlock(fused))
    runner = MonitorRunner(model, MonitorConfig(), (torch.zeros(1, 4, 8), torch.zeros(1)), device="cpu")
    assert runner.weight_blocks == []
    assert runner.coverage().endswith("skips them, and so does the weight pass (no fused attn.qkv, attn.proj, "
                                      "mlp.fc1, mlp.fc2 to read)")


# --- unread keys -----------------------------------------------------------------------------

def test_the_run_notes_a_model_key_its_command_line_sets_to_the_default(tmp_path, capsys, monkeypatch):
    """A sweep's point model.dropout=0.0 on a ViT (which reads no dropout) is noted, as 0.1 is."""
    import stabletrain.build as B

    monkeypatch.setattr(B, "task_overrides", lambda: ("model=vit_test", "model.dropout=0.0"))
    train(tmp_path, "model=vit_test", "model.dropout=0.0", "steps=1", "batch_size=4", "optim=adamw",
          "logger=none", "monitor=off", quiet=False)
    assert "note: model.dropout=0.0 changes nothing" in capsys.readouterr().err
