"""Initialisations (004 Eq. 1; 000 Table 2; docs/methods.md §5 and §6)."""

import math

import pytest
import torch
from torch import nn

from stabletrain.config import ConfigError, InitConfig
from stabletrain.layers.init import TRUNC_STDS, apply_init, init_matrix_, init_std
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from stabletrain.spectral import sigma1_exact
from tests.layers.helpers import make_cfg
from tests.helpers import model_of

SHAPES = [(256, 64), (96, 384), (200, 200)]  # (n_out, n_in)
# std of N(0, 1) truncated at +-2: sqrt(1 - 4 phi(2) / (2 Phi(2) - 1))
TRUNC2_STD_RATIO = math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(2 / math.sqrt(2)))


def _drawn(name, shape, gain=1.0, seed=0):
    torch.manual_seed(seed)
    return init_matrix_(torch.empty(shape), name, gain)


def _std_tolerance(n):
    return 5 / math.sqrt(2 * n)  # 5 standard errors of a sample std, relative


@pytest.mark.parametrize("gain", [1.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES)
def test_stableinit_std_and_sigma1_bound(shape, gain):
    n_out, n_in = shape
    want = gain / (math.sqrt(n_in) + math.sqrt(n_out))
    assert init_std("stable", n_in, n_out, gain) == pytest.approx(want)
    draws = [_drawn("stable", shape, gain, seed) for seed in range(4)]
    w = torch.stack(draws)
    assert abs(w.std().item() / want - 1) < _std_tolerance(w.numel())
    assert abs(w.mean().item()) < 5 * want / math.sqrt(w.numel())
    # E[sigma_max] <= gain (Gordon's bound for Gaussian matrices): the draws sit just under it
    mean_sigma1 = sum(sigma1_exact(d).item() for d in draws) / len(draws)
    assert mean_sigma1 <= gain * 1.01
    assert mean_sigma1 >= gain * 0.85


@pytest.mark.parametrize("shape", SHAPES)
def test_xavier_std(shape):
    n_out, n_in = shape
    want = math.sqrt(2 / (n_in + n_out))
    w = torch.stack([_drawn("xavier", shape, seed=s) for s in range(3)])
    assert abs(w.std().item() / want - 1) < _std_tolerance(w.numel())
    assert w.abs().max().item() > TRUNC_STDS * want  # untruncated: tails beyond 2 std exist


@pytest.mark.parametrize("shape", SHAPES)
def test_trunc_xavier_truncates_at_two_std(shape):
    n_out, n_in = shape
    std = math.sqrt(2 / (n_in + n_out))
    w = torch.stack([_drawn("trunc_xavier", shape, seed=s) for s in range(3)])
    assert w.abs().max().item() <= 2 * std
    assert w.abs().max().item() > 1.95 * std  # the whole [-2 std, 2 std] range is used
    assert abs(w.std().item() / (TRUNC2_STD_RATIO * std) - 1) < _std_tolerance(w.numel())


def test_fused_qkv_slices_are_initialised_as_d_by_d_matrices():
    d = 128
    cfg = make_cfg("gpt_test", init=dict(name="stable"), embed_dim=d, num_heads=2, depth=1)
    model = build_model(cfg.model, Components.of(cfg))
    qkv = model.blocks[0].attn.qkv.weight.detach()
    per_slice = 1 / (2 * math.sqrt(d))  # n_in = n_out = d
    joint = 1 / (math.sqrt(d) + math.sqrt(3 * d))  # the other reading, 3d x d
    for s in qkv.chunk(3):
        assert abs(s.std().item() / per_slice - 1) < _std_tolerance(s.numel())
        assert abs(s.std().item() / joint - 1) > 0.2
    fc1 = model.blocks[0].mlp.fc1.weight  # 4d x d
    assert abs(fc1.std().item() / (1 / (math.sqrt(d) + math.sqrt(4 * d))) - 1) < _std_tolerance(fc1.numel())
    proj = model.blocks[0].attn.proj.weight  # no nanoGPT residual scaling
    assert abs(proj.std().item() / per_slice - 1) < _std_tolerance(proj.numel())

    demo = model_of(make_cfg("gpt_test", init=dict(name="stable", fused_qkv="matrix"), embed_dim=d, num_heads=2,
                                depth=1))
    whole = demo.blocks[0].attn.qkv.weight.detach()
    assert abs(whole.std().item() / joint - 1) < _std_tolerance(whole.numel())


@pytest.mark.parametrize("name", ["xavier", "trunc_xavier", "stable"])
def test_family_init_kept_outside_linear_layers(name):
    torch.manual_seed(0)
    ref = model_of(make_cfg("gpt_test"))
    torch.manual_seed(0)
    gpt = model_of(make_cfg("gpt_test", init=dict(name=name)))
    assert gpt.lm_head.weight is gpt.wte.weight
    assert torch.equal(gpt.wte.weight, ref.wte.weight) and torch.equal(gpt.wpe.weight, ref.wpe.weight)
    assert not torch.equal(gpt.blocks[0].attn.qkv.weight, ref.blocks[0].attn.qkv.weight)

    torch.manual_seed(0)
    ref = model_of(make_cfg("vit_test"))
    torch.manual_seed(0)
    vit = model_of(make_cfg("vit_test", init=dict(name=name)))
    for key in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed", "cls_token"):
        assert torch.equal(vit.state_dict()[key], ref.state_dict()[key]), key
    linears = [m for m in vit.modules() if isinstance(m, nn.Linear)]
    assert all(m.bias is None or not m.bias.any() for m in linears)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_()
    apply_init(ref, InitConfig(name=name))
    assert all(m.bias is None or not m.bias.any() for m in ref.modules() if isinstance(m, nn.Linear))


def test_init_family_is_a_no_op_and_unknown_names_are_refused():
    model = nn.Linear(4, 4)
    w = model.weight.detach().clone()
    apply_init(model, InitConfig(name="family"))
    assert torch.equal(model.weight, w)
    with pytest.raises(ConfigError, match="init"):
        apply_init(model, InitConfig(name="kaiming"))


def test_the_init_gain_reaches_each_matrix_through_apply_init():
    """StableInit std = gain / (sqrt(n_in) + sqrt(n_out)), with the configured gain, not 1."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 200))
    apply_init(net, InitConfig(name="stable", gain=0.5))
    assert net[0].weight.std().item() == pytest.approx(0.5 / (math.sqrt(300) + math.sqrt(200)), rel=0.02)
