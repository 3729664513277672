"""What ``stabletrain.build`` promises of a config: each key given lands in what is built (or a
note says it does not), the model fits the data, each component goes where the docs say.

Each test builds from a tiny config and inspects what was built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stabletrain.errors import ConfigError
from tests.helpers import make_cfg


def test_validate_checks_the_image_size_the_data_resizes_to():
    """data.img_size is what a vision model is built at: validate refuses one its patches cannot tile,
    naming data.img_size (not model.img_size, which the user did not set)."""
    from stabletrain.build import validate

    with pytest.raises(ConfigError, match=r"data\.img_size=30 is not a multiple of model\.patch_size=4"):
        validate(make_cfg("model=vit_test", "data.img_size=30"))
    validate(make_cfg("model=vit_test", "data.img_size=32"))


def test_the_eval_note_counts_the_capped_evaluation_batch():
    """Evaluation batches are the training batch capped at EVAL_BATCH_CAP: the note says how many
    images that scores, and none where the capped batches score them all."""
    from stabletrain.build import eval_note
    from stabletrain.engine.loop import EVAL_BATCH_CAP

    data = SimpleNamespace(kind="vision", n_val=10_000)
    cfg = SimpleNamespace(batch_size=4 * EVAL_BATCH_CAP, eval_batches=2)
    note = eval_note(data, cfg)
    assert note is not None and note.startswith(f"validation: {2 * EVAL_BATCH_CAP} of the 10000 val images"), note
    assert f"eval_batches={-(-10_000 // EVAL_BATCH_CAP)} scores them all" in note
    # capped batches of 256: 4 score all 1024 images, 3 do not (uncapped, one batch of 1024 would)
    data = SimpleNamespace(kind="vision", n_val=4 * EVAL_BATCH_CAP)
    assert eval_note(data, SimpleNamespace(batch_size=4 * EVAL_BATCH_CAP, eval_batches=4)) is None
    assert eval_note(data, SimpleNamespace(batch_size=4 * EVAL_BATCH_CAP, eval_batches=3)) is not None


def _trainer(tmp_path, *overrides):
    from stabletrain.build import build_trainer

    cfg = make_cfg("logger=none", "logger.progress=false", *overrides)
    return cfg, build_trainer(cfg, tmp_path)


def test_the_loop_settings_are_the_configs_values(tmp_path):
    """Each loop key given reaches the loop as given; the lr scaled by batch uses the global batch
    (not the micro-batch); an epoch is counted in global batches; the monitor's probe is a
    validation batch of monitor.probe_batch_size, and a q/k-normalised attention logs no
    softmax entropy bound."""
    import torch

    from stabletrain.build import data_from_config

    cfg, tr = _trainer(tmp_path, "model=vit_test", "steps=7", "batch_size=8", "micro_batch_size=4",
                       "eval_every=3", "eval_batches=5", "ckpt_every=4", "logger.log_every=2",
                       "monitor.adamw2_every=6", "monitor.probe_every=3", "monitor.probe_batch_size=3",
                       "attention=qknorm", "optim=adamw", "optim.lr=0.064", "optim.lr_scale_by_batch=true",
                       "schedule=constant", "warmup=0", "grad_clip=0.5")
    s = tr.settings
    assert (s.total_steps, s.batch_size, s.eval_every, s.eval_batches, s.ckpt_every, s.log_every, s.adamw2_every,
            s.grad_clip) == (7, 8, 3, 5, 4, 2, 6, 0.5)
    assert tr.shard.micro == 4 and tr.shard.accum == 2
    data = data_from_config(cfg)
    assert s.steps_per_epoch == data.steps_per_epoch(8) != data.steps_per_epoch(4)
    assert s.equivalent == {"data.name": ("auto", "digits")}  # data=auto picks the digits: not a change on resume
    assert tr.schedule.lr_at.base_lr == pytest.approx(0.064 * 8 / 256)
    lrs = [g["lr"] for g in tr.optimizer.param_groups]
    assert lrs == pytest.approx([0.064 * 8 / 256] * len(lrs))
    x, y = tr.monitor.probe_batch
    vx, vy = next(data.val_batches(3, 1))
    assert torch.equal(x, vx) and torch.equal(y, vy)
    assert tr.monitor.blocks and not any(blk.attn.entropy_bound_applies for _, blk in tr.monitor.blocks)


def test_the_model_is_built_at_the_datas_classes_channels_and_image_size(tmp_path):
    """fit_model_to_data: the digits' 10 classes and 1 channel, and data.img_size, are what the model
    is built with, written back into cfg.model (config.yaml records what was built), and said."""
    cfg, tr = _trainer(tmp_path, "model=vit_test", "steps=1", "monitor=off", "model.num_classes=1000",
                       "model.in_chans=3", "data.img_size=32")
    assert (cfg.model.num_classes, cfg.model.in_chans, cfg.model.img_size) == (10, 1, 32)
    pe = tr.model.patch_embed
    assert tuple(pe.img_size) == (32, 32) and pe.proj.in_channels == 1 and tr.model.head.out_features == 10
    assert "img_size: 32" in tr.settings.config_yaml and "num_classes: 10" in tr.settings.config_yaml
    assert any("model.img_size=32 (was 16)" in n and "model.num_classes=10 (was 1000)" in n for n in tr.notes), tr.notes


@pytest.mark.parametrize("ckpt_every,noted", [(5, False), (6, True)])
def test_epochs_round_to_the_nearest_step_and_a_rollback_within_a_probe_is_not_noted(tmp_path, ckpt_every, noted):
    """steps=null trains round(epochs x steps_per_epoch) steps (3.6 -> 4, not 3); a rollback on alert is
    noted as reaching back too far only where ckpt_every exceeds monitor.probe_every, not equals it."""
    from stabletrain.build import data_from_config

    spe = data_from_config(make_cfg("model=vit_test", "batch_size=16")).steps_per_epoch(16)
    cfg, tr = _trainer(tmp_path, "model=vit_test", "batch_size=16", "steps=null", f"epochs={3.6 / spe!r}",
                       "monitor.rollback_on_alert=true", "monitor.stop_on_alert=true", "divergence.action=rollback",
                       f"ckpt_every={ckpt_every}", "monitor.probe_every=5")
    assert tr.settings.total_steps == 4
    assert any("monitor.rollback_on_alert with ckpt_every" in n for n in tr.notes) is noted, tr.notes


def test_dist_timeout_in_one_process_is_noted(tmp_path):
    """dist_timeout bounds a collective's wait for other ranks; a single process has none to wait for."""
    _, tr = _trainer(tmp_path, "model=vit_test", "steps=1", "monitor=off", "dist_timeout=60")
    assert sum("dist_timeout=60 changes nothing: this run is one process" in n for n in tr.notes) == 1, tr.notes
    _, tr = _trainer(tmp_path / "default", "model=vit_test", "steps=1", "monitor=off")
    assert not any("dist_timeout" in n for n in tr.notes), tr.notes


def test_sigma_reparams_power_iteration_runs_after_each_step(tmp_path):
    """reparam=sigma: the hook its registry returns is handed to the trainer, so u, v follow the
    weights as they train (they are never updated by the forward)."""
    import torch

    from stabletrain.layers.reparam import PowerStep, SigmaPart

    _, tr = _trainer(tmp_path, "model=vit_test", "reparam=sigma", "steps=2", "monitor=off", "eval_every=100",
                     "ckpt_every=100")
    assert [type(h) for h in tr.step_hooks] == [PowerStep] and tr.step_hooks[0].model is tr.model
    part = next(m for m in tr.model.modules() if isinstance(m, SigmaPart))
    u0 = part.u.clone()
    tr.fit()
    assert not torch.equal(part.u, u0)


@pytest.fixture
def own_mlp_family(monkeypatch):
    """A model family of one's own, registered for this test only, whose builder uses no component."""
    from torch import nn

    from stabletrain.models.registry import MODELS

    MODELS.names()  # load stabletrain's own first
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))

    @MODELS.register("mlp_promises", kind="vision")
    def build(m, components):
        return nn.Sequential(nn.Flatten(), nn.Linear(m.in_chans * m.img_size ** 2, m.num_classes))

    return "mlp_promises"


def test_a_family_of_ones_own_is_told_only_about_the_components_asked_for(own_mlp_family):
    """unbuilt_components: a builder that ignores components is told that a norm or attention the user
    chose changes nothing, and nothing where the user left them at their defaults."""
    from stabletrain.build import unbuilt_components
    from tests.helpers import model_of

    cfg = make_cfg("model=vit_test", f"model.family={own_mlp_family}")
    assert unbuilt_components(model_of(cfg), cfg) == []
    cfg = make_cfg("model=vit_test", f"model.family={own_mlp_family}", "norm=rmsnorm", "attention=qknorm")
    notes = unbuilt_components(model_of(cfg), cfg)
    assert len(notes) == 2 and notes[0].startswith("norm=rmsnorm changes nothing") and \
        notes[1].startswith("attention=qknorm changes nothing"), notes


def test_loss_terms_are_built_in_order_with_their_parameters_names_and_weight_reading():
    """regularizer: each term gets the parameters given (its weight coef), is named as chosen, in the
    order given, and one that reads weights says so (FSDP2 then hands it whole weights)."""
    from stabletrain.losses import build_loss_terms

    cfg = make_cfg("regularizer=[zloss,locater]", "regularizer.zloss.coef=0.5")
    terms = build_loss_terms(cfg.regularizer)
    assert [t.name for t in terms] == ["zloss", "locater"]
    assert terms[0].coef == 0.5
    assert [t.reads_weights for t in terms] == [False, True]
    assert [t.name for t in build_loss_terms({"locater": None, "zloss": None})] == ["locater", "zloss"]


def test_fsdp_is_refused_on_one_rank_and_cutmix_needs_an_even_micro_batch():
    """parallel=fsdp needs 2+ ranks; mixup and cutmix alike pair a micro-batch's samples."""
    from stabletrain.build import _shard, check_parallel
    from stabletrain.engine.distributed import DistInfo

    with pytest.raises(ConfigError, match="parallel=fsdp shards over the ranks"):
        check_parallel(make_cfg("parallel=fsdp"), 1)
    check_parallel(make_cfg("parallel=fsdp"), 2)
    for aug in ("data.mixup=0.8", "data.cutmix=1.0"):
        with pytest.raises(ConfigError, match="micro-batch 3 must be even"):
            _shard(make_cfg("model=vit_test", aug, "batch_size=6", "micro_batch_size=3"), DistInfo())
    assert _shard(make_cfg("model=vit_test", "data.cutmix=1.0", "batch_size=8", "micro_batch_size=4"),
                  DistInfo()).accum == 2


def test_adamw2s_bound_where_optim_tau_is_null_is_the_familys():
    """optim.tau=null: each family's own tau (000 Table 2: 0.01 for GPT, 0.004 for ViT and Swin)."""
    from stabletrain.models.registry import DEFAULT_TAU, family_tau

    assert family_tau("gpt") == 0.01 and family_tau("vit") == DEFAULT_TAU == 0.004


def test_bias_keys_reach_every_layer_of_every_block():
    """model.bias=false (nanoGPT) leaves no bias in a GPT block's norms, attention or MLP; a ViT's
    model.qkv_bias=false drops the q/k/v bias only (timm's qkv_bias)."""
    from tests.helpers import model_of

    gpt = model_of(make_cfg("model=gpt_test", "model.bias=false"))
    blk = gpt.blocks[0]
    for name in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
        assert getattr(blk.get_submodule(name), "bias", None) is None, name
    vit = model_of(make_cfg("model=vit_test", "model.qkv_bias=false"))
    blk = vit.blocks[0]
    assert blk.attn.qkv.bias is None
    assert all(blk.get_submodule(n).bias is not None for n in ("norm1", "norm2", "attn.proj", "mlp.fc1"))


@pytest.mark.parametrize("model", ["vit_test", "gpt_test", "swin_test"])
def test_reparam_attn_fp32_reaches_every_attention(model):
    """reparam.attn_fp32=true (001: logits and softmax in fp32) is set on every block's attention."""
    from stabletrain.models.registry import transformer_blocks
    from tests.helpers import model_of

    for on in (True, False):
        blocks = transformer_blocks(model_of(make_cfg(f"model={model}", f"reparam.attn_fp32={str(on).lower()}")))
        assert blocks and all(b.attn.attn_fp32 is on for _, b in blocks)


def test_validate_refuses_a_family_of_ones_own_that_cannot_be_called_as_a_family(monkeypatch):
    """A model family is called (model_cfg, components): one of one's own that cannot take them is
    refused by validate, before anything is built, not met as a TypeError while building."""
    from stabletrain.build import validate
    from stabletrain.models.registry import MODELS

    MODELS.names()
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))

    @MODELS.register("one_arg_promises", kind="vision")
    def build(m):
        raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"model\.family=one_arg_promises: .* must take what a model\.family option "
                                          r"is called with, \(model_cfg, components\)"):
        validate(make_cfg("model=vit_test", "model.family=one_arg_promises"))


@pytest.mark.parametrize("overrides,shown", [
    (["reparam=sigma"], "reparam=sigma,"), (["reparam=sigma_qk"], "reparam=sigma_qk,"),
    (["norm=stablenorm", "norm.alpha=0.25", "norm.placement=post"], "norm=stablenorm (alpha=0.25, post-norm),"),
    (["deescalate=ffn"], "deescalate=ffn;"), (["regularizer=zloss", "regularizer.zloss.coef=0.001"],
                                              "loss terms: zloss (coef=0.001)"),
])
def test_the_components_line_says_what_each_override_chose(overrides, shown):
    """One override turns a fix on, and the start line names it as the user typed it."""
    from stabletrain.build import components_line

    assert shown in components_line(make_cfg("model=vit_test", *overrides))


def test_the_init_is_applied_before_sigma_reparam_so_svd_gammas_start_at_the_initialised_weight():
    """build_model: init, then reparametrisation. With reparam.gamma_init=svd, gamma = sigma1 of the
    initialised weight, so at step 0 each reparametrised weight equals its raw (initialised) weight."""
    import torch

    from stabletrain.layers.reparam import raw_weight, sigma_reparams
    from tests.helpers import model_of

    model = model_of(make_cfg("model=vit_test", "init=stable", "reparam=sigma", "reparam.gamma_init=svd"))
    assert sigma_reparams(model)
    for mod in (model.blocks[0].mlp.fc1, model.blocks[0].attn.proj):
        torch.testing.assert_close(mod.weight, raw_weight(mod), atol=1e-5, rtol=1e-4)
