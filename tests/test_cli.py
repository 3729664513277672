"""What a new user meets on the command line: one line for each mistake, and a dry run."""

import re
import shutil
import sys

import pytest

from stabletrain.build import validate
from stabletrain.errors import ConfigError
from tests.helpers import cli, make_cfg, model_of


@pytest.mark.parametrize("args,needle", [
    (["+foo=1"], "unknown key 'foo'"),
    (["optim.lrr=0.1"], "unknown key 'optim.lrr': did you mean optim.lr?"),
    # a prefix that is no node (train.yaml's name, or cfg.): the key without it
    (["train.imports=[x.py]"], "unknown key 'train.imports': did you mean imports?"),
    (["optim.betas=0.9"], "optim.betas takes a list: write it in brackets, optim.betas=[x,y,...]"),
    (["experiment=locater_1layer", "model=gpt_test"], "experiment=locater_1layer sets its own model"),
    (["-m", "hydra/launcher=slurm", "optim.lr=1,2"], "no sbatch nor srun on this machine"),
    # Hydra's own groups compose after the checks: its 12 lines, exit code 1
    (["-m", "hydra/launcher=slrum", "optim.lr=1,2"], "hydra/launcher=slrum is not an option of 'hydra/launcher'; "
                                                     "choose one of: basic, slurm, submitit_local, submitit_slurm "
                                                     "(did you mean slurm?)"),
    # Hydra launches sweeps only: without -m the run trained on the login node, without a word
    (["hydra/launcher=slurm", "optim.lr=1"], "hydra/launcher=slurm launches the points of a sweep: add -m (a single "
                                             "run is a one-point sweep), or drop it to train here"),
    (["-m", "--cfg", "job", "optim.lr=1,2"], "--cfg prints the config of one run, and -m launches a sweep"),
    (["regularizer.locater.scale_coef=100"], "the locater loss term, which is not active: add regularizer=locater"),
    (["-m", "regularizer=none,locater", "regularizer.locater.scale_coef=10"],
     "in a sweep with and without it, the points without it (regularizer=none) cannot take its parameters: sweep "
     "them under regularizer=locater (a coefficient of 0 turns its part off), or launch those points as a command "
     "of their own (sweep point regularizer=none; no point was launched)"),
    # a misspelt parameter of an active term (chosen here, or by a recipe) is a misspelling
    (["regularizer=[locater,zloss]", "regularizer.zloss.coeff=1"],
     "unknown key 'regularizer.zloss.coeff': did you mean regularizer.zloss.coef?"),
    (["experiment=locater_1layer", "regularizer.locater.xyz=1"],
     "unknown key 'regularizer.locater.xyz': the locater loss term's parameters are: scale_coef, mean_coef"),
    (["+model.kwarg.depth=2"], "unknown key 'model.kwarg.depth': did you mean +model.kwargs.depth?"),
    (["+optim.lrr=2"], "unknown key 'optim.lrr': did you mean optim.lr (without the '+')?"),
    (["+optim.lr=2"], "optim.lr is a key of the config already: drop the '+' (optim.lr=2)"),
    # printing the config checks it first
    (["--cfg", "job", "optim.lrr=0.1"], "unknown key 'optim.lrr': did you mean optim.lr?"),
    (["--cfg=job", "norm.alpha=2"], "norm.alpha=2.0 must be in [0, 0.5]"),
    # a list of loss terms names the one that is none (it read as if the list were the mistake)
    (["regularizer=[locater,zlos]"], "error: regularizer=[locater,zlos]: zlos is not an option of 'regularizer'; "
                                     "choose from: locater, none, zloss (did you mean zloss?)"),
    # 1e3 is a float to the override grammar: the line quoted 1000.0 and said no more
    (["steps=1e3"], "error: steps=1000.0 must be an integer, written without an exponent or a decimal point: "
                    "steps=1000"),
])
def test_silent_overrides_and_tracebacks_are_one_line(tmp_path, args, needle):
    r = cli(*args, f"hydra.run.dir={tmp_path}", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("key,hint", [
    ("optim.tua", "did you mean optim.tau?"),               # a misspelt key
    ("otpim.lr", "did you mean optim.lr?"),                 # a misspelt node
    ("divergence.spike", "did you mean divergence.spike_factor?"),  # a key's start
    ("batchsize", "did you mean batch_size?"),
    ("lr", "did you mean optim.lr?"),                       # a key of a group, set at the top
    ("alpha", "did you mean norm.alpha or attention.alpha?"),
    ("ema.zzz", "ema has no such key; its keys: decay, every, warmup"),
    ("optim.LR", "did you mean optim.lr?"),                 # the leaf in capitals (Optim.lr was found)
    ("zzz", None),                                          # the general message, listing the groups
    # the names of nanoGPT's and timm's train scripts, at the top or under the node they would be in
    ("n_embd", "here, nanoGPT's n_embd is model.embed_dim"),
    ("model.n_layer", "here, nanoGPT's n_layer is model.depth"),
    ("max_iters", "here, nanoGPT's max_iters is steps"),
    ("opt", "here, timm's opt is optim"),
    ("reprob", "here, timm's reprob is data.erasing"),
    ("initial_checkpoint",
     "here, timm's initial_checkpoint is init_weights (the weights only; resume continues a run)"),
])
def test_a_misspelt_key_gets_the_nearest_key_of_the_schema(key, hint):
    from stabletrain.cli import _nearest_key, schema_keys

    assert _nearest_key(key) == hint
    assert {"optim.lr", "divergence.spike_factor", "model.depth", "batch_size"} <= set(schema_keys())


def test_a_key_given_twice_is_said_once_checked(capsys):
    """``make train ARGS=...`` appends to a base command: Hydra takes the last value without a word."""
    from stabletrain.cli import check_overrides, given_twice

    assert given_twice(["model=gpt_test", "optim.lr=1e-3", "steps=2"]) is None
    assert given_twice(["model=gpt_test", "model=vit_test", "optim.lr=1e-3", "+optim.lr=2e-3"]) == (
        "note: model=gpt_test, then model=vit_test: the last counts; optim.lr=1e-3, then +optim.lr=2e-3: the last "
        "counts")
    check_overrides(["model=gpt_test", "model=vit_test", "steps=2"])
    assert capsys.readouterr().err.strip() == "note: model=gpt_test, then model=vit_test: the last counts"


def test_the_foreign_names_are_no_keys_of_the_schema_and_point_at_keys_that_are():
    """A name of nanoGPT's or timm's that were a key here would hide it; each points at a real key."""
    from stabletrain.cli import FOREIGN_KEYS, group_options, is_group, schema_keys

    keys = schema_keys()
    assert not {k.rpartition(".")[2] for k in keys} & set(FOREIGN_KEYS)
    for _whose, target in FOREIGN_KEYS.values():
        key, _, option = target.split()[0].rstrip(":").partition("=")
        assert key in keys or is_group(key) or key == "hydra.run.dir", target
        assert not is_group(key) or not option or option in group_options(key), target


@pytest.mark.parametrize("args,line", [
    # pasted from a paper or a word processor
    (["optim=adamw²"], "cannot parse optim=adamw²: the override grammar takes no '²'; did you mean optim=adamw2?"),
    (["optim.lr=1e−3"], "cannot parse optim.lr=1e−3: the override grammar takes no '−'; did you mean optim.lr=1e-3?"),
    # a sweep without -m: Hydra printed a list of three ways out, and exited 1
    (["optim.lr=1e-3,1e-2"], "optim.lr=1e-3,1e-2 gives several values: add -m to run one point per value"),
    (["optim=adamw,lars"], "optim=adamw,lars gives several values: add -m"),
    (["--cfg", "job", "optim.lr=range(1,3)"], "gives several values: --cfg prints the config of one run: give it one"),
    # timm's and argparse's flags: Hydra's usage block named the flag's value among the "unrecognized arguments"
    (["--model", "vit_test", "--epochs", "5"], "--model vit_test: train.py takes overrides key=value, without dashes: "
                                               "model=vit_test"),
    (["--drop-path=0.1"], "--drop-path=0.1: train.py takes overrides key=value, without dashes: model.drop_path=0.1"),
    (["steps=3", "--smoothing", "0.1"], "--smoothing 0.1: train.py takes overrides key=value, without dashes: "
                                        "data.label_smoothing=0.1"),
    (["drop-path=0.1"], "unknown key 'drop-path': keys are written with '_': did you mean model.drop_path?"),
    (["--wandb_log", "True"], "--wandb_log True: train.py takes overrides key=value, without dashes: "
                              "logger=wandb_online"),
    # Hydra's grammar beyond key=value: ++ adds a key too, a dict into an empty struct, sweeps the
    # basic sweeper cannot take, hydra.mode=MULTIRUN as -m, and Hydra's working-directory change
    (["++optim.lrr=0.1"], "unknown key 'optim.lrr': did you mean optim.lr (without the '++')?"),
    (["norm.kwargs={g0:2.5,g1:1}"], "norm.kwargs={g0:2.5,g1:1}: norm.kwargs takes its arguments one by one: "
                                    "+norm.kwargs.g0=2.5 +norm.kwargs.g1=1"),
    (["-m", "optim.lr=interval(0.001,0.01)"], "interval() is for a sweeper that samples (hydra/sweeper=optuna"),
    (["-m", "model=glob(zz*)"], "model=glob(zz*) picks none of model's options (gpt2_l, "),
    (["hydra.mode=MULTIRUN", "optim.lr=-1,1"], "must be > 0 (e.g. optim.lr=1e-3) (sweep point optim.lr=-1; no point "
                                               "was launched)"),
    (["hydra.mode=MULTIRUN", "--cfg", "job"], "and hydra.mode=MULTIRUN launches a sweep: drop hydra.mode=MULTIRUN"),
    (["experiment=null"], "leave it out for no recipe (~experiment drops one a config of yours chose)"),
    (["-cd", "/nonexistent/stabletrain", "model=mine"], "--config-dir /nonexistent/stabletrain: no such folder"),
])
def test_an_override_hydra_cannot_take_is_one_line_with_the_fix(args, line, capsys):
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit) as e:
        check_overrides(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and line in err[0]


@pytest.mark.parametrize("override,line", [
    ("optim.lr=fast", "optim.lr=fast must be a number, e.g. optim.lr=0.001"),
    ("optim.power_iters=2.5", "optim.power_iters=2.5 must be an integer, e.g. optim.power_iters=3"),
    ("steps=abc", "steps=abc must be an integer, or null"),
    ("compile=maybe", "compile=maybe must be true or false, or null"),
    ("schedule.unit=days", "schedule.unit=days is not one of: steps, epochs"),
    ("optim.tau=abc", "optim.tau=abc must be a number, or null"),  # no example to give
    # timm's SwinTransformer(num_heads=(3, 6)): here Swin's own key
    ("model.num_heads=[3,6]", "model.num_heads=[3, 6] must be an integer, e.g. model.num_heads=12; under "
                              "model.family=swin its counterpart is model.stage_heads"),
])
def test_a_value_of_the_wrong_type_names_the_type_wanted(override, line):
    from stabletrain.cli import compose_config, explain

    with pytest.raises(Exception) as e:
        compose_config([override])
    assert explain(e.value, [override]) == line


@pytest.mark.parametrize("sub,needle", [("", "is a file"), ("/run", "is below")])
def test_a_run_dir_that_cannot_be_a_directory_is_one_line(tmp_path, sub, needle):
    (tmp_path / "f").write_text("")
    r = cli("model=vit_test", f"hydra.run.dir={tmp_path}/f{sub}")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_dry_run_prints_the_parameter_table_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    r = cli("model=vit_test", "dry_run=true", "logger=none", f"hydra.run.dir={run}", "steps=50", "warmup=60",
            "schedule=step", "schedule.milestones=[30,50,80]")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "blocks.*" in r.stderr and "total" in r.stderr and "dry run: nothing trained" in r.stderr
    # the start line of the run, without a run dir, and its schedule in steps
    assert re.search(r"^vit_test: [\d.]+K params on cpu, 50 steps of \d+ images \(1 micro-batch\(es\) of \d+ x 1 "
                     r"rank\(s\)\)$", r.stderr, re.M), r.stderr
    assert "\nschedule: warmup 60 steps to lr 0.001, then x0.1 at step(s) 30, 50, 80\n" in r.stderr
    # the data, as a run's start lines say it too: how much, and how many passes the run makes
    assert re.search(r"^data: digits \(data=auto\), 1438 training samples \(359 val\), (\d+) steps per epoch, "
                     r"[\d.]+ epochs$", r.stderr, re.M), r.stderr
    # what the run would warn of, the dry run says too
    assert "the warmup (60 steps) is as long as the run (50 steps) or longer: the learning rate never" in r.stderr
    assert "schedule.milestones at step(s) 50, 80 are past the run's 50 steps" in r.stderr
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
    assert not (run / ".hydra").exists()  # Hydra's record neither: over a run's, it replaced its overrides
    assert not run.exists()  # nor an empty directory


def test_a_dry_run_and_a_dry_sweep_leave_no_folders_behind(tmp_path):
    """The folders a dry run's directory made new (outputs/<date>/...) go with it, those that were
    there stay; a dry sweep's multirun.yaml goes with its new directory, and in a sweep's own
    directory the earlier multirun.yaml is left as it was."""
    (tmp_path / "here").mkdir()
    base = ("model=vit_test", "dry_run=true", "logger=none")
    r = cli(*base, f"hydra.run.dir={tmp_path}/here/day/run")
    assert r.returncode == 0 and sorted(p.name for p in tmp_path.rglob("*")) == ["here"], r.stderr[-2000:]
    r = cli("-m", *base, "seed=1,2", f"hydra.sweep.dir={tmp_path}/day/sweep")
    assert r.returncode == 0 and sorted(p.name for p in tmp_path.rglob("*")) == ["here"], r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "dry run of a sweep of 2 points: nothing trained, nothing written"
    r = cli(*base, f"hydra.run.dir={tmp_path}/here/../there/run")  # Hydra's directory is there/run
    assert r.returncode == 0 and not (tmp_path / "there").exists(), r.stderr[-2000:]
    # a folder named on the way that was not there: Hydra makes it as well as the run's (a/../b makes a and b)
    r = cli(*base, f"hydra.run.dir={tmp_path}/gone/../there/run")
    assert r.returncode == 0 and sorted(p.name for p in tmp_path.rglob("*")) == ["here"], r.stderr[-2000:]
    r = cli("-m", *base, "seed=1,2", f"hydra.sweep.dir={tmp_path}/gone/../there")
    assert r.returncode == 0 and sorted(p.name for p in tmp_path.rglob("*")) == ["here"], r.stderr[-2000:]
    r = cli("-m", *base, "seed=1,2", f"hydra.sweep.dir={tmp_path}/here")  # a folder that was there stays, empty
    assert r.returncode == 0 and not any((tmp_path / "here").iterdir()), r.stderr[-2000:]
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "multirun.yaml").write_text("earlier\n")
    r = cli("-m", *base, "seed=1,2", f"hydra.sweep.dir={tmp_path}/sweep")
    assert r.returncode == 0 and (tmp_path / "sweep" / "multirun.yaml").read_text() == "earlier\n", r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["multirun.yaml"]


def test_gpt_refuses_non_causal_deescalation():
    with pytest.raises(ConfigError, match="deescalate.causal=false would mix later tokens"):
        validate(make_cfg("model=gpt_test", "deescalate=block", "deescalate.causal=false"))


def test_image_augmentation_on_text_is_refused():
    with pytest.raises(ConfigError, match="data.mixup is image augmentation"):
        validate(make_cfg("model=gpt_test", "data.mixup=0.8"))


@pytest.mark.parametrize("override,what", [("data.label_smoothing=0.1", "the image classifier's loss"),
                                           ("data.repeated_aug=2", "repeated augmentation of images"),
                                           ("data.img_size=8", "the images' size")])
def test_an_image_classifiers_setting_on_text_is_refused_not_ignored(override, what):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=gpt_test", override))
    key = override.split("=")[0]
    assert str(e.value) == f"{override} sets {what}; a gpt model trains on text: remove {key}"
    # a sweep over model families: its image points read it, its text points say it changes nothing
    validate(make_cfg("model=gpt_test", override), swept={"model"})
    from stabletrain.build import unread_data_notes

    assert unread_data_notes(make_cfg("model=gpt_test", override)) == [
        f"note: {override} changes nothing: it sets {what}, and this run trains on text (data=pytext)"]


def test_a_swin_stage_without_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"model.depths=\[1, 0\]: every stage needs at least one block"):
        validate(make_cfg("model=swin_test", "model.depths=[1,0]"))


def test_a_list_of_options_of_ones_own_group_is_refused_too(tmp_path, capsys):
    """check_values sees a point's hydra.searchpath: a group only there is a group."""
    from stabletrain.cli import check_overrides

    for option in ("a", "b"):
        (tmp_path / "mine").mkdir(exist_ok=True)
        (tmp_path / "mine" / f"{option}.yaml").write_text("# @package _global_\nseed: 1\n")
    with pytest.raises(SystemExit):
        check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "+mine=[a,b]"])
    assert capsys.readouterr().err.startswith("error: +mine=[a,b]: mine takes one option; a list merges the mine "
                                              "options into one")


def test_hydras_sweeps_and_config_dir_flag_are_checked_as_hydra_reads_them(tmp_path, monkeypatch, capsys):
    """glob() expands over the group's options (it needs Hydra's loader, which the checks lack);
    hydra.mode=MULTIRUN sweeps as -m does; --config-dir's options are options, its runs checked."""
    from stabletrain.cli import _sweep_points, check_overrides

    assert _sweep_points(["model=glob(vit_t*)", "seed=1"]) == [["model=vit_test", "seed=1"]]
    assert _sweep_points(["model=glob([gpt_t*,swin_t*])"]) == [["model=gpt_test"], ["model=swin_t"],
                                                                 ["model=swin_test"]]
    assert _sweep_points(["+experiment=glob(stable_vit*)"]) == [["+experiment=stable_vit_l"],
                                                                ["+experiment=stable_vit_s_cifar100"]]
    check_overrides(["hydra.mode=MULTIRUN", "seed=1,2", "model=vit_test"])  # a sweep: takes several values
    # ++ sets a key the yaml of a loss term declares; an empty dict into kwargs changes nothing
    check_overrides(["regularizer=zloss", "++regularizer.zloss.coef=1e-4", "model=gpt_test"])
    check_overrides(["model.kwargs={}"])
    (tmp_path / "model").mkdir()
    shutil.copy("configs/model/vit_test.yaml", tmp_path / "model" / "mine.yaml")
    for flags in (["-cd", str(tmp_path)], [f"--config-dir={tmp_path}"]):
        check_overrides([*flags, "model=mine"])
        with pytest.raises(SystemExit):
            check_overrides([*flags, "model=mine", "optim.lrr=1"])
        assert capsys.readouterr().err.strip() == "error: unknown key 'optim.lrr': did you mean optim.lr?"
    with pytest.raises(SystemExit):  # a searchpath given too: both are looked in
        check_overrides(["-cd", str(tmp_path), "hydra.searchpath=[file://examples/conv_stem/configs]", "model=minee"])
    err = capsys.readouterr().err
    assert "choose one of: conv_vit_mini, conv_vit_test, gpt2_l," in err and ", mine, " in err, err


def test_a_primary_config_of_ones_own_is_checked_as_hydra_composes_it(tmp_path, capsys):
    """--config-path / --config-name choose the config Hydra composes (a relative path from
    train.py's folder): the checks compose the same one, and say in one line what is missing."""
    from stabletrain.cli import PRIMARY, CONFIG_DIR, check_overrides, compose_config

    shutil.copytree("configs", tmp_path, dirs_exist_ok=True)
    shutil.copy("configs/model/vit_test.yaml", tmp_path / "model" / "mine.yaml")
    (tmp_path / "short.yaml").write_text((tmp_path / "train.yaml").read_text().replace("steps: 600", "steps: -5"))

    def error(argv):
        with pytest.raises(SystemExit):
            check_overrides(argv)
        return capsys.readouterr().err.strip()

    check_overrides(["-cp", str(tmp_path), "model=mine"])  # its own folder's options are options
    assert error(["model=mine"]).startswith("error: model=mine is not an option of 'model'")
    assert error([f"--config-path={tmp_path}", "model=mine", "optim.lrr=1"]) == (
        "error: unknown key 'optim.lrr': did you mean optim.lr?")
    for flags in (["-cp", str(tmp_path), "-cn", "short"], [f"--config-path={tmp_path}", "--config-name=short.yaml"]):
        assert error([*flags, "model=vit_test"]) == "error: steps=-5 must be > 0"
    check_overrides(["-cp", str(tmp_path), "-cn", "short", "steps=5"])
    check_overrides(["--config-path", "configs", "--config-name", "train"])  # the default, named
    assert error(["-cn", "shorts"]) == (
        f"error: --config-name shorts: no shorts.yaml in {CONFIG_DIR}; the configs there: train")
    nope = tmp_path / "nope"
    assert error(["-cp", str(nope)]).startswith(f"error: --config-path {nope}: no such folder")
    (tmp_path / "empty").mkdir()
    assert error(["-cp", str(tmp_path / "empty")]) == (
        f"error: --config-path {tmp_path / 'empty'}: {tmp_path / 'empty'} holds no train.yaml; add one (copy "
        f"configs/train.yaml) or name yours with --config-name")
    assert PRIMARY.get() == (CONFIG_DIR, "train", None) and compose_config(["model=vit_test"]).steps == 600
    # --config-dir DIR --config-name NAME: the name found in DIR (Hydra searches it for the primary
    # config too), configs/ still searched for the groups
    own = tmp_path / "own"
    own.mkdir()
    shutil.copy(tmp_path / "short.yaml", own / "mine.yaml")
    assert error(["-cd", str(own), "-cn", "mine", "model=vit_test"]) == "error: steps=-5 must be > 0"
    check_overrides(["-cd", str(own), "-cn", "mine", "steps=5", "model=vit_test"])
    (own / "model").mkdir()  # configs/ is searched first, as Hydra does: its vit_test is the one composed
    (own / "model" / "vit_test.yaml").write_text("name: vit_test\nfamily: vit\nembed_dim: lots\n")
    check_overrides(["-cd", str(own), "-cn", "mine", "steps=5", "model=vit_test"])
    assert error(["-cd", str(own), "-cn", "mine", "steps=5", "model=vit_tst"]).startswith(
        "error: model=vit_tst is not an option of 'model'; choose one of: gpt2_l,")
    # a primary config elsewhere that names configs/ in its own hydra.searchpath: its groups' options are known
    (own / "far.yaml").write_text((tmp_path / "train.yaml").read_text().replace(
        "hydra:\n", f"hydra:\n  searchpath: [file://{CONFIG_DIR}]\n", 1)
        .replace("    dir: outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}_${name}", f"    dir: {tmp_path}/fixed"))
    assert error(["-cp", str(own), "-cn", "far", "model=vit_tst"]).startswith(
        "error: model=vit_tst is not an option of 'model'; choose one of: gpt2_l,")
    check_overrides(["-cp", str(own), "-cn", "far", "--cfg", "hydra", "--resolve"])  # its run dir reads no ${name}
    assert error(["-cn", "experiment/adamw_vit_b"]) == (
        "error: --config-name experiment/adamw_vit_b: experiment/ holds the options of a group, chosen with "
        "experiment=adamw_vit_b (the primary config is a whole run's, like configs/train.yaml)")
    (own / "twice.yaml").write_text((tmp_path / "train.yaml").read_text() + "\nseed: 1\nseed: 2\n")
    assert re.fullmatch(rf"error: {own}/twice.yaml does not parse: found duplicate key seed at line \d+",
                        error(["-cd", str(own), "-cn", "twice"]))
    (own / "model" / "broken.yaml").write_text("name: broken\nfamily: [vit\n")
    for flags in (["model=broken"], ["-m", "model=vit_test,broken"]):  # the option's file is named, not train.yaml
        assert error(["-cd", str(own), *flags]) == (f"error: {own}/model/broken.yaml does not parse: expected ',' or "
                                                    f"']', but got '<stream end>' at line 3")
    (own / "bare.yaml").write_text((tmp_path / "train.yaml").read_text().replace("  - train_schema\n", ""))
    for flags in ([], ["--help"]):  # every key would be "not in struct"; --help's page was a traceback
        assert error(["-cd", str(own), "-cn", "bare", *flags]) == (
            f"error: {own}/bare.yaml is not a run's config: its defaults list lacks train_schema (the first entry of "
            f"configs/train.yaml's, which types every key)")


@pytest.mark.parametrize("argv,flag", [
    (["-m"], "-m"), (["--multirun"], "--multirun"), (["hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN"),
    (["+hydra.mode=RunMode.MULTIRUN"], "+hydra.mode=RunMode.MULTIRUN"),  # Hydra takes the enum's name
    (["hydra.mode=multirun"], None),  # Hydra refuses it: no sweep, its own error
    (["hydra.mode=RUN", "seed=1"], None), (["model=vit_test"], None),
])
def test_a_sweep_is_told_by_the_flags_and_the_mode_hydra_takes(argv, flag):
    from stabletrain.topology import sweep_flag

    assert sweep_flag(argv) == flag


def test_a_run_started_with_a_config_dir_is_continued_with_it(monkeypatch):
    """Hydra keeps --config-dir, --config-path and --config-name among its config sources and
    job, not the overrides: the continue command names them, or the run's own config and options
    would be missing from it."""
    from hydra import compose, initialize_config_dir
    from hydra.conf import ConfigSourceInfo
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from stabletrain.config import register
    from stabletrain.engine import rundir as R
    from tests.helpers import ROOT

    register()  # the schema train.yaml's defaults list names, whichever test ran before
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.config_sources = [ConfigSourceInfo(str(ROOT / "configs"), "file", "main"),
                                            ConfigSourceInfo("/my/configs", "file", "command-line")]
    HydraConfig.instance().set_config(cfg)
    try:
        assert R.command(["model=mine"], "hydra.run.dir", "/runs/a").endswith(
            "train.py --config-dir /my/configs model=mine resume=auto hydra.run.dir=/runs/a")
        OmegaConf.set_readonly(cfg.hydra, False)
        cfg.hydra.runtime.config_sources[0].path = "/their/configs"
        cfg.hydra.job.config_name = "mine"
        HydraConfig.instance().set_config(cfg)
        assert R.command([], "hydra.run.dir", "/runs/a").endswith(
            "train.py --config-path /their/configs --config-name mine --config-dir /my/configs resume=auto "
            "hydra.run.dir=/runs/a")
    finally:
        HydraConfig.instance().cfg = None
    assert R.command(["model=mine"], "hydra.run.dir", "/runs/a").endswith("train.py model=mine resume=auto "
                                                                          "hydra.run.dir=/runs/a")


def test_a_ctrl_c_is_said_to_be_at_the_start_only_before_a_single_run_starts(monkeypatch, capsys):
    """train.py's hook: after main() began, or in a sweep (whose points may be running on a cluster while
    the login node waits), the run's own lines say what a Ctrl-C stopped; "run it again" would be wrong."""
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # importing train.py installs its hook: undone after
    import train

    seen = []
    monkeypatch.setattr(train, "_previous_hook", lambda *a: seen.append(a[0]))
    monkeypatch.setattr(sys, "argv", ["train.py", "model=gpt_test"])
    train._interrupted_while_starting(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err.strip() == "error: interrupted while starting, before training; run it again"
    train._interrupted_while_starting(ValueError, ValueError(), None)  # not a Ctrl-C: the usual traceback
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "optim.lr=1,2"])
    train._interrupted_while_starting(KeyboardInterrupt, KeyboardInterrupt(), None)
    monkeypatch.setattr(sys, "argv", ["train.py", "model=gpt_test"])
    monkeypatch.setattr(train, "_STARTED", [True])
    train._interrupted_while_starting(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert seen == [ValueError, KeyboardInterrupt, KeyboardInterrupt] and capsys.readouterr().err == ""


@pytest.mark.parametrize("args,line", [
    ("experiment=null", "experiment=null: a group takes one of its options (adamw2_gpt2_s, "),
    ("model=null", "model=null: a group takes one of its options ("),
    ("-m norm=null,layernorm", "norm=null,layernorm: a group takes one of its options ("),
    ("regularizer=NULL", "regularizer=NULL: a group takes one of its options (locater, none, zloss); leave it out for "
                         "the default, or choose regularizer=none"),
    ("+experiment=stable_gpt2_s", "+experiment=stable_gpt2_s: the group experiment is in train.yaml's defaults "
                                  "already, so its option is chosen without the '+': experiment=stable_gpt2_s"),
    ("train.max_step=3", "unknown key 'train.max_step': did you mean steps?"),
    ("~optim", "~optim: removing the optim group trains with the schema's own optim settings; choose an option "
               "instead: optim=adamw|adamw2|lars|sgd"),
    ("optim.lr=null", "optim.lr=null: optim.lr needs a value, e.g. optim.lr=0.001, or leave it out"),
    # OmegaConf's "OptimConfig (DictConfig) does not support deletion"
    ("~optim.lr", "~optim.lr: a key of the schema cannot be removed (every one is read); set it instead: "
                  "optim.lr=VALUE"),
    ("schedule.unit=null", "schedule.unit=null: schedule.unit needs a value, e.g. schedule.unit=steps, or leave it "
                           "out"),
    ("optim.betas=null", "optim.betas=null: optim.betas needs a value, e.g. optim.betas=[0.9,0.999], or leave it out"),
    ("regularizer=zloss regularizer.zloss.coef=abc",
     "regularizer.zloss.coef=abc must be a number, e.g. regularizer.zloss.coef=0.0001"),
    # OmegaConf read any integer as a bool, and Hydra merged a list of a group's options into one
    ("optim=sgd optim.nesterov=2", "optim.nesterov=2: optim.nesterov is true or false, e.g. optim.nesterov=true"),
    ("-m compile=0,2", "compile=2: compile is true or false, e.g. compile=true"),
    ("optim=[adamw,sgd]", "optim=[adamw,sgd]: optim takes one option; a list merges the optim options into one, "
                          "sgd's values replacing adamw's: choose one (optim=adamw), or with -m sweep them "
                          "(optim=adamw,sgd)"),
    ("experiment=[adamw2_gpt2_s,adamw_gpt2_s]", "experiment=[adamw2_gpt2_s,adamw_gpt2_s]: experiment takes one "
                                                "option; a list merges the recipes into one"),
    ("regularizer=[zloss,locater,zloss]", "regularizer=[zloss,locater,zloss]: zloss is listed twice, and a loss term "
                                          "is added once: regularizer=[zloss,locater]"),
])
def test_a_group_given_null_a_plus_too_many_and_a_null_value_get_one_line(args, line, capsys):
    """Each was a traceback, or a Hydra/OmegaConf line that named no fix."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit):
        check_overrides(args.split())
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("error: " + line) and "\n" not in printed, printed


def test_gpt_dropout_sits_where_nanogpt_has_it():
    """Embeddings, attention probabilities, after each branch's projection; none after the GELU."""
    model = model_of(make_cfg("model=gpt_test", "model.dropout=0.1"))
    blk = model.blocks[0]
    assert model.drop.p == 0.1 and blk.attn.attn_drop.p == 0.1 and blk.attn.proj_drop.p == 0.1
    assert blk.mlp.drop1.p == 0.0 and blk.mlp.drop2.p == 0.1


def test_config_yaml_records_what_the_data_built_and_says_what_it_replaced(tmp_path):
    r = cli("model=vit_test", "steps=1", "logger=none", "model.num_classes=1000", "model.in_chans=3",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    text = (tmp_path / "config.yaml").read_text()
    assert "num_classes: 10" in text and "in_chans: 1" in text
    assert "from the data (data=auto): model.num_classes=10 (was 1000), model.in_chans=1 (was 3)" in r.stderr


def test_a_finished_run_ends_with_the_command_that_draws_its_figures(tmp_path):
    """Its last line, run as printed (from the working directory), draws the run's figures."""
    import shlex
    import subprocess

    from tests.helpers import ROOT

    r = cli("model=gpt_test", "steps=2", "logger=none", "monitor=off", f"hydra.run.dir={tmp_path / 'run'}",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    prefix = "draw its figures (into its plots/) with: "
    assert last.startswith(prefix) and last.endswith(f"{ROOT / 'scripts/plot_dynamics.py'} run"), last
    drawn = subprocess.run(shlex.split(last[len(prefix):]), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0 and (tmp_path / "run/plots/training.png").is_file(), drawn.stderr[-2000:]


def test_a_device_that_is_not_there_is_named_as_written(monkeypatch):
    import torch

    from stabletrain.engine.distributed import pick_device
    from stabletrain.topology import DistInfo

    info = DistInfo(rank=0, world=1, local_rank=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device=cuda:0 but no CUDA GPU is visible"):
        pick_device("cuda:0", info)
    assert pick_device("auto", info) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"device=cuda:2 but 2 GPU\(s\) are visible \(cuda:0 to cuda:1\)"):
        pick_device("cuda:2", info)


def test_under_torchrun_the_error_line_is_the_root_cause_torchrun_reports(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from stabletrain.errors import fail

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as stop:
        fail("optim.lr=-1.0 must be > 0")
    assert stop.value.code == 2 and capsys.readouterr().err == "error: optim.lr=-1.0 must be > 0\n"
    report = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert report.message == "error: optim.lr=-1.0 must be > 0"


def test_hydras_full_error_switch_shows_where_a_refusal_came_from(monkeypatch, capsys):
    """HYDRA_FULL_ERROR=1, Hydra's switch for tracebacks: the refusal's traceback, then its line."""
    from stabletrain.cli import check_overrides

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(SystemExit):
        check_overrides(["optim.lr=-1"])
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "stabletrain.errors.ConfigError: " in err
    assert err.endswith("\nerror: optim.lr=-1.0 must be > 0 (e.g. optim.lr=1e-3)\n"), err
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    with pytest.raises(SystemExit):
        check_overrides(["optim.lr=-1"])
    assert capsys.readouterr().err == "error: optim.lr=-1.0 must be > 0 (e.g. optim.lr=1e-3)\n"


def test_help_opens_with_examples_that_run():
    """``python train.py --help``: the project's own header, each example a valid command."""
    import yaml

    from tests.helpers import ROOT

    r = cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("stabletrain: train a ViT, Swin or GPT")
    header = yaml.safe_load((ROOT / "configs/train.yaml").read_text())["hydra"]["help"]["header"]
    examples = [ln.split("python train.py", 1)[1].split("  ")[0].split() for ln in header.splitlines()
                if ln.startswith("  python train.py")]
    assert len(examples) == 5
    for args in (a for a in examples if not a or not a[0].startswith("--")):  # --cfg job: Hydra's own
        validate(make_cfg(*[a.split(",")[0] for a in args if a != "-m"]))


def test_help_names_the_options_of_the_searchpath_which_hydras_list_leaves_out():
    r = cli("hydra.searchpath=[file://examples/conv_stem/configs]", "--help")
    assert r.returncode == 0 and r.stdout.startswith(
        "Options of your own (in examples/conv_stem/configs), beside the groups' below:\n"
        "  model: conv_vit_mini, conv_vit_test\n"), r.stdout[:500]
    assert "stabletrain: train a ViT, Swin or GPT" in r.stdout


def test_help_prints_the_keys_this_run_reads():
    """A GPT's --help listed the ViT's patch_size and the Swin's depths; an AdamW run's, AdamW²'s
    tau; a help with a mistake in its overrides ended in Hydra's traceback."""
    import yaml

    r = cli("model=gpt_test", "optim=adamw", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    page = r.stdout.split("== Config ==\n", 1)[1].split("\n\n", 1)
    assert page[0].startswith("Override anything in the config (foo.bar=value). Left out: the ")
    shown = yaml.safe_load(page[1].split("\nA mistake costs one line")[0])
    assert {"embed_dim", "block_size", "vocab_size", "dropout"} <= set(shown["model"])
    assert not {"patch_size", "depths", "window_size", "img_size"} & set(shown["model"])
    assert "tau" not in shown["optim"] and "betas" in shown["optim"]
    assert shown["reparam"] == {"name": "none", "attn_fp32": False} and "every" not in shown["ema"]  # read alone
    # the image settings a text run refuses or notes as unread (it listed them)
    image = {"img_size", "randaug", "mixup", "cutmix", "label_smoothing", "erasing", "repeated_aug"}
    assert not image & set(shown["data"]) and {"name", "val_fraction", "tokenizer"} <= set(shown["data"])
    r = cli("model=vit_test", "optim=adamw2", "-h")
    shown = r.stdout.split("== Config ==\n", 1)[1]
    assert "  patch_size: 4\n" in shown and "  tau: " in shown and "  block_size:" not in shown
    assert "  mixup: " in shown and "  label_smoothing: " in shown
    assert "A mistake costs one line naming the fix." in r.stdout
    r = cli("model=nope", "--help")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: model=nope is not an option of 'model'"), r.stderr[-2000:]


def test_the_keys_left_unread_are_those_the_run_notes_when_set():
    """unread_reasons (the --help page, the sweep check) and unread_keys (the start notes) read one table: each
    key --help leaves out, set away from its default, is noted as changing nothing."""
    from stabletrain.config import unread_keys, unread_reasons
    from stabletrain.models.registry import model_unread_reasons, unread_model_keys

    cfg = make_cfg("model=gpt_test", "optim=adamw", "reparam=none")
    left = {**model_unread_reasons(cfg.model), **unread_reasons(cfg)}
    assert {"model.patch_size", "model.depths", "optim.tau", "reparam.power_iters", "ema.every",
            "divergence.max_rollbacks", "schedule.milestones"} <= set(left)
    assert not {"model.embed_dim", "optim.lr", "optim.betas", "schedule.min_lr", "ema.decay"} & set(left)
    assert "resume_allow_changes" in left  # a top-level key: noted and left out of --help as the others
    for given in ("optim.tau=0.5", "model.patch_size=4", "divergence.max_rollbacks=5", "ema.warmup=true",
                  "resume_allow_changes=true"):
        changed = make_cfg("model=gpt_test", "optim=adamw", given)
        notes = unread_keys(changed) + unread_model_keys(changed.model)
        assert given.split("=")[0] in left and any(n.startswith(f"note: {given} ") for n in notes), (given, notes)


def test_printing_a_valid_config_still_prints_it(tmp_path):
    r = cli("--cfg", "job", "optim.lr=0.5", "model=vit_test", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "lr: 0.5" in r.stdout and "error" not in r.stderr, r.stderr[-2000:]
    # Hydra's node resolved in place too: the job log's handlers were a list a resolver returned
    r = cli("--cfg", "all", "--resolve", "model=vit_test")
    assert r.returncode == 0 and "        level: 0\n    root:\n      level: INFO\n" in r.stdout, r.stderr[-2000:]


def test_resolve_is_checked_with_the_config_it_prints(tmp_path, capsys):
    """--resolve is a printing flag: the config it prints is checked as --cfg job's is; Hydra
    resolves --cfg hydra without the run's keys (run.dir reads ${name}): told unless run.dir is
    given; --resolve alone was Hydra's ValueError traceback."""
    from stabletrain.cli import check_overrides

    def error(*argv):
        with pytest.raises(SystemExit):
            check_overrides(list(argv))
        return capsys.readouterr().err.strip()

    assert error("--cfg", "job", "--resolve", "optim.lr=-1") == "error: optim.lr=-1.0 must be > 0 (e.g. optim.lr=1e-3)"
    assert error("--cfg=hydra", "--resolve") == (
        "error: --cfg hydra --resolve: Hydra resolves its node without the run's keys, and hydra.run.dir reads "
        "${name}; set hydra.run.dir on the command line, print it unresolved (--cfg hydra), or resolved within the "
        "whole config (--cfg all --resolve)")
    subdir = "hydra.sweep.subdir=${model.name}"
    assert error("-c", "hydra", "--resolve", f"hydra.run.dir={tmp_path}", subdir).startswith(
        "error: --cfg hydra --resolve: Hydra resolves its node without the run's keys, and hydra.sweep.subdir reads "
        "${model.name}; set hydra.sweep.subdir on the command line")
    assert error("-c", "hydra", "--resolve", "hydra.run.dir=/x/${oc.env:STABLETRAIN_NOPE}") == (
        "error: --cfg hydra --resolve: KeyError raised while resolving interpolation: \"Environment variable "
        "'STABLETRAIN_NOPE' not found\"")
    assert error("--resolve", "seed=1") == ("error: --resolve goes with --cfg: --cfg job --resolve prints the run's "
                                            "config with every ${...} resolved")
    check_overrides(["-c", "hydra", "--resolve", f"hydra.run.dir={tmp_path}"])
    r = cli("--cfg", "hydra", "--resolve", f"hydra.run.dir={tmp_path}/run", "model=vit_test")
    assert r.returncode == 0 and f"    dir: {tmp_path}/run\n" in r.stdout, r.stderr[-2000:]


def test_printing_a_config_trained_by_epochs_prints_it():
    """The steps=null that epochs=E brings went after --cfg job, where Hydra's argparse refused it
    as an argument the user never typed."""
    from stabletrain.cli import epochs_over_steps

    assert epochs_over_steps(["epochs=3", "--cfg", "job"]) == ["epochs=3", "steps=null", "--cfg", "job"]
    r = cli("model=vit_test", "epochs=3", "--cfg", "job", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "steps: null" in r.stdout and "epochs: 3" in r.stdout, r.stderr[-2000:]


def test_a_sweep_checks_every_combination_before_it_starts(tmp_path):
    """model=vit_test with data=tokens is the one bad point; every value is fine on its own, so
    checking each value once (the others at their first) missed it and the local sweep stopped
    halfway, at that point."""
    from stabletrain.data.token_files import prepare_tokens

    prepare_tokens(tmp_path / "tok", [b"some text " * 300], block_size=64)
    r = cli("-m", "model=gpt_test,vit_test", "data=auto,tokens", f"data.path={tmp_path / 'tok/train.bin'}",
            "steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and not (tmp_path / "sweep").exists(), r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: data=tokens does not fit model=vit_test")
    assert r.stderr.strip().endswith("(sweep point model=vit_test data=tokens; no point was launched)")


def test_a_large_sweep_checks_each_value_once():
    from stabletrain.cli import CHECK_EVERY_POINT, _sweep_points

    small = _sweep_points(["optim.lr=1,2,3", "seed=0,1"])
    assert sorted(map(tuple, small)) == sorted((f"optim.lr={a}", f"seed={b}") for a in (1, 2, 3) for b in (0, 1))
    n = CHECK_EVERY_POINT
    large = _sweep_points([f"seed=range(0,{n})", "optim.lr=1,2"])
    assert len(large) == n + 1 and ["seed=0", "optim.lr=1"] in large and ["seed=0", "optim.lr=2"] in large


def test_a_sweep_point_refused_while_building_is_recorded_and_the_sweep_goes_on(tmp_path):
    """A block size too long for the validation text is found only when the data is built: that
    point records why in its summary.json, the next point still trains, and the sweep exits 0."""
    import json

    r = cli("-m", "model=gpt_test", "model.block_size=5000000,16", "steps=1", "logger=none",
            f"hydra.sweep.dir={tmp_path}", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    refused, done = (json.loads((tmp_path / str(i) / "summary.json").read_text()) for i in (0, 1))
    assert refused["status"] == "refused" and refused["step"] == 0
    assert "too few for a window of model.block_size=5000000" in refused["reason"]
    assert done["status"] == "completed"
    assert "(this sweep point is skipped; the sweep goes on)" in r.stderr and "Traceback" not in r.stderr


def test_a_run_whose_console_reader_goes_away_trains_on(tmp_path):
    """``train.py 2>&1 | head -3``: once the pipe closes, the run goes on without a console
    (it ended as failed, 'BrokenPipeError', at its next progress line)."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "model=gpt_test", "steps=30", "logger=none",
                             "logger.log_every=1", f"hydra.run.dir={tmp_path}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "WANDB_MODE": "disabled"})
    proc.stderr.readline()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_an_unknown_option_named_in_a_yaml_names_the_yaml(tmp_path, capsys):
    from stabletrain.cli import check_overrides

    (tmp_path / "norm").mkdir()
    (tmp_path / "norm/mine.yaml").write_text("name: layernrm\n")
    with pytest.raises(SystemExit):
        check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "norm=mine"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: norm=layernrm is not an option; choose one of: ") and line.endswith(
        f" ({tmp_path / 'norm/mine.yaml'} sets name: layernrm)"), line


def test_an_unknown_value_typed_on_the_command_line_blames_no_yaml(capsys):
    """model=vit_test model.act=silu: the value is the user's, not vit_test.yaml's."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit):
        check_overrides(["model=vit_test", "model.act=silu"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == "error: model.act=silu is not an option: use gelu, gelu_tanh, relu"


def test_an_option_yaml_without_a_name_is_refused_not_built_as_the_default(tmp_path, capsys):
    """optim/mine.yaml without name: trained AdamW², the group's default, without a word."""
    from stabletrain.cli import check_overrides

    (tmp_path / "optim").mkdir()
    (tmp_path / "optim/mine.yaml").write_text("lr: 1e-4\n")
    with pytest.raises(SystemExit):
        check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "-m", "optim=adamw,mine"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'optim/mine.yaml'} sets no name: (the registered option it builds), so optim=mine "
        f"would build the default optim; add name: mine, or the name it registers")


def _readme_errors():
    from tests.helpers import ROOT

    text = (ROOT / "README.md").read_text()
    return re.findall(r"^\$ python train\.py (.+)\nerror: (.+)$", text, flags=re.M)


@pytest.mark.parametrize("args,line", _readme_errors())
def test_the_readmes_error_lines_are_what_train_py_prints(args, line, capsys):
    """README quotes these: each must be the line the command prints (a "..." ends a shortened one)."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit):
        check_overrides(args.split())
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("error: " + line.removesuffix("...")), printed


def test_the_readme_quotes_error_lines():
    assert len(_readme_errors()) >= 5


@pytest.mark.parametrize("args,steps", [
    (["epochs=2"], None),                 # epochs given alone trains by epochs: train.yaml's steps=600 gave way
    (["epochs=2", "steps=10"], 10),       # both given: steps wins, as the start line says
    (["epochs=null", "steps=10"], 10),
    ([], 600),
])
def test_epochs_on_the_command_line_train_by_epochs(args, steps):
    from stabletrain.cli import compose_config, epochs_over_steps

    assert compose_config(args).steps == steps
    assert epochs_over_steps(["-m", "epochs=1,2"]) == ["-m", "epochs=1,2", "steps=null"]  # every point of a sweep


def test_an_image_runs_augmentation_is_one_start_line_in_timms_terms():
    from stabletrain.build import augment_line
    from stabletrain.data import Data

    images = Data("vision", 100)
    cfg = make_cfg("model=vit_test", "data=cifar10", "data.mixup=0.8", "data.cutmix=1.0", "data.label_smoothing=0.1",
                   "model.drop_path=0.1", "data.randaug=rand-m9-mstd0.5-inc1", "data.erasing=0.25",
                   "data.repeated_aug=3")
    assert augment_line(cfg, images) == (
        "augmentation: RandAugment rand-m9-mstd0.5-inc1; random erasing p=0.25; each sample 3x per batch (repeated "
        "augmentation); mixup alpha 0.8 / cutmix alpha 1 (soft-target cross-entropy, label smoothing 0.1); "
        "drop path 0.1")
    digits = make_cfg("model=vit_test", "data.randaug=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.mixup=0.2")
    assert augment_line(digits, images) == ("augmentation: mixup alpha 0.2 / cutmix alpha 0 (soft-target "
                                            "cross-entropy)")  # tensors in memory: no image transforms
    smooth = make_cfg("model=vit_test", "data.label_smoothing=0.1")
    assert augment_line(smooth, images) == "augmentation: cross-entropy, label smoothing 0.1"
    assert augment_line(make_cfg("model=vit_test"), images) is None  # nothing on: no line
    assert augment_line(make_cfg("model=gpt_test"), Data("text", 1000)) is None


@pytest.mark.parametrize("args,line", [
    ("-m model=gpt_test optim=adamw optim.tau=0.003,0.01",
     "optim.tau=0.003,0.01 is swept, but no point of the sweep reads it: only optim=adamw2 reads it, and this run has "
     "optim=adamw; no point was launched"),
    ("-m model=vit_test deescalate.lambda_=0.5,1.0",
     "deescalate.lambda_=0.5,1.0 is swept, but no point of the sweep reads it: deescalate=none adds no de-escalation "
     "(choose another deescalate option)"),
    ("-m model=gpt_test model.patch_size=4,8",
     "model.patch_size=4,8 is swept, but no point of the sweep reads it: only model.family=swin/vit reads it, and "
     "this run has model.family=gpt"),
    ("-m model=vit_test data.erasing=0,0.25",
     "data.erasing=0,0.25 is swept, but no point of the sweep reads it: only data=cifar10/cifar100/imagefolder reads "
     "it, and this run has data=digits"),
    ("-m model=vit_test data.tokenizer=byte,gpt2",
     "data.tokenizer=byte,gpt2 is swept, but no point of the sweep reads it: only data=pytext reads it, and this run "
     "has data=digits"),
])
def test_a_swept_key_no_point_reads_is_refused(args, line, capsys):
    """Each point trained the same model behind a start note (none at the default value), and the
    sweep's table and figure read as "the key has no effect"."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit):
        check_overrides(args.split())
    assert capsys.readouterr().err.strip().startswith("error: " + line)


def test_a_swept_key_some_points_read_is_launched():
    from stabletrain.cli import check_overrides

    check_overrides("-m model=gpt_test optim=adamw,adamw2 optim.tau=0.003,0.01".split())
    check_overrides("-m model=gpt_test,vit_test model.patch_size=4,8".split())


def test_a_swept_data_key_some_points_read_is_launched(tmp_path):
    from stabletrain.cli import check_overrides

    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "a" / "0.png")
    check_overrides(f"-m model=vit_test data=digits,imagefolder data.root={tmp_path} data.erasing=0,0.25".split())


def _sweep_dir(root, taus):
    from omegaconf import OmegaConf

    for num, tau in enumerate(taus):
        (root / str(num)).mkdir(parents=True)
        cfg = make_cfg("model=gpt_test", f"optim.tau={tau}")
        (root / str(num) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def test_a_resumed_sweep_whose_points_moved_is_refused_before_any_starts(tmp_path, capsys):
    """A value added inside a list moved the later points: Hydra rewrote their .hydra/ before each
    point's own resume refused, so the sweep's table showed tau=0.01's results as tau=0.005's,
    and tau=0.03 trained again."""
    from stabletrain.cli import check_overrides

    _sweep_dir(tmp_path, ["0.003", "0.01", "0.03"])
    args = f"-m model=gpt_test optim.tau=0.003,0.005,0.01,0.03 resume=auto hydra.sweep.dir={tmp_path}".split()
    with pytest.raises(SystemExit):
        check_overrides(args)
    assert capsys.readouterr().err.strip() == (
        f"error: resume=auto: the sweep's points moved: point 1 is now optim.tau=0.005, but {tmp_path}/1/ holds the "
        f"run of optim.tau=0.01 (now point 2); Hydra numbers a sweep's points by their place in the grid: add new "
        f"values at the end of a list, or run the new points in another hydra.sweep.dir; no point was launched")
    check_overrides(f"-m model=gpt_test optim.tau=0.003,0.01,0.03,0.005 resume=auto hydra.sweep.dir={tmp_path}".split())
    check_overrides(f"-m model=gpt_test optim.tau=0.003,0.005,0.01 hydra.sweep.dir={tmp_path}".split())  # no resume
    with pytest.raises(SystemExit):
        check_overrides(f"-m model=gpt_test optim.tau=0.003,0.02 resume=auto hydra.sweep.dir={tmp_path}".split())
    assert "holds the run of optim.tau=0.01, which this sweep no longer has" in capsys.readouterr().err


def test_a_new_sweep_into_a_folder_with_points_past_its_own_is_refused(tmp_path, capsys):
    """Its points set the earlier runs in 0/ and 1/ aside, but 2/ stayed, and summarize_sweep counted
    it as a point of the new sweep (3 points, 3 completed, for a sweep of 2)."""
    from stabletrain.cli import check_overrides

    _sweep_dir(tmp_path, ["0.003", "0.01", "0.03"])
    with pytest.raises(SystemExit):
        check_overrides(f"-m model=gpt_test optim.tau=0.1,0.2 hydra.sweep.dir={tmp_path}".split())
    assert capsys.readouterr().err == (
        f"error: hydra.sweep.dir={tmp_path} holds {tmp_path}/2/ of an earlier sweep, past this sweep's 2 points: its "
        f"table would count it as this sweep's; choose another hydra.sweep.dir, or move it out; no point was "
        f"launched\n")
    with pytest.raises(SystemExit):
        check_overrides(f"-m model=gpt_test optim.tau=0.1 hydra.sweep.dir={tmp_path}".split())  # a one-point sweep
    assert f"holds {tmp_path}/1/, {tmp_path}/2/ of an earlier sweep, past this sweep's 1 point: its table would " \
           f"count them" in capsys.readouterr().err
    check_overrides(f"-m model=gpt_test optim.tau=0.1,0.2,0.3 hydra.sweep.dir={tmp_path}".split())  # rewrites all
    check_overrides(f"-m model=gpt_test optim.tau=0.003,0.01 resume=auto hydra.sweep.dir={tmp_path}".split())
    check_overrides(f"model=gpt_test optim.tau=0.1 hydra.run.dir={tmp_path}/0".split())  # a single run


@pytest.mark.parametrize("args,key,value", [
    ("experiment=locater_1layer deescalate=ffn", "deescalate", {"name": "deescalate", "placement": "ffn"}),
    ("experiment=sigma_vit_b reparam=sigma_qk", "reparam", {"name": "sigma", "apply_to": "qk"}),
])
def test_a_group_option_whose_name_is_not_its_file_name_is_kept_beside_a_recipe(args, key, value):
    """deescalate=ffn builds name: deescalate, reparam=sigma_qk name: sigma: beside experiment=...
    they were refused as replaced by the recipe, which had set neither."""
    from stabletrain.cli import check_overrides, compose_config

    check_overrides(args.split())
    cfg = compose_config(args.split())
    assert {k: str(getattr(cfg[key][k], "value", cfg[key][k])) for k in value} == value


def test_a_sweep_resumed_with_a_change_its_points_refuse_keeps_their_records(tmp_path):
    """Run again with optim.lr changed and resume=auto, every point refused, yet Hydra had rewritten
    each point's .hydra/ and multirun.yaml to the refused command (the table then read lr 0.003 for
    runs trained at 0.001), the tally said '2 completed' and the refusal's 'own command' was the
    refused one. The records stay the runs', the tally says refused, the command is the earlier one."""
    base = ["-m", "model=gpt_test", "steps=2", "batch_size=8", "logger=none", "monitor=off", "optim.tau=0.01,0.02",
            f"hydra.sweep.dir={tmp_path}"]
    assert cli(*base).returncode == 0
    records = {p: p.read_bytes() for p in sorted(tmp_path.glob("*/.hydra/*"))} | {
        tmp_path / "multirun.yaml": (tmp_path / "multirun.yaml").read_bytes()}
    r = cli(*base, "optim.lr=0.003", "resume=auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert {p: p.read_bytes() for p in records} == records
    assert not [p.name for p in tmp_path.rglob("*") if p.name.endswith((".kept", ".kept.yaml", "refused_now"))]
    refusal = next(x for x in r.stderr.splitlines() if "would change the resumed run's optim.lr" in x)
    assert "optim.tau=0.01,0.02" in refusal and "optim.lr=0.003" not in refusal.split("its own command")[1], refusal
    assert f"sweep {tmp_path}: 2 points, 2 refused this time; 0/ refused this time (its run is as it was): " in r.stderr
    r = cli(*base[:2], "steps=3", *base[3:], "resume=auto")  # a change they take: the records are the new command's
    assert r.returncode == 0 and f"sweep {tmp_path}: 2 points, 2 completed" in r.stderr, r.stderr[-2000:]
    assert "steps=3" in (tmp_path / "0" / ".hydra" / "overrides.yaml").read_text()
    assert "steps=3" in (tmp_path / "multirun.yaml").read_text()
    assert not [p.name for p in tmp_path.rglob("*") if p.name.endswith((".kept", ".kept.yaml", "refused_now"))]


def test_a_sweep_run_again_where_one_point_refuses_keeps_the_others_as_the_new_command(tmp_path):
    """Run again with optim.lr changed: point 0 (completed) refuses, point 1 (never trained) takes
    the new command. The refusal must not stick to the next point (its .hydra/ put back, the tally
    '2 refused this time'), and a .hydra.kept left by a killed sweep is replaced, not a crash."""
    base = ["-m", "model=gpt_test", "steps=2", "batch_size=8", "logger=none", "monitor=off", "optim.tau=0.01,0.02",
            f"hydra.sweep.dir={tmp_path}"]
    assert cli(*base).returncode == 0
    for p in (tmp_path / "1").iterdir():  # point 1 as a sweep killed before it trained leaves it
        if p.name != ".hydra":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    stale = tmp_path / "0" / ".hydra.kept"  # what a killed sweep left
    stale.mkdir()
    (stale / "overrides.yaml").write_text("- stale\n")
    record = (tmp_path / "0" / ".hydra" / "overrides.yaml").read_text()
    r = cli(*base, "optim.lr=0.003", "resume=auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"sweep {tmp_path}: 2 points, 1 refused this time, 1 completed; 0/ refused this time (its run is as it " \
           f"was): resume=auto would change the resumed run's optim.lr (0.001 there, 0.003 here)" in r.stderr
    assert (tmp_path / "0" / ".hydra" / "overrides.yaml").read_text() == record
    assert "optim.lr=0.003" in (tmp_path / "1" / ".hydra" / "overrides.yaml").read_text()
    assert not [p.name for p in tmp_path.rglob("*") if p.name.endswith((".kept", ".kept.yaml", "refused_now"))]
