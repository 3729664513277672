"""init_weights from a ViT or Swin of another image, patch or window size: the tensors tied to the
size are resampled as timm resamples pretrained weights, so the model computes what timm's own
model of this size computes after loading the same checkpoint."""

import logging
import re
import warnings

import pytest
import timm
import torch
from timm.models import swin_transformer, vision_transformer

from stabletrain.config import Components
from stabletrain.models.registry import build_model
from stabletrain.models.weights import load_weights
from tests.helpers import make_cfg

VIT = dict(embed_dim=32, depth=2, num_heads=2, num_classes=10)
# timm's table resize warns of its own indexing (the reference's load here as init_weights' there)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:timm.layers.interpolate")
SWIN = dict(patch_size=2, embed_dim=16, depths=(1, 1), num_heads=(2, 4), num_classes=10)


def _ours(family: str, *over: str):
    cfg = make_cfg(f"model={family}", "model.drop_path=0.0", "model.num_classes=10", *over)
    torch.manual_seed(7)
    return build_model(cfg.model, Components.of(cfg)).eval(), cfg.model


def _timm_vit(img: int, patch: int, seed: int = 0):
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=img, patch_size=patch, **VIT).eval()


def _timm_swin(window: int, seed: int = 0):
    torch.manual_seed(seed)
    return swin_transformer.SwinTransformer(img_size=16, window_size=window, **SWIN).eval()


def _randomised(model):
    """Position embeddings and tables away from timm's zero or tiny init, so resampling shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("pos_embed", "relative_position_bias_table", "cls_token")):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("img,patch,resampled", [
    (32, 4, "pos_embed resampled from (1, 17, 32) to (1, 65, 32) as timm does"),
    (16, 2, "pos_embed resampled from (1, 17, 32) to (1, 65, 32) as timm does; patch_embed.proj.weight resampled "
            "from (32, 3, 4, 4) to (32, 3, 2, 2) as timm does"),
])
@pytest.mark.parametrize("reparam", [[], ["reparam=sigma"]])
def test_a_vit_of_another_size_starts_as_timms_own_loads_it(tmp_path, img, patch, resampled, reparam):
    src = _randomised(_timm_vit(16, 4))
    torch.save({"state_dict": src.state_dict()}, tmp_path / "model_best.pth.tar")
    ref = _timm_vit(img, patch, seed=1)
    ref.load_state_dict(vision_transformer.checkpoint_filter_fn(src.state_dict(), ref))
    model, m = _ours("vit_test", f"model.img_size={img}", f"model.patch_size={patch}", *reparam)
    note = load_weights(model, tmp_path / "model_best.pth.tar", m)
    assert f"from {tmp_path / 'model_best.pth.tar'} ({resampled})" in note and "kept" not in note, note
    x = torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_a_swin_of_another_window_starts_as_timms_own_loads_it(tmp_path):
    src = _randomised(_timm_swin(window=4))
    torch.save(src.state_dict(), tmp_path / "w.pt")
    ref = _timm_swin(window=2, seed=1)
    ref.load_state_dict(swin_transformer.checkpoint_filter_fn(src.state_dict(), ref))
    model, m = _ours("swin_test", "model.window_size=2")
    with warnings.catch_warnings(record=True) as seen:  # timm's own, of its indexing: not the user's to read
        warnings.simplefilter("always")
        note = load_weights(model, tmp_path / "w.pt", m)
    assert not seen, [str(w.message) for w in seen]
    assert "layers.0.blocks.0.attn.relative_position_bias_table resampled from (49, 2) to (9, 2) as timm does" \
        in note and "kept" not in note, note
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_a_run_of_the_same_size_loads_as_it_is(tmp_path):
    """Nothing resampled, nothing said: the filter leaves a same-size checkpoint alone."""
    src = _randomised(_timm_vit(16, 4))
    torch.save(src.state_dict(), tmp_path / "w.pt")
    model, m = _ours("vit_test")
    note = load_weights(model, tmp_path / "w.pt", m)
    assert "resampled" not in note and "kept" not in note, note
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("there,here,resampled", [
    (3, 1, "patch_embed.proj.weight resampled from (32, 3, 4, 4) to (32, 1, 2, 2) as timm does"),
    (1, 3, "patch_embed.proj.weight resampled from (32, 1, 4, 4) to (32, 3, 2, 2) as timm does"),
])
def test_weights_of_another_channel_count_compute_their_function_of_a_grey_image(tmp_path, there, here, resampled):
    """RGB weights for the grey digits (the default data) and back: the patch embedding's channels
    are summed or repeated as timm's pretrained loading adapts them, not left at their initialisation."""
    torch.manual_seed(0)
    src = _randomised(timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=there, **VIT))
    torch.save(src.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(1)
    ref = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, in_chans=there, **VIT).eval()
    ref.load_state_dict(vision_transformer.checkpoint_filter_fn(src.state_dict(), ref))
    model, m = _ours("vit_test", f"model.in_chans={here}", "model.patch_size=2")
    note = load_weights(model, tmp_path / "w.pt", m)
    assert resampled in note and "kept" not in note, note
    grey = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(grey.expand(-1, here, -1, -1)), ref(grey.expand(-1, there, -1, -1)),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("reparam", [[], ["reparam=sigma"]])
def test_a_sigma_reparam_run_of_another_patch_size_has_the_weight_it_applied_resampled(tmp_path, reparam):
    """Its patch embedding is stored as sigmaReparam's raw weight and gains, which timm's filter does
    not know: the weight its forward applied is what is resampled."""
    from stabletrain.models.weights import folded

    src, _ = _ours("vit_test", "reparam=sigma")
    _randomised(src)
    torch.save({"model": src.state_dict()}, tmp_path / "last.pt")
    ref = _timm_vit(16, 2, seed=1)
    ref.load_state_dict(vision_transformer.checkpoint_filter_fn(folded(src.state_dict())[0], ref))
    model, m = _ours("vit_test", "model.patch_size=2", *reparam)
    note = load_weights(model, tmp_path / "last.pt", m)
    assert "patch_embed.proj.weight resampled from (32, 3, 4, 4) to (32, 3, 2, 2) as timm does" in note \
        and "kept" not in note, note
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("there,here,kept", [
    (True, False, "28 of the model's 31 tensors from {}; 3 kept their initialisation: pos_embed ((1, 64, 32) here, "
                  "(1, 17, 32) there), fc_norm.weight (not there), fc_norm.bias (not there); 4 of the source's unused: "
                  "cls_token, pos_embed, norm.weight, norm.bias; the optimizer"),
    (False, True, "28 of the model's 32 tensors from {}; 4 kept their initialisation: cls_token (not there), pos_embed "
                  "((1, 65, 32) here, (1, 16, 32) there), norm.weight (not there), norm.bias (not there); 3 of the "
                  "source's unused: pos_embed, fc_norm.weight, fc_norm.bias; the optimizer"),
])
@pytest.mark.parametrize("prefix", ["", "visual.trunk."])  # timm's own names, OpenCLIP's
def test_a_class_token_on_one_side_only_keeps_the_position_embedding_with_the_shape_it_has(tmp_path, there, here,
                                                                                           kept, prefix):
    """timm cannot resample these (its own model refuses what its filter makes of them, or its filter
    fails): the note names no resample and gives the source's own shape, under OpenCLIP's names too."""
    torch.manual_seed(0)
    src = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, class_token=there,
                            global_pool="token" if there else "avg", **VIT)
    torch.save({prefix + k: v for k, v in src.state_dict().items()}, tmp_path / "w.pt")
    model, m = _ours("vit_test", "model.img_size=32", f"model.class_token={str(here).lower()}")
    note = load_weights(model, tmp_path / "w.pt", m)
    assert kept.format(tmp_path / "w.pt") in note, note


def test_an_original_swin_checkpoint_is_renamed_with_no_resample_named(tmp_path):
    """Microsoft's layout (a stage ends in its downsample, head.weight): timm's filter moves each
    downsample onto the next stage's name, which the source also holds; that is no resample."""
    kw = dict(img_size=32, patch_size=2, embed_dim=16, depths=(1, 1, 1), num_heads=(2, 4, 8), num_classes=10)
    torch.manual_seed(0)
    src = swin_transformer.SwinTransformer(window_size=4, **kw)
    old = {re.sub(r"layers.(\d+).downsample", lambda g: f"layers.{int(g.group(1)) - 1}.downsample", k)
           .replace("head.fc.", "head."): v for k, v in _randomised(src).state_dict().items()}
    torch.save({"model": old}, tmp_path / "swin_tiny_patch4_window7_224.pth")
    torch.manual_seed(1)
    ref = swin_transformer.SwinTransformer(window_size=2, **kw).eval()
    ref.load_state_dict(swin_transformer.checkpoint_filter_fn(old, ref))
    model, m = _ours("swin_test", "model.img_size=32", "model.depths=[1,1,1]", "model.stage_heads=[2,4,8]",
                     "model.window_size=2")
    note = load_weights(model, tmp_path / "swin_tiny_patch4_window7_224.pth", m)
    assert "downsample" not in note and "kept" not in note and note.count("resampled") == 3, note
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("safe,file", [(True, "model.safetensors"), (False, "pytorch_model.bin")])
def test_a_folder_timm_saved_for_the_hub_starts_a_run(tmp_path, caplog, safe, file):
    """timm's save_for_hf (push_to_hub's folder): the weights beside its config.json are found; the
    note names the resample, timm's own log line of it ahead of the run's header does not repeat it."""
    from timm.models import save_for_hf

    src = _randomised(_timm_vit(16, 4))
    save_for_hf(src, tmp_path / "hub", safe_serialization=safe)
    model, m = _ours("vit_test", "model.img_size=32")
    with caplog.at_level(logging.INFO):
        note = load_weights(model, tmp_path / "hub", m)
    assert f"32 of the model's 32 tensors from {tmp_path / 'hub' / file} (pos_embed resampled" in note, note
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("timm")]


def test_a_timm_trunk_under_open_clips_names_loads_as_timms_own_loads_it(tmp_path):
    """timm's filter renames OpenCLIP's ``visual.trunk.`` tensors (its text tower left out) and
    resamples them under the new name, one the source does not hold: the note names both."""
    src = _randomised(_timm_vit(16, 4))
    # its text tower of a name alike (text.pos_embed): the trunk's is the one resampled
    text = {"text.token_embedding.weight": torch.randn(50, 32), "text.pos_embed": torch.randn(1, 16, 32),
            "logit_scale": torch.tensor(2.6)}
    torch.save({f"visual.trunk.{k}": v for k, v in src.state_dict().items()} | text, tmp_path / "open_clip.bin")
    ref = _timm_vit(32, 4, seed=1)
    ref.load_state_dict(vision_transformer.checkpoint_filter_fn(src.state_dict(), ref))
    model, m = _ours("vit_test", "model.img_size=32")
    note = load_weights(model, tmp_path / "open_clip.bin", m)
    assert ("32 of the model's 32 " \
        f"tensors from {tmp_path / 'open_clip.bin'} (pos_embed (visual.trunk.pos_embed there) resampled "
            "from (1, 17, 32) to (1, 65, 32) as timm does); the optimizer") in note, note
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_an_open_clip_projection_that_does_not_fit_the_head_is_named_as_the_source_holds_it(tmp_path):
    """OpenCLIP keeps its projection to the joint embedding outside the trunk (visual.head.proj);
    timm's filter renames it head.weight and makes a zero head.bias. Into a classifier of another
    width, the note names the source's tensor unused under its own name, and no bias the source
    never had; the trunk loads. Where the widths match, the projection loads as timm's own load does."""
    src = _randomised(_timm_vit(16, 4))
    trunk = {f"visual.trunk.{k}": v for k, v in src.state_dict().items() if not k.startswith("head.")}
    torch.save(trunk | {"visual.head.proj.weight": torch.randn(64, 32)}, tmp_path / "open_clip.bin")
    model, m = _ours("vit_test")
    note = load_weights(model, tmp_path / "open_clip.bin", m)
    assert ("init_weights: 30 of the model's 32 tensors from {}; 2 kept their initialisation: head.weight (not there), "
            "head.bias (not there); 1 of the source's unused: visual.head.proj.weight; the optimizer"
            .format(tmp_path / "open_clip.bin")) in note, note
    mine = model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in src.state_dict().items() if not k.startswith("head."))
    proj = torch.randn(10, 32)
    torch.save(trunk | {"visual.head.proj.weight": proj}, tmp_path / "fits.bin")
    model, m = _ours("vit_test")
    note = load_weights(model, tmp_path / "fits.bin", m)
    assert f"32 of the model's 32 tensors from {tmp_path / 'fits.bin'}; the optimizer" in note, note
    assert torch.equal(model.head.weight, proj) and not model.head.bias.any()


def test_a_run_resampled_to_another_size_is_not_said_to_compute_another_function(tmp_path):
    """The sizes that differ are what the resample is for: the note names the tensors resampled,
    not the source's img_size as a setting under which the same tensors compute another function;
    a head kept for another class count says the class count the source had."""
    from tests.helpers import train

    train(tmp_path / "a", "model=vit_test", "batch_size=8", "steps=1", "monitor=off")  # 16 px, digits' 10 classes
    model, m = _ours("vit_test", "model.img_size=32", "model.in_chans=1")
    note = load_weights(model, tmp_path / "a", m)
    assert "pos_embed resampled from (1, 17, 32) to (1, 65, 32) as timm does" in note and "had" not in note, note
    model, m = _ours("vit_test", "model.img_size=32", "model.in_chans=1", "model.num_classes=5")
    note = load_weights(model, tmp_path / "a", m)
    assert "2 kept their initialisation: head.weight ((5, 32) here, (10, 32) there), head.bias ((5,) here, (10,) " \
           "there) (the source's model had model.num_classes=10 (this run: 5));" in note, note
    assert "another function" not in note, note
