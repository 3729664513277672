"""Promises of the changes since 06bdb15 that no test held (a mutation audit, session 39): each
test here fails on one deliberate bug in stabletrain/ that the rest of the suite let through."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from stabletrain.analysis import plots as P
from stabletrain.monitor import names as N
from stabletrain.optim.schedule import LRSchedule
from tests.helpers import make_cfg, train

GPT = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1"]
QUIET_RUN = ["optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false"]


def _said(err: str, start: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(start)]


# --- sec.png: the step of the largest rise ---------------------------------------------------------

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


# --- epochs=E on the command line -------------------------------------------------------------------

def test_epochs_given_with_a_force_add_prefix_still_trains_by_epochs():
    """``++epochs=2`` is epochs=2: steps=null goes right after it (not a StopIteration from
    looking for an override spelled exactly ``epochs=``)."""
    from stabletrain.cli import epochs_over_steps

    assert epochs_over_steps(["++epochs=2", "--cfg", "job"]) == ["++epochs=2", "steps=null", "--cfg", "job"]


# --- resume: what it says and records ---------------------------------------------------------------

def test_resumed_with_other_settings_names_only_those_no_other_line_says(tmp_path, capsys):
    """The run's length (steps, epochs) and the weight average have notes of their own, a changed
    optim.lr the resume_allow_changes one, a dry run's own dry_run=true is no change: the line of
    'other settings' names none of them, only eval_batches here; none at all where nothing else changed."""
    own = [*GPT, *QUIET_RUN, "steps=null"]
    train(tmp_path, *own, "epochs=0.00004", "ema.decay=0.99")
    capsys.readouterr()
    more = [*own, "epochs=0.00008", "ema.decay=0.9", "eval_batches=2", "optim.lr=0.002"]
    train(tmp_path, *more, "resume=auto", "resume_allow_changes=true", quiet=False)
    err = capsys.readouterr().err
    assert _said(err, "resumed with other settings") == ["resumed with other settings: eval_batches (20 there, 2 here)"]
    assert _said(err, "the weight average changed on resume") and _said(err, "the run's length changed")
    train(tmp_path, *more, "steps=8", "resume=auto", quiet=False)  # steps only
    err = capsys.readouterr().err
    assert _said(err, "the run's length changed") and not _said(err, "resumed with other settings"), err
    assert train(tmp_path, *more, "steps=10", "resume=auto", "dry_run=true", quiet=False)["status"] == "dry_run"
    err = capsys.readouterr().err
    assert _said(err, "resume: would continue from step 8") and not _said(err, "resumed with other settings"), err


def test_a_resume_that_changes_nothing_records_no_changes(tmp_path):
    """resume=PATH of the run's own ring checkpoint, with its own settings: the record of the
    resume holds the step it continued from, and no run/changed (not a null one)."""
    from stabletrain.metrics import read_records

    own = [*GPT, *QUIET_RUN, "steps=4", "ckpt_every=2", "ckpt.keep=2"]
    train(tmp_path, *own)
    train(tmp_path, *own, f"resume={tmp_path / 'checkpoints/step_000002.pt'}")
    assert [r for r in read_records(tmp_path / "metrics.jsonl") if N.RESUMED_AT in r] == [
        {"step": 2, N.RESUMED_AT: 2}]


def _changes_of(saved: str, mine: str) -> str | None:
    from stabletrain.config import changed_keys
    from stabletrain.engine.loop import Trainer

    ckpt = SimpleNamespace(config_yaml=mine, changed_keys=lambda s, allowed: changed_keys(s, mine, allowed))
    return Trainer._changes_of(SimpleNamespace(ckpt=ckpt), {"config": saved})


def test_run_changed_says_unset_for_a_key_one_side_lacks_and_nothing_without_a_config():
    """A key only one config has is 'unset' on the other side (not None, which reads as null);
    a checkpoint or a trainer without a config has no changes to record (not every key)."""
    saved, mine = "steps: 4\noptim:\n  lr: 0.001\n", "steps: 6\noptim:\n  lr: 0.001\n  extra: 3\n"
    assert _changes_of(saved, mine) == {"optim.extra": "unset -> 3", "steps": "4 -> 6"}
    assert _changes_of(mine, saved) == {"optim.extra": "3 -> unset", "steps": "6 -> 4"}
    assert _changes_of(saved, "") == {} and _changes_of("", mine) == {}
    assert _changes_of("steps: null\n", "steps: 8\n") == {"steps": "null -> 8"}  # as the start lines spell it


def _follows(schedule: LRSchedule, step: int) -> bool:
    from stabletrain.engine.loop import Trainer

    return Trainer._lr_follows_the_length(SimpleNamespace(schedule=SimpleNamespace(lr_at=schedule)), step)


def test_a_cosine_to_the_runs_end_follows_the_length_from_inside_its_warmup():
    """Resumed at step 2 of a 10-step warmup, a cosine to the end of a 12-step run: the warmup
    ignores the length, the cosine after it does not; one of its own horizon, or a constant, ignores it."""
    assert _follows(LRSchedule("cosine", base_lr=1.0, total_steps=12, warmup_steps=10), 2)
    assert _follows(LRSchedule("cosine", base_lr=1.0, total_steps=40, warmup_steps=4), 2)
    assert not _follows(LRSchedule("cosine", base_lr=1.0, total_steps=40, warmup_steps=4, horizon_steps=20), 2)
    assert not _follows(LRSchedule("constant", base_lr=1.0, total_steps=40, warmup_steps=4), 2)


def test_the_length_note_gives_the_lr_a_rollback_scaled(tmp_path, capsys):
    """After a rollback with lr_scale_on_rollback=0.5 the run goes on at half the schedule's lr:
    the note on a longer resumed run gives that lr, not the schedule's."""
    from stabletrain.optim.schedule import make_schedule

    own = [*GPT, "optim=adamw", "precision=fp32", "divergence.action=rollback", "divergence.max_skips=1",
           "ckpt_every=4", "debug.nan_at_step=6", "divergence.lr_scale_on_rollback=0.5"]
    assert len(train(tmp_path, *own, "steps=8")["rollbacks"]) == 1
    capsys.readouterr()
    train(tmp_path, *own, "steps=12", "resume=auto", quiet=False)
    cfg = make_cfg(*own, "steps=12")
    lr = 0.5 * make_schedule(cfg.schedule, cfg.optim.lr, 12, warmup=cfg.warmup, steps_per_epoch=1)(8)
    assert f"the lr schedule is that of 12 steps from step 0, so at step 8 the lr is {lr:.3g}\n" in \
        capsys.readouterr().err


# --- a cosine whose horizon ends before the run ------------------------------------------------------

def test_the_lr_0_warning_counts_the_steps_the_run_trains_at_lr_0():
    """A horizon at the run's end trains no step at lr 0 (step ``steps`` is never trained): no
    warning; one step short, the last step is at lr 0 and is warned; a step or constant schedule
    does not read schedule.horizon, so a horizon there warns of nothing."""
    assert LRSchedule("cosine", base_lr=1.0, total_steps=40, horizon_steps=40).warnings() == []
    (w,) = LRSchedule("cosine", base_lr=1.0, total_steps=40, horizon_steps=39).warnings()
    assert "the run's last 1 of 40 steps train at lr 0" in w
    for name in ("step", "constant"):
        assert LRSchedule(name, base_lr=1.0, total_steps=40, horizon_steps=20).warnings() == []


# --- a full disk under metrics.jsonl -----------------------------------------------------------------

def test_a_used_up_quota_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """EDQUOT is a full disk of one's own quota: the same one line, which says so and names the
    file that could not be written; another OSError (a permission) is not taken for a full disk."""
    from stabletrain import run as R

    where = str(tmp_path / "metrics.jsonl")

    def quota(cfg, run_dir):
        raise OSError(errno.EDQUOT, "Disk quota exceeded", where)

    monkeypatch.setattr(R, "run", quota)
    with pytest.raises(SystemExit) as e:
        R.main_guarded(SimpleNamespace(), tmp_path)
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: cannot write into {tmp_path}: the disk quota is used up ({where}); free space and run "
                    f"it again (no checkpoint was written)"), last

    def denied(cfg, run_dir):
        raise PermissionError(errno.EACCES, "Permission denied", where)

    monkeypatch.setattr(R, "run", denied)
    with pytest.raises(PermissionError):
        R.main_guarded(SimpleNamespace(), Path(tmp_path))
