"""Registries: every option of a group is registered next to its code, the config check asks
the registry, and a new option written in one place works in every model family."""

import pytest
import torch

from stabletrain.build import validate
from stabletrain.errors import ConfigError
from stabletrain.layers.norm import NORMS
from stabletrain.registry import Registry, UnknownOption
from tests.helpers import make_cfg, model_of


def test_registry_lists_and_refuses_in_one_line():
    reg = Registry("thing", declares=("flag",))
    reg.register("b", flag=True)(lambda: 2)
    reg.register("a")(lambda: 1)
    assert reg.names() == ["a", "b"] and reg.get("a")() == 1 and reg.entry("b").info == {"flag": True}
    with pytest.raises(UnknownOption, match=r"^thing=c is not an option; choose one of: a, b \(an option of your "
                                            r"own registers itself in a Python module named in imports=\["):
        reg.get("c")
    with pytest.raises(ConfigError, match=r"^thing option 'a' is registered twice \(by [\w.]+ and [\w.]+\): give yours "
                                          r"another name \(a sweep over imports= checks every point in one "
                                          r"process: two versions of an option need two names\)$"):
        reg.register("a")(lambda: 3)


def test_a_misspelt_registration_keyword_is_refused_with_the_nearest():
    """kwarg=("cap",) for kwargs=, or check= where the group runs none, would be silently unread."""
    from stabletrain.layers.attention import ATTENTIONS

    with pytest.raises(ConfigError, match=r"^attention option 'capped': register\(\) takes no kwarg= \(it takes "
                                          r"kwargs=, keys=\); did you mean kwargs=\?$"):
        ATTENTIONS.register("capped", kwarg=("cap",))
    with pytest.raises(ConfigError, match=r"register\(\) takes no check= \(it takes kwargs=, keys=\)$"):
        ATTENTIONS.register("capped", check=print)
    assert "capped" not in ATTENTIONS
    # the registry's own example said norm_gain=True: accepted and unread (a norm's gains are found
    # through its layer= type, optim.param_groups)
    with pytest.raises(ConfigError, match=r"^norm option 'mine': register\(\) takes no norm_gain= \(it takes "
                                          r"kwargs=, layer=, keys=\)$"):
        NORMS.register("mine", norm_gain=True)


def test_every_option_can_be_called_as_its_registry_says_and_one_that_cannot_is_refused():
    """``call`` is what the code passes and what docs/architecture.md tells an author: every
    stabletrain option takes it; a norm of one's own written as (cfg, dim) is refused before the
    run, not met as a TypeError while building."""
    from stabletrain.data import DATASETS
    from stabletrain.layers.attention import ATTENTIONS
    from stabletrain.layers.deescalate import DEESCALATIONS
    from stabletrain.layers.init import INITS
    from stabletrain.layers.norm import NORMS
    from stabletrain.layers.reparam import REPARAMS
    from stabletrain.models.registry import MODELS
    from stabletrain.optim import OPTIMIZERS
    from stabletrain.optim.schedule import SCHEDULES

    registries = (DATASETS, ATTENTIONS, DEESCALATIONS, INITS, NORMS, REPARAMS, MODELS, OPTIMIZERS, SCHEDULES)
    for registry in registries:
        assert registry.call and registry.entries()
        for entry in registry.entries():
            registry.check_callable(entry.name)

    def two(cfg, dim):
        return None

    NORMS.register("two_args_own")(two)
    try:
        with pytest.raises(ConfigError, match=r"^norm=two_args_own: .*two\(cfg, dim\) must take what a norm option "
                                              r"is called with, \(cfg, dim, \*, bias, ln_eps\) \(got an unexpected "
                                              r"keyword argument 'bias'\)$"):
            NORMS.check_callable("two_args_own")
        with pytest.raises(ConfigError, match="^norm=two_args_own: "):
            validate(make_cfg("model=gpt_test", "norm.name=two_args_own"))
    finally:
        NORMS._entries.pop("two_args_own")


def test_a_registration_without_what_its_group_needs_is_refused_naming_it():
    """A loss term without its parameter dataclass failed later as KeyError: 'params'."""
    from stabletrain.data import DATASETS
    from stabletrain.losses import LOSS_TERMS

    with pytest.raises(ConfigError, match=r"^regularizer option 'bare': register\(\) needs params= \(the dataclass "
                                          r"of the term's parameters; an empty @dataclass for none\)$"):
        LOSS_TERMS.register("bare")
    with pytest.raises(ConfigError, match=r"^data option 'mine': register\(\) needs kind= \(vision or text"):
        DATASETS.register("mine", check=print)
    assert "bare" not in LOSS_TERMS and "mine" not in DATASETS


@pytest.mark.parametrize("override,needle", [
    ("norm.name=bogus", "norm=bogus is not an option; choose one of: layernorm, none, rmsnorm, stablenorm"),
    ("attention.name=bogus", "attention=bogus is not an option; choose one of: qknorm, softmax, stable"),
    ("init.name=bogus", "init=bogus is not an option"),
    ("reparam.name=bogus", "reparam=bogus is not an option; choose one of: none, sigma"),
    ("optim.name=bogus", "optim=bogus is not an option; choose one of: adamw, adamw2, lars, sgd"),
    ("schedule.name=bogus", "schedule=bogus is not an option; choose one of: constant, cosine, step"),
    ("data.name=bogus", "data=bogus is not an option"),
    ("model.family=bogus", "model.family=bogus is not an option; choose one of: gpt, swin, vit"),
    ("deescalate.name=bogus", "deescalate.name=bogus is not an option; choose one of: deescalate, none"),
    ("norm.name=stablenrm", "choose one of: layernorm, none, rmsnorm, stablenorm (did you mean stablenorm? "),
    ("data.name=imagefolder", "data=imagefolder needs data.root=PATH, a folder with train/ and val/ class folders"),
    ("data.name=imagefolder data.root=/nope", "data.root=/nope does not exist: point data=imagefolder at a folder"),
])
def test_config_check_asks_the_registries(override, needle):
    with pytest.raises(ConfigError) as err:
        validate(make_cfg("model=vit_test", *override.split()))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model", ["vit_test", "swin_test", "gpt_test"])
def test_a_new_norm_is_one_registration_and_works_in_every_family(model):
    """A norm registered at run time: validated by name, built into every norm slot of every
    family, its gain trained and bounded by AdamW² (a norm gain, known by its type)."""

    class ScaleNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()).expand(dim).clone())

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    NORMS.register("scale_for_test", layer=ScaleNorm)(lambda cfg, dim, **kw: ScaleNorm(dim))
    try:
        cfg = make_cfg(f"model={model}", "norm.name=scale_for_test", "optim=adamw2")
        validate(cfg)
        net = model_of(cfg)
        norms = [m for m in net.modules() if isinstance(m, ScaleNorm)]
        assert len(norms) >= 2 * 2  # both norms of every block
        from stabletrain.optim import build_optimizer

        opt, _ = build_optimizer(net, cfg.optim, cfg.model.family)
        bound = {id(p) for g in opt.param_groups if g["bound"] for p in g["params"]}
        assert all(id(n.weight) in bound for n in norms)
    finally:
        NORMS._entries.pop("scale_for_test")


@pytest.mark.parametrize("model", ["vit_test", "swin_test", "gpt_test"])
def test_a_norm_with_no_weight_tensor_fills_every_norm_slot_of_every_family(model):
    """A scale-only norm (one scalar gain ``g``, no ``weight``): timm's Swin block reads
    ``norm1.weight`` while it is built, which such a norm lacks (an AttributeError from timm)."""

    class ScalarNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim, self.g = dim, torch.nn.Parameter(torch.tensor(float(dim) ** 0.5))

        def forward(self, x):
            return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    NORMS.register("scalar_for_test", layer=ScalarNorm)(lambda cfg, dim, **kw: ScalarNorm(dim))
    try:
        layer_norms = [m.normalized_shape[-1] for m in model_of(make_cfg(f"model={model}")).modules()
                       if isinstance(m, torch.nn.LayerNorm)]
        cfg = make_cfg(f"model={model}", "norm.name=scalar_for_test")
        validate(cfg)
        net = model_of(cfg)
        assert not any(isinstance(m, torch.nn.LayerNorm) for m in net.modules())
        assert sorted(m.dim for m in net.modules() if isinstance(m, ScalarNorm)) == sorted(layer_norms)
        if model == "gpt_test":
            x = torch.randint(0, 64, (2, 8))
        else:
            x = torch.randn(2, net.patch_embed.proj.in_channels, *net.patch_embed.img_size)
        net(x).float().sum().backward()
        assert all(m.g.grad is not None and torch.isfinite(m.g.grad) for m in net.modules()
                   if isinstance(m, ScalarNorm))
    finally:
        NORMS._entries.pop("scalar_for_test")


def test_a_name_near_a_registered_one_may_be_a_typo_or_ones_own():
    from tests.helpers import cli

    reg = Registry("norm")
    reg.register("stablenorm")(lambda: 1)
    with pytest.raises(UnknownOption, match=r"\(did you mean stablenorm\? If scalenorm is yours, name the module "
                                            r"that registers it in imports=\[path/to/it.py\]\)$"):
        reg.get("scalenorm")
    # a group option without a yaml: the same suggestion from the command line
    r = cli("model=vit_tset")
    assert r.stderr.strip().splitlines()[-1].endswith("vit_s_cifar, vit_test (did you mean vit_test?)"), r.stderr


def test_the_option_group_lists_agree_with_the_schema_and_the_registries():
    """cli.py's KWARGS_GROUPS and NAMED_GROUPS and build's chosen options are written by hand (the
    command-line check runs before anything registers): a group added to the schema or a registry
    must be added to each, or its kwargs go unchecked and its yaml's missing name: unrefused."""
    import dataclasses
    import typing

    from stabletrain import cli
    from stabletrain.build import _chosen_options
    from stabletrain.config import TrainConfig
    from tests.helpers import _registries

    hints = typing.get_type_hints(TrainConfig)
    with_kwargs = {g for g, t in hints.items() if dataclasses.is_dataclass(t)
                   and "kwargs" in {f.name for f in dataclasses.fields(t)}}
    assert set(cli.KWARGS_GROUPS) == with_kwargs
    chosen = _chosen_options(make_cfg())
    assert set(chosen) == with_kwargs - {"model"}
    assert all(registry.group.split(".")[0] == group for group, (registry, _) in chosen.items())
    named_by_registry = {r.group for r in _registries()} - {"model.family", "regularizer"}
    assert set(cli.NAMED_GROUPS) == {g.split(".")[0] for g in named_by_registry} == set(chosen) | {"data"}
