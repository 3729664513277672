"""Monitors wired into training: they change nothing, they catch the papers' collapse; the
runner's forensic weight passes and the blocks it reads."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers import GPT_LOGGED, losses, make_cfg, model_of, train

MON = ["monitor=standard", "monitor.weight_every=2", "monitor.probe_every=3"]


@pytest.mark.parametrize("model", ["vit_test", "gpt_test", "swin_test"])
def test_monitors_change_nothing(tmp_path, model):
    args = [f"model={model}", "steps=6", "batch_size=8", "logger.log_every=1", "eval_every=1000"]
    if model != "gpt_test":
        args.append("model.drop_path=0.1")  # training draws random numbers: monitors must not
    train(tmp_path / "off", *args)
    train(tmp_path / "on", *args, *MON, "monitor.per_head=true", "reparam=sigma")
    train(tmp_path / "off_sigma", *args, "reparam=sigma")
    assert losses(tmp_path / "on") == losses(tmp_path / "off_sigma")
    recs = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    names = set().union(*recs)
    block = "layers.0.blocks.0" if model == "swin_test" else "blocks.0"
    for key in (f"sigma1/{block}/wq_t_wk_max", f"sigma1/{block}/wo_wv_full", f"sec/{block}/s1",
                f"entropy/{block}/min", f"token_sim/{block}",
                f"norm/{block}/grad_x", f"qk_spectrum/{block}/eig_mean_trace", f"sigma1/{block}/w2_w1"):
        assert key in names, key
    # Swin's logits carry a relative position bias, outside Theorem 3.1
    assert (f"entropy/{block}/bound_min" in names) == (model != "swin_test")
    assert any(r["step"] == 0 for r in recs)  # the step-0 baseline


# at lr 0.05 blocks.0's entropy ended at 0.256 on one CPU, just above the floor, where it had gone below
# on others; at 0.2 it is below 0.1 from the first probe on (step 25), and AdamW² still holds it at 2.8
COLLAPSE = ["model=vit_test", "steps=100", "batch_size=32", "optim.lr=0.2", "warmup=0",
            "monitor=standard", "monitor.weight_every=25", "monitor.probe_every=25",
            "logger.log_every=25", "eval_every=1000", "monitor.entropy_floor=0.25"]


def test_adamw_without_warmup_collapses_and_the_alert_names_the_layer(tmp_path):
    s = train(tmp_path / "adamw", *COLLAPSE, "optim=adamw")
    assert s["alerts"], "the collapse went unnoticed"
    a = s["alerts"][0]
    assert a["layer"].startswith("blocks.") and a["value"] < 0.25  # of log(17) = 2.83 nats at init
    recs = [json.loads(x) for x in (tmp_path / "adamw" / "metrics.jsonl").read_text().splitlines()]
    layer = a["layer"]
    qk = [r[f"sigma1/{layer}/wq_t_wk_max"] for r in recs if f"sigma1/{layer}/wq_t_wk_max" in r]
    ent = [r[f"entropy/{layer}/min"] for r in recs if f"entropy/{layer}/min" in r]
    assert qk[-1] > 10 * qk[0] and ent[-1] < 0.5 * ent[0]  # the papers' signature
    assert any(f"alert/{layer}" in r for r in recs)

    s2 = train(tmp_path / "adamw2", *COLLAPSE, "optim=adamw2")
    assert s2["alerts"] == []


def test_stop_on_alert_ends_the_run_as_diverged(tmp_path, capsys):
    s = train(tmp_path, *COLLAPSE, "optim=adamw", "monitor.stop_on_alert=true", quiet=False)
    assert s["status"] == "diverged" and "entropy collapse" in s["reason"]
    assert s["step"] < 100
    warning = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("WARNING "))
    assert warning.endswith("(what the papers do against it: a learning-rate warmup, optim=adamw2, reparam=sigma "
                            "or attention=qknorm)")


def test_divergence_forensics(tmp_path):
    s = train(tmp_path, "model=gpt_test", "steps=60", "batch_size=8", "optim=sgd", "optim.lr=1e4",
              "optim.momentum=0.0", "monitor=standard", "monitor.weight_every=1", "monitor.probe_every=5",
              "logger.log_every=1")
    assert s["status"] == "diverged"
    f = json.loads((tmp_path / "summary.json").read_text())["forensics"]
    assert "last_finite_snapshot" in f
    # both findings: the module whose output first went non-finite, and the block whose spectrum grew
    assert f["first_nonfinite"].startswith("first non-finite: "), f
    assert f["growth"].startswith("max sigma1(Wq^T Wk) grew ") and " steps at blocks." in f["growth"], f


def test_a_diverged_run_stopped_between_weight_passes_reports_its_last_weights(tmp_path):
    """The trainer hands the monitors the step it stopped at: a NaN step 3 stops the run
    (max_skips=1) with finite weights, which the forensics describe at step 3, not step 0."""
    s = train(tmp_path, *GPT_LOGGED, "steps=6", "debug.nan_at_step=3", "divergence.max_skips=1", "monitor=standard",
              "monitor.weight_every=100")
    assert s["status"] == "diverged" and s["step"] == 3, (s["status"], s["step"], s["reason"])
    assert s["forensics"]["last_finite_snapshot"]["step"] == 3


def _vit_runner(*overrides):
    """The monitors of vit_test, attached to a logger that keeps nothing; probes never due."""
    from stabletrain.monitor.runner import MonitorRunner

    cfg = make_cfg("model=vit_test", "monitor=standard", "monitor.probe_every=100000", "monitor.alerts=false",
                   *overrides)
    torch.manual_seed(0)
    model = model_of(cfg)
    batch = (torch.randn(2, 3, cfg.model.img_size, cfg.model.img_size), torch.randint(0, 10, (2,)))
    runner = MonitorRunner(model, cfg.monitor, batch, device=torch.device("cpu"))
    runner.attach(SimpleNamespace(log=lambda step, values: None, message=lambda text: None))
    return runner


def test_no_extra_forensic_pass_on_non_finite_weights_nor_at_a_step_already_weighed():
    """The summary of a diverged run weighs the weights once more for its forensics, but not at a
    step the weight pass already read, nor once they are no longer finite: the last finite
    snapshot stays the scheduled pass's."""
    runner = _vit_runner("monitor.weight_every=10")
    runner.after_step(-1)
    runner.after_step(29)  # a scheduled pass at step 30
    assert [h["step"] for h in runner.history] == [0, 30]
    runner.summary("diverged", 30)
    assert [h["step"] for h in runner.history] == [0, 30]  # not weighed twice
    with torch.no_grad():
        next(runner.model.parameters()).fill_(math.nan)
    forensics = runner.summary("diverged", 35)["forensics"]
    assert [h["step"] for h in runner.history] == [0, 30]  # weights no longer finite: no pass at 35
    assert forensics["last_finite_snapshot"]["step"] == 30


def test_monitor_runner_refuses_a_probe_every_of_zero():
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    with pytest.raises(ValueError, match="monitor.probe_every=0 must be >= 1"):
        MonitorRunner(nn.Linear(2, 2), MonitorConfig(probe_every=0), (torch.zeros(1, 2), torch.zeros(1)),
                      device="cpu")


def test_a_step_with_no_pass_due_reads_no_config():
    """after_step runs after every optimizer step: the cadence is read once, not from the
    OmegaConf config each step (dozens of Python calls a step on the hot path)."""
    from omegaconf import OmegaConf

    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    runner = MonitorRunner(nn.Linear(2, 2), OmegaConf.structured(MonitorConfig(weight_every=5, probe_every=7)),
                           (torch.zeros(1, 2), torch.zeros(1)), device="cpu")

    class Untouchable:
        def __getattr__(self, key):
            raise AssertionError(f"after_step read monitor.{key} on a step with no pass due")

    runner.cfg = Untouchable()
    for step in (0, 1, 2, 3, 5):  # done = 1..4, 6: neither 5 nor 7 divides them
        runner.after_step(step)
    assert (runner.weight_every, runner.probe_every) == (5, 7)


class _Attention(nn.Module):
    """``fused``: a qkv of 2 x d rows (q and k only), which no 3 x heads split reads; else
    separate q, k, v: neither stabletrain's nor timm's layout."""

    def __init__(self, d: int, fused: bool):
        super().__init__()
        self.num_heads = 2
        if fused:
            self.qkv = nn.Linear(d, 2 * d)
        else:
            self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.proj = nn.Linear(d, d)


class _OtherBlock(nn.Module):
    def __init__(self, fused: bool, d: int = 8):
        super().__init__()
        self.norm1, self.norm2, self.attn = nn.LayerNorm(d), nn.LayerNorm(d), _Attention(d, fused)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)


@pytest.mark.parametrize("fused", [False, True])
def test_blocks_of_another_layout_are_said_to_be_read_by_neither_pass(fused):
    """Blocks whose attention neither pass can read get no weight pass, and the coverage line says so."""
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    model = nn.Sequential(_OtherBlock(fused), _OtherBlock(fused))
    runner = MonitorRunner(model, MonitorConfig(), (torch.zeros(1, 4, 8), torch.zeros(1)), device="cpu")
    assert runner.weight_blocks == []
    assert runner.coverage().endswith("skips them, and so does the weight pass (no fused attn.qkv, attn.proj, "
                                      "mlp.fc1, mlp.fc2 to read)")


@pytest.mark.parametrize("model", ["vit_test", "gpt_test"])
def test_probe_gradient_norm_is_each_samples_own(tmp_path, model):
    """norm/<block>/grad_x is ||d loss_i / d x_i|| of each probe sample's own held-out loss,
    averaged over the probe batch (docs/methods.md §7), computed here one sample at a time."""
    import torch
    import torch.nn.functional as F

    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    t = build_trainer(make_cfg(*QUIET, "monitor=standard", f"model={model}", "batch_size=8",
                               "data.label_smoothing=0.1")
                      if model == "vit_test" else make_cfg(*QUIET, "monitor=standard", f"model={model}",
                                                           "batch_size=8"), tmp_path)
    runner = t.monitor
    got = runner.probe_metrics()["norm/blocks.0/grad_x"]
    t.model.eval()
    x, y = runner.probe_batch
    norms, seen = [], {}
    hook = t.model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
    for i in range(len(x)):
        out = t.model(x[i:i + 1]).float()
        loss = F.cross_entropy(out.flatten(0, -2), y[i:i + 1].flatten())  # a sequence's loss: its token mean
        (g,) = torch.autograd.grad(loss, seen["x"])
        norms.append(g.norm())
    hook.remove()
    assert got == pytest.approx(float(torch.stack(norms).mean()), rel=1e-4)


def test_mixup_recipes_run_with_the_monitors(tmp_path):
    """With mixup/cutmix the training loss takes soft targets; the probe uses hard labels."""
    s = train(tmp_path, "model=vit_test", "steps=3", "batch_size=8", "data.mixup=0.8", "data.cutmix=1.0",
              *MON)
    assert s["status"] == "completed"
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("norm/blocks.0/grad_x" in r for r in recs)


@pytest.mark.parametrize("attention", ["softmax", "qknorm"])
def test_theorem31_bound_is_logged_for_softmax_attention_from_the_post_norm_input(tmp_path, attention):
    """Without sigmaReparam too; recomputed here from the block's effective W_q, W_k and its
    attention input norm1(x) (docs/methods.md §7); absent where q/k are normalised."""
    import torch

    from stabletrain.build import build_trainer
    from stabletrain.monitor.quantities import entropy_lower_bound, split_heads
    from tests.helpers import QUIET, make_cfg

    t = build_trainer(make_cfg(*QUIET, "monitor=standard", "model=vit_test", "batch_size=8",
                               f"attention={attention}"), tmp_path)
    runner = t.monitor
    got = runner.probe_metrics()
    if attention != "softmax":
        assert "entropy/blocks.0/bound_min" not in got
        return
    t.model.eval()
    blk, seen = t.model.blocks[0], {}
    hook = blk.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
    with torch.no_grad():
        t.model(runner.probe_batch[0])
    hook.remove()
    h = blk.attn.num_heads
    wq, wk, _ = blk.attn.qkv.weight.detach().chunk(3, 0)
    bq = blk.attn.qkv.bias.detach().reshape(3, h, -1)[0]  # timm's ViT default: q/k/v biases
    bound = entropy_lower_bound(split_heads(wq, h), split_heads(wk, h), blk.norm1(seen["x"]).detach(),
                                bq_h=bq)
    assert got["entropy/blocks.0/bound_min"] == pytest.approx(float(bound.min()), rel=1e-6)
    assert got["entropy/blocks.0/bound_min"] <= got["entropy/blocks.0/min"]


@pytest.mark.parametrize("model", ["gpt_test", "vit_test"])
def test_the_probe_pass_reads_the_device_twice(tmp_path, monkeypatch, model):
    """Its finiteness check, then every block's values at once: on a GPU a read per value
    (about six a block) made the device wait for the host between blocks, and so would a
    tensor built on the host and sent to the device. The values are those each block's own
    read gives. (The GPU's path for the bound's input norms, which reads nothing; the CPU's
    eigensolver path checks finiteness on the host.)"""
    from torch.overrides import TorchFunctionMode

    from stabletrain.build import build_trainer
    from stabletrain.monitor import quantities as Q
    from tests.engine.test_hot_path import SYNCS
    from tests.helpers import QUIET

    class Reads(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += func in SYNCS
            self.sent += func in (torch.tensor, torch.as_tensor) and (kwargs or {}).get("device") is not None
            return func(*args, **(kwargs or {}))

    Reads.sent = 0
    import stabletrain.monitor.runner as R

    gram_top = Q._gram_top
    monkeypatch.setattr(Q, "_gram_top", lambda g, by_squaring=None: gram_top(g, True))
    runner = build_trainer(make_cfg(*QUIET, "monitor=standard", f"model={model}", "batch_size=8"), tmp_path).monitor
    with Reads() as reads:
        got = runner.probe_metrics()
    assert reads.n == 2 and reads.sent == 0 and "entropy/blocks.0/bound_min" in got and "token_sim/blocks.1" in got
    monkeypatch.setattr(Q, "STACK_BUDGET_BYTES", 1)  # the bounds one block at a time: the same numbers
    calls = []
    bounds = Q.entropy_lower_bounds
    monkeypatch.setattr(R, "entropy_lower_bounds", lambda blocks: calls.append(len(blocks)) or bounds(blocks))
    assert runner.probe_metrics() == pytest.approx(got, rel=1e-12, nan_ok=True) and calls == [1] * len(runner.blocks)
    per_block = {}
    values = Q.block_probe_values  # each block read on its own
    monkeypatch.setattr(R, "block_probe_values", lambda *a, **k: per_block.update(Q.to_floats(values(*a, **k))) or {})
    runner.probe_metrics()
    assert per_block and all(got[k] == pytest.approx(v, rel=1e-12, nan_ok=True) for k, v in per_block.items())


def test_a_resumed_run_logs_the_monitor_values_of_the_whole_run(tmp_path):
    """The weight pass warm-starts its power iterations from the last pass's vectors: those,
    the alert watch and the forensics history travel in the checkpoint."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg
    from tests.engine.test_loop import _run_until

    args = ["model=vit_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "steps=8", *MON]
    train(tmp_path / "full", *args)
    t = build_trainer(make_cfg(*QUIET, *args, "ckpt_every=4"), tmp_path / "half")
    _run_until(t, 4)
    train(tmp_path / "half", *args, "resume=auto")

    def records(d):
        return {r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if r["step"] > 4 and any(k.startswith("sigma1/") for k in r)}

    full, half = records(tmp_path / "full"), records(tmp_path / "half")
    assert sorted(full) == sorted(half) == [6, 8]
    for step, rec in full.items():
        assert half[step] == pytest.approx(rec, rel=1e-6), step


def test_swin_shifted_windows_entropy_reference_counts_the_keys_of_each_region(tmp_path):
    """In a shifted-window block a query attends to the keys of its own region only (timm masks
    the rest with -100): the uniform reference is the mean over queries of log(region keys),
    and no Theorem 3.1 bound is logged (the bound of all window keys exceeded the measured
    entropy there)."""
    import math

    import torch

    from stabletrain.build import build_trainer
    from tests.helpers import QUIET, make_cfg

    t = build_trainer(make_cfg(*QUIET, "monitor=standard", "model=swin_test", "model.depths=[2,1]",
                               "batch_size=8"), tmp_path)
    got = t.monitor.probe_metrics()
    shifted = t.model.layers[0].blocks[1]
    assert any(shifted.shift_size) and shifted.attn_mask is not None
    keys = (shifted.attn_mask == 0).sum(-1).double()  # (windows, queries)
    expect = float(torch.log(keys).mean())
    assert expect < math.log(shifted.window_area) - 0.1  # the regions are smaller than a window
    assert got["entropy/layers.0.blocks.1/log_T"] == pytest.approx(expect, rel=1e-9)
    assert got["entropy/layers.0.blocks.0/log_T"] == pytest.approx(math.log(shifted.window_area), rel=1e-9)
    assert got["entropy/layers.0.blocks.1/min"] <= expect
    assert not any(k.endswith("/bound_min") for k in got)
