"""Promises of the training loop (engine/loop.py) and the divergence watch (engine/divergence.py)
that a mutation audit found no test holding: each test here fails on a small plausible change of
that code (a comparison, a divisor, a state field) and passes on the code as it is."""

import json
import math
import signal

import pytest
import torch
from omegaconf import OmegaConf

from stabletrain.config import DivergenceConfig
from stabletrain.engine.divergence import DivergenceWatch
from tests.helpers import GPT_LOGGED, QUIET, make_cfg, train

GPT = [*GPT_LOGGED, "precision=fp32"]
ROLLBACK = ["divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4"]


def _watch(**kw) -> DivergenceWatch:
    return DivergenceWatch(OmegaConf.structured(DivergenceConfig(**kw)))


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_spike_counts_once_the_running_mean_stands_on_warmup_steps_losses():
    """divergence.warmup_steps=5: a spike at step 6, after five healthy losses, is counted (it
    starts a spike under watch); one at step 5, on four, is the warmup's and is not."""
    w = _watch(window=3, warmup_steps=5, spike_factor=2.0)
    for s in range(1, 5):
        w.update(s, 1.0)
    assert w.update(5, 9.0) is None and w.above and w.over == 0 and w.uncounted == (5, 1.0)
    w = _watch(window=3, warmup_steps=5, spike_factor=2.0)
    for s in range(1, 6):
        w.update(s, 1.0)
    assert w.update(6, 9.0) is None and w.over == 1 and w.spike_from == 6 and w.uncounted is None


def test_a_restored_watch_keeps_counting_the_skipped_steps_before_its_checkpoint():
    """divergence.max_skips=3 counts consecutive skipped steps across a checkpoint (a stop signal
    saves one inside a run of skips): two skipped before it and one after are a divergence, dated
    from the first."""
    w = _watch(max_skips=3, skip_nonfinite=True)
    for s in range(1, 5):
        w.update(s, 1.0)
    assert w.update(5, math.nan, skipped=True) is None and w.update(6, math.nan, skipped=True) is None
    again = _watch(max_skips=3, skip_nonfinite=True)
    again.load_state_dict(w.state_dict(), step=6)
    assert again.update(7, math.nan, skipped=True) == ("non-finite gradients at step 5 and the 2 step(s) after it, "
                                                       "skipped (divergence.max_skips=3)")
    assert again.onset == 5


def test_a_state_saved_inside_a_spike_before_above_was_kept_loads_as_above():
    """A checkpoint from code that kept no ``above``, written inside a counted spike (over > 0):
    the loss was above the running mean, so the restored watch says so (the loop keeps a
    checkpoint written while it does out of the ring)."""
    w = _watch(window=5, warmup_steps=2, spike_factor=2.0)
    for s in range(1, 5):
        w.update(s, 1.0)
    w.update(5, 9.0), w.update(6, 9.0)
    old = {k: v for k, v in w.state_dict().items() if k not in ("above", "spike_from")}
    again = _watch(window=5, warmup_steps=2, spike_factor=2.0)
    again.load_state_dict(old, step=6)
    assert (again.above, again.over, again.spike_from) == (True, 2, 5)


def test_a_resumed_run_keeps_the_spikes_it_passed_before_its_checkpoint(tmp_path):
    """A one-step spike at step 3, the run interrupted at step 5 and resumed: its summary.json
    still lists the spike, as the uninterrupted run's does."""
    from stabletrain.build import build_trainer
    from tests.engine.test_loop import _run_until

    args = [*GPT, "steps=8", "ckpt_every=4", "divergence.warmup_steps=2", "debug.spike_at_step=3"]
    full = train(tmp_path / "full", *args)
    assert full["spikes"] == [{"step": 3, "steps": 1}]
    _run_until(build_trainer(make_cfg(*QUIET, *args), tmp_path / "half"), 5)
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["status"] == "completed" and s["spikes"] == full["spikes"]


def test_the_logged_loss_is_the_mean_of_the_intervals_healthy_steps(tmp_path):
    """A NaN step skipped inside a log interval: the interval's logged loss (and the summary's final
    loss) is the mean of its other steps' losses, the same run logged every step says which, not nan."""
    args = [*GPT, "steps=6", "debug.nan_at_step=5"]
    train(tmp_path / "every", *args)
    s = train(tmp_path / "threes", *args, "logger.log_every=3")
    every = {r["step"]: r["loss"] for r in _records(tmp_path / "every") if "loss" in r}
    threes = {r["step"]: r["loss"] for r in _records(tmp_path / "threes") if "loss" in r}
    assert str(every[5]).lower() == "nan"  # the skipped step, logged alone
    assert threes[3] == pytest.approx((every[1] + every[2] + every[3]) / 3, rel=1e-5)
    assert threes[6] == pytest.approx((every[4] + every[6]) / 2, rel=1e-5)
    assert s["final"]["loss"] == pytest.approx(threes[6])


def test_val_acc_and_loss_are_the_fractions_over_every_scored_sample(tmp_path):
    """An image model's val/acc is the share of validation samples whose top logit is the label,
    and val/loss their mean cross-entropy, over the eval_batches batches of min(batch_size, 256)."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, "model=vit_test", "steps=1", "batch_size=16", "eval_batches=3",
                               "precision=fp32"), tmp_path)
    got = t.evaluate()
    t.model.eval()
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in t.data.val_batches(16, 3):
            out = t.model(x)
            correct += int((out.argmax(-1) == y).sum())
            loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
            total += len(y)
    assert total == 48
    assert got["val/acc"] == pytest.approx(correct / total) and got["val/loss"] == pytest.approx(loss / total, rel=1e-5)
    assert 0 < correct < total  # an untrained 10-class model: neither none nor all right, so acc says something


def test_a_log_line_gives_the_lr_of_its_own_step(tmp_path):
    """Logged every 3 steps, the lr recorded at steps 3 and 6 is the lr those steps ran at (as
    the same run logged every step records it), not the lr of the interval's first step."""
    args = [*GPT, "steps=6"]
    train(tmp_path / "every", *args)
    train(tmp_path / "threes", *args, "logger.log_every=3")
    every = {r["step"]: r["lr"] for r in _records(tmp_path / "every") if "lr" in r}
    threes = {r["step"]: r["lr"] for r in _records(tmp_path / "threes") if "lr" in r}
    assert every[1] != every[3]  # the schedule moves within an interval
    assert threes == {3: pytest.approx(every[3]), 6: pytest.approx(every[6])}


def test_a_first_loss_far_off_does_not_set_the_running_mean():
    """The running mean starts as the median of the first five healthy losses: a first loss 1e4x
    the rest (a broken first batch) does not lift it, so a 100x spike after the warmup is counted
    (seeded with that first loss, the mean stays above 100x the loss for some 300 steps). A resume
    in the middle of the seeding goes on as the run that was not stopped."""
    w = _watch()
    losses = [5e4, *[5.0 + 0.01 * s for s in range(2, 40)]]
    for s, loss in enumerate(losses, 1):
        assert w.update(s, loss) is None
        if s == 3:
            saved = w.state_dict()
    again = _watch()
    again.load_state_dict(saved)
    for s, loss in enumerate(losses[3:], 4):
        again.update(s, loss)
    assert again.state_dict() == w.state_dict()
    assert w.ema == pytest.approx(5.0, rel=0.1)
    assert w.update(40, 500.0) is None and w.over == 1 and w.spike_from == 40


def test_a_spike_under_watch_where_the_run_ends_is_on_record_as_open(tmp_path):
    """A counted spike at the run's last step neither passed nor lasted the window: summary.json
    keeps it, marked open (its update was applied, the final loss carries it). The checkpoint's
    record does not: a resume goes on watching it and records it once, as passed."""
    args = [*GPT, "divergence.warmup_steps=2", "debug.spike_at_step=8"]
    s = train(tmp_path, *args, "steps=8")
    assert s["status"] == "completed" and s["spikes"] == [{"step": 8, "steps": 1, "open": True}]
    s = train(tmp_path, *args, "steps=10", "resume=auto")
    assert s["status"] == "completed" and s["spikes"] == [{"step": 8, "steps": 1}]


def test_a_skipped_steps_loss_terms_count_no_more_than_its_loss(tmp_path):
    """z-loss, logged every 3 steps, step 3 non-finite and skipped: the interval's loss/penalty is
    the mean of steps 1 and 2's (those whose loss the interval's loss averages), and the task
    loss in summary.json is that loss less that penalty."""
    args = [*GPT, "steps=3", "regularizer=zloss", "regularizer.zloss.coef=1.0", "debug.nan_at_step=3"]
    train(tmp_path / "every", *args)
    s = train(tmp_path / "threes", *args, "logger.log_every=3")
    every = [r for r in _records(tmp_path / "every") if "loss" in r]
    (rec,) = [r for r in _records(tmp_path / "threes") if "loss" in r]
    assert rec["train/skipped_steps"] == 1 and math.isnan(float(every[2]["loss"]))
    assert rec["loss"] == pytest.approx((every[0]["loss"] + every[1]["loss"]) / 2, rel=1e-5)
    assert rec["loss/penalty"] == pytest.approx((every[0]["loss/penalty"] + every[1]["loss/penalty"]) / 2, rel=1e-5)
    assert s["final"]["task_loss"] == pytest.approx(rec["loss"] - rec["loss/penalty"])


def test_an_intervals_penalty_is_the_mean_of_its_steps_and_the_task_loss_the_rest(tmp_path):
    """Logged every 3 steps, loss/penalty at step 3 is the mean of the three steps' penalties (as
    the run logged every step records them), not their sum; summary.json's task_loss is the
    final loss less that penalty."""
    args = [*GPT, "steps=3", "regularizer=locater"]
    train(tmp_path / "every", *args)
    s = train(tmp_path / "threes", *args, "logger.log_every=3")
    every = [r for r in _records(tmp_path / "every") if "loss" in r]
    (rec,) = [r for r in _records(tmp_path / "threes") if "loss" in r]
    assert rec["loss/penalty"] > 0
    assert rec["loss/penalty"] == pytest.approx(sum(r["loss/penalty"] for r in every) / 3, rel=1e-5)
    assert rec["loss"] == pytest.approx(sum(r["loss"] for r in every) / 3, rel=1e-5)
    assert s["final"]["loss"] == pytest.approx(rec["loss"])
    assert s["final"]["task_loss"] == pytest.approx(rec["loss"] - rec["loss/penalty"])


def test_the_logged_step_time_is_the_intervals_time_over_its_steps(tmp_path, monkeypatch):
    """A clock that runs one second per training step, logged every 4 steps: time/step_s is 1 s
    (not the interval's 4 s), and throughput is the interval's tokens over its seconds."""
    from types import SimpleNamespace

    from stabletrain.build import build_trainer
    from stabletrain.engine import loop

    jump = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: jump[0]))  # no machine's speed in it
    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=8", "logger.log_every=4"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        jump[0] += 1.0
        return orig(*a, **k)

    t.train_step = step
    t.fit()
    recs = [r for r in _records(tmp_path) if "time/step_s" in r]
    assert [r["step"] for r in recs] == [4, 8]
    for r in recs:
        assert r["time/step_s"] == pytest.approx(1.0), r
        tokens = 8 * t.data.seq_len  # batch_size sequences of seq_len tokens per step
        assert r["throughput/tokens_per_s"] == pytest.approx(tokens / r["time/step_s"], rel=1e-6)


def test_a_rollback_to_an_onset_before_an_earlier_rollback_skips_from_the_data_that_onset_met(tmp_path):
    """A NaN at stream position 7 rolls back to step 4 and skips the data of 3 steps (offset 3); an
    alert at step 9 dated from step 3, of the history before that rollback, restores step 0, and
    step 3 ran at offset 0: the data of 3 steps is skipped, not 6 (the first rollback's skip counted
    again). The rollback past an earlier one's restored step is tests/engine/test_rollback_chains.py's."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=7", "monitor=standard",
                               "monitor.stop_on_alert=true", "monitor.rollback_on_alert=true"), tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 9 and len(t.rollbacks) == 1:
            t.monitor.stop_reason, t.monitor.stop_onset = "entropy collapse at blocks.0 (step 3)", 3

    t.monitor.after_step = after_step
    s = t.fit()
    assert [(r["trigger_step"], r["restored_step"], r["skipped_steps"]) for r in s["rollbacks"][:2]] == [(7, 4, 3),
                                                                                                        (3, 0, 3)]


def test_an_alert_at_the_restored_step_stays_on_the_kept_history(tmp_path):
    """Alerts at steps 4 and 5, then a NaN at step 6 rolls back to step 4: the state of step 4 is
    the one the run goes on from, so its alert is kept; step 5's is marked rolled back."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=8", "monitor=standard", "debug.nan_at_step=6"),
                      tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 in (4, 5) and not t.rollbacks:
            t.monitor.alerts.append({"step": step + 1, "layer": "blocks.0", "value": 0.5, "message": f"at {step + 1}"})

    t.monitor.after_step = after_step
    s = t.fit()
    assert s["status"] == "completed" and [r["restored_step"] for r in s["rollbacks"]] == [4]
    assert [(a["message"], a.get("rolled_back", False)) for a in s["alerts"]] == [("at 4", False), ("at 5", True)]


def test_no_checkpoint_is_written_at_a_skipped_step_but_the_last(tmp_path):
    """ckpt_every=2 with a NaN step 4 skipped: no checkpoint is written at step 4, inside the run of
    skipped steps (the ring keeps steps 2 and 6 only); a skipped last step is still checkpointed."""
    s = train(tmp_path / "mid", *GPT, "steps=6", "ckpt_every=2", "ckpt.keep=5", "debug.nan_at_step=4")
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    assert sorted(p.name for p in (tmp_path / "mid/checkpoints").glob("step_*.pt")) == ["step_000002.pt",
                                                                                         "step_000006.pt"]
    s = train(tmp_path / "last", *GPT, "steps=4", "ckpt_every=2", "debug.nan_at_step=4")
    assert s["status"] == "completed"
    assert torch.load(tmp_path / "last/checkpoints/last.pt", weights_only=True)["step"] == 4


def test_a_second_ctrl_c_right_after_a_resume_names_the_checkpoint_it_resumed(tmp_path):
    """A run resumed from its step-4 last.pt and stopped at once in its first step: the summary
    says last.pt holds step 4 (the step the run can go on from), not that there is no checkpoint."""
    from stabletrain.build import build_trainer
    from stabletrain.errors import StoppedAtOnce

    train(tmp_path, *GPT, "steps=4")
    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=8", "resume=auto"), tmp_path)

    def interrupted(*a, **k):
        t.stop_signal = signal.SIGINT  # the first Ctrl-C; the second raises
        raise KeyboardInterrupt

    t.train_step = interrupted
    with pytest.raises(StoppedAtOnce):
        t.fit()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["status"], s["reason"]) == ("interrupted", "a second Ctrl-C at step 4, without a checkpoint "
                                                          "(last.pt holds step 4)")


def test_a_ctrl_c_no_handler_of_the_loop_heard_still_leaves_a_summary(tmp_path):
    """A KeyboardInterrupt with no signal on record (Python's own handler: the loop's were not
    installed, as off the main thread): _finish's int(None) raised a TypeError over it."""
    from stabletrain.build import build_trainer
    from stabletrain.errors import StoppedAtOnce

    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=4"), tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    t.train_step = interrupted
    with pytest.raises(StoppedAtOnce):
        t.fit()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["status"], s["reason"], s["signal"]) == ("interrupted", "a Ctrl-C at step 0, without a checkpoint",
                                                       int(signal.SIGINT))
