"""AdamW² against Algorithm 1 (000, l.189-210) written out with exact float64 SVD."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from stabletrain.optim import AdamW2
from stabletrain.spectral import sigma1_exact

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def spiked(rows, cols):
    """Noise plus a planted top direction: a clear spectral gap, so power iteration converges."""
    a, b = torch.randn(rows, 1), torch.randn(1, cols)
    return torch.randn(rows, cols) / 3 + 2 * (a / a.norm()) @ (b / b.norm())


class Tiny(nn.Module):
    """Matrices of two shapes (one repeated), a conv kernel, a bias and a norm-like gain."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(spiked(8, 6))
        self.w2 = nn.Parameter(spiked(8, 6))
        self.w3 = nn.Parameter(spiked(4, 8))
        self.conv = nn.Parameter(spiked(4, 8).reshape(4, 2, 2, 2))  # bounded as its (4, 8) flattening
        self.bias = nn.Parameter(torch.randn(8) / 3)
        self.gain = nn.Parameter(1 + torch.randn(4) / 10)

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T + self.bias) * torch.sigmoid(x @ self.w2.T)
        h = h @ self.w3.T + h @ self.conv.reshape(4, 8).T
        return (h * self.gain).sin()


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def batches(n, seed=1, device="cpu", dtype=torch.float64):
    """Inputs share a mean direction, so gradients and Adam directions have a clear top
    singular value (sigma1/sigma2 > 1.1 throughout these runs) whatever the start vector."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, 6, generator=g)
    return [
        (
            (0.3 * torch.randn(16, 6, generator=g) + mean).to(device, dtype),
            torch.randn(16, 4, generator=g).to(device, dtype),
        )
        for _ in range(n)
    ]


def make_model(device="cpu", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return Tiny().to(device, dtype)


def groups_of(model, bound_gain=True):
    """Matrices decayed and bounded (default flag), the gain bounded, the bias free."""
    named = dict(model.named_parameters())
    mats = ["w1", "w2", "w3", "conv"]
    return [
        {"params": [named[n] for n in mats], "names": mats},
        {"params": [named["gain"]], "names": ["gain"], "bound": bound_gain, "weight_decay": 0.0},
        {"params": [named["bias"]], "names": ["bias"], "weight_decay": 0.0},
    ]


class ReferenceAdamW2:
    """Algorithm 1 line by line, float64, exact sigma1; bound per the flags of groups_of."""

    def __init__(self, model, lr, betas, eps, weight_decay, tau, eps_inside_sqrt=False):
        self.model, self.lr, self.betas, self.eps, self.tau = model, lr, betas, eps, tau
        self.eps_inside_sqrt = eps_inside_sqrt
        self.wd = {
            "w1": weight_decay,
            "w2": weight_decay,
            "w3": weight_decay,
            "conv": weight_decay,
            "gain": 0.0,
            "bias": 0.0,
        }
        self.bounded = {"w1", "w2", "w3", "conv", "gain"}
        self.m = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        self.v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        self.t = 0
        self.lr_eff = {}

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for name, w in self.model.named_parameters():
            g = w.grad
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1**self.t)
            v_hat = self.v[name] / (1 - b2**self.t)
            if self.eps_inside_sqrt:
                u = m_hat / torch.sqrt(v_hat + self.eps)
            else:
                u = m_hat / (torch.sqrt(v_hat) + self.eps)
            lr = self.lr
            if name in self.bounded:
                s_w, s_u = sigma1_exact(w), sigma1_exact(u)
                if s_w > 0 and lr * s_u / s_w > self.tau:
                    lr = (self.tau * s_w / s_u).item()
                self.lr_eff[name] = lr
            w.copy_(w - lr * u - lr * self.wd[name] * w)


def run_pair(steps, lr, tau, wd=0.1, eps=1e-8, eps_inside_sqrt=False, fused=None, device="cpu", iters=100):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamW2(
        groups_of(model),
        lr=lr,
        betas=(0.9, 0.95),
        eps=eps,
        weight_decay=wd,
        tau=tau,
        power_iters=iters,
        eps_inside_sqrt=eps_inside_sqrt,
        fused=fused,
    )
    ref = ReferenceAdamW2(ref_model, lr, (0.9, 0.95), eps, wd, tau, eps_inside_sqrt)
    fractions = []
    for x, y in batches(steps, device=device):
        for m, o in ((model, opt), (ref_model, ref)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=lambda s, n=name: f"{n}: {s}")
        tel = opt.bound_stats()
        fractions.append(tel["bound_fraction"])
        for name, lr_eff in ref.lr_eff.items():
            assert tel["lr_eff"][name] == pytest.approx(lr_eff, rel=1e-10)
    return fractions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
def test_matches_algorithm_1_with_bound_active(device, fused):
    fractions = run_pair(steps=25, lr=0.05, tau=0.01, fused=fused, device=device)
    assert min(fractions) > 0.5  # the bound really binds in this run


def test_matches_algorithm_1_with_bound_inactive():
    fractions = run_pair(steps=25, lr=1e-3, tau=10.0)
    assert max(fractions) == 0.0


def test_matches_algorithm_1_with_eps_inside_sqrt():
    run_pair(steps=15, lr=0.05, tau=0.01, eps=1e-4, eps_inside_sqrt=True)


@pytest.mark.parametrize("device", DEVICES)
def test_huge_tau_equals_torch_adamw(device):
    torch.manual_seed(0)
    model = make_model(device, torch.float32)
    twin = copy.deepcopy(model)
    opt = AdamW2(groups_of(model), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05, tau=1e9)
    plain = [{k: v for k, v in g.items() if k not in ("bound", "names")} for g in groups_of(twin)]
    ref = torch.optim.AdamW(plain, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05)
    for x, y in batches(30, device=device, dtype=torch.float32):
        for m, o in ((model, opt), (twin, ref)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
    assert opt.bound_stats()["bound_fraction"] == 0.0
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)


def test_weyl_bound_holds_every_step():
    model = make_model()
    tau = 0.02
    opt = AdamW2(groups_of(model), lr=0.5, weight_decay=0.1, tau=tau, power_iters=30)
    bounded = ["w1", "w2", "w3", "conv", "gain"]
    named = dict(model.named_parameters())
    for x, y in batches(30):
        before = {n: sigma1_exact(named[n]).item() for n in bounded}
        model.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        for n in bounded:
            assert sigma1_exact(named[n]).item() <= (1 + tau) * before[n] * (1 + 1e-9), n
    assert opt.bound_stats()["bound_fraction"] == 1.0  # lr 0.5 is far above the bound


def test_zero_initialised_tensor_learns_at_full_rate():
    lin = nn.Linear(5, 3, bias=False).double()
    nn.init.zeros_(lin.weight)
    opt = AdamW2([{"params": [lin.weight], "names": ["zero"]}], lr=0.01, tau=1e-6)
    x = torch.randn(7, 5, dtype=torch.float64)
    (lin(x) - 1).pow(2).sum().backward()
    g = lin.weight.grad.clone()
    opt.step()
    tel = opt.bound_stats()
    assert tel["sigma_w"]["zero"] == 0.0
    assert tel["lr_ratio"]["zero"] == 1.0 and tel["bound_fraction"] == 0.0
    torch.testing.assert_close(lin.weight, -0.01 * g / (g.abs() + 1e-8))


@pytest.mark.parametrize("inside", [False, True])
def test_eps_position_in_denominator(inside):
    """Two steps of an unbounded tensor against the written-out formula (large eps shows it)."""
    eps, lr, (b1, b2) = 0.05, 0.1, (0.8, 0.9)
    w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    opt = AdamW2([w], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, eps_inside_sqrt=inside)
    grads = [
        torch.tensor([0.3, -0.02, 1.5], dtype=torch.float64),
        torch.tensor([-0.1, 0.04, 0.5], dtype=torch.float64),
    ]
    expect = w.detach().clone()
    m = torch.zeros(3, dtype=torch.float64)
    v = torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        w.grad = g.clone()
        opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        denom = torch.sqrt(v_hat + eps) if inside else torch.sqrt(v_hat) + eps
        expect = expect - lr * m_hat / denom
        torch.testing.assert_close(w.detach(), expect, rtol=1e-12, atol=1e-14)


def test_warm_and_cold_start_reach_the_same_sigma():
    torch.manual_seed(3)
    mat = nn.Parameter(torch.randn(12, 7, dtype=torch.float64))
    exact = sigma1_exact(mat).item()
    warm = AdamW2([{"params": [mat], "names": ["m"]}], lr=0.0, power_iters=3, warm_start=True)
    cold = AdamW2([{"params": [mat], "names": ["m"]}], lr=0.0, power_iters=60, warm_start=False)
    for _ in range(25):
        mat.grad = torch.randn_like(mat)
        warm.step()  # lr 0 keeps the matrix fixed
        cold.step()
    assert warm.bound_stats()["sigma_w"]["m"] == pytest.approx(exact, rel=1e-10)
    assert cold.bound_stats()["sigma_w"]["m"] == pytest.approx(exact, rel=1e-10)
    assert {"w_u", "w_v", "upd_u", "upd_v"} <= set(warm.state[mat])
    assert "w_u" not in cold.state[mat]


def test_state_dict_round_trip_continues_identically():
    model = make_model()
    opt = AdamW2(groups_of(model), lr=0.05, weight_decay=0.1, tau=0.01, power_iters=2)
    data = batches(10)

    def train(m, o, part):
        for x, y in part:
            m.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()

    train(model, opt, data[:5])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed = make_model(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt2 = AdamW2(groups_of(resumed), lr=0.05, weight_decay=0.1, tau=0.01, power_iters=2)
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.state[resumed.w1]["upd_u"], opt.state[model.w1]["upd_u"])

    train(model, opt, data[5:])
    train(resumed, opt2, data[5:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_telemetry_fraction_and_ratio():
    def one_step(tau, lr=0.01):
        model = make_model()
        opt = AdamW2(groups_of(model), lr=lr, tau=tau, power_iters=100)
        x, y = batches(1)[0]
        loss_fn(model, x, y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        return opt.bound_stats(), grads, weights

    tel, grads, weights = one_step(tau=1e-9)
    assert tel["bound_fraction"] == 1.0
    assert set(tel["lr_ratio"]) == {"w1", "w2", "w3", "conv", "gain"}  # the bias is free
    for name, ratio in tel["lr_ratio"].items():
        g = grads[name]
        s_u = sigma1_exact(g / (g.abs() + 1e-8)).item()  # step 1: m_hat = g, v_hat = g^2
        s_w = sigma1_exact(weights[name]).item()
        assert ratio == pytest.approx(1e-9 * s_w / (0.01 * s_u), rel=1e-9)
        assert tel["lr_eff"][name] == pytest.approx(1e-9 * s_w / s_u, rel=1e-9)

    tel, _, _ = one_step(tau=1e9)
    assert tel["bound_fraction"] == 0.0
    assert all(r == 1.0 for r in tel["lr_ratio"].values())


def test_flat_telemetry_for_the_metrics_sink():
    model = make_model()
    opt = AdamW2(groups_of(model), lr=0.01, tau=1e-9)
    loss_fn(model, *batches(1)[0]).backward()
    opt.step()
    flat = opt.telemetry()
    assert flat["adamw2/frac_bounded"] == 1.0
    assert flat["adamw2/lr_ratio/w1"] == opt.bound_stats()["lr_ratio"]["w1"] < 1.0
    assert len(flat) == 1 + 4 * 5 and all(isinstance(v, float) for v in flat.values())


def test_standalone_default_bounds_only_matrices():
    model = make_model()
    opt = AdamW2(model.parameters(), lr=0.01)
    x, y = batches(1)[0]
    loss_fn(model, x, y).backward()
    opt.step()
    assert len(opt.bound_stats()["lr_eff"]) == 4  # w1, w2, w3, conv; not bias, gain
    assert math.isnan(AdamW2(model.parameters()).bound_stats()["bound_fraction"])


@pytest.mark.parametrize("device", DEVICES)
def test_step_reads_no_value_back_to_the_host(device, monkeypatch):
    model = make_model(device, torch.float32)
    opt = AdamW2(groups_of(model), lr=0.01, warm_start=True)
    data = batches(2, device=device, dtype=torch.float32)
    loss_fn(model, *data[0]).backward()
    opt.step()  # the first step allocates state
    model.zero_grad()
    loss_fn(model, *data[1]).backward()

    def forbidden(*_):
        raise AssertionError("AdamW2.step read a tensor value on the host")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, attr, forbidden)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    assert opt.bound_stats()["bound_fraction"] >= 0.0


def test_bf16_parameters_follow_the_fp32_run():
    """Low-precision weights take the foreach path and step in fp32, rounding once."""
    m32 = make_model(dtype=torch.float32)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    o32, o16 = (AdamW2(groups_of(m), lr=0.01, tau=0.01) for m in (m32, m16))
    for x, y in batches(5, dtype=torch.float32):
        for m, o, dtype in ((m32, o32, torch.float32), (m16, o16, torch.bfloat16)):
            m.zero_grad()
            loss_fn(m, x.to(dtype), y.to(dtype)).backward()
            o.step()
    assert o16.bound_stats()["bound_fraction"] == o32.bound_stats()["bound_fraction"] > 0
    for p, q in zip(m16.parameters(), m32.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q, rtol=0, atol=0.03)
