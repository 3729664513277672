"""Block compositions: post-LN ``LN(x + f(x))`` (002 Alg. 1; 003 Sec. 7) and pre-LN."""

import pytest
import torch
from torch import nn

from stabletrain.config import Components
from stabletrain.models.registry import build_model, transformer_blocks
from tests.layers.helpers import make_cfg, model_input

NORMS = ["layernorm", "rmsnorm", "stablenorm"]


def _randomise_norms(model):
    with torch.no_grad():
        for m in model.modules():
            for name in ("weight", "bias"):
                p = getattr(m, name, None)
                if isinstance(p, nn.Parameter) and p.dim() == 1 and not isinstance(m, (nn.Linear, nn.Conv2d)):
                    p.normal_(1.0 if name == "weight" else 0.0, 0.3)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("model_name", ["vit_test", "gpt_test"])
def test_post_norm_block_is_ln_of_residual_sum(model_name, norm):
    cfg = make_cfg(model_name, norm=dict(name=norm, placement="post", alpha=0.25))
    model = build_model(cfg.model, Components.of(cfg)).eval()
    _randomise_norms(model)
    blk = model.blocks[0]
    x = torch.randn(2, 9, cfg.model.embed_dim)
    with torch.no_grad():
        h = blk.norm1(x + blk.attn(x))
        want = blk.norm2(h + blk.mlp(h))
        torch.testing.assert_close(blk(x), want)
    assert isinstance(model.norm, nn.Identity)  # a post-LN stack already ends in a norm


@pytest.mark.parametrize("model_name", ["vit_test", "gpt_test"])
def test_pre_norm_block_is_residual_of_normed_input(model_name):
    cfg = make_cfg(model_name, norm=dict(name="rmsnorm"))
    model = build_model(cfg.model, Components.of(cfg)).eval()
    _randomise_norms(model)
    blk = model.blocks[0]
    x = torch.randn(2, 9, cfg.model.embed_dim)
    with torch.no_grad():
        h = x + blk.attn(blk.norm1(x))
        torch.testing.assert_close(blk(x), h + blk.mlp(blk.norm2(h)))
    assert not isinstance(model.norm, nn.Identity)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_swin_block_composition(placement):
    cfg = make_cfg("swin_test", norm=dict(name="layernorm", placement=placement), depths=[2, 1])
    model = build_model(cfg.model, Components.of(cfg)).eval()
    _randomise_norms(model)
    for _, blk in transformer_blocks(model):
        res = blk.input_resolution
        x = torch.randn(2, *res, blk.dim)
        with torch.no_grad():
            if placement == "post":
                h = blk.norm1(x + blk._attn(x)).reshape(2, -1, blk.dim)
                want = blk.norm2(h + blk.mlp(h))
            else:
                h = (x + blk._attn(blk.norm1(x))).reshape(2, -1, blk.dim)
                want = h + blk.mlp(blk.norm2(h))
            torch.testing.assert_close(blk(x), want.reshape(2, *res, blk.dim))
    assert isinstance(model.norm, nn.Identity) == (placement == "post")
    assert torch.isfinite(model(model_input(cfg))).all()
