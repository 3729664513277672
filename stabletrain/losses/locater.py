"""LocAteR as a loss term (``regularizer=locater``); the maths is :mod:`stabletrain.layers.locater`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from stabletrain.errors import ConfigError
from stabletrain.layers.locater import locater_penalty
from stabletrain.losses import LOSS_TERMS


@dataclass
class LocaterParams:
    scale_coef: float = 100.0  # kappa1: weight of tr(W_QK^T W_QK), the eigenspectrum scale
    mean_coef: float = 1.0  # kappa2: weight of (tr(W_QK) - 1)^2, the eigenspectrum mean

    def __post_init__(self):
        if not (self.scale_coef >= 0 and self.mean_coef >= 0):
            raise ConfigError(f"regularizer.locater.scale_coef={self.scale_coef} and "
                              f"regularizer.locater.mean_coef={self.mean_coef} must be >= 0")


@LOSS_TERMS.register("locater", params=LocaterParams, reads_weights=True)
class Locater:
    """A penalty on the weights alone: the batch and logits are not used."""

    def __init__(self, p: LocaterParams):
        self.p = p

    def __call__(self, model: nn.Module, logits: Tensor, x: Tensor, y: Tensor, whole_weights=None) -> Tensor:
        return locater_penalty(model, self.p, whole_weights)
