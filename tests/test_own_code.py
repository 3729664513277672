"""Code of your own: a model family or a fix written in the user's module (``imports=[...]``),
its options' yaml in a folder of theirs (``hydra.searchpath=[file://DIR]``), no edit to stabletrain."""

import json
import sys
import textwrap

import pytest
import torch

from stabletrain.build import validate
from stabletrain.errors import ConfigError
from tests.helpers import ROOT, cli, forget_own_code, make_cfg, model_of

EXAMPLE = ROOT / "examples" / "conv_stem"
OWN = [f"imports=[{EXAMPLE}/conv_stem_vit.py]", f"hydra.searchpath=[file://{EXAMPLE}/configs]"]


@pytest.fixture(autouse=True)
def own_code_is_forgotten(monkeypatch):
    yield from forget_own_code(monkeypatch)


def _module(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


# a norm with a gain of its own, g0 (its norm.kwargs)
GAIN_NORM = """
        import torch
        from stabletrain.layers.norm import NORMS

        class GainNorm(torch.nn.Module):
            def __init__(self, dim, g0):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.full((dim,), float(g0)))

            def forward(self, x):
                return self.weight * torch.nn.functional.rms_norm(x, x.shape[-1:])

        @NORMS.register("gain_own", layer=GainNorm, kwargs=("g0",))
        def gain_own(cfg, dim, **kw):
            return GainNorm(dim, cfg.kwargs.get("g0", 1.0))
"""

SCALE_NORM = """
    import torch
    from stabletrain.layers.norm import NORMS

    class ScaleNorm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    @NORMS.register("scale_own", layer=ScaleNorm)
    def scale_own(cfg, dim, **kw):
        return ScaleNorm(dim)
"""


@pytest.mark.parametrize("how", ["path", "module"])
def test_a_norm_of_your_own_is_an_option_in_every_slot(tmp_path, monkeypatch, how):
    """Imported by path or by module name (from the working directory), the module's norm is
    checked by name, built into both norms of every block, and its gain bounded by AdamW²."""
    path = _module(tmp_path, "my_norms", SCALE_NORM)
    monkeypatch.chdir(tmp_path)
    args = ["model=gpt_test", "norm.name=scale_own", "optim=adamw2",
            f"imports=[{path if how == 'path' else 'my_norms'}]"]
    cfg = make_cfg(*args)
    with pytest.raises(ConfigError, match="norm=scale_own is not an option"):
        validate(make_cfg("model=gpt_test", "norm.name=scale_own"))  # not without the import
    validate(cfg)
    net = model_of(cfg)
    norms = [m for m in net.modules() if type(m).__name__ == "ScaleNorm"]
    assert len(norms) == 2 * cfg.model.depth + 1  # norm1, norm2 of each block and the final norm
    from stabletrain.optim import build_optimizer

    opt, _ = build_optimizer(net, cfg.optim, cfg.model.family)
    bound = {id(p) for g in opt.param_groups if g["bound"] for p in g["params"]}
    assert all(id(n.weight) in bound for n in norms)
    validate(cfg)  # importing again is a no-op, not "registered twice"
    from stabletrain.build import own_groups
    from stabletrain.config import unread_keys

    mine = make_cfg(*args, "norm.eps=1e-6")  # which the user's norm may read: no "changes nothing"
    assert own_groups(mine) == {"norm": None} and unread_keys(mine, own_groups(mine)) == []
    assert unread_keys(mine) != []  # as a built-in norm that reads no eps would be told


@pytest.mark.parametrize("imports,needle", [
    ("nowhere/mine.py", "imports: nowhere/mine.py is not a file (relative paths start at"),
    ("no_such_module_here", "imports: no module named no_such_module_here on sys.path or in"),
    ("{tmp}/json.py", "has the name of the module json imported from"),
    # an absolute path: no word on relative ones, and the file one typo away is named
    ("{tmp}/jsno.py", "imports: {tmp}/jsno.py is not a file; did you mean {tmp}/json.py? give the path"),
])
def test_an_import_that_cannot_be_found_is_one_line(tmp_path, imports, needle):
    (tmp_path / "json.py").write_text("")
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=vit_test", f"imports=[{imports.format(tmp=tmp_path)}]"))
    assert needle.format(tmp=tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_a_module_that_fails_on_its_own_import_keeps_its_traceback(tmp_path):
    """A dependency the user's module lacks is the user's code's error: raised as Python raises
    it, naming the dependency, not reported as a missing ``imports`` entry."""
    path = _module(tmp_path, "needs_dep", "import a_dependency_not_installed\n")
    with pytest.raises(ModuleNotFoundError, match="a_dependency_not_installed"):
        validate(make_cfg("model=vit_test", f"imports=[{path}]"))
    assert "needs_dep" not in sys.modules  # a later fixed file can be imported again


def test_a_bug_in_an_option_of_ones_own_keeps_its_traceback_and_records_the_failure(tmp_path):
    """The user's code raising while the run is built: raised as Python raises it (the traceback
    names their line), and summary.json says failed and why, so a sweep's table shows it so."""
    from stabletrain.run import run

    path = _module(tmp_path, "buggy_norm", """
        from stabletrain.layers.norm import NORMS

        @NORMS.register("buggy_own")
        def buggy_own(cfg, dim, *, bias, ln_eps):
            return 1 / 0
    """)
    cfg = make_cfg("model=vit_test", f"imports=[{path}]", "norm.name=buggy_own", "steps=2", "logger=none")
    with pytest.raises(ZeroDivisionError):
        run(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"status": "failed", "step": 0,
                       "reason": "ZeroDivisionError while building the run: division by zero"}
    (tmp_path / "run" / "summary.json").write_text('{"status": "completed", "step": 5}')  # an earlier run's
    with pytest.raises(ZeroDivisionError):
        run(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"  # kept


def test_a_family_registered_without_its_kind_is_one_line(tmp_path):
    path = _module(tmp_path, "kindless", """
        from stabletrain.models.registry import MODELS
        from stabletrain.models.vit import build_vit

        MODELS.register("kindless_vit")(build_vit)
    """)
    with pytest.raises(ConfigError, match=r"^model.family=kindless_vit is registered without kind='vision' or "
                                          r"kind='text': add it to its @MODELS.register\(\.\.\.\)$"):
        validate(make_cfg("model=vit_test", "model.family=kindless_vit", f"imports=[{path}]"))


def test_model_kwargs_are_refused_by_stabletrains_own_families():
    with pytest.raises(ConfigError, match="model.kwargs is for a model family of your own"):
        validate(make_cfg("model=vit_test", "+model.kwargs.depth=3"))


def test_the_registered_no_decay_names_decide_weight_decay(tmp_path):
    """A family's ``no_decay`` names keep those tensors out of decay; an empty one decays every
    matrix (the GPT family: nanoGPT decays its position embedding)."""
    from stabletrain.optim import classify

    path = _module(tmp_path, "vit_decays", """
        from stabletrain.models.registry import MODELS
        from stabletrain.models.vit import build_vit

        MODELS.register("vit_all_decay", kind="vision", no_decay=())(build_vit)
    """)
    cfg = make_cfg("model=vit_test", f"imports=[{path}]")
    validate(cfg)
    net = model_of(cfg)
    own = {n: r.decay for n, _, r in classify(net, "vit_all_decay")}
    vit = {n: r.decay for n, _, r in classify(net, "vit")}
    assert vit["pos_embed"] is False and own["pos_embed"] is True
    assert {n for n in own if own[n] != vit[n]} == {"pos_embed", "cls_token"}  # (1, 1, d): decayed as a tensor
    gpt = {n: r.decay for n, _, r in classify(model_of(make_cfg("model=gpt_test")), "gpt")}
    assert gpt["wpe.weight"] is True


def test_the_conv_stem_example_is_a_vit_with_a_stem_in_place_of_the_patchify():
    """examples/conv_stem: two stride-2 3x3 convolutions (with BatchNorm and ReLU) and a 1x1 to
    the width give the patchify's 4x4 grid of tokens; every other tensor is vit_test's."""
    cfg = make_cfg(*OWN, "model=conv_vit_test")
    validate(cfg)
    net, vit = model_of(cfg), model_of(make_cfg("model=vit_test"))
    stem = net.patch_embed.proj
    convs = [m for m in stem if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.out_channels) for c in convs] == [((3, 3), (2, 2), 8), ((3, 3), (2, 2), 16),
                                                                          ((1, 1), (1, 1), 32)]
    x = torch.randn(2, 3, 16, 16)
    assert net.patch_embed(x).shape == vit.patch_embed(x).shape == (2, 16, 32)
    assert net(x).shape == (2, 1000)
    theirs = {n: p.shape for n, p in vit.named_parameters() if not n.startswith("patch_embed")}
    assert {n: p.shape for n, p in net.named_parameters() if not n.startswith("patch_embed")} == theirs
    from stabletrain.optim import classify

    roles = {n: r for n, _, r in classify(net, "conv_vit")}
    assert not roles["pos_embed"].decay and roles["patch_embed.proj.0.weight"].decay
    assert roles["patch_embed.proj.0.weight"].bound


@pytest.mark.parametrize("override,needle", [
    ("model.kwargs.stem_channels=[8]", "the list must hold 2 channel counts"),
    ("+model.kwargs.stem_channel=[8,16]", "model.kwargs.stem_channel: conv_vit takes no such argument (it takes: "
                                          "stem_channels); did you mean model.kwargs.stem_channels?"),
    ("model.patch_size=8", "must hold 3 channel counts"),
])
def test_the_example_checks_its_arguments_in_one_line(override, needle):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*OWN, "model=conv_vit_test", override))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_example_trains_from_the_command_line_with_a_fix(tmp_path):
    """The README's command, relative paths from the repository: the stem's convolutions are
    sigmaReparam'd with the rest, the run completes and its loss falls."""
    r = cli("imports=[examples/conv_stem/conv_stem_vit.py]", "hydra.searchpath=[file://examples/conv_stem/configs]",
            "model=conv_vit_test", "reparam=sigma", "steps=60", "optim.lr=3e-3", "eval_every=60", "monitor=off",
            "logger=none", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed"
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert "patch_embed.proj.0.parametrizations.weight.original" in state
    from tests.helpers import losses

    first, last = (lambda ls: (ls[min(ls)], ls[max(ls)]))(losses(tmp_path))
    assert last < first - 0.3, (first, last)


def test_the_command_line_finds_options_in_the_searchpath_folders(tmp_path):
    """A sweep point keeps the searchpath (composing it needs the user's yaml); a missing option
    or folder, and a new kwarg without its '+', are each one line naming the fix."""
    from hydra.errors import MissingConfigException

    from stabletrain.cli import _sweep_points, check_keys, compose_config, explain, group_options

    ovs = [f"hydra.searchpath=[file://{EXAMPLE}/configs]", "model=conv_vit_test", "optim.lr=1,2"]
    assert all(ovs[0] in p for p in _sweep_points(ovs))
    assert {"conv_vit_test", "conv_vit_mini", "vit_test"} <= set(group_options("model", ovs))
    with pytest.raises(ConfigError, match=r"hydra.searchpath: .*nowhere is not a folder"):
        check_keys([f"hydra.searchpath=[file://{tmp_path}/nowhere]"])
    bad = [OWN[0], "model=conv_vit_test"]  # imports, but the yaml's folder not on the searchpath
    with pytest.raises(MissingConfigException) as e:
        compose_config(bad)
    assert explain(e.value, bad).endswith("(an option of your own: DIR/model/conv_vit_test.yaml and "
                                          "hydra.searchpath=[file://DIR])")
    kw = [*OWN, "model=conv_vit_test", "model.kwargs.extra=1"]
    with pytest.raises(Exception) as e:
        compose_config(kw)
    # the family declares its arguments: the '+' would only meet its refusal
    assert explain(e.value, kw) == "model.kwargs.extra: conv_vit takes no such argument (it takes: stem_channels)"
    typo = [*OWN, "model=conv_vit_test", "model.kwargs.stem_chanels=8"]  # a misspelling is not a new argument
    with pytest.raises(Exception) as e:
        compose_config(typo)
    assert explain(e.value, typo) == "unknown key 'model.kwargs.stem_chanels': did you mean model.kwargs.stem_channels?"
    elsewhere = [f"hydra.searchpath=[file://{EXAMPLE}/configs/model]", "model=conv_vit_test"]  # the group's folder
    with pytest.raises(MissingConfigException) as e:
        compose_config(elsewhere)
    assert explain(e.value, elsewhere).endswith(f"(looked in {EXAMPLE}/configs/model too: an option of your own is "
                                                f"DIR/model/conv_vit_test.yaml, DIR being a searchpath folder)")


def test_a_yaml_of_your_own_with_a_wrong_key_is_one_whole_line(tmp_path):
    """Hydra's message stops at 'ConfigKeyError raised while composing config:'; the line names
    the file, the key and the nearest key of the schema."""
    from stabletrain.cli import compose_config, explain

    (tmp_path / "norm").mkdir()
    (tmp_path / "norm" / "mine.yaml").write_text("name: layernorm\nalhpa: 0.3\n")
    ovs = [f"hydra.searchpath=[file://{tmp_path}]", "norm=mine"]
    with pytest.raises(Exception) as e:
        compose_config(ovs)
    assert explain(e.value, ovs) == "norm/mine.yaml sets unknown key 'norm.alhpa': did you mean norm.alpha?"


@pytest.mark.parametrize("group,body,line", [
    ("monitor", "name: gradnoise\n", "monitor/mine.yaml: monitor.name=gradnoise is not one of: standard, full, off"),
    ("norm", "name: layernorm\nplacement: middle\n", "norm/mine.yaml: norm.placement=middle is not one of: pre, post"),
    ("optim", "name: adamw\nlr: fast\n", "optim/mine.yaml: optim.lr=fast must be a number, e.g. optim.lr=0.001"),
])
def test_a_yaml_of_your_own_with_a_wrong_value_says_which(tmp_path, group, body, line):
    """Hydra's message stopped at 'ValidationError raised while composing config:', the reason
    (the value and what it may be) on the next line, which was dropped."""
    from stabletrain.cli import compose_config, explain

    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(body)
    ovs = [f"hydra.searchpath=[file://{tmp_path}]", f"{group}=mine"]
    with pytest.raises(Exception) as e:
        compose_config(ovs)
    assert explain(e.value, ovs) == line


MLP = """
    from torch import nn
    from stabletrain.models.registry import MODELS

    @MODELS.register("mlp_own", kind="vision")
    def build_mlp(m, components):  # uses none of the components
        return nn.Sequential(nn.Flatten(), nn.Linear(m.in_chans * m.img_size ** 2, m.embed_dim), nn.GELU(),
                             nn.Linear(m.embed_dim, m.num_classes))
"""
TIMM_VIT = """
    import timm
    from stabletrain.models.registry import MODELS

    @MODELS.register("timm_vit_own", kind="vision")
    def build(m, components):  # timm's own blocks and attention
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=m.img_size,
                                 patch_size=m.patch_size, num_classes=m.num_classes, in_chans=m.in_chans,
                                 depth=m.depth, embed_dim=m.embed_dim, num_heads=m.num_heads)
"""


MHA_OWN = """
    import torch
    from torch import nn
    from stabletrain.models.registry import MODELS

    class Net(nn.Module):  # torch's nn.MultiheadAttention: no fused qkv nn.Linear, no num_heads
        def __init__(self, m):
            super().__init__()
            self.embed = nn.Linear(m.in_chans * m.patch_size ** 2, m.embed_dim)
            self.p = m.patch_size
            self.mha = nn.MultiheadAttention(m.embed_dim, m.num_heads, batch_first=True)
            self.head = nn.Linear(m.embed_dim, m.num_classes)

        def forward(self, x):
            x = self.embed(nn.functional.unfold(x, self.p, stride=self.p).transpose(1, 2))
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))

    @MODELS.register("mha_own", kind="vision")
    def build(m, components):
        return Net(m)
"""


@pytest.mark.parametrize("name,body,overrides,notes", [
    ("mha_own", MHA_OWN, ["deescalate=block", "reparam=sigma_qk", "regularizer=locater"], [
        "deescalate=block changes nothing: model.family=mha_own built no de-escalation",
        "reparam=sigma_qk changes nothing: model.family=mha_own has no attention with a fused qkv nn.Linear and "
        "num_heads (as timm's and stabletrain's have), whose query/key rows it normalises",
        "regularizer=locater adds 0: model.family=mha_own has no attention with a fused qkv nn.Linear"]),
    ("mha_own", MHA_OWN, ["reparam=sigma"], [
        "reparam=sigma leaves nn.MultiheadAttention's in_proj_weight (its W_q, W_k, W_v) raw"]),
    # names of their own: a module name is imported once per process (another test imports mlp_own)
    ("mlp_fixes", MLP.replace("mlp_own", "mlp_fixes"), ["deescalate=ffn", "reparam=sigma"],
     ["deescalate=ffn changes nothing"]),
    ("timm_fixes", TIMM_VIT.replace("timm_vit_own", "timm_fixes"), ["reparam=sigma_qk", "regularizer=locater"],
     []),  # timm's qkv + num_heads: found
    ("timm_alerts", TIMM_VIT.replace("timm_vit_own", "timm_alerts"), ["monitor.stop_on_alert=true"],
     ["monitor.stop_on_alert=true can never act: a health alert needs attention entropy, which the probe pass "
      "reads from stabletrain's attention only, and this model has none"]),
])
@pytest.mark.filterwarnings("ignore::stabletrain.errors.ReachedNothing")  # the library's line; train.py's run drops it
def test_a_fix_a_model_of_ones_own_cannot_take_is_said_at_the_start(tmp_path, name, body, overrides, notes):
    """De-escalation, sigmaReparam's q/k and LocAteR find their layers by shape: a model without
    them trained as if they were on, silently (LocAteR's penalty read 0)."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, name, body)
    cfg = make_cfg("model=vit_test", f"model.family={name}", f"imports=[{path}]", "logger=none", *overrides)
    said = "\n".join(build_trainer(cfg, tmp_path / "run").notes)
    for note in notes:
        assert note in said, said
    for fix in ("deescalate=", "reparam=", "regularizer="):
        assert sum(line.count(fix) for line in said.splitlines() if "changes nothing" in line or "adds 0" in line
                   or "raw:" in line) == sum(note.startswith(fix) for note in notes), said


@pytest.mark.parametrize("name,body,family,coverage", [
    ("mlp_own", MLP, "mlp_own", "monitor: the model has no transformer blocks (modules with norm1, attn and mlp), "
                                "so only its output's logits/log_z is monitored"),
    ("timm_vit_own", TIMM_VIT, "timm_vit_own", "monitor: 2 of 2 blocks have an attention that is not stabletrain's "
                                               "(stabletrain/layers/attention.py): the probe pass (attention entropy, "
                                               "token similarity, the alerts) skips them; the weight pass (sigma1, "
                                               "SEC) reads them"),
])
def test_a_model_of_other_blocks_trains_and_is_told_what_it_does_not_get(tmp_path, name, body, family, coverage):
    """A builder that ignores ``components``: the run says the chosen norm and attention change
    nothing and what the monitors cannot read, trains, and its probe pass logs the output's log Z."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, name, body)
    cfg = make_cfg("model=vit_test", f"model.family={family}", f"imports=[{path}]", "norm=stablenorm",
                   "attention=qknorm", "monitor=full", "monitor.probe_every=2", "steps=4", "logger=none",
                   "eval_every=4")
    validate(cfg)
    trainer = build_trainer(cfg, tmp_path / "run")
    assert f"norm=stablenorm changes nothing: model.family={family} built no StableNorm" in "\n".join(trainer.notes)
    assert f"attention=qknorm changes nothing: model.family={family}" in "\n".join(trainer.notes)
    decays = {n: g["weight_decay"] > 0 for g in trainer.optimizer.param_groups for n in g["names"]}
    if name == "timm_vit_own":  # no no_decay registered: timm's own no_weight_decay() is read
        assert not decays["pos_embed"] and not decays["cls_token"] and decays["blocks.0.attn.qkv.weight"]
    assert any(n.startswith(coverage) for n in trainer.notes)
    assert trainer.monitor.reads() == (("weight", "log_z") if name == "timm_vit_own" else ("log_z",))
    summary = trainer.fit()
    assert summary["status"] == "completed"
    from stabletrain.metrics import read_records

    records = read_records(tmp_path / "run" / "metrics.jsonl")
    probes = [r for r in records if "logits/log_z" in r]
    assert [r["step"] for r in probes] == [0, 2, 4]  # the initial snapshot, then every probe_every
    assert all(torch.isfinite(torch.tensor(r["logits/log_z"])) for r in probes)
    if name == "timm_vit_own":  # timm's blocks are read by the weight pass: their sigma1, against an exact SVD
        qkv = trainer.model.blocks[1].attn.qkv.weight.detach()
        wq = qkv.chunk(3, 0)[0]
        logged = [r for r in records if "sigma1/blocks.1/wq" in r][-1]["sigma1/blocks.1/wq"]
        assert logged == pytest.approx(float(torch.linalg.matrix_norm(wq, 2)), rel=1e-3)
    else:
        assert not any(k.startswith("sigma1/") for r in records for k in r)


def test_stabletrains_own_families_get_no_such_note():
    from stabletrain.build import unbuilt_components

    cfg = make_cfg("model=vit_test", "norm=stablenorm", "attention=qknorm")
    assert unbuilt_components(model_of(cfg), cfg) == []


def test_a_loss_term_of_your_own_is_a_regularizer_option(tmp_path):
    """A term registered in the user's module, its yaml in their searchpath folder: chosen with
    ``regularizer=...``, its parameter checked in one line, its value the formula's, logged."""
    path = _module(tmp_path, "logit_l2", """
        from dataclasses import dataclass

        from stabletrain.errors import ConfigError
        from stabletrain.losses import LOSS_TERMS

        @dataclass
        class LogitL2Params:
            coef: float = 1e-3

            def __post_init__(self):
                if not self.coef >= 0:
                    raise ConfigError(f"regularizer.logit_l2.coef={self.coef} must be >= 0")

        @LOSS_TERMS.register("logit_l2", params=LogitL2Params)
        class LogitL2:
            def __init__(self, p):
                self.coef = p.coef

            def __call__(self, model, logits, x, y):
                return self.coef * logits.float().pow(2).mean()
    """)
    (tmp_path / "configs" / "regularizer").mkdir(parents=True)
    (tmp_path / "configs" / "regularizer" / "logit_l2.yaml").write_text("logit_l2:\n  coef: 0.01\n")
    own = [f"imports=[{path}]", f"hydra.searchpath=[file://{tmp_path}/configs]", "model=gpt_test"]
    with pytest.raises(ConfigError, match=r"^regularizer.logit_l2.coef=-1.0 must be >= 0$"):
        validate(make_cfg(*own, "regularizer=logit_l2", "regularizer.logit_l2.coef=-1"))
    from stabletrain.cli import compose_config, explain

    typo = [*own, "regularizer=logit_l2", "regularizer.logit_l2.cof=1"]
    with pytest.raises(Exception) as e:
        compose_config(typo)
    assert explain(e.value, typo) == "unknown key 'regularizer.logit_l2.cof': did you mean regularizer.logit_l2.coef?"
    cfg = make_cfg(*own, "regularizer=[logit_l2,zloss]", "steps=2", "logger=none", "monitor=off", "eval_every=2")
    validate(cfg)
    from stabletrain.build import build_trainer
    from stabletrain.losses import build_loss_terms

    terms = {t.name: t for t in build_loss_terms(cfg.regularizer)}
    logits = torch.randn(2, 5, 7)
    assert torch.allclose(terms["logit_l2"](None, logits, None, None), 0.01 * (logits ** 2).mean())
    trainer = build_trainer(cfg, tmp_path / "run")
    assert trainer.fit()["status"] == "completed"
    from stabletrain.metrics import read_records

    last = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "loss/logit_l2" in r][-1]
    assert last["loss/logit_l2"] > 0 and last["loss/zloss"] > 0


def test_options_of_your_own_take_arguments_in_their_groups_kwargs(tmp_path, monkeypatch):
    """A norm, an init and a schedule of the user's own read ``<group>.kwargs`` (added with a '+',
    as ``model.kwargs``); stabletrain's own options refuse it in one line."""
    path = _module(tmp_path, "my_options", GAIN_NORM + """
        from stabletrain.layers.init import INITS
        from stabletrain.optim.schedule import SCHEDULES

        @INITS.register("const_own")
        def const_own(w, gain=1.0, value=0.0):
            return torch.nn.init.constant_(w, value)

        @SCHEDULES.register("halving_own")
        def halving_own(s, step):
            return s.base_lr * 0.5 ** (step // s.kwargs["every"])
    """)
    own = [f"imports=[{path}]", "model=gpt_test", "norm.name=gain_own", "init.name=const_own",
           "schedule.name=halving_own", "+norm.kwargs.g0=2.5", "+init.kwargs.value=0.125", "+schedule.kwargs.every=10"]
    cfg = make_cfg(*own)
    validate(cfg)
    net = model_of(cfg)
    gains = [m.weight for m in net.modules() if type(m).__name__ == "GainNorm"]
    assert gains and all(torch.all(g == 2.5) for g in gains)
    assert torch.all(net.blocks[0].attn.qkv.weight == 0.125) and torch.all(net.blocks[0].mlp.fc1.weight == 0.125)
    from stabletrain.optim.schedule import make_schedule

    s = make_schedule(cfg.schedule, 1.0, 100)
    assert [s(k) for k in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    assert s.describe() == "schedule: lr 1, schedule=halving_own (every=10)"  # its arguments on the start line
    from stabletrain.build import components_line

    # the start line says the options took, with their own arguments
    assert components_line(cfg) == ("components: norm=gain_own (g0=2.5), attention=softmax, init=const_own "
                                    "(value=0.125), reparam=none, deescalate=none; loss terms: none")
    # a preset shows as the option typed, a StableNorm with its alpha, post-norm said
    cfg = make_cfg("model=gpt_test", "reparam=sigma_qk", "deescalate=ffn", "norm=stablenorm", "norm.placement=post",
                   "regularizer=[locater,zloss]")
    assert components_line(cfg) == ("components: norm=stablenorm (alpha=0.25, post-norm), attention=softmax, "
                                    "init=family, reparam=sigma_qk, deescalate=ffn; loss terms: locater "
                                    "(scale_coef=100, mean_coef=1), zloss (coef=0.0001)")
    with pytest.raises(ConfigError, match=r"^norm.kwargs is for a norm option of your own \(imports=...\); "
                                          r"norm=layernorm takes its settings as norm.\* keys"):
        validate(make_cfg("model=gpt_test", "+norm.kwargs.g0=2.5"))
    from stabletrain.cli import check_keys

    check_keys(["+norm.kwargs.g0=2.5", "+schedule.kwargs.every=10"])  # no "adds a key nothing reads"
    with pytest.raises(ConfigError, match=r"did you mean \+norm.kwargs.g0\?"):
        check_keys(["+norm.kwarg.g0=2.5"])
    # a misspelt argument is refused before anything is built: the norm declares its names
    # (kwargs=), an init's are its signature's
    bad = [o.replace("norm.kwargs.g0", "norm.kwargs.g00") for o in own]
    with pytest.raises(ConfigError, match=r"^norm.kwargs.g00: gain_own takes no such argument \(it takes: g0\); "
                                          r"did you mean norm.kwargs.g0\?$"):
        validate(make_cfg(*bad))
    bad = [o.replace("init.kwargs.value", "init.kwargs.valeu") for o in own]
    with pytest.raises(ConfigError, match=r"^init.kwargs.valeu: const_own takes no such argument \(it takes: "
                                          r"value\); did you mean init.kwargs.value\?$"):
        validate(make_cfg(*bad))
    validate(make_cfg(*own, "+schedule.kwargs.anything=1"))  # undeclared: the schedule reads what it likes


def test_a_sweep_over_ones_own_norm_and_a_builtin_may_share_its_arguments(tmp_path):
    """``-m norm=layernorm,gain_own ++norm.kwargs.g0=2.5``: the argument is for one point's norm;
    the other notes it (a single run is refused: above), and its start line shows no argument."""
    path = _module(tmp_path, "gain_norm", GAIN_NORM)
    (tmp_path / "configs/norm").mkdir(parents=True)
    (tmp_path / "configs/norm/gain_own.yaml").write_text("name: gain_own\nkwargs:\n  g0: 1.0\n")
    common = [f"imports=[{path}]", f"hydra.searchpath=[file://{tmp_path / 'configs'}]", "model=gpt_test", "steps=1",
              "logger=none", "monitor=off"]
    r = cli(*common, "-m", "norm=layernorm,gain_own", "norm.kwargs.g0=2.5", f"hydra.sweep.dir={tmp_path / 's'}")
    assert r.returncode == 2 and ("add it with a '+', +norm.kwargs.g0=VALUE ('++norm.kwargs.g0=VALUE' where the yaml "
                                  "of some swept options sets it and others' not)") in r.stderr, r.stderr[-2000:]
    # -m after an override, as typed: Hydra's argparse would stop at it
    r = cli(*common, "-m", "norm=layernorm,gain_own", "++norm.kwargs.g0=2.5", f"hydra.sweep.dir={tmp_path / 's'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads((tmp_path / f"s/{i}/summary.json").read_text())["status"] for i in (0, 1)] == ["completed"] * 2
    assert ("note: norm.kwargs.g0=2.5 changes nothing: norm=layernorm is stabletrain's own and reads no norm.kwargs"
            in r.stderr)
    assert "components: norm=layernorm, " in r.stderr and "components: norm=gain_own (g0=2.5), " in r.stderr
    # '+' where the option's yaml has the key already: what to write instead, not Hydra's "Could not append"
    r = cli(*common, "norm=gain_own", "+norm.kwargs.g0=2.5", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: +norm.kwargs.g0 adds a key that is there already (set by its option's yaml): drop the '+' to set it, "
        "or write '++norm.kwargs.g0=...', which sets it either way"), r.stderr[-2000:]


def test_an_optimizer_of_ones_own_shows_its_arguments_on_its_start_line(tmp_path):
    from stabletrain.optim import build_optimizer

    path = _module(tmp_path, "my_sgd", """
        import torch
        from stabletrain.optim import OPTIMIZERS

        @OPTIMIZERS.register("sgd_own", kwargs=("dampening",))
        def sgd_own(groups, cfg, lr):
            return torch.optim.SGD(groups, lr=lr, dampening=cfg.kwargs["dampening"])
    """)
    cfg = make_cfg("model=gpt_test", f"imports=[{path}]", "optim.name=sgd_own", "+optim.kwargs.dampening=0.5")
    validate(cfg)
    opt, summary = build_optimizer(model_of(cfg), cfg.optim, cfg.model.family)
    assert summary.startswith("optimizer sgd_own (dampening=0.5) lr 0.001: ") and opt.defaults["dampening"] == 0.5


def test_a_norm_registered_without_its_layer_is_noted(tmp_path):
    from stabletrain.build import norm_without_layer_note

    path = _module(tmp_path, "layerless", """
        import torch
        from stabletrain.layers.norm import NORMS

        @NORMS.register("layerless_own")
        def layerless_own(cfg, dim, **kw):
            return torch.nn.modules.normalization.LayerNorm(dim)
    """)
    cfg = make_cfg("model=gpt_test", f"imports=[{path}]", "norm.name=layerless_own")
    validate(cfg)
    assert norm_without_layer_note(cfg).startswith("note: norm=layerless_own is registered without layer=: ")
    assert norm_without_layer_note(make_cfg("model=gpt_test", "norm=stablenorm")) is None


@pytest.mark.parametrize("group,body,needle", [
    ("model", """
        from stabletrain.models.gpt import GPT
        from stabletrain.models.registry import MODELS

        @MODELS.register("gpt_tuple_own", kind="text", data="pytext")
        def gpt_tuple_own(model_cfg, components):
            return GPT(model_cfg, components), {"note": "extra"}
     """, r"^model.family=gpt_tuple_own: [\w.]+\.gpt_tuple_own returned a tuple \(GPT, dict\); "
          r"a model.family option returns the model, an nn.Module$"),
    ("norm", """
        import torch
        from stabletrain.layers.norm import NORMS

        @NORMS.register("class_own", layer=torch.nn.LayerNorm)
        def class_own(cfg, dim, **kw):
            return torch.nn.LayerNorm
     """, r"^norm=class_own: [\w.]+\.class_own returned the class LayerNorm, not an instance of it; a norm option "
          r"returns the norm module \(an nn.Module instance\) of width dim$"),
    ("attention", """
        from stabletrain.layers.attention import ATTENTIONS

        @ATTENTIONS.register("none_own")
        def none_own(attn_cfg, norm_cfg, head_dim, seq_len):
            pass
     """, r"^attention=none_own: [\w.]+\.none_own returned None \(a missing return\?\); an attention option returns "
          r"\(q_norm, k_norm, scale\)"),
    ("optim", """
        import torch
        from stabletrain.optim import OPTIMIZERS

        @OPTIMIZERS.register("sgd_class_own")
        def sgd_class_own(groups, cfg, lr):
            return torch.optim.SGD
     """, r"^optim=sgd_class_own: [\w.]+\.sgd_class_own returned the class SGD, not an instance of it; an optim "
          r"option returns a torch.optim.Optimizer$"),
])
def test_an_option_of_ones_own_that_returns_the_wrong_thing_is_one_line(tmp_path, group, body, needle):
    """A builder that forgot its return, returned the class or a tuple: an AttributeError deep in
    the build ('tuple' object has no attribute 'to') became one line naming the function and
    what its group returns."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, f"{group}_own_returns", body)
    name = {"model": "model.family=gpt_tuple_own", "norm": "norm.name=class_own",
            "attention": "attention.name=none_own", "optim": "optim.name=sgd_class_own"}[group]
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", name, "steps=1")
    with pytest.raises(ConfigError, match=needle):
        build_trainer(cfg, tmp_path / "run")


CLASS_DATA = """
    from stabletrain.data import DATASETS, Data

    @DATASETS.register("class_data_own", kind="text")
    def class_data_own(d, m, seed):
        return Data
"""
CLASS_DATA_LINE = (r"^data=class_data_own: [\w.]+\.class_data_own returned the class Data, not an instance of it; "
                   r"a data option returns a stabletrain.data.Data$")


def test_a_training_run_with_a_data_set_that_returns_the_class_is_one_line(tmp_path):
    """A data set of one's own that returns the class Data, not an instance of it: the trainer
    builds its data with data_from_config, which met "type object 'Data' has no attribute 'extra'"
    instead of the one line."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, "class_data_run", CLASS_DATA)
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "data.name=class_data_own", "steps=1")
    validate(cfg)
    with pytest.raises(ConfigError, match=CLASS_DATA_LINE):
        build_trainer(cfg, tmp_path / "run")


def test_a_reparam_of_ones_own_that_returns_no_hook_is_one_line(tmp_path):
    """reparam= is checked as the other groups are: a reparametrisation returning a dict (or the
    model), not its step hook or None, was met only after the first optimizer step."""
    path = _module(tmp_path, "dict_reparam", """
        from stabletrain.layers.reparam import REPARAMS

        @REPARAMS.register("dict_own")
        def dict_own(model, cfg):
            return {"hook": None}

        @REPARAMS.register("model_own")
        def model_own(model, cfg):  # callable, but the first step would call the model with no input
            return model
    """)
    for name, got in (("dict_own", "a dict"), ("model_own", "a GPT")):
        cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", f"reparam.name={name}")
        validate(cfg)
        with pytest.raises(ConfigError, match=rf"^reparam={name}: [\w.]+\.{name} returned {got}; a reparam option "
                                              r"returns the hook to run after each optimizer step \(a function, "
                                              r"not the model or a class\), or None$"):
            model_of(cfg)


@pytest.mark.parametrize("model,body,needle", [
    ("model=vit_test", """
        from torch import nn
        from stabletrain.models.registry import MODELS

        @MODELS.register("narrow_own", kind="vision")
        def narrow_own(m, components):  # a head of 5 classes whatever model.num_classes says
            return nn.Sequential(nn.Flatten(), nn.Linear(m.in_chans * m.img_size ** 2, 5))
     """, r"^the model's output has shape \(4, 5\) for an input of \(4, 1, \d+, \d+\); the loss needs "
          r"\(batch, 10\): build its head with model.num_classes, which the data sets \(10 classes\)$"),
    ("model=gpt_test", """
        from torch import nn
        from stabletrain.models.registry import MODELS

        @MODELS.register("narrow_own", kind="text", data="pytext")
        def narrow_own(m, components):  # 100 logits for a vocabulary of model.vocab_size
            return nn.Sequential(nn.Embedding(m.vocab_size, 8), nn.Linear(8, 100))
     """, r"^the model's output has shape \(4, \d+, 100\) .* the loss needs \(batch, sequence, at least \d+\): "
          r"build its output layer with model.vocab_size"),
    ("model=vit_test", """
        from torch import nn
        from stabletrain.models.registry import MODELS

        class Pair(nn.Module):
            def __init__(self, m):
                super().__init__()
                self.head = nn.Sequential(nn.Flatten(), nn.Linear(m.in_chans * m.img_size ** 2, m.num_classes))

            def forward(self, x):
                return self.head(x), x.mean()  # logits and an auxiliary value

        @MODELS.register("narrow_own", kind="vision")
        def narrow_own(m, components):
            return Pair(m)
     """, r"^the model returned a tuple, not a tensor of logits: the loss needs its forward to return the logits "
          r"alone$"),
])
def test_a_model_whose_output_does_not_fit_the_data_is_one_line(tmp_path, model, body, needle):
    """A head that ignores model.num_classes: an IndexError inside the loss on a CPU (a
    device-side assert on a GPU) became one line at the first step."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, "narrow_own", body)
    cfg = make_cfg(f"imports=[{path}]", model, "model.family=narrow_own", "steps=1", "batch_size=4",
                   "monitor=off", "logger=none", "optim=adamw")
    trainer = build_trainer(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=needle):
        trainer.fit()


OWN_VISION = """
    from torch import nn
    from stabletrain.models.registry import MODELS

    class OneRow(nn.Module):  # one row of logits for the whole batch
        def __init__(self, m):
            super().__init__()
            self.head = nn.Linear(m.in_chans * m.img_size ** 2, m.num_classes)

        def forward(self, x):
            return self.head(x.flatten(1)).mean(0, keepdim=True)

    @MODELS.register("{name}", kind="vision")
    def build(m, components):
        return OneRow(m)
"""
OWN_TEXT = """
    from torch import nn
    from stabletrain.models.registry import MODELS

    class Lm(nn.Module):
        def __init__(self, m, extra, drop):
            super().__init__()
            self.emb, self.out, self.drop = nn.Embedding(m.vocab_size, 8), nn.Linear(8, m.vocab_size + extra), drop

        def forward(self, x):
            logits = self.out(self.emb(x))
            return logits[:, :-1] if self.drop else logits

    @MODELS.register("{name}", kind="text", data="pytext")
    def build(m, components):
        return Lm(m, {extra}, {drop})
"""


def _own_trainer(tmp_path, name: str, body: str, model: str):
    """The trainer of a one-step run of the model family ``name`` that ``body`` registers."""
    from stabletrain.build import build_trainer

    path = _module(tmp_path, name, body)
    cfg = make_cfg(f"imports=[{path}]", model, f"model.family={name}", "steps=1", "batch_size=4", "monitor=off",
                   "logger=none", "optim=adamw")
    return build_trainer(cfg, tmp_path / "run")


@pytest.mark.parametrize("name, body, model, needle", [
    ("one_row_own", OWN_VISION, "model=vit_test", r"output has shape \(1, 10\) for an input of \(4, "),
    ("short_own", OWN_TEXT.replace("{extra}", "0").replace("{drop}", "True"), "model=gpt_test",
     r"output has shape \(4, \d+, \d+\) .* the loss needs \(batch, sequence, at least \d+\)"),
], ids=["vision_batch", "text_sequence"])
def test_logits_for_another_batch_or_sequence_are_one_line(tmp_path, name, body, model, needle):
    """The right number of classes is not enough: logits of another batch size (a head that pools
    over the batch) or a shorter sequence fail the first step's check, not the loss."""
    trainer = _own_trainer(tmp_path, name, body.replace("{name}", name), model)
    with pytest.raises(ConfigError, match=needle):
        trainer.fit()


def test_a_language_model_with_a_padded_vocabulary_trains(tmp_path):
    """Logits over more ids than the data has (a vocabulary padded to a multiple of 64, as GPT-2's
    50304): "at least" model.vocab_size, as the check says."""
    body = OWN_TEXT.replace("{name}", "padded_own").replace("{extra}", "64").replace("{drop}", "False")
    s = _own_trainer(tmp_path, "padded_own", body, "model=gpt_test").fit()
    assert s["status"] == "completed"


def test_an_init_of_ones_own_that_returns_a_new_tensor_is_applied(tmp_path):
    """``return xavier_normal_(w) * scale`` wrote the Xavier draw and dropped the scale: runs at
    every scale were the same run, while the start line named the scale. The returned tensor is
    copied in; one of another shape is one line."""
    path = _module(tmp_path, "scaled_init", """
        import torch
        from stabletrain.layers.init import INITS

        @INITS.register("scaled_own")
        def scaled_own(w, gain=1.0, scale=1.0):
            return torch.ones_like(w) * scale

        @INITS.register("flat_own")
        def flat_own(w, gain=1.0):
            return torch.ones(w.numel())
    """)
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "init.name=scaled_own", "+init.kwargs.scale=0.01")
    validate(cfg)
    net = model_of(cfg)
    assert torch.all(net.blocks[0].attn.qkv.weight == 0.01) and torch.all(net.blocks[0].mlp.fc2.weight == 0.01)
    with pytest.raises(ConfigError, match=r"^init=flat_own returned a tensor of shape \(\d+,\) for a weight of shape "
                                          r"\(\d+, \d+\): an init writes the weight it is given in place, or returns"):
        model_of(make_cfg(f"imports=[{path}]", "model=gpt_test", "init.name=flat_own"))  # imported above


def test_an_init_of_ones_own_that_writes_in_place_and_returns_nothing_is_applied(tmp_path):
    """An init writes the weight it is given in place (INITS' documented form): one without a
    ``return`` is that form, not a wrong return, and its values are the model's."""
    path = _module(tmp_path, "inplace_init", """
        from stabletrain.layers.init import INITS

        @INITS.register("inplace_own")
        def inplace_own(w, gain=1.0):
            w.fill_(0.25)
    """)
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "init.name=inplace_own")
    validate(cfg)
    net = model_of(cfg)
    assert torch.all(net.blocks[0].attn.qkv.weight == 0.25) and torch.all(net.blocks[0].mlp.fc2.weight == 0.25)


def test_an_argument_without_its_plus_that_the_option_would_refuse_says_so_at_once(tmp_path):
    """norm.kwargs.g1=2 (no '+') was told to add a '+', and +norm.kwargs.g1=2 then met 'gain_own
    takes no such argument': the refusal comes first. A declared argument keeps the '+' hint."""
    from stabletrain.cli import compose_config, explain

    path = _module(tmp_path, "gain_norm_plus", GAIN_NORM)

    def said(*ovs):
        ovs = [f"imports=[{path}]", "model=gpt_test", *ovs]
        with pytest.raises(Exception) as e:
            compose_config(ovs)
        return explain(e.value, ovs)

    assert said("norm.name=gain_own", "norm.kwargs.g1=2") == ("norm.kwargs.g1: gain_own takes no such argument "
                                                              "(it takes: g0)")
    assert said("norm.name=gain_own", "norm.kwargs.g0=2") == ("norm.kwargs.g0 is a new argument in norm.kwargs: add "
                                                              "it with a '+', +norm.kwargs.g0=VALUE")
    # stabletrain's own norm takes none, but in a sweep over norm= its other points may: the '+' stands
    assert said("norm.kwargs.g0=2") == "norm.kwargs.g0 is a new argument in norm.kwargs: add it with a '+', " \
                                       "+norm.kwargs.g0=VALUE"


def test_an_option_of_ones_own_that_declares_its_keys_has_the_others_noted_and_unswept(tmp_path, capsys):
    """norm=scale_own norm.alpha=0.1,0.4 launched two identical points: an option of one's own may
    read any key of its group. One that declares them (register(keys=...)) gets the notes and the
    sweep check stabletrain's own options get."""
    from stabletrain.cli import check_overrides
    from stabletrain.config import unread_keys
    from stabletrain.build import own_groups

    path = _module(tmp_path, "scale_norm_keys", SCALE_NORM.replace('@NORMS.register("scale_own", layer=ScaleNorm)',
                                                                   '@NORMS.register("scale_own", layer=ScaleNorm, '
                                                                   'keys=("eps",))'))
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "norm.name=scale_own", "norm.alpha=0.4", "norm.eps=1e-3")
    validate(cfg)
    assert own_groups(cfg) == {"norm": ("eps",)}
    notes = unread_keys(cfg, own_groups(cfg))
    assert "note: norm.alpha=0.4 changes nothing: norm=scale_own is your own and reads only norm.eps (its " \
           "register(keys=...))" in notes
    assert not any(n.startswith("note: norm.eps") for n in notes)
    with pytest.raises(SystemExit):
        check_overrides(["-m", f"imports=[{path}]", "model=gpt_test", "norm.name=scale_own", "norm.alpha=0.1,0.4"])
    assert "norm.alpha=0.1,0.4 is swept, but no point of the sweep reads it: norm=scale_own is your own and reads " \
           "only norm.eps" in capsys.readouterr().err
    undeclared = _module(tmp_path, "scale_norm_any", SCALE_NORM.replace("scale_own", "scale_any"))
    cfg = make_cfg(f"imports=[{undeclared}]", "model=gpt_test", "norm.name=scale_any", "norm.alpha=0.4")
    validate(cfg)
    assert own_groups(cfg) == {"norm": None} and not unread_keys(cfg, own_groups(cfg))


def test_an_own_options_kwargs_are_no_unread_key_when_it_declares_its_keys(tmp_path):
    """register(keys=...) names the keys of the group the option reads besides its own arguments:
    its kwargs (declared with kwargs=) are read, and not noted as changing nothing."""
    from stabletrain.build import own_groups
    from stabletrain.config import unread_keys

    path = _module(tmp_path, "gain_keys_norm", GAIN_NORM.replace(
        '@NORMS.register("gain_own", layer=GainNorm, kwargs=("g0",))',
        '@NORMS.register("gain_keys_own", layer=GainNorm, kwargs=("g0",), keys=("eps",))').replace(
        "def gain_own(", "def gain_keys_own("))
    cfg = make_cfg(f"imports=[{path}]", "model=gpt_test", "norm.name=gain_keys_own", "+norm.kwargs.g0=2")
    validate(cfg)
    assert own_groups(cfg) == {"norm": ("eps",)}
    assert unread_keys(cfg, own_groups(cfg)) == []


@pytest.mark.parametrize("swept", [["norm.placement=pre,post"], ["attention=stable", "norm.alpha=0.1,0.4"]])
def test_a_key_of_a_declared_group_read_elsewhere_may_be_swept(tmp_path, swept):
    """A norm of one's own that declares keys=("eps",): norm.placement is still read by the model
    (pre/post), norm.alpha by attention=stable; a sweep over either launches different runs."""
    from stabletrain.cli import check_overrides

    path = _module(tmp_path, "eps_norm", """
        import torch
        from stabletrain.layers.norm import NORMS

        @NORMS.register("eps_own", layer=torch.nn.LayerNorm, keys=("eps",))
        def eps_own(cfg, dim, **kw):
            return torch.nn.LayerNorm(dim, eps=cfg.eps or 1e-5)
    """)
    check_overrides(["-m", f"imports=[{path}]", "model=gpt_test", "norm.name=eps_own", *swept])
