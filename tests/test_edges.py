"""Each check at its edge: config bounds refused just past them and passed at them, the notes
for every unread key, the keys a resume compares, parameter groups by name, epochs to steps,
and each health-alert condition at its threshold and window. Every test compares with an
explicit expected value (the exact error line, a hand-computed lr, the exact names, the alert's
step), so that an off-by-one or a dropped check fails."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from stabletrain.build import validate
from stabletrain.errors import ConfigError
from tests.helpers import alert_metrics, make_cfg


def _refused(*overrides):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=vit_test", "steps=10", *overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# --- 1. config validation -------------------------------------------------------------------


@pytest.mark.parametrize("overrides,line", [
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be > 0 (e.g. optim.lr=1e-3)"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0 (e.g. optim.lr=1e-3)"),
    (["optim.tau=0"], "optim.tau=0.0 must be > 0, or null for the model family's"),
    (["optim.tau=-0.004"], "optim.tau=-0.004 must be > 0"),
    (["norm=stablenorm", "norm.alpha=0.6"], "norm.alpha=0.6 must be in [0, 0.5] (0.5 is RMSNorm)"),
    (["norm=stablenorm", "norm.alpha=-0.1"], "norm.alpha=-0.1 must be in [0, 0.5]"),
    (["attention=stable", "attention.seq_len=1"], "attention.seq_len=1 must be >= 2"),
    (["batch_size=64", "micro_batch_size=24"],
     "micro_batch_size=24 must divide batch_size=64: e.g. micro_batch_size=16 or 32"),
    (["micro_batch_size=0"], "micro_batch_size=0 must be > 0 or null"),
    (["optim.weight_decay=-0.01"], "optim.weight_decay=-0.01 must be >= 0"),
    (["divergence.action=rollback", "monitor.stop_on_alert=false", "monitor.rollback_on_alert=true"],
     "monitor.rollback_on_alert=true needs divergence.action=rollback and monitor.stop_on_alert=true"),
    (["monitor.qk_growth=1.0"], "monitor.qk_growth=1.0 must be > 1 (a growth factor)"),
    (["steps=null", "epochs=null"], "set steps=N or epochs=E"),
    (["attention=stable", "attention.alpha=-0.01"], "attention.alpha=-0.01 must be in [0, 0.5] or null"),
])
def test_each_bound_is_refused_just_past_its_edge(overrides, line):
    assert line in _refused(*overrides)


@pytest.mark.parametrize("overrides", [
    ["norm=stablenorm", "norm.alpha=0.0"],  # alpha = 0: plain re-centering (004 Eq. 2 allows [0, 0.5])
    ["norm=stablenorm", "norm.alpha=0.5"],
    ["attention=stable", "attention.seq_len=2"],
    ["attention=stable", "attention.alpha=0.5"], ["attention=stable", "attention.alpha=0.0"],
    ["steps=null", "epochs=2"],
    ["batch_size=64", "micro_batch_size=16"],
    ["optim.weight_decay=0.0"],
    ["optim.tau=1e-6"],
    ["monitor.qk_growth=1.0001"],
    ["monitor.qk_growth=inf"],  # inf: no growth alert (config._INF_ALLOWED)
    ["divergence.action=rollback", "monitor.stop_on_alert=true", "monitor.rollback_on_alert=true"],
])
def test_the_edges_inside_each_bound_pass(overrides):
    validate(make_cfg("model=vit_test", "steps=10", *overrides))


@pytest.mark.parametrize("key,value,shown", [
    ("tau", "0.01", "0.01"), ("eps_inside_sqrt", "true", "true"), ("power_iters", "5", "5"),
    ("warm_start", "false", "false"), ("overlap_sigma_w", "true", "true"), ("bound_norm_gains", "false", "false"),
])
def test_every_adamw2_key_is_noted_under_adamw(key, value, shown):
    from stabletrain.config import unread_keys

    assert unread_keys(make_cfg("optim=adamw", f"optim.{key}={value}")) == [
        f"note: optim.{key}={shown} changes nothing: only optim=adamw2 reads it, and this run has optim=adamw"]


@pytest.mark.parametrize("key,value", [("stop_on_alert", "true"), ("rollback_on_alert", "true"),
                                       ("entropy_floor", "0.2"), ("qk_growth", "5.0"), ("qk_window", "500")])
def test_every_alert_key_is_noted_when_alerts_are_off(key, value):
    from stabletrain.config import unread_keys

    assert unread_keys(make_cfg("monitor.alerts=false", f"monitor.{key}={value}")) == [
        f"note: monitor.{key}={value} changes nothing: health alerts are off (monitor.alerts=false)"]


# how a run is run and recorded may change on resume; what it trains may not (config.RESUME_MAY_CHANGE)
_MAY = [("resume", "auto"), ("resume_allow_changes", True), ("logger.log_every", 7), ("monitor.probe_every", 9),
        ("eval_every", 11), ("eval_batches", 3), ("ckpt_every", 13), ("ckpt.keep", 5), ("steps", 999),
        ("epochs", 42.0), ("name", "other"), ("device", "cpu"), ("compile", True), ("dist_timeout", 60.0),
        ("dry_run", True), ("activation_checkpointing", True), ("ema.decay", 0.999), ("data.num_workers", 4),
        ("micro_batch_size", 8)]
_MAY_NOT = [("optim.lr", 0.5), ("seed", 7), ("model.depth", 3), ("data.img_size", 32), ("batch_size", 16),
            ("warmup", 5.0), ("schedule.horizon", 100.0), ("norm.alpha", 0.3), ("data.val_fraction", 0.1)]


@pytest.mark.parametrize("key,value", _MAY + _MAY_NOT)
def test_changed_keys_lists_exactly_the_keys_that_change_what_is_trained(key, value):
    from stabletrain.config import changed_keys

    base = make_cfg("model=vit_test")
    other = make_cfg("model=vit_test")
    OmegaConf.update(other, key, value, force_add=True)
    mine = OmegaConf.to_yaml(base)
    expected = [] if (key, value) in _MAY else [key]
    assert changed_keys(mine, OmegaConf.to_yaml(other)) == expected


@pytest.mark.parametrize("key,value", [("mixup", "0.8"), ("cutmix", "1.0"), ("erasing", "0.25"),
                                       ("randaug", "rand-m9-mstd0.5-inc1")])
def test_image_augmentation_on_a_text_model_is_one_line(key, value):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=gpt_test", "steps=10", f"data.{key}={value}"))
    assert str(e.value) == f"data.{key} is image augmentation; a gpt model trains on text: remove data.{key}"


@pytest.mark.parametrize("overrides,line", [
    (["model=gpt_test", "data=digits"],
     "data=digits does not fit model=gpt_test (a gpt model); use data=auto or one of: pytext, tokens"),
    (["model=vit_test", "data=pytext"], "data=pytext does not fit model=vit_test (a vit model); use data=auto or one "
                                        "of: cifar10, cifar100, digits, imagefolder"),
    (["model=gpt_test", "data=tokens"],
     "data=tokens needs data.path=PATH, a train.bin (scripts/prepare_tokens.py writes one)"),
    (["model=gpt_test", "data=tokens", "data.path=/nonexistent/train.bin"],
     "data.path=/nonexistent/train.bin does not exist: point data=tokens at a train.bin (scripts/prepare_tokens.py "
     "writes one)"),
    (["model=vit_test", "data=imagefolder", "data.root=/nonexistent"],
     "data.root=/nonexistent does not exist: point data=imagefolder at a folder with train/ and val/ class folders"),
])
def test_data_that_cannot_serve_the_model_is_refused_by_validate(overrides, line):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("steps=10", *overrides))
    assert str(e.value) == line


# --- 2. parameter groups and schedules ------------------------------------------------------


def _roles(model, family, **kw):
    from stabletrain.optim import classify

    return {name: role for name, _, role in classify(model, family, **kw)}


def test_vit_register_tokens_are_not_decayed():
    """timm's no_weight_decay() names pos_embed, cls_token, dist_token and reg_token: the vit family too."""
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=1, reg_tokens=2)
    r = _roles(vit, "vit")
    assert {n for n, role in r.items() if role.kind == "position"} == {"cls_token", "reg_token", "pos_embed"}
    assert not r["reg_token"].decay and not r["cls_token"].decay and not r["pos_embed"].decay


def test_swin_absolute_position_embedding_is_not_decayed_but_bounded():
    class Swinish(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.absolute_pos_embed = torch.nn.Parameter(torch.zeros(1, 16, 8))
            self.proj = torch.nn.Linear(8, 8, bias=False)

    r = _roles(Swinish(), "swin")
    a = r["absolute_pos_embed"]
    assert (a.kind, a.decay, a.bound, a.lars_exclude) == ("position", False, True, False)
    assert (r["proj.weight"].kind, r["proj.weight"].decay) == ("matrix", True)


def test_a_family_of_ones_own_without_no_decay_uses_the_models_no_weight_decay():
    from stabletrain.models.registry import MODELS

    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.my_pos = torch.nn.Parameter(torch.zeros(1, 4, 8))
            self.fc = torch.nn.Linear(8, 8)

        def no_weight_decay(self):
            return {"my_pos"}

    MODELS.register("mine_for_mutation_test", kind="vision")(lambda *a, **k: Mine())
    try:
        r = _roles(Mine(), "mine_for_mutation_test")
        assert {n for n, role in r.items() if not role.decay} == {"my_pos", "fc.bias"}
        assert r["my_pos"].kind == "position" and r["fc.weight"].decay
    finally:
        MODELS._entries.pop("mine_for_mutation_test")


def test_lars_adapts_matrices_only():
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=1)
    r = _roles(vit, "vit")
    adapted = {n for n, role in r.items() if not role.lars_exclude}
    assert adapted == {"pos_embed", "patch_embed.proj.weight", "head.weight", "blocks.0.attn.qkv.weight",
                       "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"}


@pytest.mark.parametrize("value,spe,steps", [(0.29, 100, 29), (0.57, 100, 57), (1.15, 20, 23), (2.5, 10, 25)])
def test_epochs_to_steps_rounds_to_the_nearest_step(value, spe, steps):
    from stabletrain.optim import to_steps

    # 0.29 * 100 = 28.999999999999996 and 1.15 * 20 = 22.999999999999996 in floating point
    assert to_steps(value, "epochs", spe) == steps


def test_a_cosine_horizon_in_epochs_is_converted_like_warmup():
    from stabletrain.config import ScheduleConfig
    from stabletrain.optim import make_schedule

    cfg = OmegaConf.structured(ScheduleConfig(name="cosine", unit="epochs", horizon=20.0, min_lr=0.0))
    lr = make_schedule(cfg, base_lr=1.0, total_steps=100, warmup=1.0, steps_per_epoch=10)
    assert (lr.warmup_steps, lr.horizon_steps) == (10, 200)
    # lr(s) = 0.5 * (1 + cos(pi * (s - 10) / (200 - 10)))
    for s in (10, 50, 99):
        assert lr(s) == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - 10) / 190)))
    assert lr(9) == pytest.approx(1.0) and lr(0) == pytest.approx(0.1)


# --- 3. health alerts -----------------------------------------------------------------------


def _block(step, **kw):  # the step is the caller's, for reading
    return alert_metrics(**kw)


SEC_HIGH = {1: 0.9, 2: 0.99, 4: 0.999, 8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0}  # d_h = 64, s* = 4


def _alerts(watch, points):
    out = []
    for step, metrics in points:
        out += watch.update(step, metrics)
    return [(a["step"], a["layer"]) for a in out]


@pytest.mark.parametrize("entropy,qk_last,sec4,fires", [
    (0.1, 200.0, 0.999, False),    # entropy == floor (0.1): not below it
    (0.0999, 200.0, 0.999, True),
    (0.05, 100.0, 0.999, False),   # sigma1 10 -> 100: growth 10x == qk_growth, not more
    (0.05, 100.01, 0.999, True),
    (0.05, 200.0, 0.99, False),    # SEC(64, 4) == sec_threshold (0.99): not above it
    (0.05, 200.0, 0.9901, True),
])
def test_each_alert_condition_is_strict_at_its_edge(entropy, qk_last, sec4, fires):
    from stabletrain.monitor.alerts import HealthWatch

    watch = HealthWatch(entropy_floor=0.1, qk_growth=10.0, sec_threshold=0.99, qk_window=1000)
    sec = {**SEC_HIGH, 4: sec4}
    got = _alerts(watch, [(0, _block(0, qk=10.0, ent=2.0, sec=sec)),
                          (100, _block(100, qk=qk_last, ent=entropy, sec=sec))])
    assert got == ([(100, "blocks.0")] if fires else [])


def test_growth_of_exactly_qk_growth_does_not_alert():
    from stabletrain.monitor.alerts import HealthWatch

    watch = HealthWatch(entropy_floor=0.1, qk_growth=4.0, qk_window=1000)
    # 4.0 / 1.0 = 4.0 exactly: not more than qk_growth
    assert _alerts(watch, [(0, _block(0, qk=1.0, ent=0.05)), (10, _block(10, qk=4.0, ent=0.05))]) == []
    assert _alerts(watch, [(20, _block(20, qk=4.5, ent=0.05))]) == [(20, "blocks.0")]


def test_a_sec_curve_without_s_star_cannot_alert():
    """d_h = 64 (the curve's last point) makes s* = 4; a curve that lacks s = 4 cannot say the energy
    is concentrated, so the alert stays off (conditions 1 and 2 decide alone only without any SEC)."""
    from stabletrain.monitor.alerts import HealthWatch

    watch = HealthWatch()
    sec = {1: 0.999, 2: 0.9999, 64: 1.0}
    assert _alerts(watch, [(0, _block(0, qk=1.0, ent=0.05, sec=sec)), (10, _block(10, qk=50.0, ent=0.05))]) == []
    # without any SEC, conditions 1 and 2 decide alone
    watch = HealthWatch()
    assert _alerts(watch, [(0, _block(0, qk=1.0, ent=0.05)), (10, _block(10, qk=50.0))]) == [(10, "blocks.0")]


def test_the_value_exactly_one_window_back_is_the_reference():
    """qk_window=1000: at step 2000 growth is measured from step 1000 (8 -> 60: 7.5x, no alert), not
    from step 0 (1 -> 60: 60x)."""
    from stabletrain.monitor.alerts import HealthWatch

    watch = HealthWatch(qk_window=1000)
    pts = [(s, _block(s, qk=v, ent=0.05, sec=SEC_HIGH)) for s, v in ((0, 1.0), (1000, 8.0), (2000, 60.0))]
    assert _alerts(watch, pts) == []
    assert [s for s, _ in watch.blocks["blocks.0"].qk] == [1000, 2000]


@pytest.mark.parametrize("weight_every", [1, 100, 250])
def test_the_configured_window_is_in_steps_whatever_the_weight_cadence(weight_every):
    """sigma1 grows 1.27x per 100 steps: 1.27^9 = 8.6 < 10 < 1.27^10 = 10.9, so the first step
    where it grew more than 10x within qk_window=1000 steps is step 1000."""
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.alerts import HealthWatch

    watch = HealthWatch.from_config(OmegaConf.structured(MonitorConfig(weight_every=weight_every, qk_window=1000)))
    assert watch.qk_window == 1000
    pts = [(100 * k, _block(100 * k, qk=1.27 ** k, ent=0.05, sec=SEC_HIGH)) for k in range(15)]
    assert _alerts(watch, pts) == [(1000, "blocks.0")]


def test_from_config_takes_the_entropy_floor_and_growth():
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.alerts import HealthWatch

    cfg = OmegaConf.structured(MonitorConfig(entropy_floor=0.25, qk_growth=3.0, qk_window=500))
    watch = HealthWatch.from_config(cfg)
    assert (watch.entropy_floor, watch.qk_growth, watch.qk_window) == (0.25, 3.0, 500)
    # entropy 0.2 < 0.25 and growth 3.5x > 3: an alert the defaults (0.1, 10x) would not raise
    assert _alerts(watch, [(0, _block(0, qk=2.0, ent=0.2, sec=SEC_HIGH)), (100, _block(100, qk=7.0))]) == \
        [(100, "blocks.0")]


class _Sink:
    def __init__(self):
        self.logged, self.messages = [], []

    def log(self, step, rec):
        self.logged.append((step, dict(rec)))

    def message(self, text):
        self.messages.append(text)


def _runner(**monitor):
    """A MonitorRunner whose two passes return fixed metrics (the cadence and alert logic alone)."""
    from stabletrain.config import MonitorConfig
    from stabletrain.monitor.runner import MonitorRunner

    cfg = OmegaConf.structured(MonitorConfig(**monitor))
    r = MonitorRunner(torch.nn.Linear(2, 2), cfg, (torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)),
                      device=torch.device("cpu"))
    r.attach(_Sink())
    r.calls = []
    r.weight_metrics = lambda: (r.calls.append("w"), {"w": 1.0})[1]
    r.probe_metrics = lambda: (r.calls.append("p"), {"p": 1.0})[1]
    return r


def test_weight_and_probe_passes_follow_their_cadence_and_the_last_step():
    r = _runner(weight_every=3, probe_every=5)
    for step in range(-1, 11):  # -1: the initial snapshot; 11 steps, the last is step 10 (done = 11)
        r.after_step(step, last=step == 10)
    got = {done: tuple(sorted(rec)) for done, rec in r.sink.logged}
    # done = step + 1: weights at 0, 3, 6, 9; probe at 0, 5, 10; both at the run's end, 11
    assert got == {0: ("p", "w"), 3: ("w",), 5: ("p",), 6: ("w",), 9: ("w",), 10: ("p",), 11: ("p", "w")}


def _collapse(r):
    r.weight_metrics = lambda: _block(0, qk=r.qk)
    r.probe_metrics = lambda: _block(0, ent=0.01)
    r.qk = 1.0
    r.after_step(-1)
    r.qk = 100.0
    r.after_step(0)


@pytest.mark.parametrize("stop", [False, True])
def test_stop_on_alert_decides_whether_an_alert_stops_the_run(stop):
    r = _runner(weight_every=1, probe_every=1, stop_on_alert=stop)
    _collapse(r)
    assert [(a["step"], a["layer"]) for a in r.alerts] == [(1, "blocks.0")]
    assert r.stop_reason == ("entropy collapse at blocks.0 (step 1)" if stop else None)
    assert r.sink.logged[-1][1]["alert/blocks.0"] == 1.0


def test_alerts_false_raises_no_alert_and_stops_nothing():
    r = _runner(weight_every=1, probe_every=1, alerts=False, stop_on_alert=True)
    _collapse(r)
    assert r.alerts == [] and r.stop_reason is None and r.sink.messages == []
    assert all("alert/blocks.0" not in rec for _, rec in r.sink.logged)


# --- 1b. the command line -------------------------------------------------------------------


def test_check_keys_passes_double_plus_and_refuses_single_plus_on_an_existing_key():
    """'++key=v' sets a key either way (what explain() itself suggests); '+key=v' on a key the
    schema has is one line naming the fix."""
    from stabletrain.cli import check_keys

    check_keys(["++optim.lr=0.1", "++model.depth=3"])  # no error
    with pytest.raises(ConfigError) as e:
        check_keys(["+optim.lr=0.1"])
    assert str(e.value) == "optim.lr is a key of the config already: drop the '+' (optim.lr=0.1)"
    with pytest.raises(ConfigError) as e:
        check_keys(["+optim.lrr=0.1"])
    assert str(e.value) == "unknown key 'optim.lrr': did you mean optim.lr (without the '+')?"


def test_an_alert_stops_the_run_without_rollback_on_alert_even_under_divergence_rollback(tmp_path):
    """divergence.action=rollback rolls back divergences; an alert rolls back only with
    monitor.rollback_on_alert=true, else monitor.stop_on_alert ends the run as diverged."""
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    gpt = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1", "precision=fp32"]
    t = build_trainer(make_cfg(*QUIET, *gpt, "divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4",
                               "steps=12", "monitor=standard", "monitor.stop_on_alert=true",
                               "monitor.rollback_on_alert=false"), tmp_path)
    real = t.monitor.after_step

    def after_step(step, last=False):
        real(step, last)
        if step + 1 == 7:
            t.monitor.stop_reason = "entropy collapse at blocks.0 (step 7)"

    t.monitor.after_step = after_step
    s = t.fit()
    assert (s["status"], s["step"], s.get("rollbacks", [])) == ("diverged", 7, [])
    assert "entropy collapse at blocks.0 (step 7)" in s["reason"]
