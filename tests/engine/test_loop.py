"""The loop: determinism, resume, divergence, interruption, run-directory contents."""

import json
import math
import os
import re
import signal
import sys

import pytest
import torch

from tests.helpers import GPT_LOGGED, losses, train

FAST = ["model=vit_test", "batch_size=16", "eval_every=1000", "logger.log_every=1"]


def test_run_directory_contents(tmp_path):
    s = train(tmp_path, *FAST, "steps=4", "eval_every=2")
    assert s["status"] == "completed" and s["step"] == 4
    for f in ("metrics.jsonl", "summary.json", "config.yaml", "checkpoints/last.pt"):
        assert (tmp_path / f).is_file(), f
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "lr"} <= set(recs[0]) and any("val/acc" in r for r in recs)
    ck = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)
    assert ck["step"] == 4 and {"model", "optimizer", "rng", "config"} <= set(ck)


@pytest.mark.parametrize("family", [FAST, GPT_LOGGED])
def test_same_seed_same_curve(tmp_path, family):
    train(tmp_path / "a", *family, "steps=5")
    train(tmp_path / "b", *family, "steps=5")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.parametrize("extra", [
    ["optim=adamw2"], ["optim=adamw2", "optim.overlap_sigma_w=true"], ["optim=adamw", "model.drop_path=0.1"],
    ["optim=sgd", "grad_clip=1.0"], ["data.mixup=0.8", "data.cutmix=1.0"],
])
def test_resume_continues_identically(tmp_path, extra):
    args = FAST + extra
    train(tmp_path / "full", *args, "steps=8")
    # Stop after 4 of 8 steps (same schedule horizon), then resume and finish.
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    cfg = make_cfg(*QUIET, *args, "steps=8", "ckpt_every=4")
    t = build_trainer(cfg, tmp_path / "half")
    _run_until(t, 4)
    s = train(tmp_path / "half", *args, "steps=8", "resume=auto")
    assert s["status"] == "completed"
    full, half = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(half) == sorted(full)
    for k in full:
        assert half[k] == pytest.approx(full[k], rel=1e-6, abs=1e-7), k


def test_adamw2_overlap_trains_the_inline_run(tmp_path):
    """sigma1(W) iterated right after each step (overlap_sigma_w) changes no number of a run
    with clipping, a weight average and evaluation between steps."""
    args = [*GPT_LOGGED, "optim=adamw2", "optim.tau=0.002", "grad_clip=1.0", "ema.decay=0.9", "eval_every=3",
            "steps=6", "precision=fp32"]
    a = train(tmp_path / "inline", *args)
    b = train(tmp_path / "overlap", *args, "optim.overlap_sigma_w=true")
    assert losses(tmp_path / "inline") == losses(tmp_path / "overlap")
    assert a["final"] == b["final"]
    wa = torch.load(tmp_path / "inline/checkpoints/last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "overlap/checkpoints/last.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _run_until(trainer, n):
    """Run a trainer and stop it after ``n`` steps as an interruption would."""
    orig = trainer.train_step

    def step(*a, **k):
        out = orig(*a, **k)
        if trainer.step + 1 == n:
            trainer.stop_signal = signal.SIGTERM
        return out

    trainer.train_step = step
    s = trainer.fit()
    assert s["status"] == "interrupted" and s["step"] == n
    return s


def test_sigterm_checkpoints_and_records_interrupted(tmp_path):
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    cfg = make_cfg(*QUIET, *GPT_LOGGED, "steps=1000")
    t = build_trainer(cfg, tmp_path)
    orig = t.train_step
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert s["status"] == "interrupted" and "SIGTERM" in s["reason"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["step"] == s["step"]


def test_huge_lr_diverges_cleanly(tmp_path):
    s = train(tmp_path, *GPT_LOGGED, "steps=60", "optim=sgd", "optim.lr=1e4", "optim.momentum=0.0")
    assert s["status"] == "diverged"
    assert s["reason"] and ("non-finite" in s["reason"] or "above" in s["reason"])
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "diverged"
    assert s["step"] < 60


def test_divergence_watch_spike_window():
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3, warmup_steps=5, spike_factor=2.0)))
    for s in range(10):
        assert w.update(s, 1.0) is None
    assert w.update(10, 5.0) is None and w.update(11, 5.0) is None
    assert w.update(12, 1.0) is None  # recovered: the window restarts
    assert w.update(13, 5.0) is None and w.update(14, 5.0) is None
    assert w.update(15, 5.0) == "loss 5 stayed above 2x its running mean 1 for 3 steps, from step 13 to step 15"
    assert w.onset == 13
    assert "non-finite" in w.update(16, math.nan)


@pytest.mark.parametrize("extra", [[], ["regularizer=locater", "reparam=sigma"]])
def test_gradient_accumulation_matches_full_batch(tmp_path, extra):
    """Also with LocAteR's penalty and sigmaReparam's power iteration, which must count once
    per optimizer step, not once per micro-batch."""
    train(tmp_path / "a", *GPT_LOGGED, "steps=3", "optim=sgd", *extra)
    train(tmp_path / "b", *GPT_LOGGED, "steps=3", "optim=sgd", "micro_batch_size=2", *extra)
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5)




@pytest.mark.parametrize("log_every,curve_steps", [(1, [5, 10, 15, 20]), (7, [7, 14, 20])])
def test_adamw2_telemetry_is_logged_at_its_cadence(tmp_path, log_every, curve_steps):
    """The fraction bounded at every log step; per-tensor lr_eff (App. M's curves) at the log
    step of each interval holding a multiple of monitor.adamw2_every, and at the end."""
    train(tmp_path, "model=vit_test", "batch_size=8", "eval_every=1000", "steps=20", "optim=adamw2",
          "optim.lr=0.05", f"logger.log_every={log_every}", "monitor.adamw2_every=5")
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in recs if "loss" in r]
    assert all("adamw2/frac_bounded" in r for r in logged)
    key = "adamw2/lr_eff/blocks.0.attn.qkv.weight"
    assert [r["step"] for r in logged if key in r] == curve_steps
    for r in (r for r in logged if key in r):
        ratio = r["adamw2/lr_ratio/blocks.0.attn.qkv.weight"]
        assert 0 < ratio <= 1 and r[key] == pytest.approx(ratio * r["lr"])


def test_resume_auto_on_a_finished_run_keeps_its_summary(tmp_path, capsys):
    first = train(tmp_path, *FAST, "steps=4")
    again = train(tmp_path, *FAST, "steps=4", "resume=auto")
    assert again == json.loads((tmp_path / "summary.json").read_text())
    assert again["final"] == pytest.approx(first["final"]) and again["status"] == "completed"
    assert "nothing to train" in capsys.readouterr().err


def test_a_fresh_start_in_a_used_directory_says_so_and_moves_the_old_records(tmp_path, capsys):
    train(tmp_path, *FAST, "steps=3", "ckpt_every=1000")  # the final step still checkpoints
    (tmp_path / "checkpoints/last.pt").unlink()  # as a run killed before its first checkpoint
    train(tmp_path, *FAST, "steps=3", "resume=auto")
    err = capsys.readouterr().err
    assert "resume=auto: no checkpoint in" in err and "metrics.jsonl -> metrics.previous.jsonl" in err
    assert "the run there stopped before its first checkpoint" in err  # not "pass its directory"
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3]  # this run's steps, once each
    assert (tmp_path / "metrics.previous.jsonl").is_file()


def test_divergence_step_is_the_first_bad_step_and_no_checkpoint_holds_it(tmp_path):
    """log_every=10 reads the losses back only every 10 steps; a checkpoint due at step 4 first
    checks the pending losses, so a diverged run never overwrites last.pt with the state of a bad
    step: last.pt stays the step-2 checkpoint, from before the first bad step."""
    s = train(tmp_path, "model=vit_test", "batch_size=8", "eval_every=1000", "steps=20", "optim=sgd",
              "optim.lr=1e4", "logger.log_every=10", "ckpt_every=2")
    assert s["status"] == "diverged" and s["diverged_at"] <= s["step"]
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # a step is bad when it was skipped (non-finite gradients) or logged a non-finite loss
    first_bad = min(r["step"] for r in recs if r.get("train/skipped_step")
                    or ("loss" in r and not math.isfinite(float(r["loss"]))))
    assert 2 < s["diverged_at"] == first_bad and f"at step {s['diverged_at']}" in s["reason"]
    state = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)  # step 2's, before the trouble
    assert state["step"] < s["diverged_at"]
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_bad_resume_targets_are_one_clear_error(tmp_path):
    from stabletrain.config import ConfigError

    train(tmp_path / "vit", *FAST, "steps=2")
    with pytest.raises(ConfigError, match="does not fit this run's model or optimizer"):
        train(tmp_path / "gpt", *GPT_LOGGED, "steps=2", f"resume={tmp_path / 'vit/checkpoints/last.pt'}")
    with pytest.raises(ConfigError, match="vit is a run's folder, not a checkpoint: resume=auto hydra.run.dir="):
        train(tmp_path / "dir", *FAST, "steps=2", f"resume={tmp_path / 'vit'}")
    with pytest.raises(ConfigError, match="config.yaml: not a readable checkpoint"):
        train(tmp_path / "file", *FAST, "steps=2", f"resume={tmp_path / 'vit/config.yaml'}")


def test_an_interrupted_command_line_run_exits_with_the_signals_code(tmp_path):
    """Outside SLURM a Ctrl-C (or kill) ends the process with 128 + signal, so a local sweep stops
    too; the run has checkpointed and says why in summary.json first."""
    from tests.distributed.common import clean_env, signal_once_running, start, wait_ok
    from tests.helpers import QUIET, ROOT

    cmd = [os.sys.executable, str(ROOT / "train.py"), *QUIET, *FAST, "steps=100000", f"hydra.run.dir={tmp_path}"]
    proc = start(cmd, cwd=tmp_path, env=clean_env(), log=tmp_path / "log")
    signal_once_running(proc, tmp_path, signal.SIGINT, after_step=2)
    wait_ok(proc, tmp_path / "log", expect=130)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["signal"] == signal.SIGINT
    assert "Ctrl-C: stopping after step" in (tmp_path / "log").read_text()  # said at once, not after the step


def test_data_img_size_sizes_the_model(tmp_path):
    s = train(tmp_path, *FAST, "steps=1", "data.img_size=24")
    assert s["status"] == "completed"
    cfg = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["config"]
    assert "img_size: 24" in cfg


def test_locater_penalty_is_logged_beside_the_loss(tmp_path):
    from stabletrain.build import build_trainer
    from stabletrain.layers.locater import locater_penalty
    from tests.helpers import QUIET, make_cfg

    args = [*GPT_LOGGED, "steps=1", "regularizer=locater"]
    train(tmp_path / "run", *args)
    recs = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    rec = next(r for r in recs if "loss" in r)
    cfg = make_cfg(*QUIET, *args)
    t = build_trainer(cfg, tmp_path / "fresh")  # the same seed: the weights of step 1's forward
    want = locater_penalty(t.model, cfg.regularizer.locater).item()
    assert rec["loss/penalty"] == pytest.approx(want, rel=1e-5) and rec["loss/penalty"] > 0
    assert rec["loss"] > rec["loss/penalty"]


def test_an_interrupted_run_says_how_to_continue_it(tmp_path, capsys, monkeypatch):
    from stabletrain.build import build_trainer
    from stabletrain.engine.rundir import interpreter
    from tests.helpers import make_cfg

    for var in ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR"):  # under a scheduler the job is requeued instead
        monkeypatch.delenv(var, raising=False)
    t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "logger=none", "monitor=off"), tmp_path)
    s = _run_until(t, 3)
    assert s["reason"] == "signal SIGTERM" and s["step"] == 3  # the summary keeps the reason alone
    *_, status, hint = capsys.readouterr().err.strip().splitlines()
    assert status.startswith("interrupted at step 3: signal SIGTERM"), status
    # outside Hydra (this Python API) the overrides are unknown
    assert hint == f"continue it with: the run's command plus resume=auto hydra.run.dir={tmp_path}"

    # from the command line: the command itself, quoted for the shell, on a line of its own
    t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "logger=none", "monitor=off"), tmp_path / "cli")
    t.settings.overrides = ("model=gpt_test", "steps=10", "imports=[my fix.py]", "resume=auto",
                            f"hydra.run.dir={tmp_path / 'cli'}")
    _run_until(t, 3)
    hint = capsys.readouterr().err.strip().splitlines()[-1]
    # this interpreter ("python" only where that is it: a venv's python run bare would lack torch)
    assert hint == (f"continue it with: {interpreter()} train.py model=gpt_test steps=10 'imports=[my fix.py]' "
                    f"resume=auto hydra.run.dir={tmp_path / 'cli'}")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert interpreter() == "python"


@pytest.mark.parametrize("env,launcher", [
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun --standalone --nproc_per_node=2"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"},
     "torchrun --nnodes=2 --nproc_per_node=8 <its rendezvous options>"),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}, "srun <its options> "),
    ({}, None),
])
def test_the_command_that_continues_a_distributed_run_starts_with_its_launcher(monkeypatch, env, launcher):
    """Under torchrun the hint was 'the run's command plus resume=auto ...', its overrides left out."""
    from stabletrain.engine.rundir import continue_with, launcher_of_this_job

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = launcher_of_this_job()
    assert got == launcher if launcher is None or not launcher.startswith("srun") else got.startswith(launcher)
    hint = continue_with("/runs/a", ("model=gpt_test", "parallel=fsdp"))
    assert hint.endswith("train.py model=gpt_test parallel=fsdp resume=auto hydra.run.dir=/runs/a")
    assert launcher is None or hint.startswith(launcher)


def test_the_runs_overrides_keep_the_hydra_ones_its_config_needs():
    """An option of the user's own is found through hydra.searchpath: a command that continues
    the run without it would fail; where the run lives is the continuing command's own."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from stabletrain.cli import CONFIG_DIR
    from stabletrain.config import register
    from stabletrain.engine.rundir import task_overrides
    from tests.helpers import ROOT

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        mine = f"hydra.searchpath=[file://{ROOT / 'examples/conv_stem/configs'}]"
        cfg = compose("train", overrides=[mine, "hydra.run.dir=/y", "steps=3"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    try:
        assert task_overrides() == (mine, "steps=3")
    finally:
        HydraConfig.instance().cfg = None


def test_a_sweep_point_says_to_continue_its_sweep(tmp_path, capsys, monkeypatch):
    """Inside a multirun the run dir is the sweep's: the hints name hydra.sweep.dir, and a point
    the sweep had not reached before starts without the single-run advice."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    import yaml
    from omegaconf import open_dict

    from stabletrain.build import build_trainer
    from stabletrain.cli import CONFIG_DIR
    from stabletrain.config import register
    from stabletrain.engine.rundir import RunDirLock, interpreter
    from stabletrain.errors import ConfigError
    from tests.helpers import make_cfg

    for var in ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(var, raising=False)
    sweep = tmp_path / "sweep"
    register()  # the schema train.yaml names, which only an earlier test in this process had stored
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        hydra_cfg = compose("train", overrides=[f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    with open_dict(hydra_cfg):
        hydra_cfg.hydra.mode = "MULTIRUN"
    HydraConfig.instance().set_config(hydra_cfg)
    try:
        t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "logger=none", "monitor=off", "resume=auto"), sweep / "0")
        _run_until(t, 3)
        err = capsys.readouterr().err
        assert "starting from step 0 (this sweep point had not started)\n" in err, err
        last = err.strip().splitlines()[-1]
        assert last == f"continue it with: the sweep's command plus resume=auto hydra.sweep.dir={sweep}", last
        # the sweep's own command, from the multirun.yaml Hydra writes into its directory
        # with the hydra.* overrides its options need (an option of the user's own: searchpath)
        (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {
            "hydra": [f"hydra.sweep.dir={sweep}", "hydra.mode=MULTIRUN", "hydra.searchpath=[file:///mine]"],
            "task": ["model=gpt_test", "optim.lr=1e-3,2e-3", "resume=auto"]}}}))
        t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "logger=none", "monitor=off"), sweep / "2")
        _run_until(t, 3)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == (f"continue it with: {interpreter()} train.py -m 'hydra.searchpath=[file:///mine]' "
                        f"model=gpt_test optim.lr=1e-3,2e-3 resume=auto hydra.sweep.dir={sweep}")
        held = RunDirLock(sweep / "1").acquire()
        with pytest.raises(ConfigError, match="its own hydra.sweep.dir$"):
            RunDirLock(sweep / "1").check_free()
        held.release()
    finally:
        HydraConfig.instance().cfg = None


def test_the_continue_command_of_a_sweep_run_again_is_this_one(tmp_path, monkeypatch):
    """While a sweep runs again, the earlier multirun.yaml is kept beside the new one: a point that
    refuses is told the earlier command, but one that stops (Ctrl-C, a rollback limit) is told to
    run again the command it is running."""
    import yaml

    from stabletrain.engine import rundir

    def multirun(path, task):
        path.write_text(yaml.safe_dump({"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": task}}}))

    multirun(tmp_path / "multirun.yaml", ["model=gpt_test", "steps=4", "optim.tau=0.01,0.02"])
    multirun(tmp_path / rundir.KEPT_MULTIRUN, ["model=gpt_test", "steps=2", "optim.tau=0.01,0.02"])
    monkeypatch.setattr(rundir, "sweep_dir", lambda: tmp_path)
    now, earlier = rundir.continue_with(tmp_path / "0"), rundir.continue_with(tmp_path / "0", earlier=True)
    assert now.endswith(f"train.py -m model=gpt_test steps=4 optim.tau=0.01,0.02 resume=auto "
                        f"hydra.sweep.dir={tmp_path}"), now
    assert earlier.endswith(f"train.py -m model=gpt_test steps=2 optim.tau=0.01,0.02 resume=auto "
                            f"hydra.sweep.dir={tmp_path}"), earlier


@pytest.mark.parametrize("step,after_step,agreed,said", [
    (3, False, False, "stopping after step 4, with a checkpoint"),  # inside step 4
    (4, True, False, "stopping after step 4, with a checkpoint"),  # step 4's evaluation or log
    # step 4's ranks had agreed on the signals without this one (it landed while rank 0 waited for them)
    (4, True, True, "stopping after step 5, with a checkpoint"),
    (9, False, False, "step 10 is the last: the run completes after it"),
    (9, True, True, "step 10 is the last: the run completes after it"),
    (10, True, False, "the last step is done: the run completes after its evaluation and checkpoint"),
    (10, True, True, "the last step is done: the run completes after its evaluation and checkpoint"),
])
def test_the_first_ctrl_c_names_the_step_the_run_stops_after(tmp_path, capsys, monkeypatch, step, after_step, agreed,
                                                             said):
    from stabletrain.build import build_trainer
    from tests.helpers import make_cfg

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "logger=none", "monitor=off"), tmp_path)
    capsys.readouterr()

    def ctrl_c() -> str:
        t.step, t.after_step, t.signals_agreed, t.stop_signal = step, after_step, agreed, None
        old = t._install_signals()
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        assert t.stop_signal == signal.SIGINT
        return capsys.readouterr().err.strip()

    assert ctrl_c() == f"Ctrl-C: {said} (Ctrl-C again to stop at once, without one)"
    # under torchrun a second Ctrl-C reaches torchrun alone (its workers have a session of their own)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert ctrl_c() == (f"Ctrl-C: {said}; torchrun kills the workers 30 s after a Ctrl-C "
                        f"(TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and a second one ends torchrun alone")


def test_a_spike_in_the_divergence_warmup_does_not_hide_later_ones():
    """A loss of 1e5 inside the warmup entered the running mean whole (mean ~2000 from losses of 1):
    every spike for hundreds of steps after the warmup went unseen. Among the first five losses it
    leaves their median, the mean's start, as it is; after them it enters capped at spike_factor x
    the mean; and a sustained spike after the warmup still ends the run."""
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3, warmup_steps=10, spike_factor=2.0, ema=0.9)))
    assert w.update(1, 1.0) is None and w.update(2, 1e5) is None and w.above and w.over == 0
    assert w.ema == 1.0  # the mean starts as the median of the first five losses
    for s in range(3, 8):
        assert w.update(s, 1.0) is None and not w.above
    assert w.update(8, 1e5) is None and w.above and w.over == 0
    assert w.ema == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)  # then a spike enters capped at 2x the mean, not 1e5
    for s in range(9, 30):
        assert w.update(s, 1.0) is None and not w.above
    assert [w.update(s, 5.0) for s in (30, 31)] == [None, None]
    assert w.update(32, 5.0).startswith("loss 5 stayed above 2x its running mean 1")


def test_the_watch_keeps_the_last_warmup_spike_for_its_line_and_a_restored_watch_forgets_it():
    """A spike the warmup does not count is kept with the running mean it rose above, healthy steps
    after it or not (the progress line of its interval says it); a watch restored from a checkpoint,
    as a rollback restores one, holds none of the history it left behind."""
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3, warmup_steps=5, spike_factor=2.0, ema=0.5)))
    saved = (w.update(1, 1.0), w.state_dict())[1]
    assert w.update(2, 3.0) is None and w.update(3, 1.5) is None and w.uncounted == (2, 1.0)
    assert w.update(4, 9.0) is None and w.uncounted == (4, 1.5)  # the last one, against its own mean
    for s in range(5, 12):
        w.update(s, 1.0)
    assert w.update(12, 9.0) is None and w.over == 1 and w.uncounted == (4, 1.5)  # counted: no warmup's
    w.load_state_dict(saved)
    assert w.uncounted is None


def test_warmup_spikes_go_on_record_one_entry_per_run_of_consecutive_steps():
    """summary.json's spikes: steps 2 and 3 of the warmup are one spike of two steps, step 7
    another; a counted spike recorded between is not grown by a warmup step after it."""
    from stabletrain.engine.divergence import record_spikes

    spikes = []
    record_spikes(spikes, [2], [])
    record_spikes(spikes, [3, 7], [])  # the spike of step 2 goes on into the next interval
    assert spikes == [{"step": 2, "steps": 2, "warmup": True}, {"step": 7, "steps": 1, "warmup": True}]
    record_spikes(spikes, [], [(9, 1)])
    record_spikes(spikes, [10], [])
    assert spikes[-2:] == [{"step": 9, "steps": 1}, {"step": 10, "steps": 1, "warmup": True}]


def test_a_spike_that_begins_in_the_warmup_and_goes_on_past_it_is_one_counted_spike():
    """The warmup's last step spikes and the two steps after it, counted, spike on: one entry of
    three steps from the first, in the same interval or over two; one that begins after a gap is another."""
    from stabletrain.engine.divergence import record_spikes

    one, two = [], []
    record_spikes(one, [5], [(6, 2)])
    record_spikes(two, [5], [])
    record_spikes(two, [], [(6, 2)])
    assert one == two == [{"step": 5, "steps": 3}]
    record_spikes(one, [], [(10, 1)])
    assert one[-1] == {"step": 10, "steps": 1}
    gap = []
    record_spikes(gap, [5], [(7, 1)])
    assert gap == [{"step": 5, "steps": 1, "warmup": True}, {"step": 7, "steps": 1}]


def test_a_steady_rise_in_the_divergence_warmup_still_lifts_the_mean():
    """The cap lets a genuine rise through: losses doubling once in the warmup raise the level to
    the new loss without counting a spike once the warmup ends."""
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3, warmup_steps=40, spike_factor=4.0, ema=0.9)))
    assert w.update(1, 1.0) is None
    for s in range(2, 80):
        assert w.update(s, 6.0) is None, s
    assert w.ema == pytest.approx(6.0, rel=1e-3) and w.over == 0


def test_a_spike_with_skipped_steps_inside_starts_where_its_first_step_was():
    """Skipped (non-finite) steps feed nothing to the watch: a spike at 10, a skip at 11, and
    spikes at 12 and 13 is a spike from step 10, not one counted back from 13 (step 11)."""
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    w = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3, warmup_steps=5, spike_factor=2.0)))
    for s in range(10):
        assert w.update(s, 1.0) is None
    assert w.update(10, 5.0) is None and w.update(11, math.nan, skipped=True) is None
    assert w.update(12, 5.0) is None and w.spike_start(12) == 10
    assert w.update(13, 5.0) == "loss 5 stayed above 2x its running mean 1 for 3 steps, from step 10 to step 13"
    assert w.onset == 10
    again = DivergenceWatch(OmegaConf.structured(DivergenceConfig(window=3)))
    again.load_state_dict(w.state_dict())
    assert again.spike_from == 10


def test_a_run_dates_a_spike_with_a_skipped_step_inside_from_its_first_step(tmp_path, capsys):
    """A spike at step 5, a NaN step at 6: the progress line at 6 and the spike's record date it
    from step 5, not counted back from the last step over the skipped one."""
    s = train(tmp_path, *GPT_LOGGED, "steps=10", "divergence.warmup_steps=2", "debug.spike_at_step=5",
              "debug.nan_at_step=6", quiet=False)
    lines = {int(m.group(1)): x for x in capsys.readouterr().err.splitlines()
             if (m := re.search(r"step (\d+)/10 \|", x))}
    assert "| spike since step 5, " in lines[6], lines[6]
    assert s["spikes"][0]["step"] == 5, s["spikes"]


def test_a_run_that_ends_inside_a_spike_with_skips_inside_dates_it_from_its_first_step():
    """A spike from step 10 with skipped steps at 11 and 13 still open at the end: the unresolved
    spike is said from step 10, and its onset is step 10."""
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


def test_the_divergence_watchs_spike_state_survives_a_resume():
    """A last.pt written during a warm-up spike holds above=True (the loop keeps a checkpoint
    written while it does out of the ring); a state written before ``above`` was kept reads it
    from ``over``, and one with the keys older code kept (``level``, ``above_at``) loads without them."""
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    cfg = OmegaConf.structured(DivergenceConfig(warmup_steps=5, spike_factor=2.0))
    w = DivergenceWatch(cfg)
    w.update(1, 1.0)
    w.update(2, 10.0)
    again = DivergenceWatch(cfg)
    again.load_state_dict(w.state_dict())
    assert (again.above, again.over, again.ema) == (True, 0, w.ema)
    again.load_state_dict({k: v for k, v in w.state_dict().items() if k != "above"})
    assert again.above is False
    again.load_state_dict({**w.state_dict(), "level": 1.0, "above_at": 2})
    assert again.state_dict() == w.state_dict()
