"""Never lose a run: finite checkpoints, completing a run whose steps are done, resume checks."""

import json
import re
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stabletrain.errors import ConfigError
from stabletrain.monitor import names as N
from stabletrain.optim.schedule import LRSchedule
from tests.helpers import GPT_LOGGED, make_cfg, train

QUIET_RUN = ["optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false"]


def _finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def test_a_checkpoint_never_holds_non_finite_weights_or_optimizer_state(tmp_path):
    """lr=1000 makes the weights and Adam's moments non-finite at step 4 while the loss is still
    finite (it turns NaN at step 5): last.pt must keep the finite step-0..3 state, not step 4's.
    (With divergence.skip_nonfinite on, the default, such steps are skipped instead: this is the
    check behind it, for runs that turn skipping off.)"""
    off = "divergence.skip_nonfinite=false"
    s = train(tmp_path, "model=gpt_test", "optim=adamw", "optim.lr=1000", "warmup=0", "steps=200", "ckpt_every=4",
              off)
    assert s["status"] == "diverged" and "non-finite weights" in s["reason"] and s["step"] == 4
    assert not (tmp_path / "checkpoints/last.pt").exists()  # step 4's was the first: none is better than NaN
    t = train(tmp_path / "two", "model=gpt_test", "optim=adamw", "optim.lr=1000", "warmup=0", "steps=200",
              "ckpt_every=2", off)
    assert t["status"] == "diverged" and t["diverged_at"] == 4
    state = torch.load(tmp_path / "two/checkpoints/last.pt", weights_only=True)
    assert state["step"] == 2 and _finite(state["model"]) and _finite(state["optimizer"]["state"])
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "diverged"


def test_a_signal_in_the_last_step_lets_the_run_complete(tmp_path):
    """Every step ran: the run ends completed (exit 0), with its last checkpoint, not interrupted."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    t = build_trainer(make_cfg(*QUIET, *GPT_LOGGED, "steps=4", "ckpt_every=2", "divergence.action=rollback"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if t.step == 3:
            t.stop_signal = signal.SIGTERM
        return out

    t.train_step = step
    s = t.fit()
    assert s["status"] == "completed" and s["step"] == 4 and "val/loss" in s["final"]
    assert (tmp_path / "checkpoints/step_000004.pt").is_file()


def test_a_run_whose_steps_are_done_without_a_summary_completes_on_resume(tmp_path, capsys):
    """A kill after the last checkpoint but before summary.json: the resume runs the final
    evaluation, logs it once, and writes the summary; the next resume has nothing to train."""
    train(tmp_path, *GPT_LOGGED, "steps=4")
    (tmp_path / "summary.json").unlink()
    capsys.readouterr()
    again = train(tmp_path, *GPT_LOGGED, "steps=4", "resume=auto")
    assert again["status"] == "completed" and again["step"] == 4 and "val/loss" in again["final"]
    assert "running the final evaluation" in capsys.readouterr().err
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("val/loss" in r for r in recs) == 1  # the evaluation the first run logged, once
    assert train(tmp_path, *GPT_LOGGED, "steps=4", "resume=auto") == again  # now nothing to train


def test_another_runs_completed_summary_is_not_taken_for_this_ones(tmp_path, capsys):
    """A fresh run in a used directory moves the earlier summary.json aside; a resume trusts a
    completed summary only if it is of this step and length."""
    train(tmp_path, *GPT_LOGGED, "steps=3")
    train(tmp_path, *GPT_LOGGED, "steps=2", "seed=1")
    assert json.loads((tmp_path / "summary.previous.json").read_text())["total_steps"] == 3
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "step": 3, "total_steps": 3}))
    s = train(tmp_path, *GPT_LOGGED, "steps=2", "seed=1", "resume=auto")
    assert s["status"] == "completed" and s["total_steps"] == 2 and "val/loss" in s["final"]


def test_a_refused_resume_changes_nothing_and_names_the_changed_keys(tmp_path):
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    config = (tmp_path / "config.yaml").read_text()
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"resume=auto would change the resumed run's .*model.dropout.*seed"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "seed=3", "model.dropout=0.1", "resume=auto")
    assert (tmp_path / "config.yaml").read_text() == config  # today it was rewritten before the refusal
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    # cadences and length may change; with resume_allow_changes=true, anything may
    s = train(tmp_path, *GPT_LOGGED, "steps=3", "optim=adamw", "eval_every=7", "ckpt_every=9", "resume=auto")
    assert s["status"] == "completed" and s["step"] == 3
    s = train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "seed=3", "resume=auto", "resume_allow_changes=true")
    assert s["status"] == "completed" and "seed: 3" in (tmp_path / "config.yaml").read_text()


def test_data_auto_and_the_data_it_picks_are_the_same_run(tmp_path):
    """GPT's data=auto is pytext: naming it on resume is no change; another data set is."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")  # data=auto
    s = train(tmp_path, *GPT_LOGGED, "steps=3", "optim=adamw", "data=pytext", "resume=auto")
    assert s["status"] == "completed" and s["step"] == 3
    s = train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "data=auto", "resume=auto")  # and back
    assert s["status"] == "completed" and s["step"] == 4
    from stabletrain.data.token_files import prepare_tokens

    prepare_tokens(tmp_path / "tok", [b"some other text " * 500], block_size=64)
    changed = r"would change the resumed run's data.name \(auto there, tokens here\), data.path \(null there"
    with pytest.raises(ConfigError, match=changed):
        train(tmp_path, *GPT_LOGGED, "steps=5", "optim=adamw", "data=tokens", f"data.path={tmp_path / 'tok/train.bin'}",
              "resume=auto")


@pytest.mark.parametrize("allow", [False, True])
def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path, allow):
    """AdamW² -> AdamW loads without an error (the same state keys) and would silently train on."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw2")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="written with optim=adamw2, this run uses optim=adamw"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "resume=auto", f"resume_allow_changes={allow}")
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


def test_a_checkpoint_of_another_parallel_says_so_first(tmp_path):
    """An FSDP checkpoint resumed under DDP: the changed-keys refusal offered resume_allow_changes,
    which then met this refusal."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    ck = tmp_path / "checkpoints/last.pt"
    state = torch.load(ck, weights_only=False)
    state["dcp"], state["config"] = "last_dcp", state["config"].replace("parallel: ddp", "parallel: fsdp")
    assert "parallel: fsdp" in state["config"]
    torch.save(state, ck)
    with pytest.raises(ConfigError, match=r"last.pt was written with parallel=fsdp, this run uses parallel=ddp: "
                                          r"resume it with the parallel it was written with$"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "resume=auto")


def test_the_optimizer_of_a_checkpoint_without_its_name_comes_from_its_config(tmp_path):
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw2")
    ck = tmp_path / "checkpoints/last.pt"
    state = torch.load(ck, weights_only=True)
    del state["optim_name"]  # as written before it was stored
    torch.save(state, ck)
    with pytest.raises(ConfigError, match="written with optim=adamw2"):
        train(tmp_path / "other", *GPT_LOGGED, "steps=4", "optim=adamw", f"resume={ck}")


def test_a_resume_past_the_runs_steps_is_refused(tmp_path):
    """steps below the checkpoint's step would mark an unfinished run completed: refused, nothing changed."""
    train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw")
    summary = (tmp_path / "summary.json").read_text()
    with pytest.raises(ConfigError, match=r"is at step 4, past this run's 2 steps: pass steps=4 to end it there, more"):
        train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw", "resume=auto")
    assert (tmp_path / "summary.json").read_text() == summary


def test_a_fresh_run_on_a_used_directory_moves_the_earlier_runs_files_aside(tmp_path):
    """Without resume, an earlier run's checkpoints and records are kept under a free
    ``.previous`` name: its last.pt is not overwritten, and no rollback restores its ring."""
    args = [*GPT_LOGGED, "optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false", "ckpt.keep=3"]

    def step_of(path):
        return torch.load(path, weights_only=True)["step"]

    train(tmp_path, *args, "steps=6", "ckpt_every=2", quiet=False)
    train(tmp_path, *args, "steps=3", "ckpt_every=3", quiet=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt", "step_000003.pt"]
    previous = tmp_path / "checkpoints.previous"
    assert sorted(p.name for p in previous.iterdir()) == ["last.pt", "step_000002.pt", "step_000004.pt",
                                                          "step_000006.pt"]
    assert step_of(previous / "last.pt") == 6
    train(tmp_path, *args, "steps=1", quiet=False)
    assert step_of(tmp_path / "checkpoints.previous2/last.pt") == 3 and step_of(previous / "last.pt") == 6
    from stabletrain.metrics import read_records

    def steps(name):
        return [r["step"] for r in read_records(tmp_path / name) if "loss" in r]

    assert steps("metrics.previous.jsonl") == [1, 2, 3, 4, 5, 6]
    assert steps("metrics.previous2.jsonl") == [1, 2, 3] and steps("metrics.jsonl") == [1]
    (tmp_path / "plots").mkdir()  # plot_dynamics' figures of the last run
    (tmp_path / "plots" / "training.png").write_bytes(b"png")
    train(tmp_path, *args, "steps=1", quiet=False)
    # with the checkpoints of the run that drew them: one suffix for the run's files
    assert not (tmp_path / "plots").exists() and (tmp_path / "plots.previous3" / "training.png").is_file()
    assert (tmp_path / "checkpoints.previous3").is_dir() and (tmp_path / "metrics.previous3.jsonl").is_file()



def test_a_longer_run_whose_schedule_ignores_its_length_is_not_said_to_reshape_it(tmp_path, capsys):
    """A cosine of its own horizon does not follow steps=: the note claimed the schedule became
    that of the new length, while the lr stayed at the horizon's 0 for every step added."""
    own = ["model=gpt_test", "logger=none", "monitor=off", "schedule.horizon=3"]
    train(tmp_path, *own, "steps=3")
    capsys.readouterr()
    train(tmp_path, *own, "steps=6", "resume=auto", quiet=False)
    err = capsys.readouterr().err
    assert "the run's length changed, its lr schedule does not depend on it: at step 3 the lr is 0\n" in err, err
    assert "warning: the cosine reaches lr 0 at step 3 (schedule.horizon) and stays there" in err


def _follows(schedule: LRSchedule, step: int) -> bool:
    """Whether the trainer takes the lr of ``schedule`` at ``step`` to follow the run's length."""
    from stabletrain.engine.resume import lr_follows_the_length

    return lr_follows_the_length(schedule, step)


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

    own = [*GPT_LOGGED, "optim=adamw", "precision=fp32", "divergence.action=rollback", "divergence.max_skips=1",
           "ckpt_every=4", "debug.nan_at_step=6", "divergence.lr_scale_on_rollback=0.5"]
    assert len(train(tmp_path, *own, "steps=8")["rollbacks"]) == 1
    capsys.readouterr()
    train(tmp_path, *own, "steps=12", "resume=auto", quiet=False)
    cfg = make_cfg(*own, "steps=12")
    lr = 0.5 * make_schedule(cfg.schedule, cfg.optim.lr, 12, warmup=cfg.warmup, steps_per_epoch=1)(8)
    assert f"the lr schedule is that of 12 steps from step 0, so at step 8 the lr is {lr:.3g}\n" in \
        capsys.readouterr().err


def test_a_fresh_run_sets_the_earlier_runs_config_aside_with_its_records(tmp_path, capsys):
    """config.yaml goes aside with the checkpoints and records it describes (the fresh run writes
    its own): otherwise metrics.previous.jsonl is left with the new run's settings beside it, and a
    config.yaml that was no run's is lost without a word."""
    import yaml

    args = [*GPT_LOGGED, "optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false"]
    train(tmp_path, *args, "steps=2", "optim.lr=0.002")
    train(tmp_path, *args, "steps=1", "optim.lr=0.003", quiet=False)
    assert yaml.safe_load((tmp_path / "config.previous.yaml").read_text())["optim"]["lr"] == 0.002
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["optim"]["lr"] == 0.003
    assert "config.yaml -> config.previous.yaml" in capsys.readouterr().err
    own = tmp_path / "mine"  # a directory of the user's, with a config.yaml of their own
    own.mkdir()
    (own / "config.yaml").write_text("my: settings\n")
    train(own, *args, "steps=1")
    assert (own / "config.previous.yaml").read_text() == "my: settings\n"


def test_a_resume_says_what_it_changes(tmp_path, capsys):
    """resume=PATH takes changed keys (resume=auto refuses them) and says which; a new length
    reshapes the schedule from step 0, and the note gives the lr the run continues with."""
    train(tmp_path / "a", *GPT_LOGGED, "steps=4", "optim=adamw")
    capsys.readouterr()
    last = tmp_path / "a/checkpoints/last.pt"
    train(tmp_path / "b", *GPT_LOGGED, "steps=8", "optim=adamw", "optim.lr=0.002", "seed=3", f"resume={last}",
          quiet=False)
    err = capsys.readouterr().err
    assert f"resume={last} continues with another optim.lr, seed than the run that wrote it" in err
    from stabletrain.optim.schedule import make_schedule
    from tests.helpers import make_cfg

    cfg = make_cfg(*GPT_LOGGED, "steps=8", "optim=adamw", "optim.lr=0.002")
    lr = make_schedule(cfg.schedule, 0.002, 8, warmup=cfg.warmup, steps_per_epoch=1)(4)
    assert f"the lr schedule is that of 8 steps from step 0, so at step 4 the lr is {lr:.3g}" in err


def test_the_set_aside_runs_hint_continues_that_run(tmp_path, capsys):
    """The note on the moved checkpoints names the resume that continues the earlier run (not
    resume=auto, which would find the new run's)."""
    import re

    args = [*GPT_LOGGED, "optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false"]
    train(tmp_path, *args, "steps=4")
    train(tmp_path, *args, "steps=1", quiet=False)
    hint = re.search(r"to continue that run instead, stop this one and pass (resume=\S+)\)", capsys.readouterr().err)
    assert hint and hint.group(1) == f"resume={tmp_path / 'checkpoints.previous/last.pt'}"
    s = train(tmp_path, *args, "steps=6", hint.group(1), quiet=False)
    err = capsys.readouterr().err
    assert "resumed from step 4" in err and s["status"] == "completed" and s["step"] == 6
    # the records are the continued run's whole history: its own 4 steps (set aside with its
    # checkpoints under one suffix), then 2 more; the 1-step run that was stopped is kept apart
    from stabletrain.metrics import read_records

    def losses(name):
        return [(r["step"], r["loss"]) for r in read_records(tmp_path / name) if "loss" in r]

    assert f"the records up to step 4 are copied from {tmp_path / 'metrics.previous.jsonl'}" in err
    assert losses("metrics.jsonl")[:4] == losses("metrics.previous.jsonl")
    assert [step for step, _ in losses("metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in losses("metrics.previous2.jsonl")] == [1]
    assert (tmp_path / "checkpoints.previous2/last.pt").is_file()


def test_a_resumed_run_that_trains_on_has_no_summary_until_it_ends(tmp_path):
    """A run completed at 2 steps, resumed to 4: while it trains, summary.json does not say
    'completed at step 2' (a sweep reads such a run as unfinished); at the end it is the new one."""
    from stabletrain.build import build_trainer
    from tests.helpers import make_cfg

    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    t = build_trainer(make_cfg(*GPT_LOGGED, "steps=4", "optim=adamw", "resume=auto", "logger=none"), tmp_path)
    seen, orig = [], t.train_step

    def step(*a, **k):
        seen.append((tmp_path / "summary.json").exists())
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert seen == [False, False] and s["status"] == "completed" and s["step"] == 4
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 4


def test_a_refused_resume_names_the_command_that_started_the_run(tmp_path):
    """The usual mistake: resume=auto with the run dir alone, without the run's own overrides.
    The refusal shows what differs (its value there and here) and the run's command, which the
    checkpoint keeps (Hydra's .hydra/overrides.yaml is rewritten by the refused attempt)."""
    from tests.helpers import ROOT, cli

    run = tmp_path / "run"
    own = ["model=gpt_test", "batch_size=8", "steps=3", "logger=none", "monitor=off"]
    assert cli(*own, f"hydra.run.dir={run}").returncode == 0
    record = {p.name: p.read_text() for p in (run / ".hydra").iterdir()}
    r = cli("model=gpt_test", "logger=none", "resume=auto", f"hydra.run.dir={run}")
    # the refused attempt's overrides are not left as the run's (the sweep table labels runs by them)
    assert {p.name: p.read_text() for p in (run / ".hydra").iterdir()} == record
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and line.startswith("error: resume=auto would change the resumed run's batch_size "
                                                 "(8 there, 64 here)"), line
    cmd = f"{sys.executable} {ROOT / 'train.py'} {' '.join(own)} resume=auto hydra.run.dir={run}"
    assert line.endswith(f": the run there completed at step 3 (its own command, {cmd}, with a larger steps=, trains "
                         "it on); or pass resume_allow_changes=true to continue with the changes; a new run goes in "
                         "another hydra.run.dir"), line
    # another model shape: resume_allow_changes would not help, and is not offered
    r = cli(*own, "model.depth=3", "resume=auto", f"hydra.run.dir={run}")
    line = r.stderr.strip().splitlines()[-1]
    assert "model.depth (2 there, 3 here)" in line and "resume_allow_changes cannot help" in line, line
    # a checkpoint past the default 600 steps: the run's own steps=700 is what was left out
    long = tmp_path / "long"
    assert cli(*own[:2], "steps=700", "logger=none", "monitor=off", "ckpt_every=650", "eval_every=1000",
               f"hydra.run.dir={long}").returncode == 0
    r = cli("model=gpt_test", "batch_size=8", "logger=none", "monitor=off", "resume=auto", f"hydra.run.dir={long}")
    assert "is at step 700, past this run's 600 steps: continue it with its own command, " in r.stderr
    assert "train.py model=gpt_test batch_size=8 steps=700 logger=none" in r.stderr, r.stderr[-800:]


def test_a_model_that_does_not_fit_names_the_first_mismatch(tmp_path):
    from stabletrain.engine.checkpoint import mismatch

    with pytest.raises(RuntimeError) as e:
        torch.nn.Linear(2, 3).load_state_dict(torch.nn.Linear(2, 4).state_dict())
    assert mismatch(e.value).startswith("size mismatch for weight: copying a param with shape torch.Size([4, 2])")
    assert mismatch(ValueError("one line")) == "one line"


def test_a_dry_run_with_resume_says_what_it_would_continue_or_refuses_as_the_run_would(tmp_path, capsys):
    own = ["model=gpt_test", "logger=none", "monitor=off"]
    assert train(tmp_path, *own, "steps=3")["status"] == "completed"
    capsys.readouterr()
    assert train(tmp_path, *own, "steps=6", "resume=auto", "dry_run=true")["status"] == "dry_run"
    err = capsys.readouterr().err
    assert f"resume: would continue from step 3 of {tmp_path / 'checkpoints/last.pt'}\n" in err, err
    # the longer run reshapes the schedule: said by the dry run as by the run
    length = next(ln for ln in err.splitlines() if ln.startswith("the run's length changed"))
    assert length.startswith("the run's length changed: the lr schedule is that of 6 steps from step 0, so at step 3")
    with pytest.raises(ConfigError, match=r"^resume=auto would change the resumed run's optim.lr \(0.001 there, 0.01"):
        train(tmp_path, *own, "steps=6", "optim.lr=0.01", "resume=auto", "dry_run=true")
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 3  # nothing written
    capsys.readouterr()
    assert train(tmp_path, *own, "steps=6", "resume=auto")["step"] == 6
    assert length in capsys.readouterr().err.splitlines()


def test_the_command_that_continues_another_runs_checkpoint_goes_where_it_lies(tmp_path):
    """resume=PATH from another run's checkpoints/, past this run's steps: the command offered
    continued it here with resume=auto, which found nothing and trained from step 0. It names the
    checkpoint's own run directory; a checkpoint kept elsewhere is named by its path."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    t = build_trainer(make_cfg(*QUIET, *GPT_LOGGED, "steps=2"), tmp_path / "new")
    ck = {"overrides": ["model=gpt_test", "steps=8"], "launcher": None}
    old = tmp_path / "old"
    assert t.ckpt.command_of(ck, old / "checkpoints" / "last.pt").endswith(
        f"train.py model=gpt_test steps=8 resume=auto hydra.run.dir={old}")
    assert t.ckpt.command_of(ck, tmp_path / "kept.pt").endswith(
        f"steps=8 resume={tmp_path / 'kept.pt'} hydra.run.dir={tmp_path / 'new'}")
    assert t.ckpt.command_of(ck, tmp_path / "new" / "checkpoints" / "step_000002.pt").endswith(
        f"steps=8 resume=auto hydra.run.dir={tmp_path / 'new'}")
    # a run started with --config-dir / --config-name is continued with them, whatever this command gave
    ck["config_flags"] = ["--config-name", "mine", "--config-dir", "/my/configs"]
    assert t.ckpt.command_of(ck, old / "checkpoints" / "last.pt").endswith(
        f"train.py --config-name mine --config-dir /my/configs model=gpt_test steps=8 resume=auto hydra.run.dir={old}")
    assert "config_flags" in t.ckpt._payload(0, {}) and t.ckpt._payload(0, {})["config_flags"] == []


def _with_overrides(ck_path, overrides):
    """The checkpoint as a train.py run writes it: with its command line (an in-process run has none)."""
    state = torch.load(ck_path, weights_only=False)
    state["overrides"], state["launcher"] = list(overrides), None
    torch.save(state, ck_path)


def test_a_checkpoint_past_this_runs_steps_is_continued_in_its_own_run_dir(tmp_path):
    """resume=PATH of another run's checkpoint at step 4 into a 2-step run: 'continue it with its
    own command' named this directory with resume=auto, which finds nothing and trains from 0."""
    train(tmp_path / "old", *GPT_LOGGED, "steps=4")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test", "steps=4"])
    old = re.escape(str(tmp_path / "old"))
    with pytest.raises(ConfigError, match=rf"past this run's 2 steps: continue it with its own command, \S+ "
                                          rf"\S*train.py model=gpt_test steps=4 resume=auto hydra.run.dir={old}; or "
                                          rf"pass steps=4"):
        train(tmp_path / "new", *GPT_LOGGED, "steps=2", f"resume={ck}")


def test_another_optimizers_checkpoint_names_its_own_command(tmp_path):
    """resume=PATH of a checkpoint written with another optim=: the refusal names the command it
    was written with, in its own run directory."""
    train(tmp_path / "old", *GPT_LOGGED, "steps=2", "optim=adamw")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test", "optim=adamw"])
    old = re.escape(str(tmp_path / "old"))
    with pytest.raises(ConfigError, match=rf"; resume with optim=adamw \(its own command: \S+ \S*train.py "
                                          rf"model=gpt_test optim=adamw resume=auto hydra.run.dir={old}\), "
                                          rf"or start a new run$"):
        train(tmp_path / "new", *GPT_LOGGED, "steps=4", "optim=adamw2", f"resume={ck}")


def test_a_checkpoint_of_another_model_names_the_command_in_its_own_run_dir(tmp_path):
    """resume=PATH of a checkpoint whose weights do not fit: 'resume it with the command it was
    written with' names its run's directory, not this one."""
    train(tmp_path / "old", *GPT_LOGGED, "steps=2")
    ck = tmp_path / "old" / "checkpoints" / "last.pt"
    _with_overrides(ck, ["model=gpt_test"])
    with pytest.raises(ConfigError, match=rf"does not fit this run's model or optimizer \(.*\); resume it with the "
                                          rf"command it was written with, \S+ \S*train.py model=gpt_test resume=auto "
                                          rf"hydra.run.dir={re.escape(str(tmp_path / 'old'))}$"):
        train(tmp_path / "new", *GPT_LOGGED, "steps=4", "model.embed_dim=64", f"resume={ck}")


def test_resume_allow_changes_says_what_changed(tmp_path, capsys):
    """resume_allow_changes=true took a norm of one's own swapped for LayerNorm (the same
    parameter names) without a word: the start lines name each changed key with both values."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    capsys.readouterr()
    train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "optim.lr=0.002", "norm=rmsnorm", "resume=auto",
          "resume_allow_changes=true", quiet=False)
    err = capsys.readouterr().err
    assert "resume_allow_changes=true: the run goes on with changes: " in err, err
    line = next(x for x in err.splitlines() if "resume_allow_changes=true:" in x)
    assert "norm.name (layernorm there, rmsnorm here)" in line and "optim.lr (" in line, line


def test_a_resume_records_what_it_changed_in_the_run_directory(tmp_path, capsys):
    """config.yaml is rewritten with the resumed run's values, so the run directory kept no trace
    that its first steps ran with another lr or length; a change a resume may make (eval_batches:
    another part of the val set is scored from here) was not said at all. metrics.jsonl records
    every change at the step the run resumed, and the start lines name those a resume may make."""
    from stabletrain.metrics import read_records

    args = [*GPT_LOGGED, "optim=adamw", "monitor=off", "logger.wandb=disabled", "logger.progress=false"]
    train(tmp_path, *args, "steps=2", quiet=False)
    capsys.readouterr()
    train(tmp_path, *args, "steps=4", "optim.lr=0.002", "eval_batches=2", "resume=auto",
          "resume_allow_changes=true", quiet=False)
    assert "resumed with other settings: eval_batches (20 there, 2 here)" in capsys.readouterr().err
    [rec] = [r for r in read_records(tmp_path / "metrics.jsonl") if "run/resumed_at" in r]
    assert rec == {"step": 2, "run/resumed_at": 2,
                   "run/changed": "eval_batches: 20 -> 2, optim.lr: 0.001 -> 0.002, steps: 2 -> 4"}
    train(tmp_path, *args, "steps=6", "optim.lr=0.002", "eval_batches=2", "resume=auto", quiet=False)
    [_, again] = [r for r in read_records(tmp_path / "metrics.jsonl") if "run/resumed_at" in r]
    assert again == {"step": 4, "run/resumed_at": 4, "run/changed": "steps: 4 -> 6"}


def _said(err: str, start: str) -> list[str]:
    """The lines of ``err`` that start with ``start``."""
    return [ln for ln in err.splitlines() if ln.startswith(start)]


def test_resumed_with_other_settings_names_only_those_no_other_line_says(tmp_path, capsys):
    """The run's length (steps, epochs) and the weight average have notes of their own, a changed
    optim.lr the resume_allow_changes one, a dry run's own dry_run=true is no change: the line of
    'other settings' names none of them, only eval_batches here; none at all where nothing else changed."""
    own = [*GPT_LOGGED, *QUIET_RUN, "steps=null"]
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

    own = [*GPT_LOGGED, *QUIET_RUN, "steps=4", "ckpt_every=2", "ckpt.keep=2"]
    train(tmp_path, *own)
    train(tmp_path, *own, f"resume={tmp_path / 'checkpoints/step_000002.pt'}")
    assert [r for r in read_records(tmp_path / "metrics.jsonl") if N.RESUMED_AT in r] == [
        {"step": 2, N.RESUMED_AT: 2}]


def _changes_of(saved: str, mine: str) -> dict:
    """What the trainer records as changed from a checkpoint of config ``saved`` to its own ``mine``."""
    from stabletrain.config import changed_keys
    from stabletrain.engine.resume import changes_of

    ckpt = SimpleNamespace(config_yaml=mine, changed_keys=lambda s, allowed: changed_keys(s, mine, allowed))
    return changes_of(ckpt, {"config": saved})


def test_run_changed_says_unset_for_a_key_one_side_lacks_and_nothing_without_a_config():
    """A key only one config has is 'unset' on the other side (not None, which reads as null);
    a checkpoint or a trainer without a config has no changes to record (not every key)."""
    saved, mine = "steps: 4\noptim:\n  lr: 0.001\n", "steps: 6\noptim:\n  lr: 0.001\n  extra: 3\n"
    assert _changes_of(saved, mine) == {"optim.extra": "unset -> 3", "steps": "4 -> 6"}
    assert _changes_of(mine, saved) == {"optim.extra": "3 -> unset", "steps": "6 -> 4"}
    assert _changes_of(saved, "") == {} and _changes_of("", mine) == {}
    assert _changes_of("steps: null\n", "steps: 8\n") == {"steps": "null -> 8"}  # as the start lines spell it


@pytest.mark.parametrize("how", ["allow_changes", "path"])
def test_optimizer_settings_changed_on_resume_take_effect(tmp_path, how):
    """Loading the optimizer's state dict put the checkpoint's param-group values back: a weight
    decay, betas or tau changed on resume was silently dropped while config.yaml and the notes
    claimed it. The settings are this run's; the moments are the checkpoint's."""
    train(tmp_path / "a", *GPT_LOGGED, "steps=2", "optim=adamw2")
    before = torch.load(tmp_path / "a/checkpoints/last.pt", weights_only=False)["optimizer"]
    changed = ["optim.weight_decay=0.5", "optim.betas=[0.8,0.9]", "optim.tau=0.05"]
    resume = (["resume=auto", "resume_allow_changes=true"] if how == "allow_changes"
              else [f"resume={tmp_path / 'a/checkpoints/last.pt'}"])
    run = tmp_path / "a" if how == "allow_changes" else tmp_path / "b"
    train(run, *GPT_LOGGED, "steps=3", "optim=adamw2", *changed, *resume)
    after = torch.load(run / "checkpoints/last.pt", weights_only=False)["optimizer"]
    for group in after["param_groups"]:
        assert (group["weight_decay"], tuple(group["betas"]), group["tau"]) in {(0.5, (0.8, 0.9), 0.05),
                                                                                (0.0, (0.8, 0.9), 0.05)}, group
    assert [g["params"] for g in after["param_groups"]] == [g["params"] for g in before["param_groups"]]
    steps = {int(s["step"]) for s in after["state"].values() if "step" in s}
    assert steps == {3}  # the moments went on from the checkpoint's two steps


def test_a_resume_on_another_number_of_processes_says_so(tmp_path, capsys):
    """Allowed (the global batch is the same), but stochastic layers draw per process: the start
    lines said nothing, and the run differed from the one it would have been."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    ck = tmp_path / "checkpoints/last.pt"
    state = torch.load(ck, weights_only=False)
    assert state["world"] == 1
    state["world"] = 2  # as a 2-process run writes it
    torch.save(state, ck)
    capsys.readouterr()
    train(tmp_path, *GPT_LOGGED, "steps=3", "optim=adamw", "resume=auto", quiet=False)
    err = capsys.readouterr().err
    assert "resumed on 1 process(es), written on 2: the global batch and its data are the same" in err
    train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "resume=auto", quiet=False)
    assert "written on" not in capsys.readouterr().err


def test_a_checkpoint_without_its_world_size_is_no_world_note(tmp_path, capsys):
    """Checkpoints written before the world size was saved: nothing is known of their process
    count, and the start lines say nothing of it ('written on None')."""
    train(tmp_path, *GPT_LOGGED, "steps=2")
    ck = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(ck, weights_only=False)
    del state["world"]
    torch.save(state, ck)
    capsys.readouterr()
    assert train(tmp_path, *GPT_LOGGED, "steps=3", "resume=auto", quiet=False)["step"] == 3
    assert "written on" not in capsys.readouterr().err


def test_a_requeued_job_with_a_larger_steps_is_told_resume_auto_suffices(tmp_path, monkeypatch):
    """Under SLURM a run given no resume= continues its run dir's last.pt only with the same config;
    a larger steps= was told to pass resume_allow_changes=true, which a key a resume may change
    does not need. A changed lr still needs it."""
    train(tmp_path, *GPT_LOGGED, "steps=2", "optim=adamw")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(ConfigError, match=r"was written by a run with another steps; pass resume=auto to continue"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw")
    with pytest.raises(ConfigError, match=r"another optim.lr, steps; pass resume=auto resume_allow_changes=true to"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "optim=adamw", "optim.lr=0.01")


def test_a_requeued_job_started_with_resume_path_goes_on_from_its_own_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Under SLURM, a job started as ``resume=<another run's last.pt>`` and requeued after writing
    checkpoints of its own continues those, not the path it was started from; with another
    config in its directory (not its own attempt) the path is taken as asked."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, *GPT_LOGGED, "steps=2", "optim=adamw")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    start = f"resume={a / 'checkpoints' / 'last.pt'}"
    first = train(b, *GPT_LOGGED, "steps=4", "optim=adamw", start, quiet=False)
    assert first["status"] == "completed" and first["step"] == 4
    capsys.readouterr()
    again = train(b, *GPT_LOGGED, "steps=4", "optim=adamw", start, quiet=False)
    err = capsys.readouterr().err
    assert f"resumed from {b / 'checkpoints' / 'last.pt'}, not {start}: this job was started again (requeued)" in err
    assert "the checkpoint is at step 4 of 4: nothing to train" in err and again == first
    # its own attempt run again with a longer length: a resubmission, not a requeue; asked as without resume=
    with pytest.raises(ConfigError, match=r"b/checkpoints/last.pt was written by a run with another steps; pass "
                                          r"resume=auto to continue it anyway"):
        train(b, *GPT_LOGGED, "steps=5", "optim=adamw", start, quiet=False)
    other = train(tmp_path / "c", *GPT_LOGGED, "steps=3", "optim=adamw", "optim.lr=0.01", quiet=False)
    assert other["step"] == 3
    capsys.readouterr()
    train(tmp_path / "c", *GPT_LOGGED, "steps=4", "optim=adamw", start, quiet=False)  # not that run's attempt
    err = capsys.readouterr().err
    assert "started again (requeued)" not in err and "resumed from step 2" in err, err
    assert f"{tmp_path / 'c'} held an earlier run: moved aside checkpoints/ -> checkpoints.previous/" in err


def test_resume_auto_on_a_run_killed_before_its_first_checkpoint_says_so(tmp_path, capsys):
    """A run killed before its first checkpoint leaves its records but no summary: resume=auto
    starts from step 0 and says that run stopped too early, not to pass the directory it was given."""
    import shutil

    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=2")
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "summary.json").unlink()
    capsys.readouterr()
    assert train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=2", "resume=auto", quiet=False)["step"] == 2
    assert f"resume=auto: no checkpoint in {tmp_path / 'checkpoints'}, starting from step 0 (the run there stopped " \
           "before its first checkpoint)\n" in capsys.readouterr().err


def test_a_requeued_job_started_with_resume_of_its_own_last_pt_is_no_requeue_note(tmp_path, monkeypatch, capsys):
    """Under SLURM, resume= the run directory's own last.pt is the checkpoint asked for: the start
    lines do not say it was taken instead of the one asked for."""
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=2")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    capsys.readouterr()
    last = tmp_path / "checkpoints" / "last.pt"
    assert train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=3", f"resume={last}", quiet=False)["step"] == 3
    err = capsys.readouterr().err
    assert "resumed from step 2" in err and "started again (requeued)" not in err, err


def test_a_run_set_aside_after_one_without_checkpoints_keeps_its_own_records_with_its_checkpoints(tmp_path, capsys):
    """A run killed before its first checkpoint, a fresh run, then another: the second's records
    went to metrics.previous2.jsonl beside checkpoints.previous/, where the first's records lay,
    and its hint continued it with the first run's history. The checkpoints and the files of one
    run take one suffix free for all of them; the first run's records are kept."""
    import shutil

    from stabletrain.metrics import read_records

    def steps(name):
        return [r["step"] for r in read_records(tmp_path / name) if "loss" in r]

    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=2")
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "summary.json").unlink()
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=3")
    capsys.readouterr()
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=1", quiet=False)
    last = tmp_path / "checkpoints.previous2" / "last.pt"
    assert f"{tmp_path} held an earlier run: moved aside checkpoints/ -> checkpoints.previous2/, metrics.jsonl -> " \
           "metrics.previous2.jsonl, summary.json -> summary.previous2.json, config.yaml -> config.previous2.yaml " \
           f"(to continue that run instead, stop this one and pass resume={last})\n" in capsys.readouterr().err
    assert steps("metrics.previous.jsonl") == [1, 2] and steps("metrics.previous2.jsonl") == [1, 2, 3]
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=4", f"resume={last}")
    assert steps("metrics.jsonl") == [1, 2, 3, 4]


def test_the_set_aside_note_names_no_last_pt_the_earlier_run_did_not_write(tmp_path, capsys):
    """An earlier run whose checkpoints/ holds no last.pt (its ring only): the note says where its
    files went and offers no resume= of a file that is not there."""
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=2", "ckpt_every=1", "ckpt.keep=2")
    (tmp_path / "checkpoints" / "last.pt").unlink()
    capsys.readouterr()
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=1", quiet=False)
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "held an earlier run" in ln)
    assert line.endswith("moved aside checkpoints/ -> checkpoints.previous/, metrics.jsonl -> metrics.previous.jsonl, "
                         "summary.json -> summary.previous.json, config.yaml -> config.previous.yaml"), line


def test_a_folder_holding_only_a_config_yaml_is_not_called_an_earlier_run(tmp_path, capsys):
    """Nothing is lost (it is moved aside), but "held an earlier run" said of one's own config.yaml misled."""
    (tmp_path / "config.yaml").write_text("my: precious\n")
    train(tmp_path, *GPT_LOGGED, *QUIET_RUN, "steps=1", quiet=False)
    err = capsys.readouterr().err
    assert f"{tmp_path} held a file a run writes: moved aside config.yaml -> config.previous.yaml" in err
    assert "held an earlier run" not in err and (tmp_path / "config.previous.yaml").read_text() == "my: precious\n"


def _notes_of(changed: list[str], resume: str = "/r/last.pt") -> list[str]:
    """The start lines of a resume of ``resume`` whose checkpoint's config differs from this run's in ``changed``."""
    from stabletrain.engine.resume import resume_notes

    ckpt = SimpleNamespace(config_yaml="a: 1\n", changed_keys=lambda saved, allowed: list(changed),
                           info=SimpleNamespace(world=1), ema=None)
    settings = SimpleNamespace(resume=resume, resume_allow_changes=False, total_steps=4)
    return resume_notes(ckpt, settings, lambda step: 1.0, Path(resume), {"config": "a: 2\n", "step": 2})


def test_resume_path_names_eight_changed_keys_and_says_more_only_past_them():
    keys = [f"model.k{i}" for i in range(1, 10)]
    assert _notes_of(keys[:8]) == [f"resume=/r/last.pt continues with another {', '.join(keys[:8])} than the run "
                                   "that wrote it"]
    assert _notes_of(keys) == [f"resume=/r/last.pt continues with another {', '.join(keys[:8])} ... than the run "
                               "that wrote it"]


def test_the_divergence_ahead_is_said_only_for_a_step_still_ahead_and_changes_of_the_records_alone():
    """Resumed at the step it diverged at or past it, the run has gone by it; a change of how the
    run is recorded leaves the same state and data ahead, a changed lr does not."""
    from stabletrain.engine.resume import divergence_ahead

    diverged = {"status": "diverged", "diverged_at": 6, "reason": "non-finite loss"}
    note = ("note: this run diverged at step 6 (non-finite loss) from this checkpoint's state with these settings, "
            "and will likely diverge there again; divergence.action=rollback goes past it (back to a checkpoint "
            "before it, skipping the data from there)")
    assert divergence_ahead(diverged, 4, False, {}) == note
    assert divergence_ahead(diverged, 4, False, {"eval_every": "10 -> 5", "logger.log_every": "1 -> 2"}) == note
    assert divergence_ahead(diverged, 6, False, {}) is None
    assert divergence_ahead(diverged, 4, False, {"eval_every": "10 -> 5", "optim.lr": "0.001 -> 0.0005"}) is None
    assert divergence_ahead(diverged, 4, True, {}) is None and divergence_ahead(None, 4, False, {}) is None
    # keys matched as config.may_change matches them (by their top-level key), not by a prefix
    assert divergence_ahead(diverged, 4, False, {"ckpt_every": "5 -> 2", "ckpt.keep": "2 -> 3"}) == note
    assert divergence_ahead(diverged, 4, False, {"device_map": "a -> b"}) is None
