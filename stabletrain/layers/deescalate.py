"""Token de-escalation ``X <- X - lambda * P X`` (002 Eq. 21; SPEC section 3).

``P X`` is the mean over tokens. Non-causal models use the full mean, as the paper does;
causal models use the prefix mean over tokens ``<= t`` (our deviation) so no position sees
the future. With ``lambda = 1`` the first causal token becomes exactly 0; the following
norm's eps keeps it finite.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stabletrain.layers.norm import _enum


class Deescalate(nn.Module):
    def __init__(self, lambda_: float = 1.0, learnable: bool = False, causal: bool = False):
        super().__init__()
        self.causal = causal
        lam = torch.tensor(float(lambda_))
        if learnable:
            self.lambda_ = nn.Parameter(lam)
        else:
            self.register_buffer("lambda_", lam)

    def token_mean(self, x: Tensor) -> Tensor:
        """Mean over the token dims (all but batch and width), prefix mean if causal."""
        xf = x.float()
        if self.causal:
            count = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=torch.float32)
            return xf.cumsum(1) / count.view(-1, *([1] * (x.dim() - 2)))
        return xf.mean(dim=tuple(range(1, x.dim() - 1)), keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        return (x.float() - self.lambda_ * self.token_mean(x)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


def make_deescalate(cfg, model_causal: bool) -> tuple[str, nn.Module | None]:
    """``(placement, module)``: placement ``block`` (end of block) or ``ffn`` (FFN input)."""
    name = _enum(cfg.name)
    if name == "none":
        return "none", None
    causal = model_causal if cfg.causal is None else bool(cfg.causal)
    return name, Deescalate(cfg.lambda_, cfg.learnable, causal)
