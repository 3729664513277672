"""Swin: timm's SwinTransformer, its window attention and blocks given our components.

The AdamW² paper used Liu et al.'s Swin code (000 l.660); timm's is the same architecture
(SPEC section 6 decision). Norms come from our factory via ``norm_layer``; each block's
window attention becomes :class:`SwinAttention` (same weights, our q/k variants) and each
block :class:`SwinBlock` (post-norm and de-escalation). With default components the model
computes exactly timm's.
"""

from __future__ import annotations

from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from torch import Tensor, nn

from stabletrain.config import ConfigError
from stabletrain.layers.attention import SwinAttention
from stabletrain.layers.deescalate import make_deescalate
from stabletrain.layers.norm import _enum, make_norm


class SwinBlock(SwinTransformerBlock):
    """timm's Swin block with a post-norm option and de-escalation; tokens are (B, H, W, C)."""

    # ``post``, ``deesc_at`` and ``deesc`` are set per instance by :func:`build_swin`. A
    # class-level ``deesc = None`` would shadow the registered submodule (nn.Module looks
    # submodules up only when normal attribute lookup fails).

    def forward(self, x: Tensor) -> Tensor:
        b, h, w, c = x.shape
        if self.post:
            x = self.norm1(x + self.drop_path1(self._attn(x)))
        else:
            x = x + self.drop_path1(self._attn(self.norm1(x)))
        if self.deesc_at == "ffn":
            x = self.deesc(x)
        x = x.reshape(b, -1, c)
        if self.post:
            x = self.norm2(x + self.drop_path2(self.mlp(x)))
        else:
            x = x + self.drop_path2(self.mlp(self.norm2(x)))
        x = x.reshape(b, h, w, c)
        if self.deesc_at == "block":
            x = self.deesc(x)
        return x


def _drop_norms(model: nn.Module) -> None:
    """``norm=none``: replace every LayerNorm by the identity after construction.

    timm's block reads ``norm1.weight`` to place its shift mask while it is built, so the
    model is built with LayerNorms first; they all come from ``norm_layer`` and draw no random
    numbers, so dropping them leaves every other tensor as built.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(parent, name, nn.Identity())


def build_swin(cfg) -> SwinTransformer:
    m = cfg.model
    if m.act != "gelu":
        raise ConfigError(f"model.act={m.act}: timm's Swin has a GELU MLP only")
    no_norm = _enum(cfg.norm.name) == "none"

    def norm_layer(dim: int, **_factory_kwargs) -> nn.Module:
        if no_norm:
            return nn.LayerNorm(dim, eps=1e-5)
        return make_norm(cfg.norm, dim, ln_eps=1e-5)

    model = SwinTransformer(
        img_size=m.img_size, patch_size=m.patch_size, in_chans=m.in_chans, num_classes=m.num_classes,
        embed_dim=m.embed_dim, depths=tuple(m.depths), num_heads=tuple(m.stage_heads),
        window_size=m.window_size, mlp_ratio=m.mlp_ratio, qkv_bias=m.qkv_bias,
        drop_path_rate=m.drop_path, norm_layer=norm_layer,
    )
    if no_norm:
        _drop_norms(model)
    post = _enum(cfg.norm.placement) == "post"
    for blk in (b for b in model.modules() if isinstance(b, SwinTransformerBlock)):
        blk.attn = SwinAttention.from_timm(blk.attn, attn_cfg=cfg.attention, norm_cfg=cfg.norm,
                                           attn_fp32=cfg.reparam.attn_fp32)
        # Same parameters, new forward: swapping the class keeps timm's construction intact.
        blk.__class__ = SwinBlock
        blk.post = post
        blk.deesc_at, blk.deesc = make_deescalate(cfg.deescalate, False)
    if post:
        model.norm = nn.Identity()
    return model


