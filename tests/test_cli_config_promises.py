"""What ``stabletrain.cli`` and ``stabletrain.config`` promise of a command line: the fix each
mistake's one line names, the overrides that pass untouched, the bounds each key takes and the
notes for keys nothing reads.

Each test states the exact line (or value) expected, so that a dropped branch or a moved bound
fails."""

from __future__ import annotations

import pytest

from stabletrain.errors import ConfigError
from tests.helpers import make_cfg


def _error_line(capsys, args) -> str:
    """The one line ``check_overrides(args)`` ends with (``error: `` taken off)."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit) as e:
        check_overrides(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0].removeprefix("error: ")


def _explained(*overrides: str) -> str:
    from stabletrain.cli import compose_config, explain

    with pytest.raises(Exception) as e:
        compose_config(list(overrides))
    return explain(e.value, list(overrides))


# --- an option or a key misspelt -------------------------------------------------------------


def test_a_misspelt_option_names_the_nearest_option():
    """model=vit_tset lists the group's options and suggests the one it is a typo of."""
    from stabletrain.cli import group_options

    assert _explained("model=vit_tset") == (f"model=vit_tset is not an option of 'model'; choose one of: "
                                            f"{', '.join(group_options('model'))} (did you mean vit_test?)")


@pytest.mark.parametrize("key,hint", [
    # a misspelt node whose nearest node has no such leaf: no suggestion of a key that is not there
    ("otpim.zzz", None),
    # a start that several keys share is no one key: the node's keys are listed
    ("monitor.qk", "monitor has no such key; its keys: name, weight_every, adamw2_every, probe_every, "
                   "probe_batch_size, per_head, alerts, stop_on_alert, rollback_on_alert, entropy_floor, qk_growth, "
                   "qk_window"),
])
def test_a_misspelt_key_gets_no_suggestion_that_is_not_a_key(key, hint):
    from stabletrain.cli import _nearest_key

    assert _nearest_key(key) == hint


def test_an_unknown_prefixed_key_that_is_no_key_either_gets_no_guess():
    """'did you mean imports?' for train.imports holds only where the key without its prefix is
    one: xyz.notakey is not in the schema, and no 'did you mean notakey?' is made up."""
    from stabletrain.cli import compose_config, explain

    ovs = ["model=gpt_test", "xyz.notakey=1"]
    with pytest.raises(Exception) as e:
        compose_config(ovs)
    said = explain(e.value, ovs)
    assert said.startswith("unknown key 'xyz.notakey': not in the config schema"), said
    assert "did you mean" not in said


@pytest.mark.parametrize("override,line", [
    # a bool's example as it is written on the command line
    ("monitor.alerts=maybe", "monitor.alerts=maybe must be true or false, e.g. monitor.alerts=true"),
    # an element of a list: a number, not "or null" (the list's element is no key of the schema)
    ("optim.betas=[fast,0.9]", "optim.betas[0]=fast must be a number"),
])
def test_a_value_of_the_wrong_type_gives_an_example_as_written(override, line):
    assert _explained(override) == line


# --- what the override grammar cannot take ---------------------------------------------------


@pytest.mark.parametrize("args,line", [
    # a character with no ASCII twin: no "did you mean" that is the same override
    (["data.root=/data/café"], "cannot parse data.root=/data/café: the override grammar takes no 'é' (quote a "
                               "value that needs it)"),
    # Hydra's own first line, not its "See https://..." link
    (["optim.lr=[1,2"], "cannot parse optim.lr=[1,2: no viable alternative at input '[1,2'"),
    # the override that lacks what, not "Error parsing override 'optim.lr'" or "mismatched input '<EOF>' ..."
    (["steps=3", "optim.lr"], "cannot parse optim.lr: an override is key=value; write optim.lr=VALUE"),
    (["optim.lr=1e-3,"], "cannot parse optim.lr=1e-3,: it ends in a comma; a sweep (-m) lists values a,b with one "
                         "after each comma"),
])
def test_an_override_the_grammar_cannot_take_is_named(capsys, args, line):
    assert _error_line(capsys, args) == line


@pytest.mark.parametrize("args,line", [
    # a flag without a value: the next flag, or the next override, is not its value
    (["--lr", "--epochs", "5"], "--lr: train.py takes overrides key=value, without dashes: optim.lr=VALUE"),
    (["--lr", "steps=3"], "--lr: train.py takes overrides key=value, without dashes: optim.lr=VALUE"),
    (["--model"], "--model: train.py takes overrides key=value, without dashes: model=VALUE"),
    # a name that is the leaf of several keys is written as given, not as "norm.alpha or attention.alpha"
    (["--alpha", "0.3"], "--alpha 0.3: train.py takes overrides key=value, without dashes: alpha=0.3"),
])
def test_a_flag_is_answered_with_the_override_it_meant(capsys, args, line):
    assert _error_line(capsys, args) == line


# --- what passes --------------------------------------------------------------------------------


def test_hydras_own_flags_with_an_equals_sign_are_hydras_business():
    """--config-name=train is Hydra's flag (its argparse takes --flag=value), not a foreign one."""
    from stabletrain.cli import check_overrides

    assert check_overrides(["--config-name=train", "model=vit_test"]) is None


def test_the_basic_launcher_without_m_trains_here():
    """Only a launcher that launches elsewhere (slurm) needs -m; hydra/launcher=basic is the default one."""
    from stabletrain.cli import check_overrides

    assert check_overrides(["hydra/launcher=basic", "model=vit_test"]) is None


def test_printing_the_config_of_a_slurm_run_needs_no_m(monkeypatch):
    """--cfg job hydra/launcher=slurm prints the config (of one point) the sweep's launcher would get."""
    import shutil

    from stabletrain.cli import check_overrides

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}" if name in ("sbatch", "srun") else
                        which(name, *a, **k))
    assert check_overrides(["--cfg", "job", "hydra/launcher=slurm", "model=vit_test"]) is None


def test_a_slurm_sweep_without_srun_is_one_line(monkeypatch, capsys):
    """sbatch without srun (a machine that has only the client): submitit's traceback 'Could not
    detect "srun"', after the sweep was composed."""
    import shutil

    from stabletrain.cli import check_overrides

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/sbatch" if name == "sbatch" else
                        None if name == "srun" else which(name, *a, **k))
    with pytest.raises(SystemExit):
        check_overrides(["-m", "hydra/launcher=slurm", "model=gpt_test", "optim.lr=1,2"])
    assert capsys.readouterr().err.strip() == (
        "error: hydra/launcher=slurm submits through SLURM, but there is no srun on this machine; run on the "
        "cluster's login node, or drop it to sweep locally")


@pytest.mark.parametrize("flags,given,said", [
    (["-m", "optim.lr=1,2"], "hydra.run.dir=/tmp/x/", "error: hydra.run.dir is the folder of a single run, which this "
     "sweep does not read: give hydra.sweep.dir=/tmp/x/ (its points go to /tmp/x/0, /1, ...)"),
    ([], "hydra.sweep.dir=/tmp/x", "error: hydra.sweep.dir is the folder of a sweep (-m), which this single run "
     "does not read: give hydra.run.dir=/tmp/x, or add -m to launch a sweep"),
])
def test_the_other_kinds_output_folder_alone_is_refused(capsys, tmp_path, flags, given, said):
    """Hydra dropped it without a word: the runs went to multirun/ or outputs/ under the current folder."""
    from stabletrain.cli import check_overrides

    with pytest.raises(SystemExit):
        check_overrides([*flags, "model=gpt_test", given])
    assert capsys.readouterr().err.strip() == said
    other = f"hydra.{'sweep' if 'run.dir' in given else 'run'}.dir={tmp_path}"
    check_overrides([*flags, "model=gpt_test", given, other])  # both given: each kind reads its own
    if not flags:
        check_overrides(["--cfg", "job", "model=gpt_test", given])  # printing a config runs nothing


def test_c_job_is_the_short_cfg_flag_and_still_checks(capsys):
    """``-c job`` prints one run's config as ``--cfg job`` does: the overrides are checked as such."""
    assert _error_line(capsys, ["-c", "job", "optim.lr=1,2"]) == (
        "optim.lr=1,2 gives several values: --cfg prints the config of one run: give it one")


def test_epochs_null_alone_keeps_the_steps():
    """epochs=null is no epochs: train.yaml's steps stay (steps=null would leave the run no length)."""
    from stabletrain.cli import compose_config, epochs_over_steps

    assert epochs_over_steps(["epochs=null"]) == ["epochs=null"]
    assert compose_config(["epochs=null"]).steps == 600


def test_epochs_given_with_a_force_add_prefix_still_trains_by_epochs():
    """``++epochs=2`` is epochs=2: steps=null goes right after it (not a StopIteration from
    looking for an override spelled exactly ``epochs=``)."""
    from stabletrain.cli import epochs_over_steps

    assert epochs_over_steps(["++epochs=2", "--cfg", "job"]) == ["++epochs=2", "steps=null", "--cfg", "job"]


def test_a_sweep_of_exactly_check_every_point_points_is_checked_point_by_point():
    from stabletrain.cli import CHECK_EVERY_POINT, _sweep_points

    points = _sweep_points([f"seed=range(0,{CHECK_EVERY_POINT // 2})", "optim.lr=1,2"])
    assert len(points) == CHECK_EVERY_POINT and ["seed=1", "optim.lr=2"] in points


def test_a_sweep_over_a_groups_name_key_may_share_a_setting_for_some_of_its_options(tmp_path):
    """-m data.name=tokens,pytext data.path=...: the path is for the tokens point; the pytext point
    notes it (as data=tokens,pytext does), it is not refused."""
    from stabletrain.cli import check_overrides
    from stabletrain.data.token_files import prepare_tokens

    prepare_tokens(tmp_path / "tok", [b"some text " * 300], block_size=64)
    assert check_overrides(["-m", "model=gpt_test", "data.name=tokens,pytext",
                            f"data.path={tmp_path / 'tok/train.bin'}"]) is None


def test_an_option_yaml_that_takes_its_name_from_its_defaults_is_not_refused(tmp_path):
    """optim/mine.yaml with ``defaults: [adamw]`` and no name: builds adamw, the option it extends."""
    from stabletrain.cli import check_option_names, compose_config

    (tmp_path / "optim").mkdir()
    (tmp_path / "optim/mine.yaml").write_text("defaults:\n  - adamw\n  - _self_\nlr: 1e-4\n")
    ovs = [f"hydra.searchpath=[file://{tmp_path}]", "optim=mine"]
    check_option_names(ovs)
    cfg = compose_config(ovs)
    assert (cfg.optim.name, cfg.optim.lr) == ("adamw", 1e-4)


def test_an_unknown_option_typed_by_the_user_names_no_yaml(tmp_path, capsys):
    """norm=mine whose yaml says name: mine: the user typed the unknown name, no file is blamed."""
    (tmp_path / "norm").mkdir()
    (tmp_path / "norm/mine.yaml").write_text("name: mine\n")
    ovs = [f"hydra.searchpath=[file://{tmp_path}]", "norm=mine"]
    line = _error_line(capsys, ovs)
    assert line.startswith("norm=mine is not an option") and "sets name" not in line, line


@pytest.mark.parametrize("override", ["+hydra.job.env_set.MY_FLAG=1", "+experiment=locater_1layer"])
def test_adding_a_hydra_key_or_a_group_passes(override):
    """'+hydra...' adds to Hydra's config, '+experiment=X' appends a group: neither is refused."""
    from stabletrain.cli import check_keys

    check_keys([override])


def test_an_added_key_under_a_known_node_says_nothing_reads_it():
    """+ema.zzz=1: no key near it, so the fix is to drop the '+' and set an existing key."""
    from stabletrain.cli import check_keys

    with pytest.raises(ConfigError) as e:
        check_keys(["+ema.zzz=1"])
    assert str(e.value) == ("unknown key 'ema.zzz': +ema.zzz=1 adds a key nothing reads; drop the '+' to set an "
                            "existing key (`python train.py --cfg job` prints every key)")


def test_a_run_dir_in_a_folder_without_write_permission_is_one_line(tmp_path, monkeypatch):
    """Hydra would fail creating it with a traceback; said here, naming the folder."""
    import os

    from stabletrain.cli import _check_output_dir

    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else access(p, mode))
    with pytest.raises(ConfigError) as e:
        _check_output_dir("hydra.run.dir", f"{tmp_path}/run")
    assert str(e.value) == (f"hydra.run.dir={tmp_path}/run: cannot write in {tmp_path} (permission denied); "
                            f"choose another path")


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_empty_run_dir_is_refused(key):
    """Hydra took it as the current folder: the run's files, .hydra/ and .lock written beside the user's."""
    from stabletrain.cli import _check_output_dir

    for value in ("", "''"):
        with pytest.raises(ConfigError) as e:
            _check_output_dir(key, value)
        assert str(e.value) == f"{key} is empty: give the run a folder of its own ({key}=runs/NAME)"


def test_a_quoted_run_dir_is_checked_as_the_path_hydra_takes(tmp_path):
    """hydra.run.dir='DIR' is DIR to Hydra: a file there is refused as unquoted."""
    from stabletrain.cli import _check_output_dir

    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file: a run directory must be a directory"):
        _check_output_dir("hydra.run.dir", f"'{tmp_path}/f'")


def test_a_single_run_into_a_sweeps_folder_is_refused_naming_a_point_and_the_sweep(tmp_path):
    """resume=auto there found no checkpoint and trained from step 0 into the sweep's folder, a run
    the sweep's table then counted as one of its points."""
    from tests.helpers import cli

    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    r = cli("model=vit_test", "steps=2", "logger=none", "resume=auto", f"hydra.run.dir={sweep}")
    assert r.returncode == 2 and r.stderr == (
        f"error: hydra.run.dir={sweep} is a sweep's folder (multirun.yaml): a point of it is hydra.run.dir={sweep}/N "
        f"(resume=auto continues it there), the whole sweep -m ... hydra.sweep.dir={sweep}\n")
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]


# --- config.validate: each bound at its edge ------------------------------------------------


@pytest.mark.parametrize("overrides,line", [
    (["optim.weight_decay_end=-0.1"], "optim.weight_decay_end=-0.1 must be >= 0 or null"),
    (["optim.betas=[0.9,0.99,0.9]"], "optim.betas=[0.9, 0.99, 0.9] must be two values in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (["steps=0"], "steps=0 must be > 0"),
    (["batch_size=0"], "batch_size=0 must be > 0"),
    (["grad_clip=0"], "grad_clip=0.0 must be > 0 or null"),
    (["monitor.probe_every=0"], "monitor.probe_every=0 must be >= 1"),
    (["monitor.adamw2_every=0"], "monitor.adamw2_every=0 must be >= 1"),
    (["monitor.probe_batch_size=0"], "monitor.probe_batch_size=0 must be >= 1"),
    (["model.patch_embed_std=0"], "model.patch_embed_std=0.0 must be > 0"),
    (["divergence.max_skips=0"], "divergence.max_skips=0 must be >= 1"),
    (["debug.spike_factor=0"], "debug.spike_factor=0.0 must be > 0"),
    (["data.label_smoothing=1.0"], "data.label_smoothing=1.0 must be in [0, 1)"),
    (["parallel=deepspeed"], "parallel=deepspeed is not an option: use ddp or fsdp"),
    (["resume=/nonexistent/last.pt"], "resume=/nonexistent/last.pt: no such checkpoint (use resume=auto or a path to "
                                      "a .pt file)"),
    (["device=cuda:"], "device=cuda: is not an option: use auto, cpu, cuda or cuda:N"),
    # a traceback from the build before, or a model with no MLP trained silently
    (["optim.trust_coef=0"], "optim.trust_coef=0.0 must be > 0 (LARS: 0.001)"),
    (["model.embed_dim=0"], "model.embed_dim=0 must be >= 1 (e.g. model.embed_dim=384)"),
    (["model.mlp_ratio=0"], "model.mlp_ratio=0.0 must be > 0 (e.g. 4.0)"),
    (["model.mlp_hidden=0"], "model.mlp_hidden=0 must be >= 1, or null (model.mlp_ratio x model.embed_dim)"),
    (["schedule=step", "schedule.milestones=[5,-1]"],
     "schedule.milestones=[5.0, -1.0] must be >= 0 (in schedule.unit=steps from the run's start)"),
    (["optim=sgd", "optim.momentum=0", "optim.nesterov=true"],  # torch's ValueError at the build before
     "optim.nesterov=true needs momentum: set optim.momentum > 0 (e.g. 0.9), or optim.nesterov=false"),
])
def test_each_bound_refuses_the_first_value_past_it(overrides, line):
    from stabletrain.config import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=vit_test", "steps=10", *overrides))
    assert str(e.value) == line


def test_resume_of_a_folder_names_the_checkpoint_or_the_resume_in_place(tmp_path):
    """A folder passed the existence check and met an IsADirectoryError in the loader."""
    from stabletrain.config import validate

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=vit_test", f"resume={run}"))
    assert str(e.value) == (f"resume={run} is a folder, not a checkpoint: pass a .pt file a run wrote "
                            f"(RUN/checkpoints/last.pt)")
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=vit_test", f"resume={run}"))
    assert str(e.value) == (f"resume={run} is a run's folder, not a checkpoint: resume=auto hydra.run.dir={run} "
                            f"continues that run in it; resume={run}/checkpoints/last.pt starts this run from its "
                            f"last checkpoint")
    validate(make_cfg("model=vit_test", f"resume={run}/checkpoints/last.pt"))


@pytest.mark.parametrize("overrides", [
    ["optim.betas=[0.0,0.99]"],  # beta1 = 0: no momentum, RMSProp-like Adam
    ["debug.nan_at_step=10"],  # the run's last step is a step the fault happens at
    ["optim.lr=0.001", "schedule.min_lr=0.001"],  # a cosine to the lr itself: constant
    ["model.mlp_hidden=1", "model.mlp_ratio=0.01", "schedule=step", "schedule.milestones=[0]"],
    ["optim=sgd", "optim.momentum=0.01", "optim.nesterov=true"],
    ["optim=lars", "optim.momentum=0", "optim.nesterov=true"],  # noted as unread: LARS takes no nesterov
])
def test_each_bound_takes_its_edge(overrides):
    from stabletrain.config import validate

    validate(make_cfg("model=vit_test", "steps=10", *overrides))


# --- notes and documented defaults -------------------------------------------------------------


def test_attention_alpha_is_noted_unread_without_stable_attention():
    from stabletrain.config import unread_keys

    assert unread_keys(make_cfg("attention.alpha=0.3")) == [
        "note: attention.alpha=0.3 changes nothing: only attention=stable reads it, and this run has attention=softmax"]


def test_the_defaults_the_docs_state_in_passing_are_what_a_run_composes():
    """README and docs/methods.md say ``divergence.spike_factor`` (4), ``ckpt.keep`` (3)... in their
    prose: each is the value a run composes."""
    import re

    from tests.helpers import ROOT

    cfg = make_cfg()
    stated = [(key, float(value)) for doc in ("README.md", "docs/methods.md")
              for key, value in re.findall(r"`([a-z_]+\.[a-z_.]+)`(?:-th)? \(([0-9][0-9.e-]*)[):]",
                                           (ROOT / doc).read_text())]
    assert len(stated) >= 10 and ("divergence.spike_factor", 4.0) in stated
    for key, value in stated:
        group, leaf = key.split(".")
        assert cfg[group][leaf] == value, key
