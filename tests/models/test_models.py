"""Default models are the references: timm's own ViT/Swin, GPT-2's parameter count."""

import re

import pytest
import timm
import torch

from stabletrain.config import Components
from stabletrain.models.registry import build_model, transformer_blocks
from tests.helpers import make_cfg, model_of


@pytest.mark.parametrize("ours,timm_name,kw", [
    ("vit_b", "vit_base_patch16_224", {}),
    ("vit_test", "vit_tiny_patch16_224", dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)),
    ("swin_t", "swin_tiny_patch4_window7_224", {}),
])
def test_default_vision_models_are_timms(ours, timm_name, kw):
    cfg = make_cfg(f"model={ours}", "model.drop_path=0.0")
    torch.manual_seed(0)
    model = build_model(cfg.model, Components.of(cfg)).eval()
    ref = timm.create_model(timm_name, pretrained=False, num_classes=1000, **kw).eval()
    assert list(model.state_dict()) == list(ref.state_dict())
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("Mlp") == [type(m).__name__ for m in ref.modules()].count("Mlp")
    ref.load_state_dict(model.state_dict())
    size = cfg.model.img_size
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp32", [False, True])
def test_a_vit_takes_timms_masks_as_timm_does(fp32):
    """timm's VisionTransformer passes ``attn_mask`` and ``is_causal`` to each block: a boolean mask
    was cast to 1.0/0.0 and added to the logits (masking nothing), and ``is_causal`` was dropped."""
    import inspect

    from timm.models.vision_transformer import VisionTransformer

    if "is_causal" not in inspect.signature(VisionTransformer.forward).parameters:
        pytest.skip("this timm's VisionTransformer takes no attn_mask or is_causal")  # pyproject allows timm 1.0.9
    cfg = make_cfg("model=vit_test", "model.drop_path=0.0", f"reparam.attn_fp32={str(fp32).lower()}")
    torch.manual_seed(0)
    model = build_model(cfg.model, Components.of(cfg)).eval()
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000, img_size=16, patch_size=4,
                            embed_dim=32, depth=2, num_heads=2).eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    t = 1 + (16 // 4) ** 2
    keep = torch.rand(t, t, generator=torch.Generator().manual_seed(1)) > 0.5
    keep.fill_diagonal_(True)  # every query keeps a key
    with torch.no_grad():
        free = model(x)
        for kw in (dict(attn_mask=keep), dict(attn_mask=torch.zeros(t, t).masked_fill(~keep, float("-inf"))),
                   dict(is_causal=True)):
            ours = model(x, **kw)
            torch.testing.assert_close(ours, ref(x, **kw), rtol=1e-4, atol=1e-4)
            assert not torch.allclose(ours, free, atol=1e-3), kw  # the mask changed something


def test_a_swin_block_refuses_a_mask_it_would_ignore():
    cfg = make_cfg("model=swin_test")
    block = build_model(cfg.model, Components.of(cfg)).layers[0].blocks[0]
    with pytest.raises(ValueError, match="takes no attn_mask or is_causal"):
        block(torch.randn(1, 4, 4, block.dim), is_causal=True)


def test_gpt2_s_has_gpt2_parameter_count():
    cfg = make_cfg("model=gpt2_s")
    with torch.device("meta"):
        model = build_model(cfg.model, Components.of(cfg))
    n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    # GPT-2 124M: 12 x (12 d^2) + (50304 + 1024) d + norms; nanoGPT's bias=False variant
    d = 768
    expected = 12 * (12 * d * d + 2 * d) + (50304 + 1024) * d + d
    assert n == expected
    assert 123e6 < n < 125e6


def test_gpt_is_causal():
    cfg = make_cfg("model=gpt_test")
    model = build_model(cfg.model, Components.of(cfg)).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("name,count", [("vit_test", 2), ("swin_test", 2), ("gpt_test", 2), ("vit_b", 12)])
def test_transformer_blocks_found(name, count):
    cfg = make_cfg(f"model={name}")
    with torch.device("meta"):
        model = build_model(cfg.model, Components.of(cfg))
    blocks = transformer_blocks(model)
    assert len(blocks) == count
    for _, b in blocks:
        assert hasattr(b.attn, "qkv") and hasattr(b.mlp, "fc1")


def test_vit_family_init_stds():
    cfg = make_cfg("model=vit_b", "model.init_std=0.01", "model.patch_embed_std=0.0025")
    torch.manual_seed(0)
    model = build_model(cfg.model, Components.of(cfg))
    w = model.blocks[0].mlp.fc1.weight
    assert abs(w.std().item() - 0.01) < 5e-4
    assert abs(model.patch_embed.proj.weight.std().item() - 0.0025) < 2e-4


def _size(name: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model_of(make_cfg(f"model={name}")).parameters())


@pytest.mark.parametrize("name,width,depth,heads,mlp,patch,paper_m", [
    ("vit_b", 768, 12, 12, 3072, 16, 86),  # 000
    ("vit_l", 1024, 24, 16, 4096, 16, 307),  # 000 counts 307M; timm's ViT-L/16 is 304M
    ("vit_g", 1408, 40, 16, 6144, 14, 1011),  # 000
])
def test_vit_sizes_follow_from_their_shape_and_the_papers(name, width, depth, heads, mlp, patch, paper_m):
    """Blocks of 4 d^2 + 2 d mlp weights plus biases and norms, the patch embedding, the
    positions with the class token, a 1000-way head: the count the shape implies, near the
    paper's figure."""
    cfg = make_cfg(f"model={name}")
    m = cfg.model
    assert (m.embed_dim, m.depth, m.num_heads, m.mlp_hidden or int(m.mlp_ratio * m.embed_dim), m.patch_size) == \
        (width, depth, heads, mlp, patch)
    d, tokens = width, (224 // patch) ** 2 + 1
    block = 4 * d * d + 4 * d + 2 * d * mlp + mlp + d + 4 * d
    n = depth * block + (3 * patch * patch * d + d) + tokens * d + d + 2 * d + (1000 * d + 1000)
    assert _size(name) == n
    assert abs(n / 1e6 - paper_m) / paper_m < 0.012


@pytest.mark.parametrize("name,paper_m", [("swin_s", 50), ("swin_b", 88), ("gpt2_m", 355), ("gpt2_l", 774)])
def test_other_sizes_match_the_papers(name, paper_m):
    assert abs(_size(name) / 1e6 - paper_m) / paper_m < 0.01  # 000; GPT-2's 355M


def test_gpt_family_init_is_nanogpts():
    """N(0, 0.02) everywhere, residual projections (attn.proj, mlp.fc2) 0.02 / sqrt(2 n_layer)."""
    torch.manual_seed(0)
    model = model_of(make_cfg("model=gpt_test", "model.embed_dim=256", "model.depth=4"))
    blk = model.blocks[1]
    for w in (model.wte.weight, blk.attn.qkv.weight, blk.mlp.fc1.weight):
        assert abs(w.std().item() / 0.02 - 1) < 0.03
    for w in (blk.attn.proj.weight, blk.mlp.fc2.weight):
        assert abs(w.std().item() / (0.02 / (2 * 4) ** 0.5) - 1) < 0.03


@pytest.mark.parametrize("img,window,tiles", [(16, 4, True), (16, 16, True), (40, 5, True), (24, 5, False),
                                              (20, 4, False), (36, 9, True), (12, 3, True), (28, 4, False),
                                              (18, 4, False), (14, 8, False)])
def test_swin_sizes_are_refused_exactly_where_timm_would_pad_or_drop(img, window, tiles):
    """The check against timm's own blocks: an accepted size gives every block a grid that is
    its window or a multiple of it, halving evenly; a refused one has a block that pads or drops."""
    from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock

    from stabletrain.models.swin import _untiled

    m = make_cfg("model=swin_test").model
    assert (_untiled(img, m.patch_size, window, len(m.depths)) is None) == tiles
    net = SwinTransformer(img_size=img, patch_size=m.patch_size, embed_dim=m.embed_dim, depths=tuple(m.depths),
                          num_heads=tuple(m.stage_heads), window_size=window)  # timm takes any size
    blocks = [b for b in net.modules() if isinstance(b, SwinTransformerBlock)]
    exact = img % m.patch_size == 0 and all(r % w == 0 for b in blocks
                                            for r, w in zip(b.input_resolution, b.window_size))
    exact &= [b.input_resolution[0] for b in blocks] == [img // m.patch_size // 2 ** i for i in range(len(blocks))]
    assert exact == tiles


@pytest.mark.parametrize("img,window", [(16, 4), (16, 8), (16, 16), (32, 4), (8, 8)])
def test_a_swin_window_larger_than_a_stage_grid_is_noted_where_timm_shrinks_it(img, window):
    """The note names exactly the stages whose blocks timm builds with a smaller window than asked."""
    from timm.models.swin_transformer import SwinTransformerBlock

    from stabletrain.models.swin import window_notes

    m = make_cfg("model=swin_test", f"model.img_size={img}", f"model.window_size={window}").model
    net = model_of(make_cfg("model=swin_test", f"model.img_size={img}", f"model.window_size={window}"))
    shrunk = sorted({stage for stage, layer in enumerate(net.layers) for b in layer.modules()
                     if isinstance(b, SwinTransformerBlock) and b.window_size[0] < window})
    notes = window_notes(m)
    named = [int(x) for x in re.findall(r"(\d+) \(\d+x\d+\)", notes[0])] if notes else []
    assert named == shrunk and (notes == []) == (not shrunk)
    if shrunk:
        assert notes[0].startswith(f"note: model.window_size={window} is larger than the token grid of stage")


@pytest.mark.parametrize("overrides", [("model.embed_dim=32", "model.stage_heads=[3,6]"),
                                       ("model.stage_heads=[3,4]",), ("model.embed_dim=16", "model.stage_heads=[2,3]")])
def test_swin_refuses_a_stage_width_its_heads_do_not_divide(overrides):
    """timm's Swin takes head_dim = width // heads and silently narrows the attention (32 wide, 3
    heads: q, k, v of 30); Liu et al.'s code fails there, and our ViT refuses it: one line."""
    from stabletrain.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible by its"):
        model_of(make_cfg("model=swin_test", *overrides))
