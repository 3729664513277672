"""Chains of rollbacks and resumes, as long unstable runs meet them (divergence.action=rollback): several
rollbacks in a row (the "again" rule going one ring checkpoint further back), a stop right after a
rollback and ``resume=auto``, and what summary.json says of the history a rollback abandoned. The
faults are injected by stream position (debug.nan_at_step / debug.spike_at_step, changed during the
run for a second and third fault), so a rollback that skips a batch skips its fault."""

import json
import signal

import pytest
import torch

from tests.helpers import GPT_LOGGED, QUIET, losses, make_cfg, train

GPT = [*GPT_LOGGED, "precision=fp32"]
ROLLBACK = ["divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4"]


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trainer_with_faults(run_dir, args, faults: list[int]):
    """A trainer whose NaN batch moves on to ``faults[k]`` once it rolled back ``k`` times; it
    notes the (1-based) stream position each step was served, in ``served``."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *args, f"debug.nan_at_step={faults[0]}"), run_dir)
    orig, served = t.train_step, []

    def step(*a, **k):
        t.settings.nan_at_step = faults[min(len(t.rollbacks), len(faults) - 1)]
        served.append(t.step + t.data_offset + 1)
        return orig(*a, **k)

    t.train_step = step
    return t, served


def test_three_rollbacks_in_a_row_never_serve_a_bad_batch_twice(tmp_path):
    """Bad batches at stream positions 6, 10 and 14, ckpt.keep=2, skip_window=3, lr x0.5 per
    rollback: step 6 rolls back to step 4 (3 steps of data skipped, offset 3); position 10 comes at
    step 7, and the ring's step 4 is the one just restored, so the rollback goes one checkpoint
    further, to step 0 (offset 0 there: 10 skipped); position 14 comes at step 4, and step 0 is
    again the last one restored with none before it: restored again, skipping 4 more (offset 14).
    No bad position is served twice, the lr ends at 0.125x, the steps run 1-20 on positions
    15-34, and metrics.jsonl holds one loss per step."""
    args = [*GPT, *ROLLBACK, "steps=20", "ckpt.keep=2", "divergence.skip_window=3",
            "divergence.lr_scale_on_rollback=0.5"]
    t, served = _trainer_with_faults(tmp_path, args, [6, 10, 14])
    s = t.fit()
    assert s["status"] == "completed" and s["step"] == 20 and s["lr_scale"] == pytest.approx(0.125)
    assert [(r["trigger_step"], r["detected_step"], r["restored_step"], r["skipped_steps"]) for r in s["rollbacks"]] \
        == [(6, 6, 4, 3), (7, 7, 0, 10), (4, 4, 0, 4)]
    assert [served.count(p) for p in (6, 10, 14)] == [1, 1, 1]
    assert served[-20:] == list(range(15, 35))  # the history kept: steps 1-20 on positions 15-34
    assert torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["survival"]["data_offset"] == 14
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == list(range(1, 21))
    assert s["skipped_steps"] == 3  # the run's total: each rollback's trigger was a skipped step


def test_a_stop_after_a_rollback_past_an_earlier_one_resumes_the_same_history(tmp_path):
    """Bad batches at positions 10 and 13 (ckpt.keep=3, skip_window=2, lr x0.5): the second
    rollback goes past the first one's checkpoint (step 8) to step 4. A run stopped by SIGTERM three
    steps after it and resumed with resume=auto ends with the uninterrupted run's losses, rollbacks,
    lr scale and data offset."""
    args = [*GPT, *ROLLBACK, "steps=16", "ckpt.keep=3", "divergence.skip_window=2",
            "divergence.lr_scale_on_rollback=0.5"]
    full, _ = _trainer_with_faults(tmp_path / "full", args, [10, 13])
    ref = full.fit()
    assert [(r["trigger_step"], r["restored_step"], r["skipped_steps"]) for r in ref["rollbacks"]] == [(10, 8, 2),
                                                                                                        (11, 4, 9)]
    t, _ = _trainer_with_faults(tmp_path / "half", args, [10, 13])
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if len(t.rollbacks) == 2 and t.step + 1 == 7:
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step
    s = t.fit()
    assert s["status"] == "interrupted" and s["step"] == 7 and len(s["rollbacks"]) == 2
    t, _ = _trainer_with_faults(tmp_path / "half", [*args, "resume=auto"], [10, 13])
    s = t.fit()
    assert s["status"] == "completed"
    assert (s["rollbacks"], s["lr_scale"], s["skipped_steps"]) == (ref["rollbacks"], ref["lr_scale"],
                                                                   ref["skipped_steps"])
    assert losses(tmp_path / "half") == losses(tmp_path / "full")
    offsets = [torch.load(d / "checkpoints/last.pt", weights_only=True)["survival"]["data_offset"]
               for d in (tmp_path / "full", tmp_path / "half")]
    assert offsets == [9, 9]  # step 4 + 9: past position 13


def test_a_rollback_keeps_the_warmup_spikes_before_the_restored_step_only(tmp_path):
    """divergence.warmup_steps=10: spikes at steps 2 and 5 are the warmup's (on record, marked
    so); a NaN at step 7 rolls back to step 4. summary.json keeps step 2's spike, of the history
    kept, and not step 5's, whose data the rollback skipped."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=10", "divergence.warmup_steps=10",
                               "debug.spike_at_step=2", "debug.nan_at_step=7"), tmp_path)
    orig, before = t.train_step, []

    def step(*a, **k):
        if t.step == 3:
            t.settings.spike_at_step = 5
        if t.step == 6 and not t.rollbacks:
            before.append([dict(sp) for sp in t.spikes])
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert before == [[{"step": 2, "steps": 1, "warmup": True}, {"step": 5, "steps": 1, "warmup": True}]]
    assert [(r["trigger_step"], r["restored_step"]) for r in s["rollbacks"]] == [(7, 4)]
    assert s["status"] == "completed" and s["spikes"] == [{"step": 2, "steps": 1, "warmup": True}]


def test_a_run_stopped_right_after_a_rollback_reports_nothing_of_the_abandoned_history(tmp_path, capsys):
    """A spike at step 6 (divergence.window=1) found when SIGTERM flushes the interval at step 7,
    after an evaluation at step 5: the run rolls back to step 4 and stops there. Its summary.json
    and last line describe the history kept, as a run resumed at step 4 and stopped at once would:
    no final loss of the abandoned steps 5-7 (the spike's 1e4-times loss among them), and no
    evaluation of step 5, a state the rollback threw away."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*GPT, *ROLLBACK, "steps=12", "logger.log_every=4", "eval_every=5",
                               "debug.spike_at_step=6", "divergence.window=1", "divergence.warmup_steps=2",
                               "logger=none", "monitor=off"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if not t.rollbacks and t.step + 1 == 7:
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step
    s = t.fit()
    assert s["status"] == "interrupted" and s["step"] == 4
    assert [(r["trigger_step"], r["detected_step"], r["restored_step"]) for r in s["rollbacks"]] == [(6, 7, 4)]
    assert s["final"] == {} and "eval_step" not in s, s
    last = capsys.readouterr().err.strip().splitlines()
    assert not any("evaluated at step 5" in ln for ln in last), last


def test_a_run_that_diverges_after_its_last_rollback_reports_no_evaluation_of_the_abandoned_history(tmp_path):
    """eval_every=3: a NaN at step 6 is evaluated at step 6 and rolls back to step 4
    (max_rollbacks=1); step 5 then meets a spike (window=1) and the run diverges there. summary.json's
    final values are those of the history kept: its metrics.jsonl holds the evaluation of step 3
    only, so none of step 6 is reported (nor an eval_step past the run's step)."""
    s = train(tmp_path, *GPT, *ROLLBACK, "steps=8", "eval_every=3", "debug.nan_at_step=6", "debug.spike_at_step=7",
              "divergence.window=1", "divergence.warmup_steps=2", "divergence.max_rollbacks=1")
    assert s["status"] == "diverged" and s["step"] == 5 and "max_rollbacks=1 reached" in s["reason"]
    assert [(r["trigger_step"], r["restored_step"], r["skipped_steps"]) for r in s["rollbacks"]] == [(6, 4, 2)]
    assert [r["step"] for r in _records(tmp_path) if "val/loss" in r] == [3]
    assert "eval_step" not in s and "val/loss" not in s["final"], s
    assert s["final"]["loss"] > 1e3  # the spike of step 5, of the history kept
