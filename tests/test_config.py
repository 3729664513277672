"""Out-of-range values fail in validate() with one line naming the key and the fix."""

import pytest

from stabletrain.build import validate
from stabletrain.config import ConfigError
from tests.helpers import make_cfg, model_of


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
    (["logger.log_every=0"], "logger.log_every=0 must be >= 1"),
    (["steps=40", "debug.nan_at_step=500"], "debug.nan_at_step=500 is past the run's steps=40"),
    (["device=tpu"], "device=tpu is not an option"),
    (["schedule.min_lr=-1"], "schedule.min_lr=-1.0 must be >= 0"),
    (["optim=sgd", "optim.momentum=5"], "optim.momentum=5.0 must be in [0, 1)"),
    (["data.val_fraction=0"], "data.val_fraction=0.0 must be in (0, 1)"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 must be in (0, 1)"),
    (["data.mixup=-1"], "must be >= 0 (0 is off)"),
    (["model.depth=0"], "model.depth=0 must be >= 1"),
    (["model.num_heads=0"], "model.num_heads=0 must be >= 1"),
    # int(32 x 0.03) = 0: timm's Mlp then built one as wide as the model, a larger MLP than 0.04's
    (["model=vit_test", "model.mlp_ratio=0.03"], "model.mlp_ratio=0.03 makes the MLP 0 wide at model.embed_dim=32: "
                                                  "raise it to 0.0313 or more, or set model.mlp_hidden"),
    # a cosine ending before the warmup did: one step at the peak, then lr 0
    (["warmup=4", "schedule.horizon=2"], "schedule.horizon=2 must be longer than warmup=4 (both in schedule.unit)"),
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
    # a learned lambda starts where it is told (the layer does not clamp it; the check refused it)
    validate(make_cfg("deescalate=block", "deescalate.learnable=true", "deescalate.lambda_=1.5"))
    assert float(model_of(make_cfg("model=vit_test", "deescalate=block", "deescalate.learnable=true",
                                   "deescalate.lambda_=1.5")).blocks[0].deesc.lambda_.detach()) == 1.5


@pytest.mark.parametrize("overrides,micro", [(["batch_size=5"], 5), (["batch_size=6", "micro_batch_size=3"], 3)])
def test_mixup_needs_an_even_micro_batch(tmp_path, overrides, micro):
    """Checked where the micro-batch is known (it depends on the world size)."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    with pytest.raises(ConfigError, match=f"micro-batch {micro} must be even"):
        build_trainer(make_cfg(*QUIET, "model=vit_test", "data.mixup=0.8", *overrides), tmp_path)


@pytest.mark.parametrize("overrides,needle", [
    (["warmup=inf"], "warmup=inf must be a finite number"),
    (["epochs=inf"], "epochs=inf must be a finite number"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number"),
    (["optim.lr=nan"], "optim.lr=nan must be a finite number"),
    (["optim.eps=inf"], "optim.eps=inf must be a finite number"),
    (["optim.tau=inf"], "optim.tau=inf must be a finite number"),
    (["optim.weight_decay=inf"], "optim.weight_decay=inf must be a finite number"),
    (["norm.alpha=nan"], "norm.alpha=nan must be a finite number"),
    (["grad_clip=nan"], "grad_clip=nan must be a finite number"),
    (["model=gpt_test", "model.block_size=0"], "model.block_size=0 must be >= 1"),
    (["model=gpt_test", "model.dropout=1.5"], "model.dropout=1.5 must be in [0, 1)"),
    (["model=gpt_test", "model.dropout=-0.1"], "model.dropout=-0.1 must be in [0, 1)"),
    (["model.patch_size=0"], "model.patch_size=0 must be >= 1"),
    (["model.img_size=30", "model.patch_size=4"], "model.img_size=30 is not a multiple of model.patch_size=4"),
    (["model.drop_path=1.0"], "model.drop_path=1.0 must be in [0, 1)"),
    (["model.drop_path=-0.5"], "model.drop_path=-0.5 must be in [0, 1)"),
    (["model=swin_test", "model.window_size=0"], "model.window_size=0 must be >= 1"),
    (["data.img_size=30"], "data.img_size=30 is not a multiple of model.patch_size=4: the patches must tile the "
                           "image; the nearest sizes that do are 28 or 32"),
    (["data.img_size=0"], "data.img_size=0 must be >= 1 (null: the model's, model.img_size=16)"),
    (["model=swin_test", "model.img_size=15"], "model.img_size=15 with model.patch_size=2 and model.window_size=4: "
                                               "the patches do not tile the image"),
    (["model=swin_test", "model.img_size=24", "model.window_size=5"],
     "stage 0's 12x12 token grid is not a multiple of the window (timm would drop or pad pixels and tokens, "
     "attending to the padding); the next size that fits is 40"),
    (["model=swin_test", "data.img_size=20"], "data.img_size=20 with model.patch_size=2"),
    (["model=swin_test", "model.img_size=44", "model.window_size=9"], "stage 0's 22x22 token grid is not a multiple"),
    (["seed=9223372036854775808"], "seed=9223372036854775808 must be in [0, 2**63 - 1]"),
    (["seed=-1"], "seed=-1 must be in [0, 2**63 - 1]"),
    (["device=cudaX"], "device=cudaX is not an option"),
    (["device=mps"], "device=mps is not an option"),
    (["device=cuda:x"], "device=cuda:x is not an option"),
    (["divergence.window=0"], "divergence.window=0 must be >= 1"),
    (["divergence.spike_factor=1.0"], "divergence.spike_factor=1.0 must be > 1"),
    (["schedule.horizon=0"], "schedule.horizon=0.0 must be > 0"),
    (["optim.lr=0.001", "schedule.min_lr=0.01"], "schedule.min_lr=0.01 must be <= optim.lr=0.001"),
    (["schedule.gamma=0"], "schedule.gamma=0.0 must be in (0, 1]"),
    (["schedule.gamma=1.5"], "schedule.gamma=1.5 must be in (0, 1]"),
])
def test_values_that_crashed_or_were_silently_accepted_are_one_line_errors(overrides, needle):
    cfg = make_cfg("model=vit_test", "steps=10", *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["device=cuda:1"], ["device=cuda"], ["grad_clip=inf"], ["divergence.spike_factor=inf"],
    ["seed=9223372036854775807"],
    ["model.img_size=32", "model.patch_size=4"], ["schedule.gamma=1.0"], ["data.img_size=32"],
    ["model=swin_test", "model.window_size=16"], ["model=swin_test", "data.img_size=32"], ["model=swin_t"],
])
def test_the_edges_that_mean_something_pass(overrides):
    validate(make_cfg("model=vit_test", "steps=10", *overrides))


@pytest.mark.parametrize("overrides,tau", [
    (["model=gpt_test"], 0.01),  # 000 Table 2: GPT
    (["model=vit_test"], 0.004),  # ViT
    (["model=swin_test"], 0.004),  # Swin
    (["model=gpt_test", "optim.tau=0.002"], 0.002),  # given: kept
    (["model=gpt_test", "optim=adamw"], None),  # read by AdamW² alone
])
def test_a_null_tau_is_the_model_familys_and_config_yaml_records_it(tmp_path, overrides, tau):
    from omegaconf import OmegaConf

    from stabletrain.build import build_trainer

    cfg = make_cfg(*overrides, "logger=none", "monitor=off")
    t = build_trainer(cfg, tmp_path)
    if tau is not None:
        assert [g["tau"] for g in t.optimizer.param_groups] == [tau] * len(t.optimizer.param_groups)
    assert OmegaConf.to_container(cfg, resolve=True)["optim"]["tau"] == tau  # what run.py writes to config.yaml


def test_resume_may_change_the_loader_workers_and_micro_batch_but_not_the_data():
    """data.num_workers changes no sample (each image's draws are seeded by its place in the
    stream): a resume on a machine with fewer cores is no change; the other data keys are."""
    from omegaconf import OmegaConf

    from stabletrain.config import changed_keys

    def yaml(**data):
        return OmegaConf.to_yaml(make_cfg("model=vit_test", *(f"data.{k}={v}" for k, v in data.items())))

    assert changed_keys(yaml(num_workers=8), yaml(num_workers=0)) == []
    # the batch in other pieces (what an out-of-memory error suggests) is the same run
    with_micro = OmegaConf.to_yaml(make_cfg("model=vit_test", "micro_batch_size=8"))
    assert changed_keys(yaml(), with_micro) == []
    assert changed_keys(yaml(num_workers=8, img_size=32), yaml(num_workers=0)) == ["data.img_size"]


def test_resume_reads_imports_as_the_modules_they_name(tmp_path, monkeypatch):
    """./mine.py, mine.py and its absolute path are one file, in any order; another module is a change."""
    from stabletrain.config import changed_keys

    monkeypatch.chdir(tmp_path)
    for name in ("mine.py", "other.py"):
        (tmp_path / name).write_text("")

    def yaml(*imports):
        return "imports:\n" + "".join(f"- {i}\n" for i in imports) if imports else "imports: []\n"

    assert changed_keys(yaml("mine.py", "other.py"), yaml(str(tmp_path / "other.py"), "./mine.py")) == []
    assert changed_keys(yaml("mine.py"), yaml("mine.py", "other.py")) == ["imports[1]"]
    assert changed_keys(yaml("mine.py"), yaml("other.py")) == ["imports[0]"]
    assert changed_keys(yaml("pkg.mod"), yaml("pkg.mod")) == []


@pytest.mark.parametrize("overrides,world,error", [
    (["batch_size=15"], 2,
     "batch_size=15 does not split evenly over its 2 rank(s): use batch_size=14 or batch_size=16, or launch 1 or 3 "
     "process(es)"),
    (["batch_size=16", "micro_batch_size=3"], 2,
     "batch_size=16 does not split evenly over micro_batch_size=3 x 2 rank(s): use micro_batch_size=2, or "
     "batch_size=12 or batch_size=18"),
    # what a run resumed on another number of processes can change: its micro-batch
    (["batch_size=64", "micro_batch_size=64"], 2,
     "batch_size=64 does not split evenly over micro_batch_size=64 x 2 rank(s): use micro_batch_size=32, or "
     "batch_size=128, or launch 1 process(es)"),
    (["batch_size=15", "micro_batch_size=5"], 2,
     "batch_size=15 does not split evenly over micro_batch_size=5 x 2 rank(s): use batch_size=10 or batch_size=20, "
     "or launch 1 or 3 process(es)"),
    (["batch_size=1"], 2, "batch_size=1 does not split evenly over its 2 rank(s): use batch_size=2, or launch 1 "
                          "process(es)"),
    (["batch_size=24"], 5, "batch_size=24 does not split evenly over its 5 rank(s): use batch_size=20 or "
                           "batch_size=25, or launch 4 or 6 process(es)"),
])
def test_a_batch_that_does_not_split_names_the_sizes_that_do(overrides, world, error):
    """It named micro_batch_size=7, a value derived, not given, and no size that works; a resumed
    run, which cannot change its batch, is told the micro-batch and the process counts that split it."""
    from stabletrain.build import _shard
    from stabletrain.topology import DistInfo

    with pytest.raises(ConfigError) as e:
        _shard(make_cfg("model=gpt_test", *overrides), DistInfo(0, world, 0))
    assert str(e.value) == error
