"""StableNorm (004 Eq. 2; docs/methods.md §5) and the norm factory."""

import math

import pytest
import torch
from torch import nn

from stabletrain.config import ConfigError, NormConfig
from stabletrain.layers.norm import StableNorm, make_norm


def _x(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("d", [8, 64])
def test_alpha_half_is_rmsnorm_with_eps_over_d(d):
    # sqrt(d) x / sqrt(||x||^2 + eps) = x / sqrt(mean(x^2) + eps / d): exact for RMSNorm(eps / d)
    x = _x(3, 5, d)
    gain = _x(d, seed=1)
    sn = StableNorm(d, alpha=0.5, eps=1e-3)
    rms = nn.RMSNorm(d, eps=1e-3 / d)
    with torch.no_grad():
        sn.weight.copy_(gain)
        rms.weight.copy_(gain)
    torch.testing.assert_close(sn(x), rms(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps_mode", ["sqrt", "add"])
@pytest.mark.parametrize("alpha", [0.0, 0.125, 0.25, 0.375, 0.475, 0.5])
def test_output_norm_is_d_to_alpha(alpha, eps_mode):
    d = 48
    x = _x(4, 7, d, scale=3.0)
    y = StableNorm(d, alpha=alpha, eps=1e-12, eps_mode=eps_mode)(x)
    torch.testing.assert_close(y.norm(dim=-1), torch.full((4, 7), d**alpha), rtol=1e-5, atol=0)


@pytest.mark.parametrize("eps_mode", ["sqrt", "add"])
def test_eps_modes_follow_their_formulas(eps_mode):
    d, eps, alpha = 16, 0.3, 0.25  # a large eps makes the two modes differ visibly
    x = _x(5, d, scale=0.2)
    n2 = x.pow(2).sum(-1, keepdim=True)
    want = d**alpha * x / (torch.sqrt(n2 + eps) if eps_mode == "sqrt" else n2.sqrt() + eps)
    torch.testing.assert_close(StableNorm(d, alpha, eps, eps_mode)(x), want)


@pytest.mark.parametrize("alpha", [-0.01, 0.51, 1.0])
def test_alpha_outside_range_is_refused(alpha):
    with pytest.raises(ConfigError, match=r"alpha=.*\[0, 0.5\]"):
        StableNorm(8, alpha=alpha)
    with pytest.raises(ConfigError, match="alpha"):
        make_norm(NormConfig(name="stablenorm", alpha=alpha), 8)


def test_stablenorm_reduces_in_fp32_under_autocast():
    # a bf16 sum of squares over 4096 entries would be off by far more than bf16 rounding
    d = 4096
    x = (_x(2, d) + 1.0).bfloat16()
    sn = StableNorm(d, alpha=0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sn(x)
    want = d**0.25 * x.double() / torch.sqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=1e-3)


def test_factory_builds_each_norm():
    cfg = NormConfig
    ln = make_norm(cfg(name="layernorm"), 8, bias=False, ln_eps=1e-6)
    assert isinstance(ln, nn.LayerNorm) and ln.bias is None and ln.eps == 1e-6
    rms = make_norm(cfg(name="rmsnorm", eps=1e-4), 8)
    assert isinstance(rms, nn.RMSNorm) and rms.eps == 1e-4
    sn = make_norm(cfg(name="stablenorm", alpha=0.25, eps=1e-6, eps_mode="add"), 8)
    assert isinstance(sn, StableNorm) and (sn.alpha, sn.eps, sn.eps_mode) == (0.25, 1e-6, "add")
    assert math.isclose(sn.scale, 8**0.25)
    assert isinstance(make_norm(cfg(name="none"), 8), nn.Identity)


@pytest.mark.parametrize("eps_mode,eps", [("sqrt", 1e-5), ("add", 1e-8)])
def test_null_eps_is_each_modes_own(eps_mode, eps):
    """docs/methods.md §5: sqrt(||x||^2 + 1e-5) as the text, ||x|| + 1e-8 as the demo; also in
    StableAtten's q/k norms, which take norm.eps_mode."""
    from stabletrain.config import AttentionConfig
    from stabletrain.layers.attention import qk_transform

    d, alpha = 16, 0.25
    x = torch.randn(4, d, dtype=torch.float64) * 1e-3  # small: eps shows in the output
    n2 = x.pow(2).sum(-1, keepdim=True)
    want = d**alpha * x / (torch.sqrt(n2 + eps) if eps_mode == "sqrt" else n2.sqrt() + eps)
    sn = make_norm(NormConfig(name="stablenorm", alpha=alpha, eps_mode=eps_mode), d)
    assert sn.eps == eps
    torch.testing.assert_close(sn(x), want.to(sn(x).dtype))
    qn, kn, _ = qk_transform(AttentionConfig(name="stable"), NormConfig(alpha=alpha, eps_mode=eps_mode), d, 64)
    assert qn.eps == kn.eps == eps and qn.eps_mode == eps_mode
    assert make_norm(NormConfig(name="rmsnorm"), d).eps == 1e-5


def test_float64_input_is_normalised_in_float64():
    """Low precision is computed in fp32; float64 (a gradcheck, a reference run) stays float64."""
    x = _x(4, 32).double()
    sn = StableNorm(32, alpha=0.25, eps=1e-5).double()
    expect = 32**0.25 * x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-5)
    assert sn(x).dtype == torch.float64
    torch.testing.assert_close(sn(x), expect, rtol=1e-14, atol=0)


def test_the_start_note_on_stablenorm_under_adamw2_states_the_output_scale_it_measures():
    """norm=stablenorm (alpha < 0.5) under AdamW² is noted at the start with the factor by which
    its output is smaller than RMSNorm's; that factor is the measured ratio of the two outputs."""
    import re

    from stabletrain.build import stablenorm_note
    from tests.helpers import make_cfg

    cfg = make_cfg("model=vit_test", "norm=stablenorm", "norm.alpha=0.125", "optim=adamw2")
    note = stablenorm_note(cfg)
    d = cfg.model.embed_dim
    factor = float(re.search(r"= ([\d.]+)x an RMSNorm's at width (\d+)", note).group(1))
    assert f"at width {d}" in note and "norm.alpha=0.125" in note
    x = torch.randn(64, d)
    ratio = StableNorm(d, alpha=0.125, eps=0.0).forward(x).norm(dim=-1) / nn.RMSNorm(d, eps=0.0)(x).norm(dim=-1)
    assert torch.allclose(ratio, torch.full_like(ratio, factor), atol=0.005)
    for other in (["optim=adamw"], ["norm.alpha=0.5"], ["norm=rmsnorm"]):
        assert stablenorm_note(make_cfg("model=vit_test", "norm=stablenorm", "norm.alpha=0.125", *other)) is None
