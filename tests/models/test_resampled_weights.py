"""init_weights from a ViT or Swin of another image, patch or window size: the tensors tied to the
size are resampled as timm resamples pretrained weights, so the model computes what timm's own
model of this size computes after loading the same checkpoint."""

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
