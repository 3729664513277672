"""Optimizers and schedules against recipes written out by hand.

Each test computes its expectation from a closed form or an update rule spelled out here (the
LARS and Adam recurrences, the cosine and step schedules), not from another run of the code.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from stabletrain.config import OptimConfig, ScheduleConfig
from stabletrain.optim import LARS, build_optimizer, make_schedule, set_lr

F64 = torch.float64


# --- lr schedules from the config ---------------------------------------------------------------


def test_make_schedule_cosine_reaches_the_configured_min_lr():
    """cosine from the config: lr(s) = min + (base - min) * (1 + cos(pi (s - W) / (T - W))) / 2 after a
    W-step warmup, ``min`` being ``schedule.min_lr`` (not 0), and ``min`` from step T on."""
    cfg = OmegaConf.structured(ScheduleConfig(name="cosine", min_lr=1e-4))
    lr = make_schedule(cfg, base_lr=1e-3, total_steps=100, warmup=10)
    base, low, w, t = 1e-3, 1e-4, 10, 100
    for s in (10, 30, 55, 80, 99):
        assert lr(s) == pytest.approx(low + (base - low) * (1 + math.cos(math.pi * (s - w) / (t - w))) / 2, rel=1e-12)
    assert lr(55) == pytest.approx((base + low) / 2, rel=1e-12)
    assert lr(100) == pytest.approx(low, rel=1e-12) and lr(250) == pytest.approx(low, rel=1e-12)


def test_make_schedule_step_decays_by_the_configured_gamma():
    """step from the config: lr(s) = base * gamma ** #{milestones <= s}, with ``schedule.gamma`` = 0.5."""
    cfg = OmegaConf.structured(ScheduleConfig(name="step", milestones=[30, 60], gamma=0.5))
    lr = make_schedule(cfg, base_lr=0.2, total_steps=100)
    expect = {0: 0.2, 29: 0.2, 30: 0.1, 59: 0.1, 60: 0.05, 99: 0.05}
    assert {s: lr(s) for s in expect} == pytest.approx(expect, rel=1e-12)


# --- LARS ----------------------------------------------------------------------------------------


def _lars_by_hand(w, grads, lrs, mu, wd, eta):
    """The LARS recipe of optim/lars.py's docstring for one adapted matrix: r = eta ||w|| / (||g|| +
    wd ||w||), d = r (g + wd w), buf = mu buf + d, w = w - lr_t buf (the rate outside the buffer)."""
    buf = torch.zeros_like(w)
    for g, lr in zip(grads, lrs):
        r = eta * w.norm() / (g.norm() + wd * w.norm())
        buf = mu * buf + r * (g + wd * w)
        w = w - lr * buf
    return w


GRADS = [torch.tensor([[0.6, 0.0], [0.0, 0.8]], dtype=F64), torch.tensor([[0.0, -2.0], [1.0, 0.0]], dtype=F64),
         torch.tensor([[0.3, 0.1], [-0.2, 0.4]], dtype=F64)]
W0 = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=F64)


def test_lars_rate_multiplies_the_buffer_not_the_direction():
    """With a scheduled rate (0.5, then 0.1, then 0.05) the step is lr_t * buf_t, buf_t = mu buf_{t-1} + d_t:
    an earlier step's rate is not baked into the buffer (as in the paper's v = m v + lr_t r (g + wd w))."""
    w = nn.Parameter(W0.clone())
    b = nn.Parameter(torch.tensor([1.0, -1.0], dtype=F64))  # 1-D: excluded, plain momentum SGD
    gb = [torch.tensor(h, dtype=F64) for h in ([0.5, 0.25], [-1.0, 2.0], [0.1, 0.1])]
    lrs, mu, wd, eta = [0.5, 0.1, 0.05], 0.9, 0.1, 0.02
    opt = LARS([w, b], lr=lrs[0], momentum=mu, weight_decay=wd, trust_coef=eta)
    for g, h, lr in zip(GRADS, gb, lrs):
        set_lr(opt, lr)
        w.grad, b.grad = g.clone(), h.clone()
        opt.step()
    torch.testing.assert_close(w.detach(), _lars_by_hand(W0, GRADS, lrs, mu, wd, eta), rtol=1e-13, atol=1e-13)
    buf_b, expect_b = torch.zeros(2, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64)
    for h, lr in zip(gb, lrs):
        buf_b = mu * buf_b + h
        expect_b = expect_b - lr * buf_b
    torch.testing.assert_close(b.detach(), expect_b, rtol=1e-13, atol=1e-13)


def test_built_lars_takes_momentum_and_trust_coef_from_the_config():
    """``optim=lars optim.momentum=0.5 optim.trust_coef=0.02 optim.weight_decay=0.1``: three steps of the
    LARS recipe with those numbers (not LARS's defaults 0.9 and 0.001) on a decayed, adapted matrix."""
    holder = nn.Module()
    holder.proj = nn.Linear(2, 2, bias=False).to(F64)
    with torch.no_grad():
        holder.proj.weight.copy_(W0)
    cfg = OmegaConf.structured(OptimConfig(name="lars", lr=0.5, momentum=0.5, trust_coef=0.02, weight_decay=0.1))
    opt, _ = build_optimizer(holder, cfg, "gpt")
    (group,) = [g for g in opt.param_groups if "proj.weight" in g["names"]]
    assert group["weight_decay"] == 0.1 and not group["lars_exclude"]  # a matrix: decayed and adapted
    for g in GRADS:
        holder.proj.weight.grad = g.clone()
        opt.step()
    expect = _lars_by_hand(W0, GRADS, [0.5] * 3, mu=0.5, wd=0.1, eta=0.02)
    torch.testing.assert_close(holder.proj.weight.detach(), expect, rtol=1e-13, atol=1e-13)


# --- AdamW as built from the config --------------------------------------------------------------


def test_built_adamw_takes_betas_and_eps_in_order():
    """``optim=adamw optim.betas=[0.8,0.95] optim.eps=1e-3`` on a no-decay vector, Adam written out:
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""
    holder = nn.Module()
    holder.gain = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=F64))
    cfg = OmegaConf.structured(OptimConfig(name="adamw", lr=0.1, betas=[0.8, 0.95], eps=1e-3, weight_decay=0.0))
    opt, _ = build_optimizer(holder, cfg, "gpt")
    grads = [torch.tensor([0.01, -0.02, 0.005], dtype=F64), torch.tensor([-0.03, 0.01, 0.0], dtype=F64),
             torch.tensor([0.02, 0.02, -0.01], dtype=F64)]
    w, m, v = holder.gain.detach().clone(), torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64)
    b1, b2, eps, lr = 0.8, 0.95, 1e-3, 0.1
    for t, g in enumerate(grads, start=1):
        holder.gain.grad = g.clone()
        opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    torch.testing.assert_close(holder.gain.detach(), w, rtol=1e-12, atol=1e-12)
