"""Every paper recipe composes, validates and builds; the AdamW² ones train on embedded data."""

from pathlib import Path

import pytest
import torch

from stabletrain.build import validate
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from tests.helpers import ROOT, make_cfg, train, model_of

RECIPES = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
REQUIRED = {"deesc_vit_cifar": ["optim.lr=1e-3"]}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_builds(name):
    cfg = make_cfg(f"experiment={name}", *REQUIRED.get(name, []))
    validate(cfg)
    if cfg.reparam.name == "none":
        with torch.device("meta"):
            build_model(cfg.model, Components.of(cfg))
    else:  # sigmaReparam's SVD init needs real numbers: a shallow copy of the recipe
        model_of(make_cfg(f"experiment={name}", *REQUIRED.get(name, []), "model.depth=1"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_length_is_the_papers(name):
    """A recipe given in epochs trains for its epochs: train.yaml's steps=600 (make train's
    length) would otherwise override them."""
    cfg = make_cfg(f"experiment={name}", *REQUIRED.get(name, []))
    assert (cfg.steps is None) != (cfg.epochs is None), (cfg.steps, cfg.epochs)


def test_an_epoch_recipe_sets_the_trainers_length_and_schedule_in_epochs(tmp_path):
    from stabletrain.build import build_trainer
    from stabletrain.optim import scaled_lr

    cfg = make_cfg("experiment=vit_s_cifar100", "model=vit_test", "data=digits", "logger=none", "monitor=off",
                   "batch_size=64", "epochs=3", "warmup=1")
    t = build_trainer(cfg, tmp_path)
    spe = t.steps_per_epoch
    assert t.total_steps == round(3 * spe) and spe > 1
    assert cfg.schedule.unit == "epochs"
    assert t.schedule.lr_at(spe) == pytest.approx(scaled_lr(cfg.optim, cfg.batch_size))  # warmup: one epoch
    assert t.schedule.lr_at(spe // 2) < t.schedule.lr_at(spe)


def test_warmup_free_recipes_have_baselines():
    for model in ("vit_b", "gpt2_s", "swin_s"):
        ours, base = make_cfg(f"experiment=adamw2_{model}"), make_cfg(f"experiment=adamw_{model}")
        assert ours.optim.name == "adamw2" and ours.warmup == 0
        assert base.optim.name == "adamw" and base.warmup > 0
        assert base.init.name == "family"  # the reference code's own AdamW run
    assert make_cfg("experiment=adamw_vit_b").warmup == 60
    assert make_cfg("experiment=adamw_gpt2_s").warmup == 2000
    assert make_cfg("experiment=adamw_swin_s").warmup == 20


@pytest.mark.parametrize("name,shrink", [
    ("adamw2_vit_b", ["model.depth=1"]),
    ("adamw2_gpt2_s", ["model.depth=1", "model.block_size=64"]),
    ("adamw2_swin_s", ["model.depths=[1,1,1,1]"]),
])
def test_adamw2_recipes_train_on_embedded_data(tmp_path: Path, name, shrink):
    s = train(tmp_path, f"experiment={name}", *shrink, "steps=2", "batch_size=2", "eval_every=1000",
              "eval_batches=1", "precision=fp32")
    assert s["status"] == "completed" and s["step"] == 2


def _recipe_values(name: str) -> dict:
    c = make_cfg(f"experiment={name}")
    o, d = c.optim, c.data
    return {"optim": o.name, "tau": o.tau, "betas": list(o.betas), "lr": o.lr, "wd": o.weight_decay,
            "batch": c.batch_size, "epochs": c.epochs, "steps": c.steps, "init": c.init.name,
            "mixup": d.mixup, "cutmix": d.cutmix, "smoothing": d.label_smoothing, "erasing": d.erasing,
            "randaug": d.randaug, "drop_path": c.model.drop_path, "clip": c.grad_clip, "ema": c.ema.decay,
            "schedule": c.schedule.name, "min_lr": c.schedule.min_lr, "warmup": c.warmup,
            "context": c.model.block_size}


@pytest.mark.parametrize("name,want", [
    # docs/methods.md §8.2, the ViT-B column: tau 0.004, truncated Xavier, 1e-3 / 0.05, betas (0.9, 0.99),
    # batch 1024, 150 epochs, cosine, RandAug (9, 0.5), mixup .8, cutmix 1, erasing 0, smoothing .1,
    # stochastic depth 0.1, no clip, no EMA
    ("adamw2_vit_b", dict(optim="adamw2", tau=0.004, betas=[0.9, 0.99], lr=1e-3, wd=0.05, batch=1024, epochs=150,
                          steps=None, init="trunc_xavier", mixup=0.8, cutmix=1.0, smoothing=0.1, erasing=0.0,
                          randaug="rand-m9-mstd0.5-inc1", drop_path=0.1, clip=None, ema=None, schedule="cosine",
                          min_lr=0.0, warmup=0)),
    # GPT-S: tau 0.01, Xavier, 6e-4 / 0.1, betas (0.9, 0.95), 480 x 1024 tokens, 600K iterations,
    # cosine to nanoGPT's 6e-5, clip 1.0
    ("adamw2_gpt2_s", dict(optim="adamw2", tau=0.01, betas=[0.9, 0.95], lr=6e-4, wd=0.1, batch=480, context=1024,
                           epochs=None,
                           steps=600000, init="xavier", clip=1.0, ema=None, schedule="cosine", min_lr=6e-5,
                           warmup=0)),
    # Swin-S: tau 0.004 and Liu et al.'s defaults (AdamW (0.9, 0.999), 1e-3 at 1024, wd 0.05,
    # min lr 5e-6, clip 5.0, smoothing .1, mixup .8, cutmix 1, erasing .25, 300 epochs)
    ("adamw2_swin_s", dict(optim="adamw2", tau=0.004, betas=[0.9, 0.999], lr=1e-3, wd=0.05, batch=1024, epochs=300,
                           steps=None, init="family", mixup=0.8, cutmix=1.0, smoothing=0.1, erasing=0.25,
                           randaug="rand-m9-mstd0.5-inc1", clip=5.0, ema=None, schedule="cosine", min_lr=5e-6,
                           warmup=0)),
])
def test_adamw2_recipes_carry_spec_8_2(name, want):
    got = _recipe_values(name)
    assert {k: got[k] for k in want} == want
