"""sigmaReparam (001 Sec. 3.2, App. C; docs/methods.md §2)."""

import copy

import pytest
import torch
from torch import nn

from stabletrain.config import AttentionConfig, ConfigError, NormConfig, ReparamConfig
from stabletrain.layers.attention import Attention
from stabletrain.layers.reparam import (
    SigmaReparam,
    apply_reparam,
    gamma_parameters,
    raw_weight,
    reparam_step,
    sigma_reparams,
)
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from stabletrain.spectral import sigma1_exact
from tests.layers.helpers import make_cfg, model_input
from tests.helpers import model_of

D, H = 16, 2


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 12))


def _attn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Attention(D, H, attn_cfg=AttentionConfig(), norm_cfg=NormConfig(), seq_len=8))


def _buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith((".u", ".v"))}


def _set_gammas(model, values):
    with torch.no_grad():
        for (_, g), val in zip(gamma_parameters(model), values):
            g.fill_(val)


def test_sigma1_of_effective_weight_equals_gamma_after_power_iterations():
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma"))
    _set_gammas(model, [2.5, 0.7])
    for _ in range(300):
        reparam_step(model)
    for lin, gamma in zip((model[0], model[2]), (2.5, 0.7)):
        assert sigma1_exact(lin.weight).item() == pytest.approx(gamma, rel=1e-4)


def test_effective_weight_is_gamma_over_u_w_v_times_w():
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma"))
    _set_gammas(model, [1.3, 0.4])
    lin = model[0]
    part = lin.parametrizations.weight[0].parts[0]
    w = raw_weight(lin)
    torch.testing.assert_close(lin.weight, 1.3 * w / (part.u @ w @ part.v))


@pytest.mark.parametrize("iters", [1, 3])
def test_reparam_step_is_algorithm_1s_iteration(iters):
    """001 Alg. 1: u = normalize(W v) first, then v = normalize(W^T u), ``power_iters`` times."""
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma", power_iters=iters))
    parts = [(raw_weight(lin).detach(), lin.parametrizations.weight[0].parts[0]) for lin in (model[0], model[2])]
    expected = []
    for w, part in parts:
        u, v = part.u.clone(), part.v.clone()
        for _ in range(iters):
            u = w @ v
            u = u / u.norm()
            v = w.T @ u
            v = v / v.norm()
        expected.append((u, v))
    reparam_step(model)
    for (_, part), (u, v) in zip(parts, expected):
        torch.testing.assert_close(part.u, u)
        torch.testing.assert_close(part.v, v)


def test_forward_and_eval_never_change_buffers():
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma", power_iters=3))
    before = _buffers(model)
    x = torch.randn(5, 24)
    model.train()
    model(x).square().sum().backward()
    model.eval()
    with torch.no_grad():
        model(x)
    for k, v in _buffers(model).items():
        assert torch.equal(v, before[k]), k
    reparam_step(model)
    assert any(not torch.equal(v, before[k]) for k, v in _buffers(model).items())


def test_gradients_reach_w_and_gamma_and_match_the_explicit_formula():
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma"))
    _set_gammas(model, [1.5, 0.8])
    lin = model[0]
    x = torch.randn(5, 24)
    lin(x).sin().sum().backward()
    w, gamma = raw_weight(lin), lin.parametrizations.weight[0].parts[0].gamma
    assert w.grad is not None and gamma.grad is not None
    assert w.grad.abs().sum() > 0 and gamma.grad.abs().sum() > 0
    # the same quantity written out: gradient flows through W inside sigma = u^T W v
    part = lin.parametrizations.weight[0].parts[0]
    w2 = w.detach().clone().requires_grad_()
    g2 = gamma.detach().clone().requires_grad_()
    sigma = part.u @ w2 @ part.v
    torch.nn.functional.linear(x, g2 * w2 / sigma, lin.bias.detach()).sin().sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(gamma.grad, g2.grad)


def test_gamma_init_svd_matches_initial_sigma1_and_keeps_the_weight():
    model = _mlp()
    w_init = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    apply_reparam(model, ReparamConfig(name="sigma", gamma_init="svd"))
    for (_, g), w in zip(gamma_parameters(model), w_init):
        assert g.item() == pytest.approx(torch.linalg.svdvals(w.double())[0].item(), rel=1e-6)
    for lin, w in zip((model[0], model[2]), w_init):
        torch.testing.assert_close(lin.weight, w, rtol=1e-5, atol=1e-6)


def test_gamma_init_one_starts_every_gamma_at_exactly_one():
    """The default (000: gamma initialised to 1): W_hat = W / sigma(W), whatever W's scale."""
    assert ReparamConfig().gamma_init == "one"
    model = _mlp()
    apply_reparam(model, ReparamConfig(name="sigma"))
    gammas = [g for _, g in gamma_parameters(model)]
    assert len(gammas) == 2 and all(g.item() == 1.0 for g in gammas)


@pytest.mark.parametrize("apply_to,split,groups", [
    ("all", "joint", [(0, 3)]),
    ("all", "qk_v", [(0, 2), (2, 3)]),
    ("all", "q_k_v", [(0, 1), (1, 2), (2, 3)]),
    ("qk", "joint", [(0, 2)]),
    ("qk", "qk_v", [(0, 2)]),
    ("qk", "q_k_v", [(0, 1), (1, 2)]),
])
def test_qkv_split_gives_each_slice_its_own_sigma_and_gamma(apply_to, split, groups):
    model = _attn()
    w0 = model[0].qkv.weight.detach().clone()
    apply_reparam(model, ReparamConfig(name="sigma", apply_to=apply_to, qkv_split=split))
    gammas = gamma_parameters(model)
    n_qkv = len([n for n, _ in gammas if ".qkv." in n])
    assert n_qkv == len(groups)
    values = [0.5 + i for i in range(len(gammas))]
    _set_gammas(model, values)
    for _ in range(300):
        reparam_step(model)
    w = model[0].qkv.weight
    qkv_gammas = [g.item() for n, g in gammas if ".qkv." in n]
    for (lo, hi), gamma in zip(groups, qkv_gammas):
        assert sigma1_exact(w[lo * D:hi * D]).item() == pytest.approx(gamma, rel=1e-4)
    if apply_to == "qk":
        torch.testing.assert_close(w[2 * D:], w0[2 * D:])  # values stay raw
        assert not torch.nn.utils.parametrize.is_parametrized(model[0].proj, "weight")


def test_fp32_under_bf16_autocast():
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma"))
    _set_gammas(model, [1.7, 1.0])
    ref = model[0].weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = model[0].weight
        y = model[0](torch.randn(3, 24))
    assert w.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert torch.equal(w.detach(), ref)


def test_vit_reparametrises_every_linear_and_the_patch_conv():
    cfg = make_cfg("vit_test", reparam=dict(name="sigma"), norm=dict(name="none"))
    model = build_model(cfg.model, Components.of(cfg))
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert all(torch.nn.utils.parametrize.is_parametrized(m, "weight") for m in layers)
    conv = model.patch_embed.proj
    _set_gammas(model, [0.9] * len(gamma_parameters(model)))
    for _ in range(300):
        reparam_step(model)
    assert sigma1_exact(conv.weight.reshape(conv.out_channels, -1)).item() == pytest.approx(0.9, rel=1e-4)


@pytest.mark.parametrize("model_name", ["vit_test", "swin_test"])
def test_apply_to_qk_leaves_everything_but_the_query_key_rows_raw(model_name):
    model = model_of(make_cfg(model_name, reparam=dict(name="sigma", apply_to="qk")))
    reparametrised = {n.rsplit(".parametrizations", 1)[0] for n, _ in model.named_parameters()
                      if ".parametrizations." in n and n.endswith(".original")}
    qkv = {n for n, m in model.named_modules() if n.endswith("attn.qkv")}
    assert reparametrised == qkv and qkv
    for name in qkv:
        lin = model.get_submodule(name)
        parts, w = lin.parametrizations.weight[0].parts, raw_weight(lin)
        assert len(parts) == 1 and parts[0].u.numel() == 2 * w.shape[0] // 3  # one sigma for [W_q; W_k]
        torch.testing.assert_close(lin.weight[2 * w.shape[0] // 3:], w[2 * w.shape[0] // 3:])  # values raw


def test_gpt_skips_the_tied_lm_head():
    cfg = make_cfg("gpt_test", reparam=dict(name="sigma"))
    model = build_model(cfg.model, Components.of(cfg))
    assert model.lm_head.weight is model.wte.weight
    assert not torch.nn.utils.parametrize.is_parametrized(model.lm_head, "weight")
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules()) - 1
    assert len(sigma_reparams(model)) == n_linear


def test_gammas_are_named_and_one_element_and_state_dict_round_trips():
    cfg = make_cfg("gpt_test", reparam=dict(name="sigma", qkv_split="q_k_v"))
    model = build_model(cfg.model, Components.of(cfg))
    names = dict(model.named_parameters())
    gammas = gamma_parameters(model)
    assert gammas and all(n.endswith(".gamma") and g.numel() == 1 and names[n] is g for n, g in gammas)
    sd = model.state_dict()
    assert any(k.endswith(".u") for k in sd) and any(k.endswith(".v") for k in sd)
    other = model_of(make_cfg("gpt_test", reparam=dict(name="sigma", qkv_split="q_k_v")))
    other.load_state_dict(sd)
    x = model_input(cfg, tokens=8)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x))
        torch.testing.assert_close(copy.deepcopy(model)(x), model(x))


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="gamma_init"):
        SigmaReparam(torch.randn(4, 4), gamma_init="kernel")
    with pytest.raises(ConfigError, match="reparam"):
        apply_reparam(_mlp(), ReparamConfig(name="none"))


def test_all_zero_weight_is_refused():
    model = _mlp()
    with torch.no_grad():
        model[2].weight.zero_()
    with pytest.raises(ConfigError, match="all-zero"):
        apply_reparam(model, ReparamConfig(name="sigma"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_cast_model_runs_and_float64_matches_the_formula(dtype):
    """``.double()`` / ``.bfloat16()`` / ``.half()`` cast the u, v buffers but not the fp32 copy
    of W the parametrization computes with; the forward must follow the cast."""
    model = apply_reparam(_mlp(), ReparamConfig(name="sigma")).to(dtype)
    x = torch.randn(3, 24, dtype=dtype)
    out = model(x)
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    if dtype == torch.float64:
        lin = model[0]
        w = lin.parametrizations.weight.original
        part = lin.parametrizations.weight[0].parts[0]
        want = part.gamma * w / (part.u @ w @ part.v)
        torch.testing.assert_close(lin.weight, want)
