"""A model family of your own, trained by stabletrain with every fix: a ViT whose patchify
convolution is replaced by a stack of stride-2 3x3 convolutions (a convolutional stem, as in
Xiao et al. 2021, "Early convolutions help transformers see better", who found it makes ViT
training less sensitive to the learning rate and the optimizer).

    python train.py imports=[examples/conv_stem/conv_stem_vit.py] \\
        hydra.searchpath=[file://examples/conv_stem/configs] model=conv_vit_mini

The family builds stabletrain's ViT, whose blocks take every norm, attention, reparam, init and
de-escalation option, and swaps only the patch embedding's projection. So the monitors read its
blocks, AdamW² and sigmaReparam (which reparametrises convolutions too) reach the new layers, and
``reparam=sigma`` or ``norm=stablenorm`` apply to it with no more code.
"""

from __future__ import annotations

from torch import nn

from stabletrain.errors import ConfigError
from stabletrain.models.registry import MODELS
from stabletrain.models.vit import VIT_NO_DECAY, build_vit, check_vit


def check_conv_vit(m, components) -> None:
    """Before anything is built: one stride-2 convolution per halving of ``model.patch_size``
    (the names in model.kwargs are checked against ``kwargs=`` at registration)."""
    check_vit(m, components)
    channels = list(m.kwargs.get("stem_channels", []))
    halvings = m.patch_size.bit_length() - 1
    if m.patch_size != 2 ** halvings or len(channels) != halvings:
        raise ConfigError(f"model.kwargs.stem_channels={channels}: the stem halves the image once per "
                          f"convolution, so model.patch_size={m.patch_size} must be a power of 2 and the list "
                          f"must hold {halvings} channel counts")


def conv_stem(in_chans: int, channels: list[int], embed_dim: int) -> nn.Sequential:
    """3x3 stride-2 conv, BatchNorm, ReLU per entry of ``channels``, then a 1x1 conv to the width."""
    layers: list[nn.Module] = []
    for c in channels:
        layers += [nn.Conv2d(in_chans, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        in_chans = c
    return nn.Sequential(*layers, nn.Conv2d(in_chans, embed_dim, 1))


# kind: the data it trains on (images -> class logits); kwargs: the model.kwargs it takes (a
# misspelt one is refused); no ``flops`` is registered, so runs report no MFU; the position
# embedding and class token stay out of weight decay as in the ViT.
@MODELS.register("conv_vit", kind="vision", kwargs=("stem_channels",), check=check_conv_vit, no_decay=VIT_NO_DECAY)
def build_conv_vit(m, components) -> nn.Module:
    model = build_vit(m, components)
    model.patch_embed.proj = conv_stem(m.in_chans, m.kwargs["stem_channels"], m.embed_dim)
    return model
