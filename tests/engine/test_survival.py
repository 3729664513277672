"""Surviving a spike: skipped non-finite steps, the checkpoint ring, rollbacks."""

import itertools
import json
import re
import shutil
import signal

import pytest
import torch

from tests.helpers import GPT_LOGGED, QUIET, losses, make_cfg, train

GPT = [*GPT_LOGGED, "precision=fp32"]
ROLLBACK = ["divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4"]


def _load(path):
    return torch.load(path, weights_only=True)


def _assert_equal(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [
    ["optim=adamw"],  # torch's fused AdamW on CPU: found_inf
    ["optim=adamw", "optim.fused=false"],
    ["optim=adamw2", "reparam=sigma", "ema.decay=0.9"],  # hooks and EMA guarded too
    ["optim=adamw2", "optim.overlap_sigma_w=true", "optim.warm_start=true"],  # found_inf with sigma1(W) ahead
    ["optim=adamw2", "optim.warm_start=false"],
    ["optim=sgd", "grad_clip=1.0"],
    ["optim=lars"],
])
def test_nan_step_leaves_weights_and_state_untouched(tmp_path, extra):
    """A NaN in the last step's loss: the weights and optimizer state equal those after the step
    before it (bit-exact), as if that update was never applied."""
    args = [*GPT, *extra, "steps=4"]
    s = train(tmp_path / "nan", *args, "debug.nan_at_step=4")
    assert s["status"] == "completed"
    train(tmp_path / "ref", *args, "ckpt_every=1", "ckpt.keep=4")
    a = _load(tmp_path / "nan/checkpoints/last.pt")
    b = _load(tmp_path / "ref/checkpoints/step_000003.pt")
    _assert_equal(a["model"], b["model"], "model")
    _assert_equal(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer")
    if a["ema"] is not None:  # its sigmaReparam vectors are fitted at the final evaluation: the weights only
        keep = [k for k in a["ema"]["module"] if not k.endswith((".u", ".v"))]
        _assert_equal({k: a["ema"]["module"][k] for k in keep}, {k: b["ema"]["module"][k] for k in keep}, "ema")
    skipped = {r["step"]: r["train/skipped_steps"] for r in _records(tmp_path / "nan") if "loss" in r}
    assert skipped == {1: 0, 2: 0, 3: 0, 4: 1}


def test_nan_in_the_middle_is_skipped_and_the_run_goes_on(tmp_path):
    s = train(tmp_path, *GPT, "steps=6", "debug.nan_at_step=2", "logger.log_every=3")
    assert s["status"] == "completed" and s["step"] == 6
    recs = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["train/skipped_steps"] for r in recs] == [1, 0]
    assert all(isinstance(r["loss"], float) for r in recs)  # the mean of the healthy steps
    # the step itself, in a record of its own, for the figures' grey line: not the interval's log step 3
    assert [r["step"] for r in _records(tmp_path) if "train/skipped_step" in r] == [2]


def test_persistent_nan_stops_without_rollback(tmp_path):
    s = train(tmp_path, *GPT, "steps=6", "debug.nan_at_step=3", "divergence.max_skips=1")
    assert s["status"] == "diverged" and s["diverged_at"] == 3 and "non-finite" in s["reason"]
    s = train(tmp_path / "off", *GPT, "steps=6", "debug.nan_at_step=3", "divergence.skip_nonfinite=false")
    assert s["status"] == "diverged" and s["diverged_at"] == 3


def test_a_divergence_seen_at_the_end_of_a_logging_interval_says_why_it_stopped_later(tmp_path, capsys):
    """Losses are read once per interval: the run went on to the interval's end (step 6) after
    its step-3 divergence, and said only 'diverged at step 3 (stopped at step 6)'."""
    s = train(tmp_path, *GPT, "steps=8", "debug.nan_at_step=3", "divergence.max_skips=1", "logger.log_every=6",
              quiet=False)
    assert (s["status"], s["diverged_at"], s["step"]) == ("diverged", 3, 6)
    assert "diverged at step 3 (stopped at step 6, where the logging interval that saw it ended): " \
        in capsys.readouterr().err


def _skipping(data, at: int, skip: int):
    """``data.train_iter`` that jumps ``skip`` positions at step ``at``, as a rollback does."""
    orig = data.train_iter

    def train_iter(start, shard):
        for s in itertools.count(start):
            yield next(orig(s + (skip if s >= at else 0), shard))

    return train_iter


def test_rollback_equals_a_run_that_skipped_the_data(tmp_path):
    """NaN at step 6 (max_skips=1): the ring's step 4 is restored, the data of steps 5-6 is
    skipped, and the run goes on exactly as a fresh run that skipped that data."""
    s = train(tmp_path / "rb", *GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=6")
    assert s["status"] == "completed" and s["step"] == 12
    assert s["rollbacks"] == [{"trigger_step": 6, "detected_step": 6, "restored_step": 4, "skipped_steps": 2,
                               "reason": s["rollbacks"][0]["reason"]}]
    recs = _records(tmp_path / "rb")
    rb = [r for r in recs if "rollback/restored_step" in r]
    assert len(rb) == 1 and rb[0]["step"] == 4 and rb[0]["rollback/skipped_steps"] == 2
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == list(range(1, 13))  # one consistent history: the records of steps 5-6 were dropped
    assert _load(tmp_path / "rb/checkpoints/last.pt")["survival"]["data_offset"] == 2

    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=12"), tmp_path / "ref")
    t.data.train_iter = _skipping(t.data, 4, 2)
    t.fit()
    assert losses(tmp_path / "rb") == losses(tmp_path / "ref")


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_resume_after_a_rollback_continues_exactly(tmp_path, scale):
    """With lr_scale_on_rollback=0.5 the resumed run keeps the scale: its lr and losses are the
    uninterrupted run's."""
    args = [*GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=6", f"divergence.lr_scale_on_rollback={scale}"]
    train(tmp_path / "full", *args)
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *args), tmp_path / "half")
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if t.rollbacks and t.step + 1 == 9:
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step
    assert t.fit()["status"] == "interrupted"
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    assert losses(tmp_path / "half") == losses(tmp_path / "full")
    assert _logged(tmp_path / "half", "lr") == _logged(tmp_path / "full", "lr")


def test_a_divergence_found_by_a_stop_signal_is_rolled_back_too(tmp_path):
    """A stop signal logs the steps since the last log line; a divergence among them is survived
    as at a log step (rolled back, saved), and the run ends interrupted, so that a requeued job
    continues it as if nothing had stopped it."""
    args = [*GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=6", "logger.log_every=4"]
    train(tmp_path / "full", *args)
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *args), tmp_path / "half")
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if not t.rollbacks and t.step + 1 == 7:  # after step 7: its interval holds the NaN of step 6
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step
    s = t.fit()
    assert s["status"] == "interrupted" and s["step"] == 4 and len(s["rollbacks"]) == 1, s
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_skipped_steps_are_named_on_the_progress_line_and_counted_in_the_summary(tmp_path, capsys):
    s = train(tmp_path, *GPT, "steps=6", "debug.nan_at_step=3", "logger.log_every=2", "logger=none", "monitor=off",
              quiet=False)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert ["skipped 1 non-finite step(s) (step 3)" in ln for ln in lines] == [False, True, False]  # steps 2, 4, 6
    assert s["skipped_steps"] == 1 and "| 1 non-finite step(s) skipped" in err.splitlines()[-1]


def test_max_rollbacks_reached_is_diverged(tmp_path):
    s = train(tmp_path, *GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=6", "divergence.max_rollbacks=0")
    assert s["status"] == "diverged" and "max_rollbacks=0 reached" in s["reason"] and s["rollbacks"] == []


def test_lr_scale_compounds_and_is_saved(tmp_path):
    s = train(tmp_path, *GPT, *ROLLBACK, "steps=8", "debug.nan_at_step=6", "divergence.lr_scale_on_rollback=0.5")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    assert _load(tmp_path / "checkpoints/last.pt")["survival"]["lr_scale"] == 0.5


def test_ring_keeps_the_last_k(tmp_path):
    train(tmp_path, *GPT, "steps=10", "ckpt_every=2", "ckpt.keep=2")
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")) == \
        ["step_000008.pt", "step_000010.pt"]


@pytest.mark.parametrize("override, message", [
    (["divergence.action=rollback", "ckpt.keep=0"], "set ckpt.keep >= 1"),
    (["divergence.skip_window=0"], "skip_window=0 must be >= 1"),
    (["divergence.max_rollbacks=-1"], "max_rollbacks=-1 must be >= 0"),
    (["divergence.lr_scale_on_rollback=1.5"], "must be in (0, 1]"),
    (["divergence.lr_scale_on_rollback=0"], "must be in (0, 1]"),
    (["divergence.action=retry"], "use stop or rollback"),
    (["monitor.rollback_on_alert=true"], "needs divergence.action=rollback"),
])
def test_bad_combinations_are_one_line_errors(override, message):
    from stabletrain.build import validate
    from stabletrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(make_cfg(*GPT, "steps=4", *override))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, copies_weights", [
    (["optim=adamw2"], False),  # found_inf: nothing of the optimizer copied
    (["optim=adamw"], False),  # torch's fused AdamW
    (["optim=adamw", "optim.fused=false"], True),
    (["optim=lars"], True),
])
def test_guard_copies_only_what_cannot_skip(tmp_path, extra, copies_weights):
    """With AdamW² (and fused AdamW) the guard's snapshots are sigmaReparam's u, v alone: no
    copy of the weights, the optimizer state or the EMA, whose update is itself conditional."""
    from stabletrain.build import build_trainer
    from stabletrain.layers.reparam import SigmaPart

    t = build_trainer(make_cfg(*QUIET, *GPT, *extra, "reparam=sigma", "ema.decay=0.9", "steps=2"), tmp_path)
    t.fit()
    guard = t.guard
    sigma_bufs = [b for m in t.model.modules() if isinstance(m, SigmaPart) for b in m.buffers(recurse=False)]
    assert sigma_bufs and guard.buffers == sigma_bufs
    snap_bytes = sum(s.numel() * s.element_size() for s in guard.snapshots)
    buf_bytes = sum(b.numel() * b.element_size() for b in sigma_bufs)
    if copies_weights:
        assert snap_bytes > sum(p.numel() * p.element_size() for p in t.model.parameters())
    else:
        assert guard.found_inf and guard.ema_skips
        assert [s.shape for s in guard.snapshots] == [b.shape for b in sigma_bufs] and snap_bytes == buf_bytes


def _ema_pair(decay=0.9, every=1, warmup=False):
    from stabletrain.engine.ema import WeightEma
    from stabletrain.layers.reparam import SigmaPart

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    model[0].part = SigmaPart(5, 6)  # buffers u, v, as sigmaReparam holds them
    ema = WeightEma(model, decay, every, warmup)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model[0].part.u.copy_(torch.randn(5))
    return model, ema


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_update_with_found_inf_zero_equals_timm(warmup):
    model, ema = _ema_pair(warmup=warmup)
    _, ref = _ema_pair(warmup=warmup)
    for step in range(4):
        ema.found_inf = torch.tensor(0.0)
        ema.after_step(model, step)
        ema.found_inf = None
        ref.after_step(model, step)
    _assert_equal(ema.module.state_dict(), ref.module.state_dict(), "ema")


def test_ema_update_with_found_inf_leaves_the_average_bit_exact():
    """A skipped step lerps with weight 0 (torch's foreach lerp returns the start exactly) and
    keeps the buffers: the average equals what it was, with no copy taken."""
    model, ema = _ema_pair()
    ema.after_step(model, 0)
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e30)  # far from the average: any nonzero weight would show
        model[0].part.u.copy_(torch.randn(5))
    ema.found_inf = torch.tensor(1.0)
    ema.after_step(model, 1)
    ema.found_inf = None
    _assert_equal(ema.module.state_dict(), before, "ema")
    assert ema.skips_exactly


def test_a_sustained_spike_rolls_back_past_its_first_step(tmp_path):
    """debug.spike_at_step=6 multiplies step 6's loss by 1e4; with a one-step spike window the
    divergence watch calls it at once, and the ring's step 4 is restored, skipping 5-6."""
    s = train(tmp_path, *GPT, *ROLLBACK, "steps=10", "debug.spike_at_step=6", "divergence.window=1",
              "divergence.warmup_steps=2")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    rb = s["rollbacks"][0]
    assert (rb["trigger_step"], rb["restored_step"], rb["skipped_steps"]) == (6, 4, 2)
    assert "stayed above" in rb["reason"]


def test_an_entropy_collapse_alert_rolls_back_when_asked(tmp_path):
    """monitor.rollback_on_alert: the monitor's stop request (here raised by hand at step 7, as
    the alert does) restores the newest ring checkpoint instead of ending the run."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=12", "monitor=standard", "monitor.stop_on_alert=true",
                               "monitor.rollback_on_alert=true"), tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 7 and not t.rollbacks:
            t.monitor.stop_reason = "entropy collapse at blocks.0 (step 7)"

    t.monitor.after_step = after_step
    s = t.fit()
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    assert s["rollbacks"][0]["restored_step"] == 4 and "entropy collapse" in s["rollbacks"][0]["reason"]


def _stop_after(t, n, when=lambda: True):
    """Have trainer ``t`` receive SIGTERM during step ``n`` (1-based) when ``when()``."""
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if t.step + 1 == n and when():
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step


def test_a_signal_on_a_checkpoint_step_adds_that_checkpoint_to_the_ring(tmp_path):
    """Interrupted at step 8 (a ring step), resumed, and rolled back at step 10: the resumed run
    restores step 8, as the uninterrupted one does, not the older step 4."""
    args = [*GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=10"]
    full = train(tmp_path / "full", *args)
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *args), tmp_path / "half")
    _stop_after(t, 8)
    assert t.fit()["status"] == "interrupted"
    assert (tmp_path / "half/checkpoints/step_000008.pt").is_file()
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["rollbacks"][0]["restored_step"] == full["rollbacks"][0]["restored_step"] == 8
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_a_refused_checkpoint_is_rolled_back_when_asked(tmp_path):
    """Non-finite optimizer state with a finite loss (a 3e37 spike overflows Adam's second
    moment; skipping off): the save is refused, and divergence.action=rollback restores the
    newest ring checkpoint instead of ending the run."""
    args = [*GPT, "ckpt_every=4", "steps=12", "optim=adamw", "divergence.skip_nonfinite=false",
            "debug.spike_at_step=6", "debug.spike_factor=3e37"]
    stop = train(tmp_path / "stop", *args)
    assert stop["status"] == "diverged" and "non-finite weights or optimizer state" in stop["reason"]
    s = train(tmp_path / "rb", *args, "divergence.action=rollback")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    rb = s["rollbacks"][0]
    assert (rb["detected_step"], rb["restored_step"]) == (8, 4) and "non-finite" in rb["reason"]
    assert rb["skipped_steps"] == 4  # the steps after the restored checkpoint, the spike among them


def test_checkpoints_written_during_a_spike_stay_out_of_the_ring(tmp_path):
    """A sustained spike is confirmed only after divergence.window steps above the mean; the
    ring must still hold a checkpoint from before it then, however short ckpt_every is."""
    from stabletrain.build import build_trainer

    args = [*GPT, "divergence.action=rollback", "steps=24", "ckpt_every=2", "ckpt.keep=2",
            "divergence.window=6", "divergence.warmup_steps=2"]
    t = build_trainer(make_cfg(*QUIET, *args), tmp_path)
    t._fault_due = lambda: (t.step + t.data_offset + 1) if 9 <= t.step + t.data_offset + 1 <= 14 else None
    t._inject = lambda loss, done: loss * 1e3
    s = t.fit()
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1
    rb = s["rollbacks"][0]
    assert rb["trigger_step"] == 9 and rb["restored_step"] == 8, rb


def test_a_resume_from_an_earlier_checkpoint_abandons_the_history_after_it(tmp_path, capsys):
    """resume=<step_000004.pt> after a run reached step 12: the ring's later checkpoints are
    dropped and last.pt holds step 4, so neither a rollback nor resume=auto returns to them;
    the run says so (it said only 'resumed from step 4')."""
    args = [*GPT, "steps=12", "ckpt_every=4", "optim=adamw"]
    train(tmp_path, *args)
    ck = tmp_path / "checkpoints"
    capsys.readouterr()
    # its dry run says so first (it said only "would continue from step 4"), and removes nothing
    assert train(tmp_path, *args, "steps=6", f"resume={ck / 'step_000004.pt'}", "dry_run=true",
                 quiet=False)["status"] == "dry_run"
    out = capsys.readouterr()
    assert ("resume=step_000004.pt would go back to step 4: this run's history after it (to step 12 at least) would "
            "be abandoned, its records dropped and its 2 later checkpoint(s) removed") in out.out + out.err
    assert sorted(p.name for p in ck.glob("step_*.pt")) == ["step_000004.pt", "step_000008.pt", "step_000012.pt"]
    s = train(tmp_path, *args, "steps=6", f"resume={ck / 'step_000004.pt'}", quiet=False)
    assert s["status"] == "completed"
    assert ("resume=step_000004.pt goes back to step 4: this run's history after it (to step 12 at least) is "
            "abandoned, its records dropped and its 2 later checkpoint(s) removed") in capsys.readouterr().err
    assert sorted(p.name for p in ck.glob("step_*.pt")) == ["step_000004.pt", "step_000006.pt"]  # 8, 12 gone
    assert _load(ck / "last.pt")["step"] == 6
    assert max(r["step"] for r in _records(tmp_path)) == 6


def test_a_resume_from_another_runs_checkpoint_sets_the_directorys_run_aside(tmp_path):
    """resume=<run X's last.pt> into a directory that holds run A: A's checkpoints, records and
    summary move aside, so a rollback restores X's resumed state (not A's ring) and the records
    are X's history up to its checkpoint, then this run's."""
    d, x = tmp_path / "d", tmp_path / "x"
    train(d, *GPT, "steps=12", "ckpt_every=4", "seed=1")  # run A
    train(x, *GPT, "steps=10", "ckpt_every=5")
    s = train(d, *GPT, *ROLLBACK, "steps=16", f"resume={x / 'checkpoints/last.pt'}", "debug.nan_at_step=11")
    assert s["status"] == "completed" and s["rollbacks"][0]["restored_step"] == 10
    assert (d / "checkpoints.previous/step_000012.pt").is_file()  # A's, kept
    assert (d / "metrics.previous.jsonl").is_file() and (d / "summary.previous.json").is_file()
    x_history = [r for r in _records(x) if r["step"] <= 10]
    assert _records(d)[:len(x_history)] == x_history
    own = _records(d)[len(x_history):]  # the resume's and the rollback's records are dated at the step they restored
    resume_only = ({"run/resumed_at"}, {"run/resumed_at", "run/changed"})
    assert all(r["step"] > 10 or set(r) - {"step"} in resume_only or "rollback/restored_step" in r for r in own)
    resumed = _load(x / "checkpoints/last.pt")["model"]
    _assert_equal(_load(d / "checkpoints/step_000010.pt")["model"], resumed)


def test_a_finished_run_resumed_into_another_runs_directory_reports_its_own_results(tmp_path):
    d, x = tmp_path / "d", tmp_path / "x"
    train(d, *GPT, "steps=12", "seed=1")
    want = train(x, *GPT, "steps=12")
    got = train(d, *GPT, "steps=12", f"resume={x / 'checkpoints/last.pt'}")
    assert got["status"] == "completed"
    assert got["final"] == pytest.approx(want["final"], rel=1e-6)  # not run A's summary


def test_the_resumed_state_enters_the_ring(tmp_path):
    """resume=PATH into a new directory: a divergence two steps later rolls back to it."""
    train(tmp_path / "x", *GPT, "steps=10", "ckpt_every=5")
    s = train(tmp_path / "y", *GPT, *ROLLBACK, "steps=20", f"resume={tmp_path / 'x/checkpoints/last.pt'}",
              "debug.nan_at_step=12")
    assert s["status"] == "completed" and s["rollbacks"][0]["restored_step"] == 10


TAIL = [*GPT, "steps=40", "ckpt_every=10", "logger.log_every=10", "optim=sgd", "debug.spike_at_step=37",
        "debug.spike_factor=1e10"]


def test_a_run_that_ends_inside_a_spike_diverged_and_keeps_the_last_healthy_checkpoint(tmp_path):
    """A blow-up at step 37 of 40 (huge but finite weights, then three non-finite steps skipped):
    the run did not live to confirm it, but its end is no state to save as the final one."""
    s = train(tmp_path, *TAIL)
    assert s["status"] == "diverged" and s["diverged_at"] == 37 and "ended inside a loss spike" in s["reason"]
    assert s["skipped_steps"] == 3
    last = _load(tmp_path / "checkpoints/last.pt")
    assert last["step"] == 30 and max(v.abs().max().item() for v in last["model"].values()) < 10


def test_a_run_that_ends_inside_a_spike_is_rolled_back_when_asked(tmp_path):
    s = train(tmp_path, *TAIL, "divergence.action=rollback")
    assert s["status"] == "completed" and s["step"] == 40
    rb = s["rollbacks"]
    assert len(rb) == 1 and (rb[0]["trigger_step"], rb[0]["restored_step"]) == (37, 30)
    last = _load(tmp_path / "checkpoints/last.pt")
    assert last["step"] == 40 and max(v.abs().max().item() for v in last["model"].values()) < 10


def test_a_lone_skipped_last_step_completes_the_run(tmp_path):
    """A non-finite last step without a spike before it leaves the weights of the step before,
    a healthy state: the run completes and saves it."""
    s = train(tmp_path, *GPT, "steps=12", "ckpt_every=4", "debug.nan_at_step=12")
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    assert _load(tmp_path / "checkpoints/last.pt")["step"] == 12


def test_a_kill_during_a_rollback_resumes_the_run_it_would_have_been(tmp_path):
    """Killed inside the rollback, once the restored state is saved but before the later ring
    and records are dropped: last.pt already holds the restored step with the rollback, and
    resume=auto drops what the kill left and continues exactly as the run that was not killed."""
    from stabletrain.build import build_trainer
    from stabletrain.engine.checkpoint import ring_path

    args = [*GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=10", "ckpt.keep=3"]
    train(tmp_path / "full", *args)
    t = build_trainer(make_cfg(*QUIET, *args), tmp_path / "killed")

    def killed(step):
        raise SystemExit("killed")

    t.ckpt.drop_after = killed
    with pytest.raises(SystemExit):
        t.fit()
    ck = _load(tmp_path / "killed/checkpoints/last.pt")
    assert ck["step"] == 8 and len(ck["survival"]["rollbacks"]) == 1
    later = ring_path(tmp_path / "killed", 10)  # as a ring checkpoint of the abandoned steps would be
    shutil.copyfile(tmp_path / "killed/checkpoints/last.pt", later)
    s = train(tmp_path / "killed", *args, "resume=auto")
    assert s["status"] == "completed" and len(s["rollbacks"]) == 1 and not later.exists()
    assert losses(tmp_path / "killed") == losses(tmp_path / "full")


def test_a_second_rollback_to_the_same_checkpoint_reaches_further_back(tmp_path):
    """An alert at step 10 twice: the first rollback restores the ring's step 8; the trouble
    comes back from it, so the second restores step 4, which comes before it. Both alerts stay in
    the summary (a restore does not take the record back)."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=16", "ckpt.keep=3", "monitor=standard",
                               "monitor.stop_on_alert=true", "monitor.rollback_on_alert=true",
                               "divergence.max_rollbacks=3"), tmp_path)
    real, raised = t.monitor.after_step, []

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 10 and len(raised) < 2:
            raised.append(step + 1)
            t.monitor.alerts.append({"step": 10, "layer": "blocks.0", "value": 0.01, "message": f"alert {len(raised)}"})
            t.monitor.stop_reason = "entropy collapse at blocks.0 (step 10)"

    t.monitor.after_step = after_step
    s = t.fit()
    assert s["status"] == "completed" and [r["restored_step"] for r in s["rollbacks"]] == [8, 4]
    assert [a["message"] for a in s["alerts"]] == ["alert 1", "alert 2"]
    # each fired in a history its rollback abandoned: marked so, and left off the figures' curves
    assert [a.get("rolled_back") for a in s["alerts"]] == [True, True]
    from stabletrain.analysis.plots import load_run

    assert load_run(tmp_path).alerts == []


def test_an_alert_before_the_restored_step_stays_on_the_kept_history(tmp_path, capsys):
    """An alert at step 2, then a rollback from step 10 to step 8: the step-2 alert is on the curve
    the run goes on from, so it is not marked abandoned, and the figures and final line keep it."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=12", "ckpt.keep=3", "monitor=standard",
                               "monitor.stop_on_alert=true", "monitor.rollback_on_alert=true"), tmp_path)
    real, raised = t.monitor.after_step, []

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 2 and not raised:
            raised.append(2)
            t.monitor.alerts.append({"step": 2, "layer": "blocks.1", "value": 0.5, "message": "early"})
        if step + 1 == 10 and len(raised) == 1:
            raised.append(10)
            t.monitor.alerts.append({"step": 10, "layer": "blocks.0", "value": 0.01, "message": "late"})
            t.monitor.stop_reason = "entropy collapse at blocks.0 (step 10)"

    t.monitor.after_step = after_step
    s = t.fit()
    assert s["status"] == "completed" and [r["restored_step"] for r in s["rollbacks"]] == [8]
    assert [(a["message"], a.get("rolled_back", False)) for a in s["alerts"]] == [("early", False), ("late", True)]
    from stabletrain.analysis.plots import load_run

    assert [a["step"] for a in load_run(tmp_path).alerts] == [2]


def test_the_last_line_names_the_health_alerts(tmp_path, capsys):
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*GPT, "steps=6", "monitor=standard", "logger=none"), tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 3:
            t.monitor.alerts.append({"step": 3, "layer": "blocks.1", "value": 0.01, "message": "m"})

    t.monitor.after_step = after_step
    assert t.fit()["status"] == "completed"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("completed at step 6 | 1 health alert(s), the first at blocks.1 step 3 |"), last
    # alerts of a history a rollback abandoned are counted apart: their steps may lie past the end
    t.monitor.alerts = [{"step": 9, "layer": "blocks.0", "rolled_back": True}, {"step": 3, "layer": "blocks.1"}]
    t._finish("completed", None, {})
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("completed at step 6 | 2 health alert(s), the first at blocks.1 step 3 and 1 in the "
                           "histories rollbacks abandoned"), last


@pytest.mark.parametrize("ckpt_every,noted", [(200, True), (50, False)])
def test_rolling_back_alerts_with_sparse_checkpoints_is_noted(tmp_path, ckpt_every, noted):
    """An alert fires at a probe; with checkpoints rarer than probes a rollback restores a state
    long before it (step 0 in a short run): said at the start, with the setting that avoids it."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=4", "monitor=standard", "monitor.stop_on_alert=true",
                               "monitor.rollback_on_alert=true", "monitor.probe_every=50", f"ckpt_every={ckpt_every}"),
                      tmp_path)
    want = ("note: monitor.rollback_on_alert with ckpt_every=200 > monitor.probe_every=50: a rollback may restore a "
            "state long before the alert, or step 0; set ckpt_every=50 or less")
    assert (want in t.notes) == noted

def _logged(run_dir, key) -> dict:
    """step -> the value of ``key`` in each record of the run's metrics.jsonl that has it."""
    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if key in r}



def test_rollback_scales_the_lr_the_steps_run_at(tmp_path):
    """lr_scale_on_rollback must change the lr used after the rollback, not only the saved number."""
    s = train(tmp_path / "rb", *GPT, *ROLLBACK, "steps=8", "debug.nan_at_step=6",
              "divergence.lr_scale_on_rollback=0.5")
    assert len(s["rollbacks"]) == 1 and s["rollbacks"][0]["restored_step"] == 4
    train(tmp_path / "ref", *GPT, "steps=8")
    rb, ref = _logged(tmp_path / "rb", "lr"), _logged(tmp_path / "ref", "lr")
    for k in range(1, 5):
        assert rb[k] == pytest.approx(ref[k]), k
    for k in range(5, 9):
        assert rb[k] == pytest.approx(0.5 * ref[k]), k


def test_lr_scale_compounds_over_two_rollbacks(tmp_path):
    """Two rollbacks at 0.5 each: lr_scale 0.25 (the existing test has only one rollback)."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, *ROLLBACK, "steps=14", "debug.nan_at_step=6",
                               "divergence.lr_scale_on_rollback=0.5"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        if len(t.rollbacks) == 1 and t.settings.nan_at_step == 6:
            t.settings.nan_at_step = 12  # a second bad batch, further on
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert s["status"] == "completed" and len(s["rollbacks"]) == 2
    survival = _load(tmp_path / "checkpoints/last.pt")["survival"]
    assert survival["lr_scale"] == pytest.approx(0.25)
    # rollback 1: trigger 6, restored 4, offset 2; rollback 2: trigger 10, restored 8 (saved with offset 2) -> 2 + 2
    assert [(r["trigger_step"], r["restored_step"]) for r in s["rollbacks"]] == [(6, 4), (10, 8)]
    assert survival["data_offset"] == 4
    lr = _logged(tmp_path, "lr")
    ref_dir = tmp_path.parent / (tmp_path.name + "_ref")
    train(ref_dir, *GPT, "steps=14")
    ref = _logged(ref_dir, "lr")
    assert lr[14] == pytest.approx(0.25 * ref[14])


def test_rollback_skips_at_least_skip_window_steps_of_data(tmp_path):
    """divergence.skip_window=5 with a trigger 2 steps after the restored checkpoint: 5 skipped."""
    s = train(tmp_path, *GPT, *ROLLBACK, "steps=12", "debug.nan_at_step=6", "divergence.skip_window=5")
    assert s["status"] == "completed"
    assert s["rollbacks"][0]["restored_step"] == 4 and s["rollbacks"][0]["skipped_steps"] == 5
    assert _load(tmp_path / "checkpoints/last.pt")["survival"]["data_offset"] == 5


def test_resume_restores_the_divergence_watch(tmp_path):
    """The divergence watch's running mean is resumed, not restarted: a resumed run's last.pt
    holds the same watch state as the uninterrupted run's."""
    from stabletrain.build import build_trainer
    from tests.engine.test_loop import _run_until

    args = [*GPT, "steps=8", "ckpt_every=4"]
    train(tmp_path / "full", *args)
    _run_until(build_trainer(make_cfg(*QUIET, *args), tmp_path / "half"), 4)
    train(tmp_path / "half", *args, "resume=auto")
    a, b = _load(tmp_path / "full/checkpoints/last.pt"), _load(tmp_path / "half/checkpoints/last.pt")
    assert a["divergence"]["seen"] == b["divergence"]["seen"] == 8
    assert b["divergence"]["ema"] == pytest.approx(a["divergence"]["ema"], rel=1e-6)


def test_loss_terms_are_logged_once_per_step_under_accumulation(tmp_path):
    """The logged penalty (loss/penalty) must not grow with the number of micro-batches."""
    extra = ["optim=sgd", "regularizer=locater"]
    train(tmp_path / "a", *GPT, "steps=3", *extra)
    train(tmp_path / "b", *GPT, "steps=3", "micro_batch_size=2", *extra)
    a, b = _logged(tmp_path / "a", "loss/penalty"), _logged(tmp_path / "b", "loss/penalty")
    assert a and a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), k


def test_the_hint_after_a_spike_names_the_spikes_first_step_where_a_rollback_goes(tmp_path, capsys):
    """A spike from step 22, confirmed at 29: a rollback restores a checkpoint from before 22, which
    the hint names (it said "before step 29")."""
    s = train(tmp_path, "model=vit_test", "optim=sgd", "ckpt_every=2", "ckpt.keep=20", "eval_every=100",
              "logger.log_every=1", "divergence.warmup_steps=5", "divergence.window=8", "debug.spike_at_step=22",
              "steps=40", quiet=False)
    assert (s["status"], s["diverged_at"]) == ("diverged", 29) and "from step 22 to step 29" in s["reason"]
    assert "divergence.action=rollback (back to a checkpoint before step 22, " in capsys.readouterr().err


def test_a_run_ended_by_a_refused_save_says_how_to_go_past_it(tmp_path, capsys):
    """Adam's moments overflow under a finite loss (a 3e37 spike at step 9): the save at step 12 is
    refused and the run diverges there; its last line names the rollback that goes past it, back to
    a checkpoint before step 12 (it named none: the trouble had no trigger step)."""
    s = train(tmp_path, *GPT, "optim=adamw", "steps=12", "ckpt_every=4", "divergence.skip_nonfinite=false",
              "debug.spike_at_step=9", "debug.spike_factor=3e37", quiet=False)
    assert s["status"] == "diverged" and "non-finite weights or optimizer state at step 12" in s["reason"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("to go past it: ") and "divergence.action=rollback (back to a checkpoint before step 12" \
        in last, last


def test_the_start_note_of_an_injected_spike_says_what_the_watch_makes_of_it():
    """debug.spike_at_step's note follows the divergence settings: a one-step window makes the spike a
    divergence, the warmup names it without counting it, the first step has nothing to compare with,
    and with the watch off nothing watches it."""
    from stabletrain.build import spike_note

    def note(*o):
        return spike_note(make_cfg("model=gpt_test", *o)).split("; ", 1)[1]

    assert note("debug.spike_at_step=30").startswith("a spike of one step is watched, not acted on (a divergence is "
                                                     "20 steps in a row above 4x the running mean")
    assert note("debug.spike_at_step=30", "divergence.window=1") == \
        "a spike of one step is a divergence (divergence.window=1): the run stops"
    assert note("debug.spike_at_step=30", "divergence.window=1", "divergence.action=rollback").endswith("rolls back")
    assert note("debug.spike_at_step=20") == ("in the first divergence.warmup_steps=20 steps a spike is named on the "
                                              "progress line, not counted")
    assert note("debug.spike_at_step=21").startswith("a spike of one step is watched")
    assert note("debug.spike_at_step=1").startswith("the first loss has none before it")
    assert note("debug.spike_at_step=30", "divergence.enabled=false") == \
        "no loss spike is watched (divergence.enabled=false)"


def test_a_diverged_run_says_how_to_go_past_it_and_resumes_with_rollback(tmp_path, capsys):
    """resume=auto refused divergence.action=rollback (and dropping the injected fault) as a change
    of the run, and the command the refusal offered diverged again at the same step."""
    args = [*GPT, "steps=12", "debug.nan_at_step=7", "divergence.max_skips=1", "ckpt_every=4"]
    assert train(tmp_path, *args, quiet=False)["status"] == "diverged"
    err = capsys.readouterr().err
    assert "resume=auto" in err and err.strip().splitlines()[-1].startswith("to go past it: ")
    assert (" divergence.action=rollback (back to a checkpoint before step 7, skipping the data from there; "
            "divergence.lr_scale_on_rollback=0.5 also halves the lr)") in err
    s = train(tmp_path, *args, "resume=auto", "divergence.action=rollback", "divergence.lr_scale_on_rollback=0.5",
              quiet=False)
    assert s["status"] == "completed" and s["lr_scale"] == 0.5
    assert [(r["trigger_step"], r["restored_step"]) for r in s["rollbacks"]] == [(7, 4)]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "| 1 rollback(s), the last from step 7 to 4, lr x0.5 from then on |" in last, last
    s = train(tmp_path / "dropped", *args)
    assert train(tmp_path / "dropped", *args[:-3], "ckpt_every=4", "resume=auto")["status"] == "completed"


def test_an_alert_that_stops_a_run_at_its_last_step_leaves_it_completed(tmp_path):
    """monitor.stop_on_alert with the alert at the last probe, the last step: the run had trained
    every step and was filed as diverged, beside NaN crashes."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=6", "monitor=standard", "monitor.stop_on_alert=true"), tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 in (3, 6):
            t.monitor.alerts.append({"step": step + 1, "layer": "blocks.0", "value": 0.01, "message": "m"})
            t.monitor.stop_reason = f"entropy collapse at blocks.0 (step {step + 1})"

    t.monitor.after_step = after_step
    s = t.fit()
    assert s["status"] == "diverged" and s["step"] == 3  # early: a stop
    t = build_trainer(make_cfg(*QUIET, *GPT, "steps=6", "monitor=standard", "monitor.stop_on_alert=true"),
                      tmp_path / "late")
    real_late = t.monitor.after_step

    def after_last(step, last=False):
        real_late(step, last)
        if last:
            t.monitor.alerts.append({"step": step + 1, "layer": "blocks.0", "value": 0.01, "message": "m"})
            t.monitor.stop_reason = f"entropy collapse at blocks.0 (step {step + 1})"

    t.monitor.after_step = after_last
    s = t.fit()
    assert s["status"] == "completed" and s["step"] == 6 and len(s["alerts"]) == 1


def test_a_passed_loss_spike_is_on_record(tmp_path, capsys):
    """A one-step spike is watched, not acted on, but its update was applied: the run ended worse
    than its twin and neither the last line nor summary.json said a spike had been."""
    s = train(tmp_path, *GPT, "steps=30", "debug.spike_at_step=25", quiet=False)
    assert s["status"] == "completed" and s["spikes"] == [{"step": 25, "steps": 1}]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "| 1 loss spike(s) passed, the last at step 25 (1 step(s)) |" in last, last
    assert "spikes" not in train(tmp_path / "calm", *GPT, "steps=30")


def test_a_spike_in_the_divergence_warmup_stays_out_of_the_ring(tmp_path, capsys):
    """A spike before divergence.warmup_steps is not counted (the running mean is young), but the
    README promises no ring checkpoint while the loss is above spike_factor x its running mean:
    a rollback must not land on the spiked state. The progress line says it was seen."""
    from stabletrain.engine.checkpoint import ring_checkpoints

    s = train(tmp_path, *GPT, "divergence.action=rollback", "steps=8", "ckpt_every=4", "ckpt.keep=3",
              "debug.spike_at_step=4", quiet=False)
    assert s["status"] == "completed"
    assert [step for step, _ in ring_checkpoints(tmp_path)] == [0, 8]
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.lstrip().startswith("step 4/") or "step 4/8" in x)
    assert "| spike at step 4, above 4x the running mean " in line, line
    assert "; not counted in the first divergence.warmup_steps=20 steps |" in line, line
    # its update was applied, as a counted spike's: summary.json and the last line keep it
    assert s["spikes"] == [{"step": 4, "steps": 1, "warmup": True}], s
    assert ("| 1 loss spike(s) passed (1 in the divergence warmup, not counted), the last at step 4 (1 step(s))"
            in err.strip().splitlines()[-1]), err


def test_a_spike_that_begins_in_the_warmups_last_step_and_goes_on_is_one_counted_spike(tmp_path, capsys):
    """Steps 1-2 set the running mean, step 3 is the warmup's last (not counted) and spikes, and
    steps 4-5 spike on, counted: one spike of three steps from step 3 on record, not two."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*GPT, "steps=8", "divergence.warmup_steps=3", "divergence.window=5"), tmp_path)
    t._fault_due = lambda: (t.step + 1) if 3 <= t.step + 1 <= 5 else None
    t._inject = lambda loss, done: loss * 1e3
    s = t.fit()
    assert s["status"] == "completed" and s["spikes"] == [{"step": 3, "steps": 3}], s
    err = capsys.readouterr().err.strip().splitlines()
    assert "| 1 loss spike(s) passed, the last at step 3 (3 step(s)) |" in err[-1], err[-1]
    # the progress lines say it as the record does: from step 3, counted from step 4
    lines = {int(m.group(1)): x for x in err if (m := re.search(r"step (\d+)/8 \|", x))}
    assert "| spike at step 3, above" in lines[3] and "not counted in the first divergence.warmup_steps=3" in lines[3]
    assert "| spike since step 3, the loss above" in lines[4] and "(1 of 5 steps to a divergence)" in lines[4]
    assert "| spike of step 3 passed after 3 step(s) |" in lines[6], lines[6]


def test_the_steps_skipped_after_a_warmup_spike_do_not_repeat_it_on_their_lines(tmp_path, capsys):
    """A NaN step after a warm-up spike leaves the watch's verdict on the spike as it was: its
    line names the skipped step, not a spike "at step 5"."""
    train(tmp_path, *GPT, "steps=6", "debug.spike_at_step=4", "debug.nan_at_step=5", quiet=False)
    lines = {int(m.group(1)): x for x in capsys.readouterr().err.splitlines()
             if (m := re.search(r"step (\d+)/6 \|", x))}
    assert "| spike at step 4, above 4x" in lines[4], lines[4]
    assert "skipped 1 non-finite step(s) (step 5)" in lines[5] and "spike" not in lines[5], lines[5]


def test_a_diverged_run_resumed_unchanged_is_told_it_will_meet_the_divergence_again(tmp_path, capsys):
    """Its own command resumes the checkpoint before the divergence with the same state and data:
    said at the start, with what goes past it, not after the steps that find it out again."""
    args = [*GPT, "steps=10", "debug.nan_at_step=6", "divergence.max_skips=1", "ckpt_every=4"]
    s = train(tmp_path, *args)
    assert s["status"] == "diverged" and s["diverged_at"] == 6
    capsys.readouterr()
    train(tmp_path, *args, "resume=auto", quiet=False)  # the progress lines and monitors on: the same run
    err = capsys.readouterr().err
    assert "note: this run diverged at step 6 (" in err and "from this checkpoint's state with these settings, " \
        "and will likely diverge there again; divergence.action=rollback goes past it" in err, err
    s = train(tmp_path, *args, "resume=auto", "divergence.action=rollback", quiet=False)
    assert "will likely diverge there again" not in capsys.readouterr().err and s["status"] == "completed"
