"""Model names -> built models, with the init and reparametrisation components applied."""

from __future__ import annotations

from torch import nn

from stabletrain.config import ConfigError
from stabletrain.layers.norm import _enum


def build_model(cfg) -> nn.Module:
    family = _enum(cfg.model.family)
    if family == "vit":
        from stabletrain.models.vit import build_vit as build
    elif family == "swin":
        from stabletrain.models.swin import build_swin as build
    elif family == "gpt":
        from stabletrain.models.gpt import GPT as build
    else:
        raise ConfigError(f"model.family={family!r} is unknown; choose vit, swin or gpt")
    model = build(cfg)
    if _enum(cfg.init.name) != "family":
        from stabletrain.layers.init import apply_init

        apply_init(model, cfg.init)
    if _enum(cfg.reparam.name) != "none":
        from stabletrain.layers.reparam import apply_reparam

        apply_reparam(model, cfg.reparam)
    return model


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` for every transformer block, in forward order.

    A block has ``norm1``, ``attn`` (qkv, proj, num_heads), ``norm2`` and ``mlp`` (fc1, fc2):
    true of our Block (ViT, GPT) and of timm's Swin blocks.
    """
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "attn") and hasattr(m, "mlp") and hasattr(m, "norm1")]
