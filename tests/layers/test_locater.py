"""LocAteR against the explicit d x d formula (003 Sec. 6; docs/methods.md §4)."""

import pytest
import torch
from torch import nn

from stabletrain.config import AttentionConfig, NormConfig, ReparamConfig
from stabletrain.losses.locater import LocaterParams
from stabletrain.layers.attention import Attention
from stabletrain.layers.locater import layer_penalty, locater_penalty, locater_value, qk_eigen_stats, qk_heads
from stabletrain.layers.reparam import apply_reparam
from tests.layers.helpers import make_cfg
from tests.helpers import model_of

D, H = 12, 3
DH = D // H
K1, K2 = 100.0, 1.0


def explicit_penalty(qkv_weight, num_heads, k1, k2):
    """Per head: W_QK = W_Q^T W_K (d x d), k1 tr(W_QK^T W_QK) + k2 (tr(W_QK) - 1)^2, summed."""
    d = qkv_weight.shape[1]
    d_h = d // num_heads
    total = qkv_weight.new_zeros(())
    for h in range(num_heads):
        w_q = qkv_weight[h * d_h:(h + 1) * d_h]
        w_k = qkv_weight[d + h * d_h:d + (h + 1) * d_h]
        w_qk = w_q.T @ w_k
        total = total + k1 * torch.trace(w_qk.T @ w_qk) + k2 * (torch.trace(w_qk) - 1) ** 2
    return total


def _model(layers=2, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Attention(D, H, attn_cfg=AttentionConfig(), norm_cfg=NormConfig(), seq_len=8)
                           for _ in range(layers)])


@pytest.mark.parametrize("k1,k2", [(K1, K2), (0.0, 10.0), (1.0, 0.0)])
def test_value_and_gradient_equal_the_explicit_formula(k1, k2):
    model = _model()
    reg = LocaterParams(scale_coef=k1, mean_coef=k2)
    pen = locater_penalty(model, reg)
    pen.backward()
    ours = [m.qkv.weight.grad.clone() for m in model]
    ws = [m.qkv.weight.detach().double().requires_grad_() for m in model]
    want = sum(explicit_penalty(w, H, k1, k2) for w in ws)
    want.backward()
    assert pen.item() == pytest.approx(want.item(), rel=1e-5)
    for g, w in zip(ours, ws):
        torch.testing.assert_close(g.double(), w.grad, rtol=1e-4, atol=1e-6)
    assert locater_value(model, reg)["total"] == pytest.approx(want.item(), rel=1e-9)


def test_biases_do_not_enter():
    model = _model(1)
    reg = LocaterParams(scale_coef=K1, mean_coef=K2)
    before = locater_penalty(model, reg).item()
    with torch.no_grad():
        model[0].qkv.bias.normal_()
    assert locater_penalty(model, reg).item() == before


def test_monitor_statistics_equal_explicit_traces():
    w = torch.randn(3 * D, D, dtype=torch.float64)
    w_q, w_k = qk_heads(w, H)
    stats = qk_eigen_stats(w_q, w_k)
    for h in range(H):
        w_qk = w[h * DH:(h + 1) * DH].T @ w[D + h * DH:D + (h + 1) * DH]
        tr, tr2 = torch.trace(w_qk), torch.trace(w_qk @ w_qk)
        assert stats["eig_mean_trace"][h].item() == pytest.approx(tr.item(), rel=1e-10)
        assert stats["eig_scale_fro2"][h].item() == pytest.approx(torch.trace(w_qk.T @ w_qk).item(), rel=1e-10)
        assert stats["eig_scale_tr2"][h].item() == pytest.approx(tr2.item(), rel=1e-10)
        assert stats["eig_var_d2"][h].item() == pytest.approx((D * tr2 - tr**2).item(), rel=1e-10)


def test_uses_the_effective_weight_under_sigma_reparam():
    model = apply_reparam(_model(1), ReparamConfig(name="sigma"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gamma"):
                p.fill_(3.0)
    reg = LocaterParams(scale_coef=K1, mean_coef=K2)
    want = explicit_penalty(model[0].qkv.weight.detach().double(), H, K1, K2)
    assert locater_penalty(model, reg).item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("model_name", ["vit_test", "swin_test", "gpt_test"])
def test_every_family_sums_over_its_attention_layers(model_name):
    model = model_of(make_cfg(model_name))
    reg = LocaterParams(scale_coef=K1, mean_coef=K2)
    attns = [m for m in model.modules() if hasattr(m, "qkv") and hasattr(m, "num_heads")]
    want = sum(explicit_penalty(a.qkv.weight.detach().double(), a.num_heads, K1, K2) for a in attns)
    pen = locater_penalty(model, reg)
    assert len(attns) == 2 and pen.requires_grad
    assert pen.item() == pytest.approx(want.item(), rel=1e-5)
    assert layer_penalty(attns[0].qkv.weight, attns[0].num_heads, K1, K2).dtype == torch.float32
