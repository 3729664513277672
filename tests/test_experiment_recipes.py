"""The paper recipes compose, carry docs/methods.md's settings and build the intended models."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from stabletrain.layers.attention import Attention
from stabletrain.layers.deescalate import Deescalate
from stabletrain.layers.locater import locater_penalty
from stabletrain.layers.norm import StableNorm
from stabletrain.registry import option_value
from stabletrain.layers.reparam import gamma_parameters
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from stabletrain.spectral import sigma1_exact
from tests.layers.helpers import compose_cfg, model_input
from tests.helpers import model_of

NAMES = ["stable_gpt2_s", "stable_vit_l", "sigma_vit_b", "deesc_vit_cifar", "locater_1layer", "vit_s_cifar100",
         "stable_vit_s_cifar100"]


def _v(node):
    return option_value(node)


@pytest.mark.parametrize("name", NAMES)
def test_recipe_composes(name):
    cfg = compose_cfg(f"experiment={name}")
    assert cfg.name == name
    assert OmegaConf.to_yaml(cfg)


def test_stable_gpt2_s():
    cfg = compose_cfg("experiment=stable_gpt2_s")
    assert (_v(cfg.model.name), _v(cfg.norm.name), _v(cfg.attention.name), _v(cfg.init.name)) == \
        ("gpt2_s", "stablenorm", "stable", "stable")
    assert cfg.norm.alpha == 0.475 and cfg.attention.c == 1.618
    o = cfg.optim
    assert (_v(o.name), o.lr, list(o.betas), o.weight_decay) == ("adamw", 6e-4, [0.9, 0.95], 0.1)
    assert (_v(cfg.schedule.name), cfg.schedule.min_lr, cfg.warmup, cfg.steps) == ("cosine", 6e-5, 2000, 600000)
    assert (cfg.batch_size, cfg.grad_clip, _v(cfg.precision), cfg.model.dropout) == (480, 1.0, "auto", 0.0)
    with torch.device("meta"):
        model = build_model(cfg.model, Components.of(cfg))
    norms = [m for m in model.modules() if isinstance(m, (StableNorm, nn.LayerNorm, nn.RMSNorm))]
    assert len(norms) == 2 * 12 * 2 + 1 and all(isinstance(n, StableNorm) for n in norms)
    attn = model.blocks[0].attn
    assert attn.scale == pytest.approx(1.618 * math.log2(1024) * 64 ** (-2 * 0.475))
    assert attn.q_norm.alpha == 0.475


def test_stable_vit_l():
    cfg = compose_cfg("experiment=stable_vit_l")
    assert (_v(cfg.model.name), _v(cfg.norm.name), _v(cfg.attention.name), _v(cfg.init.name)) == \
        ("vit_l", "stablenorm", "stable", "stable")
    assert cfg.norm.alpha == 0.25 and cfg.warmup == 0 and cfg.epochs == 300 and cfg.batch_size == 1024
    o = cfg.optim
    assert (_v(o.name), o.lr, list(o.betas), o.weight_decay) == ("adamw", 1e-3, [0.9, 0.99], 0.1)
    assert cfg.model.drop_path == 0.5 and cfg.grad_clip is None
    d = cfg.data
    assert (d.mixup, d.cutmix, d.erasing, d.label_smoothing) == (0.8, 1.0, 0.0, 0.1)
    with torch.device("meta"):
        model = build_model(cfg.model, Components.of(cfg))
    assert model.blocks[0].attn.scale == pytest.approx(1.618 * math.log2(197) * 64 ** -0.5)


def test_cifar100_pair_differs_only_in_the_stable_transformer():
    base, ours = compose_cfg("experiment=vit_s_cifar100"), compose_cfg("experiment=stable_vit_s_cifar100")
    for cfg in (base, ours):  # App. O's protocol
        o = cfg.optim
        assert (cfg.epochs, cfg.batch_size, _v(o.name), o.lr, o.weight_decay) == (200, 512, "adamw", 1e-3, 1e-4)
    changed = {k for k in OmegaConf.to_container(base) if OmegaConf.to_container(base)[k] !=
               OmegaConf.to_container(ours)[k]}
    assert changed == {"norm", "attention", "init", "name"}
    assert (_v(ours.norm.name), ours.norm.alpha, _v(ours.attention.name), _v(ours.init.name)) == \
        ("stablenorm", 0.25, "stable", "stable")
    with torch.device("meta"):
        model = build_model(ours.model, Components.of(ours))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(21.3e6, rel=0.01)  # ViT-S, 100 classes
    assert model.blocks[0].attn.scale == pytest.approx(1.618 * math.log2(65) * 64 ** -0.5)  # 64 patches + cls


def test_sigma_vit_b_builds_a_normless_fully_reparametrised_vit():
    cfg = compose_cfg("experiment=sigma_vit_b")
    r, o, s = cfg.reparam, cfg.optim, cfg.schedule
    assert (_v(r.name), _v(r.gamma_init), r.attn_fp32, _v(cfg.norm.name)) == ("sigma", "svd", True, "none")
    assert (_v(o.name), o.lr, o.lr_scale_by_batch, o.momentum, o.weight_decay) == ("lars", 0.1, False, 0.9, 0.0)
    assert (_v(s.name), _v(s.unit), list(s.milestones), s.gamma) == ("step", "epochs", [210.0], 0.1)
    assert (cfg.epochs, cfg.warmup, cfg.batch_size) == (250, 0, 4096)
    small = compose_cfg("experiment=sigma_vit_b", "model=vit_test")  # the recipe on a tiny ViT
    torch.manual_seed(0)
    ref = model_of(compose_cfg("model=vit_test", "norm=none", "model.patch_embed_std=0.02"))  # Table 13 init
    torch.manual_seed(0)
    model = build_model(small.model, Components.of(small))
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm, StableNorm)) for m in model.modules())
    assert all(m.attn_fp32 for m in model.modules() if isinstance(m, Attention))
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert all(torch.nn.utils.parametrize.is_parametrized(m, "weight") for m in layers)
    assert len(gamma_parameters(model)) == len(layers)
    # gamma_init=svd: the effective weights start equal to the family init
    for name, w in ref.state_dict().items():
        if name.endswith("weight") and w.dim() >= 2:
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            torch.testing.assert_close(mod.weight, w, rtol=1e-4, atol=1e-6)
            gamma = mod.parametrizations.weight[0].parts[0].gamma
            assert gamma.item() == pytest.approx(sigma1_exact(w).item(), rel=1e-5)


def test_deesc_vit_cifar_requires_an_lr():
    cfg = compose_cfg("experiment=deesc_vit_cifar")
    with pytest.raises(Exception, match="optim.lr is required by this recipe"):
        _ = cfg.optim.lr
    cfg = compose_cfg("experiment=deesc_vit_cifar", "optim.lr=3e-4")
    assert cfg.optim.lr == 3e-4
    assert (_v(cfg.model.name), _v(cfg.norm.name), _v(cfg.norm.placement), _v(cfg.deescalate.placement)) == \
        ("vit_cifar_deep", "layernorm", "post", "block")
    assert (cfg.deescalate.lambda_, cfg.batch_size, cfg.epochs, list(cfg.schedule.milestones)) == \
        (1.0, 128, 150, [105.0, 135.0])
    assert (cfg.model.depth, cfg.model.embed_dim, cfg.model.num_heads, cfg.model.mlp_hidden) == (80, 192, 8, 384)
    small = compose_cfg("experiment=deesc_vit_cifar", "optim.lr=3e-4", "model.depth=2")
    model = build_model(small.model, Components.of(small))
    assert all(b.post and b.deesc_at == "block" and isinstance(b.deesc, Deescalate) for b in model.blocks)
    assert isinstance(model.norm, nn.Identity)


def test_locater_1layer_is_a_one_head_post_ln_gpt():
    cfg = compose_cfg("experiment=locater_1layer")
    m = cfg.model
    assert (_v(m.family), m.depth, m.num_heads, m.embed_dim, m.mlp_hidden, m.block_size) == \
        ("gpt", 1, 1, 128, 128, 64)
    assert dict(cfg.regularizer) == {"locater": {"scale_coef": 100.0, "mean_coef": 1.0}}
    assert (_v(cfg.optim.name), cfg.optim.lr, cfg.optim.weight_decay, _v(cfg.schedule.name)) == \
        ("adamw", 2.5e-5, 0.01, "constant")
    assert (cfg.batch_size, cfg.steps, cfg.grad_clip, _v(cfg.norm.placement)) == (64, 50000, None, "post")
    model = build_model(cfg.model, Components.of(cfg))
    assert len(model.blocks) == 1 and model.blocks[0].post and model.blocks[0].attn.num_heads == 1
    loss = model(model_input(cfg, tokens=64)).float().mean() + locater_penalty(model, cfg.regularizer.locater)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
