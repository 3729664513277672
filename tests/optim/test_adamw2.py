"""AdamW² against Algorithm 1 (000) written out with exact float64 SVD."""

import copy
import io
import math
import re

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


def _worst_growth(power_iters: int, seed: int, tau: float = 0.01, steps: int = 60, starts: int | None = None) -> float:
    """The largest one-step growth of sigma1(W), in units of tau, on the slowest case for power
    iteration: a 64 x 64 float64 matrix whose top 8 singular values are equal, pushed along one of
    its top singular directions (plus noise) at a rate far above the bound. ``starts`` (else
    ``seed``) draws the power iteration's start vectors, from the global generator: left to whatever
    the tests before had drawn, they made the figure depend on which tests ran first. The direction
    is the one W was built with: an SVD's choice among 8 equal singular values depends on the LAPACK
    build and its thread count, and so did the figure (1.15 tau or 0.98 tau on one machine)."""
    torch.manual_seed(seed if starts is None else starts)
    g = torch.Generator().manual_seed(seed)
    n = 64
    q, p = (torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0] for _ in range(2))
    s = torch.linspace(1.0, 0.1, n, dtype=torch.float64)
    s[:8] = 1.0
    w = nn.Parameter(q @ torch.diag(s) @ p.T)
    top = q[:, :1] @ p[:, :1].T
    opt = AdamW2([{"params": [w], "bound": True}], lr=1.0, weight_decay=0.0, tau=tau, power_iters=power_iters)
    worst = 0.0
    for _ in range(steps):
        before = sigma1_exact(w.detach()).item()
        w.grad = -top + 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64) / n ** 0.5
        opt.step()
        worst = max(worst, sigma1_exact(w.detach()).item() / before - 1)
    return worst / tau


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_warm_started_iterations_keep_the_bound_near_tau(seed):
    """Power iteration underestimates sigma1, so the bound holds up to its error (docs/methods.md
    §1 quotes these figures): with the default 3 warm-started iterations and these start vectors
    the worst step grows sigma1 by at most 1.1 tau (0.99 tau), where one iteration lets it reach
    1.32 tau (other start vectors: up to 1.45 tau with 3, 2.40 tau with 1); converged, at most tau."""
    assert _worst_growth(3, seed) <= 1.1
    assert _worst_growth(30, seed) <= 1.0
    if seed == 0:  # the case is hard enough to tell: one iteration goes past the bound
        assert _worst_growth(1, seed) > 1.2


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


def _growths(weights, steps, make_opt, lr=0.1):
    """sigma1(W_t) / sigma1(W_{t-1}) - 1 per step (exact SVD) of a small regression whose two
    layers ``weights`` start as given, stepped by ``make_opt(params)``."""
    torch.manual_seed(0)
    w1, w2 = (nn.Parameter(w.clone()) for w in weights)
    opt = make_opt([{"params": [w1, w2], "names": ["w1", "w2"]}], lr)
    x, y = torch.randn(32, w1.shape[1], dtype=w1.dtype), torch.randn(32, w2.shape[0], dtype=w1.dtype)
    out = []
    for _ in range(steps):
        before = [sigma1_exact(w) for w in (w1, w2)]
        ((torch.tanh(x @ w1.T) @ w2.T - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        out.append([(sigma1_exact(w) / b - 1) if b > 0 else math.nan for w, b in zip((w1, w2), before)])
    return out, opt


def test_a_zero_initialised_tensor_is_bounded_from_its_second_step():
    """A zero matrix has sigma1 = 0 and takes the plain lr once; its power-iteration vectors must
    stay unit vectors through that step (W^T u = 0), or the warm start would read sigma1 = 0 and
    leave it unbounded ever after. The layer before it gets a zero gradient at step 0, which must
    not unbound it either."""
    tau = 0.01
    weights = (torch.randn(16, 8, dtype=torch.float64) / 3, torch.zeros(4, 16, dtype=torch.float64))
    growth, opt = _growths(weights, 12, lambda groups, lr: AdamW2(groups, lr=lr, weight_decay=0.0, tau=tau))
    later = [g for step in growth[1:] for g in step]
    assert max(later) <= 1.05 * tau, later  # before the fix: 20-80 tau per step, for good
    stats = opt.bound_stats()
    assert stats["sigma_w"]["w2"] > 0 and stats["sigma_u"]["w1"] > 0 and stats["bound_fraction"] == 1.0
    for p in opt.state:
        for key in ("w_u", "w_v", "upd_u", "upd_v"):
            assert torch.linalg.vector_norm(opt.state[p][key]).item() == pytest.approx(1.0)


def test_zero_warm_start_vectors_of_an_earlier_state_are_drawn_afresh_on_load():
    """A state dict saved with zero vectors (by the optimizer before they were kept unit) resumes bounded."""
    tau = 0.01
    weights = (torch.randn(16, 8, dtype=torch.float64) / 3, torch.randn(4, 16, dtype=torch.float64) / 3)
    _, opt = _growths(weights, 2, lambda groups, lr: AdamW2(groups, lr=lr, tau=tau))
    saved = opt.state_dict()
    for state in saved["state"].values():
        for key in ("w_u", "w_v", "upd_u", "upd_v"):
            state[key] = torch.zeros_like(state[key])
    fresh = AdamW2(opt.param_groups, lr=0.1, tau=tau)
    fresh.load_state_dict(saved)
    assert all("w_v" not in st and "upd_v" not in st for st in fresh.state.values())
    assert all("exp_avg" in st for st in fresh.state.values())  # the moments are kept


def test_a_tiny_weight_decay_keeps_the_bound():
    """-U/wd is no way to store the direction when wd is tiny (it overflows float32): the step is
    W(1 - lr_eff wd) - lr_eff U all the same, bounded."""
    tau = 0.01
    weights = (torch.randn(16, 8) / 3, torch.randn(4, 16) / 3)
    for wd in (1e-20, 1e-7):
        growth, opt = _growths(weights, 6, lambda groups, lr, wd=wd: AdamW2(groups, lr=lr, weight_decay=wd, tau=tau))
        assert max(g for step in growth for g in step) <= 1.1 * tau, (wd, growth)
        assert all(v > 0 for v in opt.bound_stats()["sigma_u"].values())


def test_the_rate_ratio_is_one_at_lr_zero():
    lin = nn.Linear(5, 3)
    opt = AdamW2(lin.parameters(), lr=0.0)
    lin(torch.randn(4, 5)).sum().backward()
    opt.step()
    assert opt.bound_stats()["lr_ratio"] == {"group0.0": 1.0}


@pytest.mark.parametrize("key,value,says", [
    ("tau", 0.0, "tau=0.0 must be a finite number > 0"),
    ("tau", -1.0, "tau=-1.0 must be"),
    ("tau", None, "tau=None must be"),
    ("lr", -0.1, "lr=-0.1 must be a finite number >= 0"),
    ("lr", "1e-3", "lr='1e-3' must be a finite number >= 0 (a YAML 1e-3 is a string: write 1.0e-3)"),
    ("lr", math.inf, "lr=inf must be"),
    ("eps", 0.0, "eps=0.0 must be a finite number > 0 (at 0, an entry whose gradients were all 0 divides 0 by 0)"),
    ("weight_decay", -1, "weight_decay=-1 must be"),
    ("betas", (1.0, 0.999), "betas=(1.0, 0.999) must be two numbers in [0, 1)"),
    ("betas", 0.9, "betas=0.9 must be two numbers"),
    ("power_iters", 0, "power_iters=0 must be an integer >= 1"),
    ("power_iters", 2.5, "power_iters=2.5 must be an integer >= 1"),
    ("bound", "false", "bound='false' must be True, False or None"),
])
def test_a_bad_value_is_refused_in_one_line_as_an_argument_and_in_a_param_group(key, value, says):
    lin = nn.Linear(4, 4)
    if key != "bound":  # a param group's key only
        with pytest.raises(ValueError, match=re.escape(f"AdamW2: {says}")) as err:
            AdamW2(lin.parameters(), **{key: value})
        assert "\n" not in str(err.value)
    groups = [{"params": [lin.weight]}, {"params": [lin.bias], key: value}]
    with pytest.raises(ValueError, match=re.escape(f"AdamW2: param group 1: {says}")):
        AdamW2(groups)


def test_a_misspelt_group_key_is_refused_and_other_keys_are_kept():
    """{"tua": 0.1} trained the group at the default tau, silently; a scheduler's or one's own keys
    stay the group's, as torch.optim keeps them."""
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"^AdamW2: param group 1: unknown key 'tua': did you mean 'tau'\?$"):
        AdamW2([{"params": [lin.weight]}, {"params": [lin.bias], "tua": 0.1}])
    for key, value, meant in (("weight_decy", 0.1, "weight_decay"), ("warm_strat", False, "warm_start"),
                              ("beta", (0.9, 0.99), "betas"), ("bounds", True, "bound")):
        with pytest.raises(ValueError, match=f"unknown key '{key}': did you mean '{meant}'"):
            AdamW2([{"params": [lin.weight], key: value}])
    own = {"name": "decay", "initial_lr": 1e-3, "layer_id": 3, "tag": "attn", "layer_decay": 0.75, "no_decay": True,
           "is_decay": False, "bounded": True, "weight_decay_end": 0.1, "param_kind": "matrix"}
    opt = AdamW2([{"params": [lin.weight], **own}])
    assert {k: opt.param_groups[0][k] for k in own} == own and opt.param_groups[0]["tau"] == 0.004


@pytest.mark.parametrize("key,value,says", [("maximize", True, "negate the loss"), ("amsgrad", True, "no max"),
                                             ("fused", True, "AdamW2(..., fused=...)"),
                                             ("differentiable", True, "not differentiable"),
                                             ("foreach", True, "drop it"), ("foreach", False, "drop it")])
def test_a_group_asking_for_a_torch_adamw_switch_is_refused(key, value, says):
    """{"maximize": True} in a group minimised, silently; a group copied from torch.optim.AdamW, with
    those switches off (foreach unset), is taken."""
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=rf"^AdamW2: param group 0: {key}={value}: .*{re.escape(says)}"):
        AdamW2([{"params": [lin.weight], key: value}])
    copied = torch.optim.AdamW(lin.parameters(), lr=0.01).param_groups
    assert AdamW2(copied).param_groups[0]["lr"] == 0.01


def test_names_are_read_from_any_iterable_and_a_string_is_refused():
    lin = nn.Linear(4, 4)
    named = list(lin.named_parameters())
    opt = AdamW2([{"params": [p for _, p in named], "names": (n for n, _ in named)}])
    assert opt.param_groups[0]["names"] == ["weight", "bias"]
    with pytest.raises(ValueError, match=r"^AdamW2: param group 0: names must be a list of strings, one per param, "
                                         r"not str$"):
        AdamW2([{"params": [lin.weight], "names": "weight"}])
    with pytest.raises(ValueError, match=r"^AdamW2: param group 0: 1 names for 2 params$"):
        AdamW2([{"params": [lin.weight, lin.bias], "names": ["weight"]}]).step()


def test_a_name_given_twice_is_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match="param group 1: name 'w' is given twice"):
        AdamW2([{"params": [a.weight], "names": ["w"]}, {"params": [b.weight], "names": ["w"]}])
    with pytest.raises(ValueError, match="param group 0: name 'w' is given twice"):
        AdamW2([{"params": [a.weight, b.weight], "names": ["w", "w"]}])


def test_the_state_of_another_optimizer_is_refused_on_load():
    lin = nn.Linear(4, 4)
    other = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    other.step()
    with pytest.raises(ValueError, match=r"no tau in its param groups, so another optimizer \(torch.optim.AdamW\?\)"):
        AdamW2(lin.parameters()).load_state_dict(other.state_dict())


def test_gradscaler_without_unscale_meets_the_optimizers_own_message():
    """torch's GradScaler multiplies the optimizer's grad_scale (default 1): the step then says
    what to do, instead of a TypeError inside torch."""
    model = make_model()
    opt = make_adamw2(model)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, *batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match=r"call GradScaler.unscale_\(optimizer\) before GradScaler.step"):
        scaler.step(opt)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, *batches(1)[0])).backward()
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # unscaled first: a plain step
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


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


@pytest.mark.parametrize("overlap", [False, True])
def test_state_dict_round_trip_continues_identically(overlap):
    data = batches(10)
    model = make_model()
    opt = make_adamw2(model, overlap_sigma_w=overlap)
    train_steps(model, opt, data[:5])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed = make_model(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt2 = make_adamw2(resumed, overlap_sigma_w=overlap)
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.state[resumed.w1]["upd_u"], opt.state[model.w1]["upd_u"])
    train_steps(model, opt, data[5:])
    train_steps(resumed, opt2, data[5:])
    assert_same_run(resumed, opt2, model, opt)


def test_a_resume_keeps_the_warm_start_vectors_of_low_precision_weights_in_float32(dtype=torch.bfloat16):
    """torch's load_state_dict casts state to the parameter's dtype: the fp32 vectors came back
    in bf16, and the resumed run's sigma1, rates and weights drifted from the uninterrupted one."""
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(6, 10, generator=g) / 3).to(dtype)
    grads = [torch.randn(6, 10, generator=g).to(dtype) for _ in range(10)]

    def run(w, opt, gs):
        for grad in gs:
            w.grad = grad.clone()
            opt.step()

    w = nn.Parameter(w0.clone())
    opt = AdamW2([w], lr=0.05, tau=0.01, weight_decay=0.1)
    run(w, opt, grads[:4])
    saved = io.BytesIO()
    torch.save({"w": w.detach().clone(), "optim": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved)
    assert ckpt["optim"]["state"][0]["w_u"].dtype == torch.float32
    w2 = nn.Parameter(ckpt["w"])
    opt2 = AdamW2([w2], lr=0.05, tau=0.01, weight_decay=0.1)
    opt2.load_state_dict(ckpt["optim"])
    for key in ("w_u", "w_v", "upd_u", "upd_v"):
        assert opt2.state[w2][key].dtype == torch.float32 and torch.equal(opt2.state[w2][key], opt.state[w][key])
    assert opt2.state[w2]["exp_avg"].dtype == dtype
    run(w, opt, grads[4:])
    run(w2, opt2, grads[4:])
    assert opt.bound_stats()["bound_fraction"] == 1.0  # the vectors decide the steps
    assert torch.equal(w, w2)


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_a_weight_not_laid_out_contiguously_gets_adams_step(layout):
    """The fused kernel walks flat memory and the direction buffer is contiguous: a transposed
    or channels_last weight's moments and gradient are not, and its update landed on the wrong
    entries (twice the step's size off). Step 1, bound inactive: W - lr g / (|g| + eps) - lr wd W."""
    g = torch.Generator().manual_seed(1)
    if layout == "transposed":
        w0, grad = (torch.randn(7, 12, generator=g) / 4).t(), torch.randn(7, 12, generator=g).t()
    else:
        w0 = torch.randn(8, 3, 4, 4, generator=g).to(memory_format=torch.channels_last) / 4
        grad = torch.randn(8, 3, 4, 4, generator=g).to(memory_format=torch.channels_last)
    assert not w0.is_contiguous()
    for fused in (None, False):
        w = nn.Parameter(w0.clone())
        w.grad = grad.clone()
        AdamW2([w], lr=1e-2, tau=1e9, weight_decay=0.1, fused=fused).step()
        want = w0 - 1e-2 * grad / (grad.abs() + 1e-8) - 1e-3 * w0
        assert torch.allclose(w, want, atol=1e-6), (fused, (w - want).abs().max())


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
    assert opt.telemetry(per_tensor=False) == {"adamw2/frac_bounded": 1.0}
    # the names the figures read (monitor.names, the metric contract)
    from stabletrain.monitor import names as N

    assert flat[N.FRAC_BOUNDED] == 1.0 and flat[N.adamw2_lr_ratio("w1")] == flat["adamw2/lr_ratio/w1"]
    assert N.adamw2_lr_eff("w1") in flat


@pytest.mark.parametrize("tau", [1e-9, 0.01, 1e9])  # all, four of five, none cut
def test_the_bound_fraction_alone_is_the_share_of_bounded_tensors_cut(tau):
    model = make_model()
    opt = AdamW2(groups_of(model), lr=0.01, tau=tau)
    loss_fn(model, *batches(1)[0]).backward()
    opt.step()
    stats = opt.bound_stats()
    hit = [stats["lr_ratio"][n] < 1.0 for n in stats["lr_ratio"]]
    assert opt.telemetry(per_tensor=False)["adamw2/frac_bounded"] == pytest.approx(sum(hit) / len(hit), abs=1e-7)


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

    before = [p.detach().clone() for p in model.parameters()]
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
    # a step that read nothing back must still be a step: every tensor moved, and the bound was checked
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
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


# --- overlap_sigma_w: sigma1(W_{t-1}) iterated right after step t-1, used by step t ---------


def train_steps(model, opt, data, between=None):
    torch.manual_seed(5)  # the first step draws the start vectors from the global RNG
    for i, (x, y) in enumerate(data):
        model.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if between is not None:
            between(i, model)


def make_adamw2(model, **kw):
    args = {"lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.1, "tau": 0.01, "power_iters": 2}
    return AdamW2(groups_of(model), **(args | kw))


def assert_same_run(model_a, opt_a, model_b, opt_b):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_overlap_gives_the_numbers_of_the_inline_step(device, monkeypatch):
    data = batches(12, device=device)
    inline_model, ahead_model = make_model(device), make_model(device)
    inline = make_adamw2(inline_model)
    ahead = make_adamw2(ahead_model, overlap_sigma_w=True)
    train_steps(inline_model, inline, data)

    # count the weight-stacking copies inside step(): with the result ready, none
    import stabletrain.optim.adamw2 as mod

    stacked_in_step = []
    real_stack, real_ahead = mod._stack_matrices, AdamW2._iterate_ahead
    in_ahead = [False]

    def counting_stack(params, out):
        if not in_ahead[0]:
            stacked_in_step.append(len(params))
        return real_stack(params, out)

    def flagged_ahead(self, buckets):
        in_ahead[0] = True
        try:
            return real_ahead(self, buckets)
        finally:
            in_ahead[0] = False

    monkeypatch.setattr(mod, "_stack_matrices", counting_stack)
    monkeypatch.setattr(AdamW2, "_iterate_ahead", flagged_ahead)
    train_steps(ahead_model, ahead, data)
    monkeypatch.undo()

    # step 1 has nothing iterated ahead (2 matrix buckets + the 1-D gain); later steps stack only the gain
    assert stacked_in_step[:3] == [2, 2, 1]
    assert stacked_in_step[3:] == [1] * 11
    assert sorted(len(key[1]) for key in ahead._ahead) == [2, 2]  # matrices only
    assert ahead.bound_stats()["bound_fraction"] > 0.5  # the bound binds, so sigma_w matters
    assert_same_run(ahead_model, ahead, inline_model, inline)
    assert ahead.bound_stats() == inline.bound_stats()


def test_overlap_recomputes_after_weights_change_between_steps():
    """An in-place write between steps (here a no_grad rescale, like a load) invalidates the
    result iterated ahead; the run then equals an inline run with the same write."""
    data = batches(8)

    def rescale(i, model):
        if i == 3:
            with torch.no_grad():
                model.w1.mul_(3.0)

    runs = []
    for overlap in (False, True):
        model = make_model()
        opt = make_adamw2(model, overlap_sigma_w=overlap)
        train_steps(model, opt, data, between=rescale)
        runs.append((model, opt))
    assert_same_run(*runs[1], *runs[0])
    assert runs[1][1].bound_stats()["sigma_w"]["w1"] == runs[0][1].bound_stats()["sigma_w"]["w1"]


def test_overlap_drops_a_bucket_whose_members_change():
    """w1 and w2 share a bucket; a step where w2 has no gradient iterates w1 alone."""
    data = batches(6)

    def run(overlap):
        model = make_model()
        opt = make_adamw2(model, overlap_sigma_w=overlap)
        torch.manual_seed(5)
        for i, (x, y) in enumerate(data):
            model.zero_grad(set_to_none=True)
            loss_fn(model, x, y).backward()
            if i == 2:
                model.w2.grad = None
            opt.step()
        return model, opt

    assert_same_run(*run(True), *run(False))


def test_overlap_needs_warm_start():
    with pytest.raises(ValueError, match="overlap_sigma_w=True needs warm_start=True"):
        AdamW2([nn.Parameter(torch.ones(2, 2))], overlap_sigma_w=True, warm_start=False)


def test_overlap_is_a_config_option_with_a_clear_error():
    from stabletrain.build import validate
    from stabletrain.config import ConfigError
    from stabletrain.optim import build_optimizer
    from tests.helpers import make_cfg

    cfg = make_cfg("model=vit_test", "optim=adamw2", "optim.overlap_sigma_w=true")
    validate(cfg)
    opt, _ = build_optimizer(make_model(), cfg.optim, "vit")
    assert isinstance(opt, AdamW2) and opt.overlap_sigma_w
    bad = make_cfg("model=vit_test", "optim=adamw2", "optim.overlap_sigma_w=true", "optim.warm_start=false")
    with pytest.raises(ConfigError, match="optim.overlap_sigma_w=true needs optim.warm_start=true"):
        validate(bad)


def test_overlap_stream_protocol(monkeypatch):
    """The CUDA ordering, with recording stand-ins for streams and events on the CPU: the side
    stream starts after the main stream's writes, the results are marked as used by the main
    stream, and the next step waits for the side stream before it reads sigma1(W) or writes W."""
    import contextlib

    import stabletrain.optim.adamw2 as mod

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name}.wait_stream({other.name})")

        def wait_event(self, event):
            log.append(f"{self.name}.wait_event({event.name})")

    main, side = FakeStream("main"), FakeStream("side")
    events = []

    class FakeEvent:
        def __init__(self):
            self.name = f"ev{len(events)}"
            events.append(self)

        def record(self, stream):
            log.append(f"{self.name}.record({stream.name})")

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(f"enter {stream.name}")
        yield
        log.append(f"exit {stream.name}")

    real_stack = mod._stack_matrices

    def stack(params, out):
        log.append("stack")
        return real_stack(params, out)

    monkeypatch.setattr(AdamW2, "_side_stream", lambda self, device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(f"record_stream({s.name})"))
    monkeypatch.setattr(mod, "_stack_matrices", stack)
    real_zero = torch.Tensor.zero_

    def zero(t):
        log.append("zero")
        return real_zero(t)

    monkeypatch.setattr(torch.Tensor, "zero_", zero)
    for name in ("_foreach_lerp_", "_foreach_addcmul_"):  # the bounded update, with and without decay
        real = getattr(torch, name)

        def logged(tensors, *args, _real=real):
            if isinstance(tensors[0], nn.Parameter):
                log.append("write W")
            return _real(tensors, *args)

        monkeypatch.setattr(torch, name, logged)

    model = make_model()
    opt = make_adamw2(model, overlap_sigma_w=True)
    data = batches(3)
    for x, y in data:
        model.zero_grad()
        loss_fn(model, x, y).backward()
        log.append("step")
        opt.step()

    # the spent stack is zeroed on the side stream and becomes the next step's direction buffer
    # (sigma, u, v, the start vectors u0, v0 that a skipped step keeps, the stack)
    ahead = ["enter side", "stack", "zero", "exit side", *["record_stream(main)"] * 6]
    first = log.index("step", 1)
    step1, later = log[:first], log[first:]
    # step 1: every bucket (two of matrices, the 1-D gain) iterated in line and written, then
    # the side stream waits for those writes and iterates the two matrix buckets ahead
    assert step1.count("write W") == 3
    last_write = max(i for i, e in enumerate(step1) if e == "write W")
    assert step1[last_write + 1:] == ["side.wait_stream(main)", *ahead, "ev0.record(side)", *ahead, "ev1.record(side)"]
    # step 2 waits on both events before anything else and stacks and zeroes only the gain in line
    second = later[: later.index("step", 1)]
    assert second[1:3] == ["main.wait_event(ev0)", "main.wait_event(ev1)"]
    last_write = max(i for i, e in enumerate(second) if e == "write W")
    assert second[:last_write].count("stack") == 1
    assert second[:last_write].count("zero") == 1
    assert second[last_write + 1:] == ["side.wait_stream(main)", *ahead, "ev2.record(side)", *ahead, "ev3.record(side)"]


def test_readme_example_runs_and_reports_per_tensor_rates():
    """The README's "AdamW² in your own loop" block, executed on a small timm ViT."""
    import re

    import timm

    from tests.helpers import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## AdamW² in your own loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
    loader = [(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))) for _ in range(2)]
    scope = {"model": model, "loader": loader, "loss_fn": nn.functional.cross_entropy}
    exec(code, scope)
    stats = scope["stats"]
    assert 0.0 <= stats["adamw2/frac_bounded"] <= 1.0
    assert "adamw2/lr_eff/blocks.0.attn.qkv.weight" in stats  # named per tensor
    assert "adamw2/lr_eff/blocks.0.attn.qkv.bias" not in stats  # vectors are not bounded


# --- skipping a step: found_inf (GradScaler's and StepGuard's contract) ---------------------

SKIP_CASES = {
    "fused": {},
    "cold": {"warm_start": False},
    "overlap": {"overlap_sigma_w": True},
    "foreach": {"eps_inside_sqrt": True},  # the non-fused direction and free step
    "no_decay": {"weight_decay": 0.0},  # the bounded step's addcmul form
}


def _flat_state(opt):
    return {(i, k): v.clone() for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def _step_with(model, opt, x, y, found_inf, nan=False):
    model.zero_grad()
    loss_fn(model, x, y).backward()
    if nan:
        for p in model.parameters():
            p.grad.view(-1)[0] = float("nan")
    opt.found_inf = found_inf
    try:
        opt.step()
    finally:
        opt.found_inf = None


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_found_inf_leaves_weights_and_every_state_tensor_unchanged(case):
    """found_inf = 1 with NaN gradients: weights and the whole state dict (moments, step counts,
    warm-start vectors) equal those before the step; the next steps equal a run without it."""
    data = batches(6)
    model, ref = make_model(), make_model()
    opt, ref_opt = make_adamw2(model, **SKIP_CASES[case]), make_adamw2(ref, **SKIP_CASES[case])
    train_steps(model, opt, data[:3])
    train_steps(ref, ref_opt, data[:3])
    weights = {n: p.clone() for n, p in model.named_parameters()}
    state = _flat_state(opt)
    _step_with(model, opt, *data[3], torch.tensor(1.0), nan=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    after = _flat_state(opt)
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(after[k], v), k
    stats = opt.bound_stats()
    assert stats["bound_fraction"] == 0 and set(stats["lr_eff"].values()) == {0.0}  # marked: nothing moved
    if SKIP_CASES[case].get("warm_start", True):  # cold starts draw from the global RNG in the skipped step too
        rng = torch.get_rng_state()
        for x, y in data[3:]:
            _step_with(model, opt, x, y, None)
        torch.set_rng_state(rng)
        for x, y in data[3:]:
            _step_with(ref, ref_opt, x, y, None)
        assert_same_run(model, opt, ref, ref_opt)


def test_found_inf_on_the_first_step_creates_clean_state():
    data = batches(3)
    model = make_model()
    opt = make_adamw2(model)
    weights = [p.clone() for p in model.parameters()]
    _step_with(model, opt, *data[0], torch.tensor(1.0), nan=True)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    for st in opt.state.values():
        assert st["step"].item() == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        assert all(torch.isfinite(v).all() for v in st.values())
    train_steps(model, opt, data[1:])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_found_inf_zero_is_a_plain_step(case):
    data = batches(5)
    model, ref = make_model(), make_model()
    opt, ref_opt = make_adamw2(model, **SKIP_CASES[case]), make_adamw2(ref, **SKIP_CASES[case])
    torch.manual_seed(5)
    for x, y in data:
        _step_with(model, opt, x, y, torch.tensor(0.0))
    train_steps(ref, ref_opt, data)
    assert_same_run(model, opt, ref, ref_opt)
    assert opt.bound_stats() == ref_opt.bound_stats()


def test_grad_scale_is_refused():
    model = make_model()
    opt = make_adamw2(model)
    loss_fn(model, *batches(1)[0]).backward()
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="grad_scale must be None"):
        opt.step()


def test_matches_algorithm_1_where_some_tensors_are_bound_and_others_not():
    """At lr 0.005 the bound binds some matrices (sigma1(W) about 1.6 to 2.5) and not others: a bound
    tested against tau alone, not tau x sigma1(W), decides some of them otherwise."""
    fractions = run_pair(steps=10, lr=0.005, tau=0.01)
    assert any(0 < f < 1 for f in fractions), fractions


def test_a_tiny_weight_decay_decays_at_the_bounded_rate():
    """W(1 - lr_eff wd) - lr_eff U, as Algorithm 1: the decay uses the bounded rate, not lr."""
    run_pair(steps=10, lr=0.05, tau=0.01, wd=5e-7)


def test_the_optimizers_own_defaults_are_the_documented_ones():
    """The config's defaults are tested elsewhere; AdamW2 built in Python must agree with them."""
    from stabletrain.config import OptimConfig

    d, c = AdamW2([nn.Parameter(torch.zeros(2, 2))]).defaults, OptimConfig()
    assert (d["power_iters"], d["warm_start"], d["eps_inside_sqrt"]) == (c.power_iters, c.warm_start, c.eps_inside_sqrt)
    assert d["power_iters"] == 3


@pytest.mark.parametrize("skip", [None, 0.0])
def test_the_host_dispatches_a_few_ops_per_tensor_and_the_rest_per_bucket(skip):
    """On a GPU each op the step dispatches costs the host microseconds whatever its size: the
    power iteration runs once per bucket of equal shapes, and a tensor more in a bucket adds only
    its copy into the stack (warm start, with and without the skip flag of divergence.skip_nonfinite)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def ops_of_a_step(n: int) -> int:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(12, 8)) for _ in range(n)] + [nn.Parameter(torch.randn(8))]
        opt = AdamW2(params, lr=1e-2, tau=0.01, weight_decay=0.1)
        for _ in range(3):  # the third step's vectors are warm, as in training
            for p in params:
                p.grad = torch.randn_like(p)
            opt.found_inf = None if skip is None else torch.tensor(skip)
            with Count() as count:
                opt.step()
        return count.ops

    assert ops_of_a_step(6) - ops_of_a_step(2) <= 4 * 1  # the stack's reshape of each matrix, no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64,
                                   torch.complex128])
def test_the_compute_dtype_is_the_parameters_promoted_with_fp32(dtype):
    """The step computes in fp32 at least, fp64 and complex kept: a complex parameter steps."""
    from stabletrain.optim.adamw2 import _compute_dtype

    p = nn.Parameter(torch.randn(4, 3, dtype=dtype))
    assert _compute_dtype(p) == torch.promote_types(dtype, torch.float32)
    if dtype.is_complex:
        before = p.detach().clone()
        p.grad = torch.randn_like(p)
        AdamW2([p], lr=1e-2).step()
        assert torch.isfinite(torch.view_as_real(p.detach())).all() and not torch.equal(p.detach(), before)
