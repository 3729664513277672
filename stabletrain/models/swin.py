"""Swin: timm's SwinTransformer, its window attention and blocks given our components.

The AdamW² paper used Liu et al.'s Swin code (000); timm's is the same architecture
(docs/methods.md §6 decision). Norms come from our factory via ``norm_layer``; each block's
window attention becomes :class:`SwinAttention` (same weights, our q/k variants) and each
block :class:`SwinBlock` (the shared block arrangement: post-norm and de-escalation). With default components the model
computes exactly timm's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock, checkpoint_filter_fn
from torch import Tensor, nn

from stabletrain.config import FAMILY_KEYS, Components
from stabletrain.errors import ConfigError
from stabletrain.layers.attention import SwinAttention
from stabletrain.layers.block import BlockForward
from stabletrain.layers.norm import make_norm
from stabletrain.models.registry import MODELS
from stabletrain.models.weights import timm_filter
from stabletrain.registry import option_value


class SwinBlock(BlockForward, SwinTransformerBlock):
    """timm's Swin block, arranged by the shared :class:`BlockForward`: the attention branch is
    timm's shifted-window attention on the (B, H, W, C) map; the MLP acts on each token. The
    components (``post``, ``deesc_at``, ``deesc``) are set per instance by :func:`build_swin`."""

    def attention_branch(self, x: Tensor, attn_mask=None, is_causal: bool = False) -> Tensor:
        if attn_mask is not None or is_causal:  # timm's Swin stages pass neither; its windows make their own mask
            raise ValueError("a Swin block takes no attn_mask or is_causal: its shifted windows mask themselves")
        return self._attn(x)

    def mlp_branch(self, x: Tensor) -> Tensor:
        return self.mlp(x)


def _swap_norms(model: nn.Module, make: Callable[[int], nn.Module]) -> None:
    """Replace every LayerNorm by ``make(dim)`` after construction: for a norm with no ``weight``
    tensor (``norm=none``, a scale-only norm of one's own).

    timm's block reads ``norm1.weight`` to place its shift mask while it is built, so the
    model is built with LayerNorms first; they all come from ``norm_layer`` and draw no random
    numbers, so swapping them leaves every other tensor as built.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(parent, name, make(child.normalized_shape[-1]))


def check_swin(m, components: Components) -> None:
    if m.act != "gelu":
        raise ConfigError(f"model.act={m.act}: timm's Swin has a GELU MLP only")
    if components.deescalate.causal:
        raise ConfigError("deescalate.causal=true does not apply to Swin (its windows have no token order); "
                          "leave it null")
    if len(m.depths) != len(m.stage_heads):
        raise ConfigError(f"model.depths={list(m.depths)} and model.stage_heads={list(m.stage_heads)} must have "
                          f"one entry per stage each")
    if not all(d >= 1 for d in m.depths):
        raise ConfigError(f"model.depths={list(m.depths)}: every stage needs at least one block, "
                          f"e.g. model.depths=[2,2,6,2]")
    for stage, heads in enumerate(m.stage_heads):
        width = m.embed_dim * 2**stage
        if heads < 1 or width % heads:
            raise ConfigError(f"model.stage_heads={list(m.stage_heads)}: stage {stage}'s width {width} "
                              f"(model.embed_dim={m.embed_dim} x {2**stage}) is not divisible by its {heads} heads "
                              f"(timm would narrow the attention to {heads} x {width // max(heads, 1)})")
    if (why := _untiled(m.img_size, m.patch_size, m.window_size, len(m.depths))) is not None:
        tile = m.patch_size * m.window_size * 2 ** len(m.depths)  # a multiple of it always fits
        fits = next(size for size in range(m.img_size + 1, m.img_size + tile + 1)
                    if _untiled(size, m.patch_size, m.window_size, len(m.depths)) is None)
        raise ConfigError(f"model.img_size={m.img_size} with model.patch_size={m.patch_size} and "
                          f"model.window_size={m.window_size}: {why} (timm would drop or pad pixels and tokens, "
                          f"attending to the padding); the next size that fits is {fits}")


def _untiled(img_size: int, patch: int, window: int, stages: int) -> str | None:
    """Why an image does not tile exactly into Swin's patches, merges and windows: the patches
    must cover it, each patch merging halves an even grid, and a stage's grid larger than the
    window must be a multiple of it (a grid no larger is one window). None where it tiles."""
    if img_size % patch:
        return "the patches do not tile the image"
    grid = img_size // patch
    for stage in range(stages):
        if grid > window and grid % window:
            return f"stage {stage}'s {grid}x{grid} token grid is not a multiple of the window"
        if stage < stages - 1 and grid % 2:
            return f"stage {stage}'s {grid}x{grid} token grid is odd, and patch merging halves it"
        grid //= 2
    return None


def window_notes(m) -> list[str]:
    """A window larger than a stage's token grid is that grid, unshifted (timm's blocks shrink it):
    the stage attends globally, which the window size did not say."""
    grids = [m.img_size // m.patch_size // 2**stage for stage in range(len(m.depths))]
    small = [f"{stage} ({grid}x{grid})" for stage, grid in enumerate(grids) if grid < m.window_size]
    if not small:
        return []
    return [f"note: model.window_size={m.window_size} is larger than the token grid of stage{'s' * (len(small) > 1)} "
            f"{', '.join(small)}: each such block attends over its whole grid as one window, unshifted (timm's Swin)"]


def swin_flops(model: nn.Module, m) -> float:
    """Training FLOPs of one image: ``6 x params x tokens`` of every block at its stage's
    resolution, plus ``12 d T W`` for attention within windows of ``W`` tokens; the patch
    embedding, patch merging and head are counted on the tokens they see."""
    total, counted = 0.0, set()
    for blk in (b for b in model.modules() if isinstance(b, SwinTransformerBlock)):
        t = blk.input_resolution[0] * blk.input_resolution[1]
        params = list(blk.parameters())
        counted |= {id(p) for p in params}
        total += 6 * sum(p.numel() for p in params) * t + 12 * blk.dim * t * blk.window_area
    tokens = (m.img_size // m.patch_size) ** 2  # the rest, generously, at the first resolution
    return total + 6 * sum(p.numel() for p in model.parameters() if id(p) not in counted) * tokens


@MODELS.register("swin", kind="vision", data="digits", check=check_swin, notes=window_notes, flops=swin_flops,
                 no_decay=("absolute_pos_embed", "relative_position_bias_table"),  # timm's Swin recipe
                 keys=FAMILY_KEYS["swin"],
                 instead={"depth": "depths", "num_heads": "stage_heads"},  # one per stage
                 weights=timm_filter(checkpoint_filter_fn))
def build_swin(m, components: Components) -> SwinTransformer:
    """Swin from ``m`` (the ``model`` group) with ``components``' norm, attention and de-escalation."""
    cfg = components
    check_swin(m, components)
    swap = not isinstance(getattr(make_norm(cfg.norm, 1), "weight", None), torch.Tensor)

    def norm_layer(dim: int, **_factory_kwargs) -> nn.Module:
        if swap:
            return nn.LayerNorm(dim, eps=1e-5)
        return make_norm(cfg.norm, dim, ln_eps=1e-5)

    model = SwinTransformer(
        img_size=m.img_size, patch_size=m.patch_size, in_chans=m.in_chans, num_classes=m.num_classes,
        embed_dim=m.embed_dim, depths=tuple(m.depths), num_heads=tuple(m.stage_heads),
        window_size=m.window_size, mlp_ratio=m.mlp_ratio, qkv_bias=m.qkv_bias,
        drop_path_rate=m.drop_path, norm_layer=norm_layer,
    )
    if swap:
        _swap_norms(model, lambda dim: make_norm(cfg.norm, dim, ln_eps=1e-5))
    for blk in (b for b in model.modules() if isinstance(b, SwinTransformerBlock)):
        blk.attn = SwinAttention.from_timm(blk.attn, attn_cfg=cfg.attention, norm_cfg=cfg.norm,
                                           attn_fp32=cfg.reparam.attn_fp32)
        # Same parameters, new forward: swapping the class keeps timm's construction intact.
        blk.__class__ = SwinBlock
        blk.set_components(cfg, causal=False)
    if option_value(cfg.norm.placement) == "post":
        model.norm = nn.Identity()
    return model


