"""A key set for an option the run does not use changes nothing: the run says so (a note, since
a sweep may share such keys across options), and no recipe or group option sets one."""

import pytest

from stabletrain.cli import group_options
from stabletrain.config import unread_keys
from stabletrain.models.registry import unread_model_keys
from tests.helpers import cli, make_cfg


@pytest.mark.parametrize("overrides,note", [
    (["norm.alpha=0.3"], "norm.alpha=0.3 changes nothing: only norm=stablenorm or attention=stable reads it, and "
                         "this run has norm=layernorm, attention=softmax"),
    (["optim=adamw", "optim.tau=0.01"], "optim.tau=0.01 changes nothing: only optim=adamw2 reads it"),
    (["optim=adamw2", "optim.momentum=0.5"], "optim.momentum=0.5 changes nothing: only optim=sgd/lars reads it"),
    (["schedule.milestones=[10]"], "schedule.milestones=[10.0] changes nothing: only schedule=step reads it"),
    (["attention=qknorm", "attention.c=2"], "attention.c=2.0 changes nothing: only attention=stable reads it"),
    (["reparam.gamma_init=svd"], "reparam.gamma_init=svd changes nothing: reparam=none reparametrises no layer"),
    (["deescalate.lambda_=0.5"], "deescalate.lambda_=0.5 changes nothing: deescalate=none adds no de-escalation"),
    (["ema.every=5"], "ema.every=5 changes nothing: the weight average is off"),
    (["norm.eps=1e-6"], "norm.eps=1e-06 changes nothing: only norm=stablenorm/rmsnorm reads it"),
    (["norm.alpha=0.3", "attention=qknorm"], "only norm=stablenorm or attention=stable reads it, and this run has "
                                             "norm=layernorm, attention=qknorm"),
    (["init.gain=0.5"], "init.gain=0.5 changes nothing: init=family keeps the model's own init"),
    (["init.fused_qkv=matrix"], "init.fused_qkv=matrix changes nothing: init=family"),
    (["schedule=constant", "schedule.min_lr=1e-5"], "schedule.min_lr=1e-05 changes nothing: only schedule=cosine"),
    (["schedule=step", "schedule.horizon=100"], "schedule.horizon=100.0 changes nothing: only schedule=cosine"),
    (["divergence.max_rollbacks=5"], "divergence.max_rollbacks=5 changes nothing: a divergence stops the run"),
    (["divergence.lr_scale_on_rollback=0.5"], "set divergence.action=rollback"),
    (["divergence.enabled=false", "divergence.window=5"], "divergence.window=5 changes nothing: the spike check"),
    (["divergence.skip_nonfinite=false", "divergence.max_skips=3"], "divergence.max_skips=3 changes nothing: no step"),
    (["monitor=off", "monitor.stop_on_alert=true"],
     "monitor.stop_on_alert=true changes nothing: monitor=off measures nothing"),
    (["optim=sgd", "optim.betas=[0.8,0.9]"], "optim.betas=[0.8,0.9] changes nothing: only optim=adamw/adamw2"),
    (["optim=lars", "optim.fused=true"], "optim.fused=true changes nothing: only optim=adamw/adamw2 reads it"),
    (["logger=none", "logger.project=mine"], "logger.project=mine changes nothing: wandb is off"),
    (["resume_allow_changes=true"], "resume_allow_changes=true changes nothing: this run resumes nothing"),
    (["monitor.alerts=false", "monitor.entropy_floor=0.2"], "monitor.entropy_floor=0.2 changes nothing: health alerts "
                                                            "are off (monitor.alerts=false)"),
])
def test_a_key_nothing_reads_is_noted(overrides, note):
    notes = unread_keys(make_cfg(*overrides))
    assert len(notes) == 1 and note in notes[0], notes


@pytest.mark.parametrize("overrides", [
    ["norm=stablenorm", "norm.alpha=0.3"], ["optim=sgd", "optim.momentum=0.5"], ["schedule=step",
    "schedule.milestones=[10]"], ["reparam=sigma", "reparam.gamma_init=svd"], ["ema.decay=0.99", "ema.every=5"],
    ["attention=qknorm", "attention.eps=1e-6"],
    ["attention=stable", "norm.alpha=0.3"],  # StableAtten's alpha when attention.alpha is null
    ["norm=rmsnorm", "norm.eps=1e-6"], ["init=stable", "init.gain=0.5"], ["schedule.min_lr=1e-5"],
    ["divergence.action=rollback", "divergence.max_rollbacks=5"],
    # read whatever the option: AdamW²'s own telemetry under monitor=off, fp32 attention without sigmaReparam
    ["optim=adamw2", "monitor=off", "monitor.adamw2_every=10"], ["reparam=none", "reparam.attn_fp32=true"],
    ["logger=wandb_online", "logger.entity=me"], ["resume=auto", "resume_allow_changes=true"],
])
def test_a_key_its_option_reads_is_not_noted(overrides):
    assert unread_keys(make_cfg(*overrides)) == []


@pytest.mark.parametrize("group", ["norm", "attention", "optim", "schedule", "reparam", "deescalate", "monitor",
                                   "experiment"])
def test_no_option_or_recipe_sets_a_key_it_does_not_read(group):
    for option in group_options(group):
        assert unread_keys(make_cfg(f"{group}={option}")) == [], f"{group}={option}"


@pytest.mark.parametrize("overrides,note", [
    (["model=vit_test", "model.dropout=0.1"], "model.dropout=0.1 changes nothing: only model.family=gpt reads it, "
                                              "and this run has model.family=vit"),
    (["model=swin_test", "model.depth=3"], "only model.family=gpt/vit reads it, and this run has model.family=swin; "
                                           "its counterpart there is model.depths"),
    (["model=swin_test", "model.num_heads=8"], "; its counterpart there is model.stage_heads"),
    (["model=gpt_test", "model.drop_path=0.1"], "only model.family=swin/vit reads it"),
    (["model=gpt_test", "model.img_size=64"], "model.img_size=64 changes nothing"),
    (["model=vit_test", "model.vocab_size=100"], "only model.family=gpt reads it"),
])
def test_a_model_key_its_family_does_not_read_is_noted(overrides, note):
    notes = unread_model_keys(make_cfg(*overrides).model)
    assert len(notes) == 1 and note in notes[0], notes


@pytest.mark.parametrize("overrides", [
    ["model=vit_test", "model.drop_path=0.1"], ["model=gpt_test", "model.dropout=0.1"],
    ["model=swin_test", "model.window_size=2"],
])
def test_a_model_key_its_family_reads_is_not_noted(overrides):
    assert unread_model_keys(make_cfg(*overrides).model) == []


@pytest.mark.parametrize("group", ["model", "experiment"])
def test_no_model_or_recipe_sets_a_model_key_its_family_does_not_read(group):
    for option in group_options(group):
        assert unread_model_keys(make_cfg(f"{group}={option}").model) == [], f"{group}={option}"


def test_the_run_prints_the_note(tmp_path, capsys):
    from tests.helpers import train

    train(tmp_path, "model=gpt_test", "steps=1", "batch_size=4", "optim=adamw", "optim.tau=0.01", "logger=none",
          "monitor=off", quiet=False)
    assert "note: optim.tau=0.01 changes nothing" in capsys.readouterr().err


def test_a_key_given_at_its_default_is_noted_too():
    """A sweep's point norm.alpha=0.5 (the default) beside 0.25, under norm=layernorm: both change
    nothing, and both are said; without the command line, the default is not news."""
    cfg = make_cfg("norm.alpha=0.5", "model.dropout=0.0", "model=vit_test")
    assert unread_keys(cfg) == [] and unread_model_keys(cfg.model) == []
    assert [n.split(": ")[1] for n in unread_keys(cfg, given={"norm.alpha"})] == ["norm.alpha=0.5 changes nothing"]
    assert "model.dropout=0.0 changes nothing" in unread_model_keys(cfg.model, given={"model.dropout"})[0]


def test_the_run_notes_a_key_its_command_line_sets_to_the_default(tmp_path, capsys, monkeypatch):
    import stabletrain.build as B
    from tests.helpers import train

    monkeypatch.setattr(B, "task_overrides", lambda: ("+norm.alpha=0.5", "optim=adamw"))
    train(tmp_path, "model=gpt_test", "steps=1", "batch_size=4", "optim=adamw", "logger=none", "monitor=off",
          quiet=False)
    assert "note: norm.alpha=0.5 changes nothing: only norm=stablenorm" in capsys.readouterr().err


def test_the_run_notes_a_model_key_its_command_line_sets_to_the_default(tmp_path, capsys, monkeypatch):
    """A sweep's point model.dropout=0.0 on a ViT (which reads no dropout) is noted, as 0.1 is."""
    import stabletrain.build as B
    from tests.helpers import train

    monkeypatch.setattr(B, "task_overrides", lambda: ("model=vit_test", "model.dropout=0.0"))
    train(tmp_path, "model=vit_test", "model.dropout=0.0", "steps=1", "batch_size=4", "optim=adamw",
          "logger=none", "monitor=off", quiet=False)
    assert "note: model.dropout=0.0 changes nothing" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,error", [
    (["model=gpt_test", "data.path=/some/train.bin"],
     "data.path=/some/train.bin is read by data=tokens only, and data=auto picks pytext for a gpt model: "
     "add data=tokens"),
    (["model=gpt_test", "data=pytext", "data.path=/some/text.txt"], "and this run has data=pytext: add data=tokens"),
    (["model=vit_test", "data.root=/some/images"],
     "data.root=/some/images is read by data=cifar10/cifar100/imagefolder only, and data=auto picks digits for a "
     "vit model: add the one it belongs to"),
])
def test_a_data_path_the_chosen_data_set_does_not_read_is_refused(overrides, error):
    """Trained past, it would train on the embedded data instead of the user's files."""
    from stabletrain.build import validate
    from stabletrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*overrides))
    assert error in str(e.value) and "\n" not in str(e.value)
    # a point of a sweep over data sets (data=auto,tokens data.path=...): the path is for the others
    from stabletrain.build import unread_data_notes

    validate(make_cfg(*overrides), swept={"data"})
    key = next(o.split("=")[0] for o in overrides if o.startswith(("data.path", "data.root")))
    assert [n for n in unread_data_notes(make_cfg(*overrides)) if n.startswith(f"note: {key}=")]


@pytest.mark.parametrize("overrides,notes", [
    (["model=vit_test", "data.tokenizer=gpt2"],
     ["note: data.tokenizer=gpt2 changes nothing: only data=pytext reads it, and this run has data=digits"]),
    (["model=gpt_test", "data.randaug=rand-m9-mstd0.5", "data=tokens", "data.path=x"], None),  # refused: text
    (["model=gpt_test", "data=tokens", "data.path=x", "data.val_fraction=0.5", "data.num_workers=2"],
     ["note: data.val_fraction=0.5 changes nothing: only data=digits/pytext reads it, and this run has data=tokens",
      "note: data.num_workers=2 changes nothing: only data=cifar10/cifar100/imagefolder reads it, and this run has "
      "data=tokens"]),
    (["model=vit_test", "data.val_fraction=0.5"], []),
    (["model=gpt_test", "data.tokenizer=gpt2"], []),
])
def test_a_data_key_the_chosen_data_set_does_not_read_is_noted(overrides, notes):
    from stabletrain.build import unread_data_notes, validate
    from stabletrain.errors import ConfigError

    if notes is None:  # image augmentation on a text data set is refused, not merely noted
        with pytest.raises(ConfigError, match=r"^data.randaug is image augmentation; a gpt model trains on text"):
            validate(make_cfg(*overrides))
        return
    assert sorted(unread_data_notes(make_cfg(*overrides))) == sorted(notes)


def test_a_data_key_given_at_its_default_is_noted_as_the_others_are():
    """A sweep's point at the default (data.erasing=0 of data.erasing=0,0.25 on the digits) says
    what the other points say, as for every other group's keys (README, "changes nothing")."""
    from stabletrain.build import unread_data_notes

    cfg = make_cfg("model=vit_test", "data.erasing=0.0", "data.tokenizer=byte", "data.val_fraction=0.2")
    assert unread_data_notes(cfg) == []  # not given: said only away from the default
    assert sorted(unread_data_notes(cfg, {"data.erasing", "data.tokenizer", "data.val_fraction"})) == [
        "note: data.erasing=0.0 changes nothing: only data=cifar10/cifar100/imagefolder reads it, and this run has "
        "data=digits",
        "note: data.tokenizer=byte changes nothing: only data=pytext reads it, and this run has data=digits"]


@pytest.mark.parametrize("option", group_options("data"))
def test_no_data_option_sets_a_data_key_it_does_not_read(option):
    from stabletrain.build import unread_data_notes
    from stabletrain.errors import ConfigError

    extra = {"tokens": ["data.path=x"], "imagefolder": ["data.root=x"]}.get(option, [])
    fits = []
    for model in ("model=vit_test", "model=gpt_test"):
        cfg = make_cfg(model, f"data={option}", *extra)
        try:
            notes = unread_data_notes(cfg)
        except ConfigError as e:  # a data set of the other kind is refused, not noted
            assert f"data={option} does not fit {model}" in str(e), e
            continue
        assert notes == [], option
        fits.append(model)
    # every data set is one family's (data=auto either's): a refusal of both would check nothing above
    assert len(fits) == (2 if option == "auto" else 1), (option, fits)


def test_a_short_run_is_told_when_its_monitor_passes_run():
    """The entropy alerts come from the probe pass: in a 200-step run at the default cadence it
    ran at steps 0 and 200 only, so a collapse at step 50 was reported at the end; a 150-step run's
    sigma1 and SEC curves were three points."""
    from stabletrain.build import cadence_note

    cfg = make_cfg("model=gpt_test")  # weight_every=100, probe_every=200
    assert cadence_note(cfg.monitor, 300) == (
        "note: in this 300-step run the probe pass (attention entropy and its alerts) runs at steps 0, 200 and 300 "
        "(monitor.probe_every=200); monitor.probe_every=30 watches it ten times")
    assert cadence_note(cfg.monitor, 150) == (
        "note: in this 150-step run the weight pass (sigma1, SEC, the QK spectrum) runs at steps 0, 100 and 150 "
        "(monitor.weight_every=100) and the probe pass (attention entropy and its alerts) at steps 0 and 150 "
        "(monitor.probe_every=200); monitor.weight_every=15 monitor.probe_every=15 watch each ten times")
    assert "at steps 0, 200, 400 and 450 (" in cadence_note(cfg.monitor, 450)
    assert cadence_note(cfg.monitor, 600) is None  # the default run: six weight passes, four probes
    # a run shorter than ten steps watches at every step at most ("ten times" in a 3-step run)
    assert cadence_note(cfg.monitor, 3).endswith(
        "monitor.weight_every=1 monitor.probe_every=1 watch each at every step")
    assert cadence_note(cfg.monitor, 299) is not None and "weight pass" not in cadence_note(cfg.monitor, 300)
    quiet = make_cfg("model=gpt_test", "monitor.alerts=false").monitor
    assert "the probe pass (attention entropy) at steps 0 and 200" in cadence_note(quiet, 200)


def test_a_resumed_run_is_told_the_passes_still_to_come(tmp_path, capsys):
    """Resumed at step 30 of 60: the probe pass ran at step 0 in the first process; the start line
    names those after step 30 only."""
    from stabletrain.build import cadence_note
    from tests.helpers import train

    cfg = make_cfg("model=gpt_test")  # probe_every=200
    note = cadence_note(cfg.monitor, 60, start=30)
    assert "run, from step 30, the weight pass (sigma1, SEC, the QK spectrum) runs at step 60 only" in note
    assert "the probe pass (attention entropy and its alerts) at step 60 only (monitor.probe_every=200)" in note
    assert cadence_note(cfg.monitor, 60, start=60) is None  # resumed at its last step: no pass to come
    args = ["model=gpt_test", "batch_size=4", "logger=none", "eval_every=1000", "monitor.weight_every=40",
            "monitor.probe_every=50"]
    train(tmp_path, *args, "steps=2", quiet=False)
    assert "runs at steps 0 and 2 (monitor.weight_every=40)" in capsys.readouterr().err
    train(tmp_path, *args, "steps=60", "resume=auto", quiet=False)
    err = capsys.readouterr().err
    assert ("note: in this 60-step run, from step 2, the weight pass (sigma1, SEC, the QK spectrum) runs at steps 40 "
            "and 60 (monitor.weight_every=40) and the probe pass (attention entropy and its alerts) at steps 50 and 60 "
            "(monitor.probe_every=50)") in err, err


def test_a_short_adamw2_run_is_told_when_its_per_tensor_rates_are_logged():
    """AdamW²'s per-tensor rates are logged at multiples of monitor.adamw2_every and at the last
    step, monitors on or off: a 100-step run's adamw2_lr.png was two points, unannounced."""
    from stabletrain.build import cadence_note

    cfg = make_cfg("model=gpt_test", "optim=adamw2")  # adamw2_every=50
    assert cadence_note(cfg.monitor, 100, passes=(), adamw2=True) == (
        "note: in this 100-step run AdamW²'s per-tensor rates (adamw2_lr.png) are logged at steps 50 and 100 "
        "(monitor.adamw2_every=50); monitor.adamw2_every=10 watches it ten times")
    assert "(adamw2_lr.png) at step 40 only (monitor.adamw2_every=50)" in cadence_note(cfg.monitor, 40, adamw2=True)
    assert cadence_note(cfg.monitor, 150, passes=(), adamw2=True) is None
    assert "adamw2" not in cadence_note(cfg.monitor, 100, passes=("weight", "entropy"), adamw2=False)
    assert cadence_note(cfg.monitor, 100, passes=(), adamw2=False) is None


def test_a_run_too_short_for_adamw2s_bound_and_a_batch_over_the_data_are_noted():
    """vit_test, 100 steps of AdamW² at tau 0.004, ended below chance: sigma1 could grow 1.5x."""
    from stabletrain.build import batch_over_data_note, short_bound_note
    from stabletrain.data import Data

    optim = make_cfg("model=vit_test", "optim.tau=0.004").optim
    assert short_bound_note(optim, 100) == (
        "note: optim=adamw2 bounds each update to tau=0.004 x sigma1(W), so in these 100 steps a weight matrix's "
        "sigma1 can grow 1.49x at most: where the loss falls slowly, that is the likely limit (more steps, a larger "
        "optim.tau, or optim=adamw)")
    assert f"{1.004 ** 100:.3g}" == "1.49" and short_bound_note(optim, 600) is None  # the default run: 11x
    two = short_bound_note(make_cfg("model=vit_test", "optim.tau=0.01").optim, 2)
    assert "in these 2 steps a weight matrix's sigma1 can grow 1.02x at most" in two  # not "1x"
    assert short_bound_note(make_cfg("model=vit_test", "optim=adamw").optim, 100) is None
    gpt = make_cfg("model=gpt_test", "optim.tau=0.01").optim  # GPT's tau: noted below 10x, up to 231 steps
    assert "231 steps a weight matrix's sigma1 can grow 9.96x" in short_bound_note(gpt, 231)
    assert short_bound_note(gpt, 232) is None
    # paper-length runs: (1 + tau)^steps overflows a float (adamw2_gpt2_s: 1.01^600000; Swin-S on
    # ImageNet: 1.004^375300); they grow far past 10x and get no note, not an OverflowError
    assert short_bound_note(gpt, 600_000) is None and short_bound_note(optim, 375_300) is None
    images = Data("vision", 1438)
    assert batch_over_data_note(images, 4096) == ("note: a batch (4096 samples) holds 2.85x the 1438 training "
                                                  "samples: each step sees them repeated (a smaller batch_size, or "
                                                  "more data)")
    assert batch_over_data_note(images, 1438) is None
    assert batch_over_data_note(Data("text", 1000, seq_len=64), 16) == (
        "note: a batch (1024 tokens) holds 1.02x the 1000 training tokens: each step sees them repeated (a smaller "
        "batch_size, or more data)")


@pytest.mark.parametrize("overrides", [["experiment=adamw2_gpt2_s"],
                                       ["experiment=adamw2_swin_s", "steps=375300"],  # 300 ImageNet epochs
                                       ["experiment=adamw2_vit_b", "steps=187650"]])  # 150 ImageNet epochs
def test_adamw2_paper_recipes_at_paper_length_build(overrides, tmp_path):
    """The AdamW² recipes at their papers' lengths describe themselves (dry run) instead of
    failing in the short-run note with an OverflowError."""
    r = cli(*overrides, "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dry run: nothing trained" in r.stdout + r.stderr


def test_the_cadence_note_names_only_the_passes_the_monitors_run_on_this_model():
    """A model of other blocks: the monitors read its output's log Z alone (the start line before
    says so), and the note on a short run's passes advertised the weight pass and attention entropy."""
    from stabletrain.build import cadence_note

    cfg = make_cfg("model=vit_test")  # weight_every=100, probe_every=200
    assert cadence_note(cfg.monitor, 100, passes=("log_z",)) == (
        "note: in this 100-step run the probe pass (the output's log Z) runs at steps 0 and 100 "
        "(monitor.probe_every=200); monitor.probe_every=10 watches it ten times")
    timm = cadence_note(cfg.monitor, 100, passes=("weight", "log_z"))
    assert "the weight pass (sigma1, SEC, the QK spectrum) runs at steps 0 and 100" in timm
    assert "the probe pass (the output's log Z)" in timm and "entropy" not in timm
