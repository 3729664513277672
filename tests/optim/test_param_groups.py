import pytest
import timm
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.utils import parametrize

from stabletrain.config import OptimConfig, ReparamConfig
from stabletrain.layers.deescalate import Deescalate
from stabletrain.layers.reparam import SigmaReparam
from stabletrain.layers.norm import StableNorm
from stabletrain.optim import LARS, AdamW2, build_optimizer, classify, make_param_groups


@pytest.fixture(scope="module")
def vit():
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=2)


def roles(model, family, **kw):
    return {name: role for name, _, role in classify(model, family, **kw)}


def test_vit_decay_split(vit):
    r = roles(vit, "vit")
    no_decay = {n for n, role in r.items() if not role.decay}
    decay = {n for n, role in r.items() if role.decay}
    assert {
        "pos_embed",
        "cls_token",
        "norm.weight",
        "norm.bias",
        "head.bias",
        "patch_embed.proj.bias",
        "blocks.0.norm1.weight",
        "blocks.1.norm2.bias",
        "blocks.0.attn.qkv.bias",
    } <= no_decay
    assert decay == {"patch_embed.proj.weight", "head.weight"} | {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    }


def test_vit_bound_flags(vit):
    r = roles(vit, "vit")
    bound = {n for n, role in r.items() if role.bound}
    norm_gains = {n for n in r if "norm" in n and n.endswith("weight")}
    matrices = {n for n, role in r.items() if role.decay}
    assert bound == matrices | norm_gains | {"pos_embed"}
    assert not r["cls_token"].bound and not r["blocks.0.attn.qkv.bias"].bound
    r = roles(vit, "vit", bound_norm_gains=False)
    assert not any(r[n].bound for n in norm_gains)


def test_swin_relative_position_table_not_decayed():
    swin = timm.create_model(
        "swin_tiny_patch4_window7_224",
        img_size=32,
        embed_dim=16,
        depths=(1, 1),
        num_heads=(1, 2),
        window_size=4,
        num_classes=10,
    )
    r = roles(swin, "swin")
    tables = [n for n in r if n.endswith("relative_position_bias_table")]
    assert tables and all(not r[n].decay and r[n].bound for n in tables)
    assert r["layers.0.blocks.0.attn.qkv.weight"].decay
    assert not r["layers.1.downsample.norm.weight"].decay and r["layers.1.downsample.norm.weight"].bound


class TinyGPT(nn.Module):
    def __init__(self, vocab=11, d=8, ctx=5):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.ln = nn.LayerNorm(d, bias=False)
        self.attn = nn.Linear(d, d, bias=False)
        self.snorm = StableNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        parametrize.register_parametrization(self.attn, "weight", SigmaReparam(self.attn.weight))
        self.deesc = Deescalate(learnable=True)  # a learned 0-dim scalar that is not a gamma


def test_gpt_decays_every_matrix_and_reparam_gamma_gets_its_multiplier():
    r = roles(TinyGPT(), "gpt", gamma_lr_mult=2.0)
    assert set(r) == {
        "wte.weight",
        "wpe.weight",
        "ln.weight",
        "snorm.weight",
        "attn.parametrizations.weight.original",
        "attn.parametrizations.weight.0.parts.0.gamma",
        "deesc.lambda_",
    }
    assert r["wte.weight"].decay and r["wpe.weight"].decay and r["wpe.weight"].bound
    assert r["attn.parametrizations.weight.original"].decay and r["attn.parametrizations.weight.original"].bound
    gamma = r["attn.parametrizations.weight.0.parts.0.gamma"]
    assert (gamma.kind, gamma.decay, gamma.bound, gamma.lars_exclude, gamma.lr_mult) == (
        "gamma",
        False,
        False,
        True,
        2.0,
    )
    lam = r["deesc.lambda_"]
    assert (lam.kind, lam.decay, lam.bound, lam.lr_mult) == ("vector", False, False, 1.0)
    assert r["ln.weight"].kind == r["snorm.weight"].kind == "norm_gain"
    assert not r["snorm.weight"].decay and r["snorm.weight"].bound and r["snorm.weight"].lars_exclude


def test_groups_carry_names_flags_and_lr():
    model = TinyGPT()
    cfg = OmegaConf.structured(OptimConfig(name="adamw2", lr=1e-3, weight_decay=0.1, lr_scale_by_batch=True))
    opt, summary = build_optimizer(model, cfg, "gpt", OmegaConf.structured(ReparamConfig(gamma_lr_mult=2.0)), 512)
    assert isinstance(opt, AdamW2)
    by_name = {n: g for g in opt.param_groups for n in g["names"]}
    assert by_name["attn.parametrizations.weight.0.parts.0.gamma"]["lr"] == pytest.approx(4e-3)  # 1e-3 * 512/256 * 2
    assert by_name["wte.weight"]["lr"] == pytest.approx(2e-3)
    assert by_name["wte.weight"]["weight_decay"] == 0.1 and by_name["ln.weight"]["weight_decay"] == 0.0
    assert by_name["wte.weight"]["bound"] and by_name["ln.weight"]["bound"]
    assert not by_name["attn.parametrizations.weight.0.parts.0.gamma"]["bound"]
    assert by_name["deesc.lambda_"]["lr"] == pytest.approx(2e-3)  # no gamma multiplier
    assert "7 tensors" in summary and "decay" in summary and "no-decay" in summary
    n_params = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name,kind",
    [("adamw", torch.optim.AdamW), ("adamw2", AdamW2), ("lars", LARS), ("sgd", torch.optim.SGD)],
)
def test_every_optimizer_builds_and_steps(vit, name, kind):
    cfg = OmegaConf.structured(OptimConfig(name=name))
    opt, summary = build_optimizer(vit, cfg, "vit")
    assert isinstance(opt, kind) and summary.startswith(f"optimizer {name}")
    vit.zero_grad()
    vit(torch.randn(2, 3, 32, 32)).sum().backward()
    before = vit.head.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, vit.head.weight)
    if name == "lars":
        flags = {n: g["lars_exclude"] for g in opt.param_groups for n in g["names"]}
        assert flags["cls_token"] and flags["blocks.0.norm1.weight"] and not flags["pos_embed"]


def test_plain_groups_for_adamw_have_no_adamw2_keys():
    groups = make_param_groups(TinyGPT(), "gpt", 0.1, optimizer="adamw")
    assert all("bound" not in g and "lars_exclude" not in g for g in groups)
    with pytest.raises(ValueError):
        make_param_groups(TinyGPT(), "bert", 0.1)


def test_norm_gains_are_known_by_the_registered_norm_type_not_the_class_name():
    """A new norm registered in the ``norm`` group keeps AdamW²'s bound on its gain, whatever it
    is called; a module merely named ``...Norm`` that no one registered does not."""
    from stabletrain.layers.norm import NORMS

    class Scaler(nn.Module):  # a new normalisation layer with no "Norm" in its name
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

    class FakeNorm(nn.Module):  # "Norm" in the name, but not a registered norm layer
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

    NORMS.register("scaler_for_test", layer=Scaler)(lambda cfg, dim, **kw: Scaler(dim))
    try:
        model = nn.Sequential(nn.Linear(4, 4), Scaler(4), FakeNorm(4))
        r = roles(model, "vit")
        assert r["1.weight"].kind == "norm_gain" and r["1.weight"].bound
        assert r["2.weight"].kind == "vector" and not r["2.weight"].bound
    finally:
        NORMS._entries.pop("scaler_for_test")


def test_the_group_table_says_what_bound_and_free_mean():
    from stabletrain.optim.param_groups import summarize_groups

    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    groups = [{"params": [w], "names": ["w"], "kinds": ["matrix"], "weight_decay": 0.1, "bound": True},
              {"params": [b], "names": ["b"], "kinds": ["vector"], "weight_decay": 0.0, "bound": False}]
    head, bound, free = summarize_groups(groups, "optimizer adamw2: ").splitlines()
    assert head.endswith("(bound: each update's spectral norm at most tau x sigma1(W); free: plain AdamW)")
    # a sweep over tau tells its points apart in this line
    assert summarize_groups(groups, tau=0.004).splitlines()[0].endswith("at most tau=0.004 x sigma1(W); free: plain "
                                                                         "AdamW)")
    assert bound.split()[:2] == ["decay", "bound"] and free.split()[:2] == ["no-decay", "free"]
    sgd = [{k: v for k, v in g.items() if k != "bound"} for g in groups]
    assert "bound:" not in summarize_groups(sgd).splitlines()[0]  # no AdamW², no such words


def test_a_group_decayed_on_a_schedule_from_zero_is_labelled_decay():
    from stabletrain.optim.param_groups import summarize_groups

    w = torch.nn.Parameter(torch.ones(4, 4))
    group = {"params": [w], "names": ["w"], "kinds": ["matrix"], "weight_decay": 0.0, "wd_mult": 1.0}
    assert summarize_groups([group]).splitlines()[1].split()[0] == "decay"
    assert summarize_groups([{**group, "wd_mult": 0.0}]).splitlines()[1].split()[0] == "no-decay"
