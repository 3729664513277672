"""The cosine weight-decay schedule (001) against hand-computed values, and in the loop."""

import math

import pytest
import torch

from stabletrain.optim import build_optimizer, set_weight_decay, weight_decay_at
from tests.helpers import make_cfg, train


def test_weight_decay_at_hand_values():
    assert weight_decay_at(0.05, None, 37, 100) == 0.05
    assert weight_decay_at(0.0, 1e-5, 0, 100) == 0.0
    assert weight_decay_at(0.0, 1e-5, 50, 100) == pytest.approx(0.5e-5)
    assert weight_decay_at(0.0, 1e-5, 25, 100) == pytest.approx(1e-5 * (1 - math.cos(math.pi / 4)) / 2)
    assert weight_decay_at(0.0, 1e-5, 100, 100) == pytest.approx(1e-5)


def test_set_weight_decay_leaves_no_decay_groups_alone():
    cfg = make_cfg("model=vit_test", "optim=lars", "optim.weight_decay=0.0")
    from stabletrain.config import Components
    from stabletrain.models.registry import build_model

    opt, _ = build_optimizer(build_model(cfg.model, Components.of(cfg)), cfg.optim, "vit")
    set_weight_decay(opt, 3e-6)
    decayed = {n for g in opt.param_groups if g["weight_decay"] == 3e-6 for n in g["names"]}
    kept = {n for g in opt.param_groups if g["weight_decay"] == 0.0 for n in g["names"]}
    assert decayed | kept == {n for g in opt.param_groups for n in g["names"]}
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.0.mlp.fc1.weight" in decayed
    assert {"pos_embed", "cls_token", "blocks.0.attn.qkv.bias", "blocks.0.norm1.weight"} <= kept


def test_the_loop_follows_the_schedule(tmp_path):
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    cfg = make_cfg(*QUIET, "model=vit_test", "steps=4", "batch_size=4", "optim=adamw", "optim.weight_decay=0.0",
                   "optim.weight_decay_end=1e-2", "eval_every=100")
    t = build_trainer(cfg, tmp_path)
    seen = []
    orig = t.optimizer.step

    def step(*a, **k):
        seen.append(max(g["weight_decay"] for g in t.optimizer.param_groups))
        return orig(*a, **k)

    t.optimizer.step = step
    t.fit()
    assert seen == pytest.approx([weight_decay_at(0.0, 1e-2, s, 4) for s in range(4)])
    assert torch.isfinite(torch.tensor(seen)).all()
    assert train(tmp_path / "r", "experiment=sigma_vit_l", "model=vit_test", "steps=2", "batch_size=2",
                 "eval_every=100", "eval_batches=1")["status"] == "completed"


def test_a_scheduled_weight_decay_has_a_start_line(tmp_path):
    """The groups' line shows wd 0 at step 0; a recipe's schedule to 1e-5 was said nowhere."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    t = build_trainer(make_cfg(*QUIET, "model=vit_test", "steps=300", "optim.weight_decay=0",
                               "optim.weight_decay_end=1e-5"), tmp_path)
    assert ("weight decay: 0 at step 0, a half cosine to 1e-05 at step 300 (optim.weight_decay_end), in the groups "
            "that decay") in t.notes
