"""stabletrain's pieces used from a loop of one's own (no Trainer): what a library user meets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stabletrain.config import Components, DeescConfig, ModelConfig, MonitorConfig, ReparamConfig
from stabletrain.errors import ConfigError
from stabletrain.layers.reparam import PowerStep, apply_reparam
from stabletrain.models.registry import build_model
from stabletrain.monitor.runner import MonitorRunner
from stabletrain.optim import AdamW2


def _vit(**kw) -> ModelConfig:
    base = dict(name="t", family="vit", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10)
    return ModelConfig(**{**base, **kw})


def test_build_model_exposes_the_reparam_hook_it_documents():
    model = build_model(_vit(), Components(reparam=ReparamConfig(name="sigma")))
    assert isinstance(model.step_hook, PowerStep) and model.step_hook.model is model
    assert build_model(_vit(), Components()).step_hook() is None  # a no-op: a loop calls it whatever the options


def test_build_model_runs_the_family_check():
    with pytest.raises(ConfigError, match="deescalate.causal=false"):
        build_model(ModelConfig(name="g", family="gpt", vocab_size=32, block_size=8, embed_dim=32, depth=1,
                                num_heads=2), Components(deescalate=DeescConfig(name="deescalate", causal=False)))
    with pytest.raises(ConfigError, match="img_size=18 is not a multiple"):
        build_model(_vit(img_size=18), Components())
    # int(32 x 0.01) = 0, which timm's Mlp reads as "as wide as the model"
    with pytest.raises(ValueError, match=r"Block: mlp_ratio=0.01 makes the MLP 0 wide at dim=32"):
        build_model(_vit(mlp_ratio=0.01), Components())
    assert build_model(_vit(mlp_ratio=1 / 32), Components()).blocks[0].mlp.fc1.out_features == 1


@pytest.mark.parametrize("iters", [0, -1, 1.5, "2", True])
def test_sigma_reparam_refuses_a_bad_power_iters_in_one_line(iters):
    with pytest.raises(ConfigError, match="reparam.power_iters"):
        apply_reparam(nn.Linear(4, 4), ReparamConfig(name="sigma", power_iters=iters))


def test_adamw2_takes_numpy_scalars_as_torch_adamw_does():
    opt = AdamW2(nn.Linear(3, 3).parameters(), lr=np.float32(1e-3), tau=np.float32(0.01),
                 betas=(np.float32(0.9), 0.999))
    assert isinstance(opt.param_groups[0]["lr"], float) and isinstance(opt.param_groups[0]["tau"], float)


@pytest.mark.parametrize("kw, key", [({"warm_start": "false"}, "warm_start"),
                                     ({"eps_inside_sqrt": "yes"}, "eps_inside_sqrt"),
                                     ({"fused": "auto"}, "fused"), ({"lr": torch.tensor(1e-3)}, "not a tensor")])
def test_adamw2_refuses_values_of_the_wrong_type(kw, key):
    with pytest.raises(ValueError, match=key):
        AdamW2(nn.Linear(3, 3).parameters(), **kw)


def test_monitor_runner_in_a_loop_of_ones_own():
    model = build_model(_vit(), Components())
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    with pytest.raises(ValueError, match="monitor.weight_every=0"):
        MonitorRunner(model, MonitorConfig(weight_every=0), batch, device="cpu")
    runner = MonitorRunner(model, MonitorConfig(weight_every=1, probe_every=1), batch, device="cpu")
    with pytest.raises(RuntimeError, match="attach"):
        runner.after_step(0)
    logged = []
    runner.attach(type("Sink", (), {"message": lambda self, t: None,
                                     "log": lambda self, step, v: logged.append((step, v))})())
    runner.after_step(0)
    assert logged and logged[0][0] == 1 and "sigma1/blocks.0/wq" in logged[0][1]


@pytest.mark.parametrize("attention,bounded", [("softmax", True), ("qknorm", False), ("stable", False)])
def test_a_monitor_runner_of_ones_own_logs_the_entropy_bound_only_where_it_holds(attention, bounded):
    """Theorem 3.1 bounds the entropy of raw q . k / sqrt(d_h) logits: a runner built as the docs show
    (no with_bound argument) on a q/k-normalised model logged a "bound" above the measured entropy."""
    from stabletrain.config import AttentionConfig

    torch.manual_seed(0)
    model = build_model(_vit(), Components(attention=AttentionConfig(name=attention)))
    runner = MonitorRunner(model, MonitorConfig(weight_every=1, probe_every=1),
                           (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))), device="cpu")
    got = runner.probe_metrics()
    assert ("entropy/blocks.0/bound_min" in got) is bounded and "entropy/blocks.0/min" in got
    if bounded:
        assert got["entropy/blocks.0/bound_min"] <= got["entropy/blocks.0/min"]


def test_the_readmes_own_loop_block_builds_the_options_values_and_iterates_sigma():
    """README's "The fixes on a model in your own loop": norm=stablenorm's alpha is 0.25 (the
    dataclass default, 0.5, is RMSNorm), and model.step_hook() moves sigmaReparam's estimate."""
    import re

    from stabletrain.layers.norm import StableNorm
    from tests.helpers import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The fixes on a model in your own loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.manual_seed(0)
    loader = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(3)]
    calls = []
    scope = {"loader": loader, "loss_fn": nn.functional.cross_entropy}
    real = None

    def counted(model):  # the hook build_model attached, counted
        nonlocal real
        real = model.step_hook
        model.step_hook = lambda: calls.append(1) or real()
        return model

    run = {**scope, "counted": counted}
    exec(code.replace("model = build_model(cfg.model, Components.of(cfg))",
                      "model = counted(build_model(cfg.model, Components.of(cfg)))"), run)
    assert isinstance(real, PowerStep) and len(calls) == 3
    norms = [m for m in real.model.modules() if isinstance(m, StableNorm)]
    assert norms and all(m.alpha == 0.25 for m in norms)
    # the data's classes, and train.py's groups: sigmaReparam's gamma neither decayed nor bounded
    from stabletrain.layers.reparam import gamma_parameters

    assert run["model"].head.out_features == 10
    gammas = {id(p) for _, p in gamma_parameters(run["model"])}
    of_gammas = [g for g in run["opt"].param_groups if any(id(p) in gammas for p in g["params"])]
    assert of_gammas and all(g["weight_decay"] == 0 and g["bound"] is False for g in of_gammas)
    # without a reparametrisation the same loop runs: step_hook is a no-op
    exec(code.replace('"reparam=sigma"', '"reparam=none"'), dict(scope))


class _SeparateQK(nn.Module):
    """An attention of one's own with separate q, k, v linears (no fused qkv)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.num_heads = 2


def test_a_fix_that_finds_no_layer_of_ones_own_model_warns_instead_of_doing_nothing_silently():
    """reparam=sigma_qk reparametrises a fused qkv's query/key rows and LocAteR penalises them: on a
    model with separate q/k linears both did nothing, without a word, outside train.py (whose start
    notes say it). Applying sigmaReparam a second time still changes nothing, quietly."""
    import warnings

    from torch.nn.utils import parametrize

    from stabletrain.errors import ReachedNothing
    from stabletrain.layers.locater import locater_penalty
    from stabletrain.losses.locater import LocaterParams

    model = _SeparateQK()
    with pytest.warns(ReachedNothing, match=r"^apply_reparam: _SeparateQK has no fused qkv nn.Linear in a module with "
                                            r"num_heads, .*: the model is unchanged$"):
        apply_reparam(model, ReparamConfig(name="sigma", apply_to="qk"))
    assert not any(parametrize.is_parametrized(m, "weight") for m in model.modules())
    with pytest.warns(ReachedNothing, match=r"^LocAteR: _SeparateQK has no attention with a fused qkv .*adds 0$"):
        assert float(locater_penalty(model, LocaterParams())) == 0.0
    apply_reparam(model, ReparamConfig(name="sigma"))  # every linear: reached
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReachedNothing)
        apply_reparam(model, ReparamConfig(name="sigma"))  # again: each is reparametrised already


def test_checked_config_ends_a_mistake_in_one_line_and_names_a_string_for_a_list(capsys):
    """The README's way to compose a config from a loop of one's own: an unknown option is train.py's line;
    a string (read a character at a time) says to give a list."""
    from stabletrain.cli import checked_config

    assert checked_config(["model=vit_mini", "norm=stablenorm"]).norm.alpha == 0.25
    for given, line in ((["model=nope"], "error: model=nope is not an option of 'model'"),
                        ("model=vit_mini norm=stablenorm", "error: checked_config takes a list of overrides: "
                                                           "checked_config(['model=vit_mini', 'norm=stablenorm'])")):
        with pytest.raises(SystemExit):
            checked_config(given)
        err = capsys.readouterr().err.strip()
        assert err.startswith(line) and "\n" not in err, err
