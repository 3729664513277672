"""Out-of-range values fail in validate() with one line naming the key and the fix."""

import pytest

from stabletrain.build import validate
from stabletrain.config import ConfigError
from tests.helpers import make_cfg


@pytest.mark.parametrize("overrides,needle", [
    (["attention=stable", "attention.eps=0"], "attention.eps=0.0 must be > 0"),
    (["attention=stable", "attention.seq_len=0"], "attention.seq_len=0 must be >= 2"),
    (["attention=stable", "attention.c=-1"], "attention.c=-1.0 must be > 0"),
    (["attention=stable", "attention.alpha=0.6"], "attention.alpha=0.6 must be in [0, 0.5]"),
    (["init=stable", "init.gain=-1"], "init.gain=-1.0 must be > 0"),
    (["init=stable", "init.gain=0"], "init.gain=0.0 must be > 0"),
    (["reparam=sigma", "reparam.gamma_lr_mult=-2"], "reparam.gamma_lr_mult=-2.0 must be >= 0"),
    (["reparam=sigma", "reparam.power_iters=0"], "reparam.power_iters=0 must be >= 1"),
    (["deescalate=block", "deescalate.lambda_=1.5"], "deescalate.lambda_=1.5 must be in [0, 1]"),
    (["model=swin_test", "deescalate=block", "deescalate.causal=true"], "does not apply to Swin"),
    (["regularizer=locater", "regularizer.locater.scale_coef=-1"], "must be >= 0"),
    (["norm.eps=0"], "norm.eps=0.0 must be > 0"),
    (["optim.power_iters=0"], "optim.power_iters=0 must be >= 1"),
    (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two values in [0, 1)"),
    (["monitor.weight_every=0"], "monitor.weight_every=0 must be >= 1"),
    (["monitor.qk_window=0"], "monitor.qk_window=0 must be >= 1"),
    (["monitor.qk_growth=0.5"], "monitor.qk_growth=0.5 must be > 1"),
    (["monitor.entropy_floor=-1"], "monitor.entropy_floor=-1.0 must be >= 0"),
    (["eval_every=0"], "eval_every=0 must be >= 1"),
    (["ckpt_every=0"], "ckpt_every=0 must be >= 1"),
    (["eval_batches=0"], "eval_batches=0 must be >= 1"),
    (["device=tpu"], "device=tpu is not an option"),
    (["schedule.min_lr=-1"], "schedule.min_lr=-1.0 must be >= 0"),
    (["optim=sgd", "optim.momentum=5"], "optim.momentum=5.0 must be in [0, 1)"),
    (["data.val_fraction=0"], "data.val_fraction=0.0 must be in (0, 1)"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 must be in (0, 1)"),
    (["data.mixup=-1"], "must be >= 0 (0 is off)"),
    (["model.depth=0"], "model.depth=0 and model.num_heads=4 must be >= 1"),
    (["model.num_heads=0"], "must be >= 1"),
    (["model.act=swish"], "model.act=swish is not an option"),
])
def test_out_of_range_values_are_refused(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate(make_cfg(*overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_defaults_and_the_recipes_validate():
    validate(make_cfg())
    validate(make_cfg("model=swin_test", "deescalate=block"))
    validate(make_cfg("model=gpt_test", "deescalate=block", "deescalate.causal=true"))


@pytest.mark.parametrize("overrides,micro", [(["batch_size=5"], 5), (["batch_size=6", "micro_batch_size=3"], 3)])
def test_mixup_needs_an_even_micro_batch(tmp_path, overrides, micro):
    """Checked where the micro-batch is known (it depends on the world size)."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    with pytest.raises(ConfigError, match=f"micro-batch {micro} must be even"):
        build_trainer(make_cfg(*QUIET, "model=vit_test", "data.mixup=0.8", *overrides), tmp_path)
