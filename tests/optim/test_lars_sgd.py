import copy

import torch
from omegaconf import OmegaConf
from torch import nn

from stabletrain.config import OptimConfig
from stabletrain.optim import LARS, build_optimizer


def test_lars_two_steps_by_hand():
    w = nn.Parameter(torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64))  # ||w|| = 5
    b = nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    lr, mu, wd, eta = 0.5, 0.9, 0.1, 0.02
    opt = LARS([w, b], lr=lr, momentum=mu, weight_decay=wd, trust_coef=eta)  # b excluded: 1-D

    g1 = torch.tensor([[0.6, 0.0], [0.0, 0.8]], dtype=torch.float64)  # ||g|| = 1
    gb = torch.tensor([0.5, 0.25], dtype=torch.float64)
    w.grad, b.grad = g1.clone(), gb.clone()
    opt.step()
    # r = 0.02 * 5 / (1 + 0.1 * 5) = 1/15;  d = r * (g + 0.1 w);  buf = d;  w -= 0.5 * d
    w0 = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    d1 = (0.02 * 5 / 1.5) * (g1 + 0.1 * w0)
    w1 = w0 - 0.5 * d1
    b1 = torch.tensor([1.0, -1.0], dtype=torch.float64) - 0.5 * gb  # no decay, no trust ratio
    torch.testing.assert_close(w.detach(), w1, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(b.detach(), b1, rtol=1e-14, atol=1e-14)

    g2 = torch.tensor([[0.0, -2.0], [1.0, 0.0]], dtype=torch.float64)
    w.grad, b.grad = g2.clone(), gb.clone()
    opt.step()
    wn, gn = w1.norm().item(), g2.norm().item()
    d2 = (eta * wn / (gn + wd * wn)) * (g2 + wd * w1)
    torch.testing.assert_close(w.detach(), w1 - lr * (mu * d1 + d2), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(b.detach(), b1 - lr * (mu * gb + gb), rtol=1e-14, atol=1e-14)


def test_lars_zero_weight_takes_unit_ratio_and_group_flag_excludes():
    w = nn.Parameter(torch.zeros(3, 2))
    m = nn.Parameter(torch.ones(2, 2))
    opt = LARS(
        [{"params": [w]}, {"params": [m], "lars_exclude": True}],
        lr=0.1,
        momentum=0.0,
        weight_decay=0.5,
        trust_coef=0.001,
    )
    w.grad = torch.ones(3, 2)
    m.grad = torch.ones(2, 2)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 2), -0.1))  # ||w|| = 0: ratio 1
    torch.testing.assert_close(m.detach(), torch.full((2, 2), 0.9))  # excluded: plain SGD


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_sgd_nesterov_matches_torch():
    model = _mlp()
    twin = copy.deepcopy(model)
    cfg = OmegaConf.structured(OptimConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.0))
    opt, _ = build_optimizer(model, cfg, "gpt")
    ref = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_built_sgd_nesterov_two_steps_by_hand():
    holder = nn.Module()
    holder.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    cfg = OmegaConf.structured(OptimConfig(name="sgd", lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.3))
    opt, _ = build_optimizer(holder, cfg, "gpt")  # a 1-D tensor: no decay in any family
    g1, g2 = (
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        torch.tensor([2.0, 0.0], dtype=torch.float64),
    )
    for g in (g1, g2):
        holder.w.grad = g.clone()
        opt.step()
    # buf1 = g1, step by g1 + mu buf1; buf2 = mu buf1 + g2, step by g2 + mu buf2
    buf2 = 0.5 * g1 + g2
    expect = torch.tensor([1.0, 2.0], dtype=torch.float64) - 0.1 * (g1 + 0.5 * g1) - 0.1 * (g2 + 0.5 * buf2)
    torch.testing.assert_close(holder.w.detach(), expect, rtol=1e-14, atol=1e-14)
