"""z-loss (PaLM, Chowdhery et al. 2022; docs/methods.md §9): ``coef * mean (log Z)^2``.

``log Z = logsumexp`` of the output logits of each position (GPT: every token; ViT/Swin: every
image). Pulling ``log Z`` towards 0 keeps the output logits from drifting to large values,
the output-logit divergence Wortsman et al. (2023) show at small scale; they use 1e-4.
Computed in fp32 whatever the autocast dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stabletrain.errors import ConfigError
from stabletrain.losses import LOSS_TERMS


@dataclass
class ZLossParams:
    coef: float = 1e-4

    def __post_init__(self):
        if not self.coef >= 0:
            raise ConfigError(f"regularizer.zloss.coef={self.coef} must be >= 0 (PaLM uses 1e-4)")


@LOSS_TERMS.register("zloss", params=ZLossParams)
class ZLoss:
    def __init__(self, p: ZLossParams):
        self.coef = p.coef

    def __call__(self, model: nn.Module, logits: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return self.coef * log_z(logits).pow(2).mean()


def log_z(logits: Tensor) -> Tensor:
    """The log-partition of each position's output distribution, in fp32."""
    return torch.logsumexp(logits.float(), dim=-1)
