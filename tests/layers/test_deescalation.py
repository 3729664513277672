"""Token de-escalation (002 Eq. 21; docs/methods.md §3)."""

import pytest
import torch
from torch import nn

from stabletrain.config import DeescConfig, NormConfig
from stabletrain.layers.deescalate import Deescalate, make_deescalate, token_similarity
from stabletrain.layers.norm import make_norm
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from tests.layers.helpers import make_cfg, model_input
from tests.helpers import model_of


def _x(*shape, seed=0, offset=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) + offset * torch.randn(shape[-1], generator=g)  # shared mean


def _sim(x):
    """||P X||_F^2 / ||X||_F^2 for one sequence (T x d), P = (1/T) 1 1^T, written out."""
    t = x.shape[0]
    p = torch.full((t, t), 1.0 / t, dtype=x.dtype)
    return (p @ x).pow(2).sum() / x.pow(2).sum()


def test_similarity_matches_its_definition():
    x = _x(3, 10, 8)
    torch.testing.assert_close(token_similarity(x), torch.stack([_sim(s) for s in x]))
    assert token_similarity(x[:, :1].expand(3, 10, 8)).sub(1).abs().max() < 1e-6  # equal rows: 1
    assert token_similarity(torch.zeros(2, 4, 8)).eq(1).all()  # guarded zero: all rows equal


@pytest.mark.parametrize("shape", [(2, 12, 8), (2, 4, 3, 8)])  # ViT/GPT tokens, Swin (B, H, W, C)
def test_lambda_one_gives_zero_token_mean(shape):
    x = _x(*shape)
    y = Deescalate(1.0)(x)
    assert y.flatten(1, -2).mean(1).abs().max() < 1e-5
    assert token_similarity(y).abs().max() < 1e-10


@pytest.mark.parametrize("lam", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_similarity_drops_by_the_predicted_amount(lam):
    # P is a projection, so P(X - lam P X) = (1 - lam) P X and
    # ||X - lam P X||^2 = ||X||^2 - (2 lam - lam^2) ||P X||^2, hence
    # sim' = (1 - lam)^2 s ||X||^2 / ||X - lam P X||^2 = (1 - lam)^2 s / (1 - (2 lam - lam^2) s)
    x = _x(4, 16, 8).double()
    s = token_similarity(x).double()
    y = Deescalate(lam)(x)
    px = x.mean(1, keepdim=True).expand_as(x)
    ratio = x.pow(2).sum((1, 2)) / (x - lam * px).pow(2).sum((1, 2))
    want = (1 - lam) ** 2 * s * ratio
    torch.testing.assert_close(token_similarity(y).double(), want, rtol=1e-5, atol=1e-7)
    closed = (1 - lam) ** 2 * s / (1 - (2 * lam - lam**2) * s)
    torch.testing.assert_close(want, closed)
    assert (s > 0.5).all()  # the offset makes tokens similar, so the drop is large


def test_causal_prefix_mean_and_no_leak():
    x = _x(2, 9, 6)
    y = Deescalate(0.7, causal=True)(x)
    for t in range(9):
        torch.testing.assert_close(y[:, t], x[:, t] - 0.7 * x[:, : t + 1].mean(1))
    x2 = x.clone()
    x2[:, 5:] += 3.0
    torch.testing.assert_close(Deescalate(0.7, causal=True)(x2)[:, :5], y[:, :5])
    assert torch.equal(Deescalate(1.0, causal=True)(x)[:, 0], torch.zeros(2, 6))  # exactly 0


def test_learnable_lambda_is_a_trained_parameter():
    mod = Deescalate(0.5, learnable=True)
    assert isinstance(mod.lambda_, nn.Parameter)
    x = _x(2, 5, 4)
    mod(x).square().sum().backward()
    assert mod.lambda_.grad is not None and mod.lambda_.grad.abs() > 0
    # d/dlam sum (X - lam P X)^2 = -2 sum (X - lam P X) * P X, written out
    px = x.mean(1, keepdim=True).expand_as(x)
    torch.testing.assert_close(mod.lambda_.grad, -2 * ((x - 0.5 * px) * px).sum())
    assert "lambda_" in dict(Deescalate(0.5).named_buffers())


NORMS = [dict(name="layernorm"), dict(name="rmsnorm"), dict(name="stablenorm", eps_mode="sqrt"),
         dict(name="stablenorm", eps_mode="add"), dict(name="stablenorm", alpha=0.0, eps_mode="add"),
         dict(name="none")]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", NORMS, ids=lambda n: "-".join(str(v) for v in n.values()))
def test_zeroed_first_token_stays_finite_through_the_next_norm(norm, bias):
    x = _x(2, 6, 8).requires_grad_()
    y = Deescalate(1.0, causal=True)(x)
    assert torch.equal(y[:, 0], torch.zeros(2, 8))
    out = make_norm(NormConfig(**norm), 8, bias=bias)(y)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


def _mean_at_mlp_input(block, x):
    seen = {}
    handle = block.mlp.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    out = block(x)
    handle.remove()
    return seen["x"], out


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_placements(placement):
    x = torch.randn(2, 17, 32)
    cfg = make_cfg("vit_test", norm=dict(name="layernorm", placement=placement),
                   deescalate=dict(name="deescalate", placement="block"))
    block = build_model(cfg.model, Components.of(cfg)).blocks[0]
    _, out = _mean_at_mlp_input(block, x)
    assert out.mean(1).abs().max() < 1e-5  # the end of the block
    cfg = make_cfg("vit_test", norm=dict(name="layernorm", placement=placement),
                   deescalate=dict(name="deescalate", placement="ffn"))
    block = build_model(cfg.model, Components.of(cfg)).blocks[0].eval()
    mlp_in, out = _mean_at_mlp_input(block, x)
    if placement == "post":
        assert mlp_in.mean(1).abs().max() < 1e-5  # the FFN sees the de-escalated stream ...
        with torch.no_grad():  # ... and so does its residual path
            torch.testing.assert_close(out, block.norm2(mlp_in + block.mlp(mlp_in)))
    else:
        with torch.no_grad():
            h = x + block.attn(block.norm1(x))
            h = h - h.mean(1, keepdim=True)  # de-escalated residual stream entering the FFN
            torch.testing.assert_close(out, h + block.mlp(block.norm2(h)))


def test_models_use_prefix_mean_only_when_causal():
    gpt = model_of(make_cfg("gpt_test", deescalate=dict(name="deescalate", placement="block")))
    vit = model_of(make_cfg("vit_test", deescalate=dict(name="deescalate", placement="block")))
    swin = model_of(make_cfg("swin_test", deescalate=dict(name="deescalate", placement="ffn")))
    assert all(b.deesc.causal for b in gpt.blocks)
    assert not any(b.deesc.causal for b in vit.blocks)
    swin_blocks = [m for m in swin.modules() if hasattr(m, "deesc_at")]
    assert swin_blocks and all(b.deesc_at == "ffn" and not b.deesc.causal for b in swin_blocks)
    forced = make_deescalate(DeescConfig(name="deescalate", placement="block", causal=False), model_causal=True)[1]
    assert not forced.causal
    assert make_deescalate(DeescConfig(name="none"), True) == ("none", None)
    for model, cfg in ((gpt, make_cfg("gpt_test")), (swin, make_cfg("swin_test"))):
        assert torch.isfinite(model(model_input(cfg))).all()


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("where", ["block", "ffn"])
def test_swin_block_placements_follow_the_formula(placement, where):
    """A Swin block's output against the block written out by hand, with the token mean taken
    over the whole (H, W) feature map."""
    cfg = make_cfg("swin_test", norm=dict(name="layernorm", placement=placement),
                   deescalate=dict(name="deescalate", placement=where))
    model = build_model(cfg.model, Components.of(cfg)).eval()
    blk = next(m for m in model.modules() if hasattr(m, "deesc_at"))
    b, h, w, c = 2, *blk.input_resolution, blk.norm1.normalized_shape[0]
    x = torch.randn(b, h, w, c)

    def center(t):  # X - P X over all tokens of each sample
        return t - t.mean(dim=(1, 2), keepdim=True)

    with torch.no_grad():
        y = blk.norm1(x + blk._attn(x)) if placement == "post" else x + blk._attn(blk.norm1(x))
        if where == "ffn":
            y = center(y)
        t = y.reshape(b, -1, c)
        t = blk.norm2(t + blk.mlp(t)) if placement == "post" else t + blk.mlp(blk.norm2(t))
        want = t.reshape(b, h, w, c)
        if where == "block":
            want = center(want)
        torch.testing.assert_close(blk(x), want)
