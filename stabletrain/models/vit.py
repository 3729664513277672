"""ViT: timm's VisionTransformer with our Block and norm factory as its extension points."""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import GELUTanh, trunc_normal_
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from stabletrain.config import FAMILY_KEYS, Components
from stabletrain.errors import ConfigError
from stabletrain.layers.block import Block
from stabletrain.layers.norm import make_norm
from stabletrain.models.registry import MODELS
from stabletrain.models.weights import timm_filter
from stabletrain.registry import option_value

LN_EPS = 1e-6  # timm ViT's LayerNorm eps
LINEAR_STD = 0.02  # timm ViT's trunc_normal std for Linear weights


def check_heads(m, components: Components) -> None:
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.embed_dim={m.embed_dim} must be divisible by model.num_heads={m.num_heads}")


# model.act: the MLP's activation (ViT and GPT); gelu_tanh is GPT-2's own (Hugging Face's gelu_new)
ACTS = {"gelu": nn.GELU, "gelu_tanh": GELUTanh, "relu": nn.ReLU}


def act_layer(act: str) -> type[nn.Module]:
    """The MLP activation named by ``model.act`` (gelu | gelu_tanh | relu); another raises :class:`ConfigError`."""
    if act not in ACTS:
        raise ConfigError(f"model.act={act} is not an option: use {', '.join(ACTS)}")
    return ACTS[act]


def check_vit(m, components: Components) -> None:
    check_heads(m, components)
    if m.img_size % m.patch_size:
        below, above = m.img_size // m.patch_size * m.patch_size, -(-m.img_size // m.patch_size) * m.patch_size
        fits = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(f"model.img_size={m.img_size} is not a multiple of model.patch_size={m.patch_size}: "
                          f"the patches must tile the image; the nearest sizes that do are {fits}")


def vit_flops(model: nn.Module, m) -> float:
    """Training FLOPs of one image, nanoGPT's count with the ``T`` tokens of an image:
    ``(6 N + 12 L d T) T``, ``N`` without the position embedding and class token (the patch
    embedding applied to each patch counts as a linear layer on every token)."""
    t = (m.img_size // m.patch_size) ** 2 + int(m.class_token)
    n = sum(p.numel() for name, p in model.named_parameters() if name not in ("pos_embed", "cls_token"))
    return (6 * n + 12 * m.depth * m.embed_dim * t) * t


# timm's VisionTransformer.no_weight_decay(): the position embedding and the extra tokens
VIT_NO_DECAY = ("pos_embed", "cls_token", "dist_token", "reg_token")


@MODELS.register("vit", kind="vision", data="digits", check=check_vit, flops=vit_flops, no_decay=VIT_NO_DECAY,
                 keys=FAMILY_KEYS["vit"], weights=timm_filter(checkpoint_filter_fn, trunk="visual.trunk."))
def build_vit(m, components: Components) -> VisionTransformer:
    """ViT from ``m`` (the ``model`` group) built of :class:`Block` with ``components``."""
    tokens = (m.img_size // m.patch_size) ** 2 + int(m.class_token)
    post = option_value(components.norm.placement) == "post"

    def norm_layer(dim: int, **_factory_kwargs) -> nn.Module:  # timm unbinds partials' positional args
        return make_norm(components.norm, dim, ln_eps=LN_EPS)

    block_fn = partial(Block, components=components, seq_len=tokens, causal=False, ln_eps=LN_EPS,
                       mlp_hidden=m.mlp_hidden)
    model = VisionTransformer(
        img_size=m.img_size, patch_size=m.patch_size, in_chans=m.in_chans, num_classes=m.num_classes,
        embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
        qkv_bias=m.qkv_bias, class_token=m.class_token, global_pool="token" if m.class_token else "avg",
        drop_path_rate=m.drop_path, norm_layer=norm_layer, block_fn=block_fn,
        act_layer=act_layer(m.act),
    )
    if post:  # a post-LN stack already ends in a norm
        model.norm = nn.Identity()
    _family_init(model, m.init_std, m.patch_embed_std)
    return model


@torch.no_grad()
def _family_init(model: nn.Module, std: float, patch_std: float | None) -> None:
    """timm's init with other standard deviations: sigmaReparam's ViT-B trains with
    trunc_normal(.02) on the patch embedding too (001 Table 13), ViT-L with .01 / .0025
    (Table 14). The defaults leave timm's init untouched."""
    if std != LINEAR_STD:
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                trunc_normal_(mod.weight, std=std)
    if patch_std is not None:
        trunc_normal_(model.patch_embed.proj.weight, std=patch_std)
