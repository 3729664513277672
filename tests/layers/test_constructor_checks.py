"""Layers built directly (not through train.py's validation) refuse values that would give silent
wrong results, in one line naming the key and its range, as :func:`stabletrain.config.validate` does."""

from __future__ import annotations

import pytest
from torch import nn

from stabletrain.config import AttentionConfig, Components, InitConfig, ModelConfig, NormConfig
from stabletrain.errors import ConfigError
from stabletrain.layers.attention import qk_transform
from stabletrain.layers.deescalate import Deescalate
from stabletrain.layers.init import apply_init
from stabletrain.layers.norm import StableNorm, make_norm
from stabletrain.models.registry import build_model

TINY = dict(embed_dim=16, depth=1, num_heads=2)
VIT = dict(family="vit", img_size=16, patch_size=8, in_chans=1, num_classes=3, **TINY)
GPT = dict(family="gpt", vocab_size=32, block_size=8, **TINY)


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=-1.0), "StableNorm eps=-1.0 must be >= 0"),
    (dict(eps=float("nan")), "StableNorm eps=nan must be >= 0"),
    (dict(eps="1e-5"), "StableNorm eps='1e-5' must be >= 0"),
    (dict(alpha="0.25"), r"StableNorm alpha='0.25' must be a number in \[0, 0.5\]"),
    (dict(alpha=0.6), r"StableNorm alpha=0.6 must be a number in \[0, 0.5\]"),
    (dict(alpha=float("nan")), r"StableNorm alpha=nan must be a number in \[0, 0.5\]"),
    (dict(eps=-1e-8, eps_mode="add"), "StableNorm eps=-1e-08 must be >= 0"),
])
def test_stablenorm_refuses(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        StableNorm(16, **kwargs)
    _one_line(err)


@pytest.mark.parametrize("kwargs", [dict(), dict(alpha=0), dict(alpha=0.5), dict(eps=0.0), dict(eps=1e-3),
                                    dict(alpha=0.125, eps_mode="add")])
def test_stablenorm_accepts(kwargs):
    StableNorm(16, **kwargs)


@pytest.mark.parametrize("name", ["stablenorm", "rmsnorm"])
@pytest.mark.parametrize("eps", [-1.0, 0.0])
def test_norm_builders_use_configs_eps_range(name, eps):
    with pytest.raises(ConfigError, match=rf"norm.eps={eps} must be > 0 or null"):
        make_norm(NormConfig(name=name, alpha=0.25, eps=eps), 16)


@pytest.mark.parametrize("lam", [2.0, -1.0, 1.0001, float("nan")])
def test_deescalate_refuses_lambda_outside_unit_interval(lam):
    with pytest.raises(ConfigError, match=r"deescalate.lambda_=.* must be in \[0, 1\]") as err:
        Deescalate(lam)
    _one_line(err)


@pytest.mark.parametrize("lam, learnable", [(0.0, False), (1.0, False), (0.5, False), (2.0, True), (-1.0, True)])
def test_deescalate_accepts(lam, learnable):
    assert float(Deescalate(lam, learnable=learnable).lambda_.detach()) == lam


@pytest.mark.parametrize("cfg, match", [
    (AttentionConfig(name="stable", c=-1), "attention.c=-1 must be > 0"),
    (AttentionConfig(name="stable", c=0), "attention.c=0 must be > 0"),
    (AttentionConfig(name="stable", eps=-1.0), "attention.eps=-1.0 must be > 0 or null"),
    (AttentionConfig(name="qknorm", eps=-1.0), "attention.eps=-1.0 must be > 0 or null"),
    (AttentionConfig(name="qknorm", eps=0.0), "attention.eps=0.0 must be > 0 or null"),
])
def test_attention_builders_refuse(cfg, match):
    with pytest.raises(ConfigError, match=match) as err:
        qk_transform(cfg, NormConfig(alpha=0.25), 8, 16)
    _one_line(err)


@pytest.mark.parametrize("cfg", [AttentionConfig(name="stable"), AttentionConfig(name="stable", c=0.5, eps=1e-6),
                                 AttentionConfig(name="qknorm"), AttentionConfig(name="qknorm", eps=1e-6)])
def test_attention_builders_accept(cfg):
    qn, kn, scale = qk_transform(cfg, NormConfig(alpha=0.25), 8, 16)
    assert scale > 0


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


@pytest.mark.parametrize("cfg, match", [
    (InitConfig(name="stable", gain=0), "init.gain=0 must be > 0"),
    (InitConfig(name="xavier", gain=-1), "init.gain=-1 must be > 0"),
    (InitConfig(name="stable", fused_qkv="rows"), "init.fused_qkv=rows is not an option: use slices or matrix"),
])
def test_apply_init_refuses(cfg, match):
    with pytest.raises(ConfigError, match=match) as err:
        apply_init(_mlp(), cfg)
    _one_line(err)


@pytest.mark.parametrize("cfg", [InitConfig(name="stable"), InitConfig(name="trunc_xavier", gain=0.5),
                                 InitConfig(name="stable", fused_qkv="matrix"), InitConfig(name="family", gain=0)])
def test_apply_init_accepts(cfg):
    apply_init(_mlp(), cfg)


@pytest.mark.parametrize("model", [VIT, GPT])
def test_model_act_refuses_unknown(model):
    with pytest.raises(ConfigError, match="model.act=swish is not an option: use gelu, gelu_tanh, relu") as err:
        build_model(ModelConfig(name="tiny", act="swish", **model), Components())
    _one_line(err)


@pytest.mark.parametrize("model", [VIT, GPT])
@pytest.mark.parametrize("act, layer", [("gelu", nn.GELU), ("relu", nn.ReLU)])
def test_model_act_builds(model, act, layer):
    m = build_model(ModelConfig(name="tiny", act=act, **model), Components())
    assert any(isinstance(mod, layer) for mod in m.modules())
