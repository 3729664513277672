"""Malignant vs benign entropy collapse alerts and crash forensics (docs/methods.md §7)."""

import pytest
import torch
from torch import nn

from stabletrain.config import MonitorConfig
from stabletrain.monitor import alerts as A

D_H = 64


def _snapshot(step, block, qk, sec4, ent):
    """One step's metrics for one block: a SEC curve with SEC(64, 4) = sec4, rising to 1."""
    snap = {"step": step, f"sigma1/{block}/wq_t_wk_max": qk, f"entropy/{block}/min": ent}
    for s in (1, 2, 4, 8, 16, 32, 64):
        frac = min(1.0, sec4 * s / 4) if s < 4 else sec4 + (1 - sec4) * (s - 4) / 60
        snap[f"sec/{block}/s{s}"] = frac
    return snap


def _malignant_history(n=10):
    """blocks.3 crashes: sigma1 30 -> 1500, SEC(64,4) 0.5 -> 0.998 from step 700, entropy
    3 -> 0.01; blocks.0 stays healthy; entropy is logged every other step only."""
    hist = []
    for i in range(n):
        f = i / (n - 1)
        snap = {"step": 100 * i, "loss": 3.0}
        snap.update(_snapshot(100 * i, "blocks.3", 30 * 50**f, 0.998 if f > 0.75 else 0.5 + 0.4 * f,
                              3.0 * (1 - f) ** 4 + 0.01))
        snap.update(_snapshot(100 * i, "blocks.0", 20 + i, 0.4, 2.5))
        if i % 2:
            snap = {k: v for k, v in snap.items() if not k.startswith("entropy/")}
        hist.append(snap)
    return hist


def _feed(watch, history):
    out = []
    for snap in history:
        out += watch.update(snap["step"], {k: v for k, v in snap.items() if k != "step"})
    return out


def test_malignant_collapse_alerts_once_naming_the_layer():
    alerts = _feed(A.HealthWatch(entropy_floor=0.1, qk_growth=10.0), _malignant_history())
    assert len(alerts) == 1
    a = alerts[0]
    assert a["layer"] == "blocks.3"
    assert a["quantity"] == "entropy/blocks.3/min"
    assert a["value"] < 0.1
    # entropy fell below the floor at step 600 (its last probe); SEC concentrated at 700
    assert a["step"] == 700
    assert "blocks.3" in a["message"] and "SEC(64,4)" in a["message"]
    assert set(a) == {"step", "layer", "quantity", "value", "message", "onset"}
    # where a rollback must go back before: the entropy under the floor and sigma1 past 10x (300) since 600
    assert a["onset"] == 600


def test_benign_near_identity_collapse_does_not_alert():
    watch = A.HealthWatch.from_config(MonitorConfig())
    # low entropy from the start, sigma1 flat, spectrum spread out
    hist = [_snapshot(50 * i, "blocks.1", 40.0 + 0.5 * i, 0.2, 0.02) for i in range(20)]
    assert _feed(watch, hist) == []
    # sigma1 grows and entropy is low, but the energy stays spread: still benign
    hist = [_snapshot(50 * i, "blocks.2", 10.0 * 1.5**i, 0.3, 0.02) for i in range(20)]
    assert _feed(watch, hist) == []
    # growing and concentrated but entropy healthy: no collapse yet
    hist = [_snapshot(50 * i, "blocks.4", 10.0 * 1.5**i, 0.999, 1.5) for i in range(20)]
    assert _feed(watch, hist) == []


def test_alert_rearms_after_recovery_and_skips_nonfinite():
    watch = A.HealthWatch()
    bad = _snapshot(0, "blocks.0", 1.0, 0.5, 2.0)
    assert watch.update(0, bad) == []
    hit = _snapshot(10, "blocks.0", 50.0, 0.999, 0.01)
    assert len(watch.update(10, hit)) == 1
    assert watch.update(20, hit) == []  # still collapsed: no repeat
    assert watch.update(30, {"entropy/blocks.0/min": 1.0}) == []  # recovered
    assert len(watch.update(40, {"entropy/blocks.0/min": 0.05})) == 1  # collapsed again
    assert watch.update(50, {"entropy/blocks.0/min": float("nan")}) == []


def test_growth_summary_names_block_factor_and_window():
    hist = []
    for step in range(0, 1001, 50):
        grow = 31.25 * 40 ** ((step - 800) / 200) if step >= 800 else 31.25
        hist.append({"step": step, "sigma1/blocks.3/wq_t_wk_max": grow,
                     "sigma1/blocks.1/wq_t_wk_max": 20.0 + step / 100})
    hist.append({"step": 1010, "loss": float("nan")})
    msg = A.growth_summary(hist, window=200)
    assert msg.startswith("max sigma1(Wq^T Wk) grew 40x in 200 steps at blocks.3")
    assert A.growth_summary([{"step": 0, "loss": 1.0}]) is None


class _Attn(nn.Module):
    def __init__(self, d, blow_up=False):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.blow_up = blow_up

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2)).softmax(-1)
        if self.blow_up:  # the module's own code, between its children, overflows
            a = a * float("inf")
        return self.proj(a @ v)


class _Block(nn.Module):
    def __init__(self, d, blow_up=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attn(d, blow_up)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(x)


class _Net(nn.Module):
    def __init__(self, d=8, depth=4, blow_up_at=None):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d, i == blow_up_at) for i in range(depth))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_first_nonfinite_finds_poisoned_module_parent_code_and_input():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    net = _Net()
    assert A.first_nonfinite(net, lambda m: m(x)) is None
    with torch.no_grad():
        net.blocks[2].attn.proj.weight[0, 0] = float("inf")
    assert A.first_nonfinite(net, lambda m: m(x)) == "blocks.2.attn.proj"
    assert A.first_nonfinite(_Net(blow_up_at=1), lambda m: m(x)) == "blocks.1.attn"
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    assert A.first_nonfinite(_Net(), lambda m: m(bad)) == A.INPUT
    # hooks are gone afterwards
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_first_nonfinite_removes_hooks_when_forward_raises():
    net = _Net()
    with pytest.raises(RuntimeError):
        A.first_nonfinite(net, lambda m: m(torch.randn(2, 5, 3)))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_growth_is_measured_over_the_recent_window():
    """Healthy training multiplies sigma1(Wq^T Wk) many-fold from init, slowly; the alert needs
    qk_growth within qk_window steps."""
    watch = A.HealthWatch(qk_window=1000)
    slow = [_snapshot(500 * i, "blocks.0", 0.5 * 1000 ** (i / 100), 0.999, 0.05) for i in range(101)]
    assert _feed(watch, slow) == []  # 1000x since step 0, but 1.07x per 500 steps
    jump = [_snapshot(50000 + 500 * i, "blocks.0", 500 * 20 ** (i / 2), 0.999, 0.05) for i in (1, 2)]
    alerts = _feed(watch, jump)
    assert len(alerts) == 1 and alerts[0]["step"] == 51000
    assert "20.0x its value at step 50000" in alerts[0]["message"]

    from dataclasses import asdict

    state = {b: asdict(s) for b, s in watch.blocks.items()}
    restored = A.HealthWatch(qk_window=1000)
    restored.blocks = {b: A._BlockState.restore(s) for b, s in state.items()}
    assert restored.blocks == watch.blocks
    old = A._BlockState.restore({"qk_first": 1.0, "qk_first_step": 0, "entropy_min": 0.5, "sec": {"4": 0.2}})
    assert old.entropy_min == 0.5 and old.sec == {4: 0.2} and old.qk == []


def test_growth_summary_needs_two_snapshots():
    assert A.growth_summary([{"step": 0, "sigma1/blocks.0/wq_t_wk_max": 3.0}]) is None
