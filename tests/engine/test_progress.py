"""The progress line as a user reads it: validation only where it was computed, speed and ETA,
and MFU from the model's FLOPs on a GPU."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from stabletrain.config import DivergenceConfig
from stabletrain.engine.divergence import DivergenceWatch
from stabletrain.engine.loop import Trainer
from stabletrain.engine.progress import Pace, end_line, interval_fields
from stabletrain.metrics import duration, milliseconds, peak_flops
from stabletrain.monitor import names as N
from tests.helpers import make_cfg, model_of, train


def _lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("step ")]


def test_validation_shows_only_on_the_line_of_its_step(tmp_path, capsys):
    train(tmp_path, "model=gpt_test", "steps=12", "logger=none", "monitor=off", "logger.log_every=2",
          "eval_every=5", "batch_size=8", quiet=False)
    lines = _lines(capsys.readouterr().err)
    steps = [int(re.match(r"step (\d+)/", ln).group(1)) for ln in lines]
    assert {5, 10, 12} <= set(steps)  # an evaluation step is logged even off the log cadence
    for s, ln in zip(steps, lines):
        assert ("val/loss" in ln) == (s in (5, 10, 12)), ln
        assert re.search(r"tok/s [\d.]+k? \| ms/step [\d.]+ \| eta \d", ln), ln


def test_the_progress_line_shows_the_loss_terms_share(tmp_path, capsys):
    """The loss shown is what is minimised; with a loss term it reads as task + penalty, so the
    task part compares with val/loss and with a run without the term."""
    summary = train(tmp_path, "model=gpt_test", "steps=2", "logger=none", "monitor=off", "batch_size=8",
                    "eval_every=10", "regularizer=zloss", "regularizer.zloss.coef=0.5", quiet=False)
    line = _lines(capsys.readouterr().err)[-1]
    loss, task, penalty = map(float, re.search(r"\| loss ([\d.]+) \(task ([\d.]+) \+ penalty ([\d.]+)\) \|",
                                               line).groups())
    rec = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][-1]
    # each shown to 4 significant digits: their sum is off by at most half a unit of each last digit
    assert 0 < penalty < loss and task + penalty == pytest.approx(loss, abs=0.011), line
    assert (loss, penalty) == (pytest.approx(rec["loss"], rel=1e-3), pytest.approx(rec["loss/penalty"], rel=1e-3))
    # the summary's task loss is what a sweep table and compare_runs set beside runs without terms
    final = summary["final"]
    assert final["loss"] == rec["loss"] and final["task_loss"] == pytest.approx(rec["loss"] - rec["loss/penalty"])
    from stabletrain.analysis import sweeps
    from stabletrain.analysis.compare import _task_loss
    from stabletrain.analysis.runs import load_run

    columns, table = sweeps.rows(sweeps.find_runs(tmp_path))
    assert "final_task_loss" in columns and table[0]["final_task_loss"] == final["task_loss"]
    steps, task_losses = _task_loss(load_run(tmp_path))
    assert task_losses[-1] == pytest.approx(final["task_loss"]) and steps[-1] == 2


def _etas_with_slow_steps(tmp_path, capsys, monkeypatch, slow: range, seconds: float, steps: int) -> dict:
    """The ETA of each progress line of a run whose steps take 10 ms each, those in ``slow``
    (0-based) ``seconds`` more, on the loop's clock: a real one made the ETA depend on the
    machine's load (a busy 2-core machine said 1s where 0s was due)."""
    import types

    from stabletrain.engine import loop as loop_module

    clock = [0.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    plain = Trainer.train_step

    def step(self, *args, **kwargs):
        clock[0] += 0.01 + (seconds if self.step in slow else 0.0)
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step)
    train(tmp_path, "model=gpt_test", f"steps={steps}", "logger=none", "monitor=off", "logger.log_every=2",
          "eval_every=100", "batch_size=8", quiet=False)
    return {int(m.group(1)): m.group(2) for m in (re.match(r"step (\d+)/.*\| eta (\S+)", ln)
                                                  for ln in _lines(capsys.readouterr().err))}


def test_the_eta_forgets_the_warm_up_interval(tmp_path, capsys, monkeypatch):
    """A slow first interval (compilation) is replaced by the second in the ETA, not averaged in."""
    eta = _etas_with_slow_steps(tmp_path, capsys, monkeypatch, range(1), 3.0, steps=8)
    assert eta[2] != "0s"  # 1.5 s per step, 6 steps to go
    assert eta[4] == "0s", eta  # averaged in, it would say 4s


def test_the_eta_shrugs_off_two_slow_intervals(tmp_path, capsys, monkeypatch):
    """Two intervals slowed by something else on the machine do not multiply the ETA (the
    median of the last five intervals); a smoothed mean would carry them for many lines."""
    eta = _etas_with_slow_steps(tmp_path, capsys, monkeypatch, range(8, 12), 0.5, steps=20)
    assert eta[12] == "0s" and eta[14] == "0s", eta  # the mean would say 2s, then 1s


def test_a_run_shorter_than_the_probe_cadence_ends_with_a_probe(tmp_path):
    import json

    train(tmp_path, "model=vit_test", "steps=3", "monitor=standard", "batch_size=8", "logger=none")
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["step"] == 3 and "entropy/blocks.0/min" in r for r in recs)


def test_duration_and_peaks():
    assert [duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]
    # step times in ms without an exponent, however slow the step
    assert [milliseconds(s) for s in (0.0573, 0.41249, 12.3456)] == ["57.3", "412", "12346"]
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("Some CPU") is None


def test_mfu_is_flops_per_sample_times_rate_over_peak():
    fake = SimpleNamespace(peak_flops=peak_flops("NVIDIA H100 80GB HBM3"), info=SimpleNamespace(world=2),
                           settings=SimpleNamespace(flops_per_sample=1e12))
    assert Trainer._mfu(fake, 100.0) == pytest.approx(1e12 * 100 / (989e12 * 2))
    fake.peak_flops = None  # a CPU, or a GPU of unknown peak
    assert Trainer._mfu(fake, 100.0) is None


def test_gpt_flops_are_nanogpts_count():
    """GPT-2 small at T=1024: 6N + 12 L d T per token, N without the position embedding."""
    from stabletrain.models.gpt import gpt_flops

    cfg = make_cfg("model=gpt2_s")
    model = model_of(cfg)
    n = sum(p.numel() for p in model.parameters()) - 1024 * 768
    assert n == pytest.approx(123.7e6, rel=1e-2)  # nanoGPT: "number of parameters: 123.69M" (vocab 50304)
    assert gpt_flops(model, cfg.model) == (6 * n + 12 * 12 * 768 * 1024) * 1024


def test_vit_flops_count_every_token():
    from stabletrain.models.vit import vit_flops

    cfg = make_cfg("model=vit_test")
    model = model_of(cfg)
    t = (16 // 4) ** 2 + 1
    n = sum(p.numel() for k, p in model.named_parameters() if k not in ("pos_embed", "cls_token"))
    assert vit_flops(model, cfg.model) == (6 * n + 12 * 2 * 32 * t) * t


def test_step_time_leaves_out_evaluations_and_checkpoints(tmp_path, monkeypatch):
    """The logged time per step, and so throughput, MFU and the ETA, counts training only: a
    clock that jumps 1000 s in every evaluation and every checkpoint leaves them unchanged."""
    from stabletrain.build import build_trainer
    from stabletrain.engine import loop
    from stabletrain.metrics import read_records

    jump = [0.0]
    real = loop.time.perf_counter
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: real() + jump[0]))
    t = build_trainer(make_cfg("model=gpt_test", "steps=9", "batch_size=4", "logger.log_every=2",
                               "ckpt_every=3", "eval_every=4", "monitor=off", "logger.wandb=disabled"), tmp_path)

    def slow(fn):
        def wrapped(*a, **k):
            jump[0] += 1000.0
            return fn(*a, **k)
        return wrapped

    t.evaluate, t.ckpt.save = slow(t.evaluate), slow(t.ckpt.save)
    t.fit()
    times = [r["time/step_s"] for r in read_records(tmp_path / "metrics.jsonl") if "time/step_s" in r]
    assert len(times) == 6 and max(times) < 100, times  # log steps 2, 3, 4, 6, 8, 9: none near 1000 s



@pytest.mark.parametrize("loss,ppl", [(2.0, math.exp(2.0)), (68.36, math.exp(68.36)), (800.0, math.inf)])
def test_perplexity_is_exp_of_the_loss_not_a_cap(loss, ppl, monkeypatch, tmp_path):
    """A diverging run's val/ppl was exp(50) for every loss above 50, a number that read as
    measured; it is exp(loss), inf beyond float range."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg("model=gpt_test", "steps=1", "logger=none", "monitor=off"), tmp_path)
    monkeypatch.setattr(t, "_eval_sums", lambda model: torch.tensor([loss * 10, 0.0, 10.0], dtype=torch.float64))
    got = t.evaluate()
    assert got["val/loss"] == pytest.approx(loss) and got["val/ppl"] == pytest.approx(ppl, rel=1e-9)


def test_the_logged_gradient_norm_is_the_intervals_largest(tmp_path):
    """A spike between two log steps showed as a dip: grad_norm was the log step's own. It is
    the interval's largest, the same run logged every step says which."""
    args = ["model=gpt_test", "steps=20", "batch_size=8", "logger=none", "monitor=off", "eval_every=100",
            "debug.spike_at_step=15", "precision=fp32"]
    train(tmp_path / "every", *args, "logger.log_every=1")
    train(tmp_path / "tens", *args, "logger.log_every=10")

    def norms(d):
        return {r["step"]: r["grad_norm"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if "grad_norm" in r}

    every, tens = norms(tmp_path / "every"), norms(tmp_path / "tens")
    assert tens[20] == pytest.approx(max(every[s] for s in range(11, 21)), rel=1e-5)
    assert tens[20] > 2 * every[20]  # the spike at step 15, not step 20's


def test_the_progress_line_says_what_the_divergence_watch_sees(tmp_path, capsys):
    """An injected one-step spike at step 30, a log step: the start lines say a lone spike is
    watched, not acted on; step 30's line says how far it is from a divergence, step 40's that it
    passed. A spike inside an interval is said as passed on its interval's line."""
    args = ["model=gpt_test", "steps=40", "batch_size=8", "logger=none", "monitor=off", "eval_every=100",
            "logger.log_every=10"]
    train(tmp_path / "a", *args, "debug.spike_at_step=30", quiet=False)
    err = capsys.readouterr().err
    assert "debug.spike_at_step=30: that step's loss is multiplied by 10000; a spike of one step is watched, " \
           "not acted on (a divergence is 20 steps in a row above 4x the running mean, divergence.window)" in err
    lines = {int(m.group(1)): ln for ln in err.splitlines() if (m := re.match(r"step (\d+)/40 ", ln))}
    assert re.search(r"\| spike since step 30, the loss above 4x its running mean [\d.]+ \(1 of 20 steps to a "
                     r"divergence\) \|", lines[30]), lines[30]
    assert "| spike of step 30 passed after 1 step(s) |" in lines[40], lines[40]
    assert "spike" not in lines[10] + lines[20]
    train(tmp_path / "b", *args, "debug.spike_at_step=25", quiet=False)
    out = capsys.readouterr().err
    assert "step 30/40 | loss 5" in out and "| spike of step 25 passed after 1 step(s) |" in out
    # in the divergence warmup (20 steps), inside an interval: its line says why its mean loss is so high
    train(tmp_path / "c", *args, "debug.spike_at_step=12", quiet=False)
    err = capsys.readouterr().err
    lines = {int(m.group(1)): ln for ln in err.splitlines() if (m := re.match(r"step (\d+)/40 ", ln))}
    assert re.search(r"\| spike at step 12, above 4x the running mean 5\.\d+; not counted in the first "
                     r"divergence.warmup_steps=20 steps \|", lines[20]), lines[20]
    assert "spike" not in lines[10] + lines[30] + lines[40]


# --- the lines from the values alone (engine/progress.py) ---


def test_pace_drops_the_first_interval_once_the_second_comes_and_takes_the_median_of_five():
    pace = Pace()
    assert pace.add(30.0) == 30.0  # the warm-up interval: all there is
    assert pace.add(1.0) == 1.0  # replaced by the second
    assert pace.add(3.0) == 2.0
    for s in (2.0, 2.0, 100.0):  # an interval slowed by something else does not move the median
        p = pace.add(s)
    assert p == 2.0 and list(pace.recent) == [1.0, 3.0, 2.0, 2.0, 100.0]
    assert pace.add(100.0) == 3.0  # five at most: the 1.0 went


def _rec(**extra):
    return {N.LOSS: 2.5, N.LR: 1e-3, N.STEP_TIME: 0.25, N.throughput("tokens"): 4096 / 0.25, **extra}


def test_interval_fields_name_the_penalty_the_skipped_steps_validation_and_the_time_left():
    fields = interval_fields(_rec(**{N.LOSS_PENALTY: 0.5, N.MFU: 0.4}), steps=[10, 11, 12, 13, 14],
                             skipped=[False, True, False, True, True], passed=[], reason=None,
                             last_vals={"val/loss": 2.0, "val_ema/loss": 1.9, "other": 7},
                             watch=DivergenceWatch(), step=15, total_steps=255, text=True, step_time=0.25)
    assert fields == {N.LOSS: "2.5 (task 2 + penalty 0.5)", "skipped": "3 non-finite step(s) (step 12, 14, 15)",
                      N.LR: 1e-3, "val/loss": 2.0, "val_ema/loss": 1.9, "tok/s": "16.4k", "ms/step": "250",
                      "mfu": "40.0%", "eta": "1m00s"}
    fields = interval_fields(_rec(), [0, 1, 2, 3], [True] * 4, [], None, {}, watch=DivergenceWatch(), step=4,
                             total_steps=4, text=True, step_time=1.0)
    assert fields["skipped"] == "4 non-finite step(s) (step 1, 2, 3, ...)" and fields["eta"] == "0s"


def test_interval_fields_say_a_spike_under_watch_one_in_the_warmup_and_one_that_passed():
    w = DivergenceWatch(DivergenceConfig(spike_factor=2.0, window=5, warmup_steps=0, ema=0.0))
    for step, loss in ((1, 1.0), (2, 3.0), (3, 3.0)):
        assert w.update(step, loss) is None
    args = dict(watch=w, step=3, total_steps=10, text=False, step_time=0.1)
    rec = {N.LOSS: 3.0, N.LR: 0.1, N.STEP_TIME: 0.1, N.throughput("samples"): 10.0}
    assert interval_fields(rec, [1, 2], [False] * 2, [], None, {}, **args)["spike"] == (
        "since step 2, the loss above 2x its running mean 1 (2 of 5 steps to a divergence)")
    assert "spike" not in interval_fields(rec, [1, 2], [False] * 2, [], "diverged", {}, **args)
    warm = DivergenceWatch(DivergenceConfig(spike_factor=2.0, warmup_steps=10, ema=0.0))
    warm.update(1, 1.0), warm.update(2, 5.0)
    line = interval_fields(rec, [1], [False], [], None, {}, **{**args, "watch": warm, "step": 2})
    assert line["spike"] == ("at step 2, above 2x the running mean 1; not counted in the first "
                             "divergence.warmup_steps=10 steps")
    assert "spike" not in interval_fields(rec, [2], [False], [], None, {}, **{**args, "watch": warm, "step": 3})
    warm.update(3, 1.5)  # a healthy step after it, in the same interval: the line still explains its loss
    line = interval_fields(rec, [0, 1, 2], [False] * 3, [], None, {}, **{**args, "watch": warm, "step": 3})
    assert line["spike"].startswith("at step 2, above 2x the running mean 1;"), line
    line = interval_fields(rec, [5, 6], [False] * 2, [(3, 2), (5, 1)], None, {}, **{**args, "watch": DivergenceWatch()})
    assert line["spike"] == "of step 5 passed after 1 step(s)" and line["img/s"] == "10"


def test_end_line_says_where_and_why_a_run_stopped_and_what_it_survived():
    summary = {"status": "diverged", "step": 40, "reason": "non-finite loss (nan) at step 37", "diverged_at": 37,
               "skipped_steps": 2, "spikes": [{"step": 9, "steps": 3}, {"step": 20, "steps": 1}],
               "rollbacks": [{"trigger_step": 12, "restored_step": 10}, {"trigger_step": 30, "restored_step": 25}],
               "lr_scale": 0.25}
    alerts = [{"layer": "blocks.0.attn", "step": 14, "rolled_back": True}, {"layer": "blocks.1.attn", "step": 33}]
    assert end_line(summary, alerts=alerts, last_vals={"val/loss": 2.345678}, eval_step=30) == (
        "diverged at step 37 (stopped at step 40, where the logging interval that saw it ended): non-finite loss "
        "(nan) at step 37 | 2 non-finite step(s) skipped | 2 loss spike(s) passed, the last at step 20 (1 step(s)) "
        "| 2 rollback(s), the last from step 30 to 25, lr x0.25 from then on | 2 health alert(s), the first at "
        "blocks.1.attn step 33 and 1 in the histories rollbacks abandoned | val/loss 2.346 (evaluated at step 30)")
    done = {"status": "completed", "step": 8, "reason": None, "rollbacks": [], "lr_scale": 1.0}
    assert end_line(done, alerts=[], last_vals={"val/loss": 1.5, "val/acc": 0.5}, eval_step=8) == (
        "completed at step 8 | val/loss 1.5 | val/acc 0.5")
    early = {**done, "spikes": [{"step": 2, "steps": 2, "warmup": True}, {"step": 6, "steps": 1}]}
    assert end_line(early, alerts=[], last_vals={}, eval_step=None) == (
        "completed at step 8 | 2 loss spike(s) passed (1 in the divergence warmup, not counted), the last at step "
        "6 (1 step(s))")
    # a spike still under watch where the run ended (summary.json marks it open) is not said to have passed
    open_ = {**done, "spikes": [{"step": 2, "steps": 1}, {"step": 7, "steps": 2, "open": True}]}
    assert end_line(open_, alerts=[], last_vals={}, eval_step=None) == (
        "completed at step 8 | 1 loss spike(s) passed, the last at step 2 (1 step(s)) | a loss spike since step 7 "
        "(2 step(s)) had not passed")
    gone = [{"layer": "blocks.0.attn", "step": 3, "rolled_back": True}]
    assert end_line(done, alerts=gone, last_vals={}, eval_step=None) == (
        "completed at step 8 | 1 health alert(s), 1 in the histories rollbacks abandoned")


def test_the_progress_line_reads_loss_skips_spike_lr_validation_speed_then_the_time_left():
    """The fields come in one order on every line, the loss first and the time left last, so that
    the eye finds each at its place: validation between the lr and the speed, not after the ETA."""
    w = DivergenceWatch(DivergenceConfig(spike_factor=2.0, window=5, warmup_steps=0, ema=0.0))
    for step, loss in ((1, 1.0), (2, 3.0)):
        w.update(step, loss)
    fields = interval_fields(_rec(**{N.MFU: 0.4}), [0, 1], [False, True], [], None, {"val/loss": 2.0}, watch=w,
                             step=2, total_steps=10, text=True, step_time=0.25)
    assert list(fields) == [N.LOSS, "skipped", "spike", N.LR, "val/loss", "tok/s", "ms/step", "mfu", "eta"]


def test_end_line_names_the_first_standing_alert_and_no_lr_scale_or_skips_the_run_did_not_have():
    """Of the health alerts, the first one no rollback abandoned is named; a rollback that kept the
    lr says no 'lr x1', and a guarded run that skipped no step says nothing of skipped steps."""
    summary = {"status": "completed", "step": 10, "reason": None, "skipped_steps": 0, "lr_scale": 1.0,
               "rollbacks": [{"trigger_step": 6, "restored_step": 4}]}
    alerts = [{"layer": "blocks.1.attn", "step": 2, "rolled_back": True}, {"layer": "blocks.0.attn", "step": 3},
              {"layer": "blocks.1.mlp", "step": 8}]
    assert end_line(summary, alerts=alerts, last_vals={}, eval_step=None) == (
        "completed at step 10 | 1 rollback(s), the last from step 6 to 4 | 3 health alert(s), the first at "
        "blocks.0.attn step 3 and 1 in the histories rollbacks abandoned")
