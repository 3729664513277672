"""A key set for an option the run does not use changes nothing: the run says so (a note, since
a sweep may share such keys across options), and no recipe or group option sets one."""

import pytest

from stabletrain.cli import group_options
from stabletrain.config import unread_keys
from tests.helpers import make_cfg


@pytest.mark.parametrize("overrides,note", [
    (["norm.alpha=0.3"], "norm.alpha=0.3 changes nothing: only norm=stablenorm reads it, and this run has "
                         "norm=layernorm"),
    (["optim=adamw", "optim.tau=0.01"], "optim.tau=0.01 changes nothing: only optim=adamw2 reads it"),
    (["optim=adamw2", "optim.momentum=0.5"], "optim.momentum=0.5 changes nothing: only optim=sgd/lars reads it"),
    (["schedule.milestones=[10]"], "schedule.milestones=[10.0] changes nothing: only schedule=step reads it"),
    (["attention=qknorm", "attention.c=2"], "attention.c=2.0 changes nothing: only attention=stable reads it"),
    (["reparam.gamma_init=svd"], "reparam.gamma_init=svd changes nothing: reparam=none is off"),
    (["deescalate.lambda_=0.5"], "deescalate.lambda_=0.5 changes nothing: deescalate=none is off"),
    (["ema.every=5"], "ema.every=5 changes nothing: the weight average is off"),
])
def test_a_key_nothing_reads_is_noted(overrides, note):
    notes = unread_keys(make_cfg(*overrides))
    assert len(notes) == 1 and note in notes[0], notes


@pytest.mark.parametrize("overrides", [
    ["norm=stablenorm", "norm.alpha=0.3"], ["optim=sgd", "optim.momentum=0.5"], ["schedule=step",
    "schedule.milestones=[10]"], ["reparam=sigma", "reparam.gamma_init=svd"], ["ema.decay=0.99", "ema.every=5"],
    ["attention=qknorm", "attention.eps=1e-6"],
])
def test_a_key_its_option_reads_is_not_noted(overrides):
    assert unread_keys(make_cfg(*overrides)) == []


@pytest.mark.parametrize("group", ["norm", "attention", "optim", "schedule", "reparam", "deescalate", "experiment"])
def test_no_option_or_recipe_sets_a_key_it_does_not_read(group):
    for option in group_options(group):
        assert unread_keys(make_cfg(f"{group}={option}")) == [], f"{group}={option}"


def test_the_run_prints_the_note(tmp_path, capsys):
    from tests.helpers import train

    train(tmp_path, "model=gpt_test", "steps=1", "batch_size=4", "optim=adamw", "optim.tau=0.01", "logger=none",
          "monitor=off", quiet=False)
    assert "note: optim.tau=0.01 changes nothing" in capsys.readouterr().err
