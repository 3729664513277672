"""Token de-escalation ``X <- X - lambda * P X`` (002 Eq. 21; docs/methods.md §3).

``P X`` is the mean over tokens. ``lambda`` in [0, 1]: 0 does nothing, 1 centres the token
columns (complete de-escalation). Because ``P`` is a projection, one de-escalation takes the
token similarity ``s = ||PX||^2 / ||X||^2`` to ``(1-lambda)^2 s / (1 - (2 lambda - lambda^2) s)``.

Decisions (docs/methods.md §3):

- ``lambda_`` default 1.0 (our guess: the paper's value was lost; 1.0 is the only value its
  text singles out). ``learnable: true`` makes it a parameter (the paper says it can be,
  reports no such run); it is not clamped to [0, 1].
- Placement (``deescalate.placement``): ``block`` at the end of each block, after the second
  norm of a post-norm block (ViT/CIFAR); ``ffn`` on the residual stream entering the
  FFN, after the attention sub-layer (and its norm, post-norm), so the de-escalated ``X``
  feeds both the FFN and its residual path (Transformer-XL). ViT's class token is
  part of the mean; Swin averages over all tokens of the feature map.
- Causal models use the prefix mean over tokens ``<= t`` (our deviation, so no position
  sees the future); non-causal ones the full mean, as the paper. With ``lambda = 1`` the
  first causal token becomes exactly 0; every norm maps 0 to 0 with finite gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry, option_value


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_similarity(x: Tensor) -> Tensor:
    """``||P X||_F^2 / ||X||_F^2`` per sequence (full token mean), ``x`` of shape (B, tokens..., d).

    002 Def. 1.1: 1 exactly when all tokens are equal. **Decision:** a zero sequence has all
    rows equal and counts as 1 (the ratio is 0/0 there).
    """
    xf = _at_least_fp32(x).flatten(1, -2)
    num = xf.mean(1).pow(2).sum(-1) * xf.shape[1]
    den = xf.pow(2).sum((1, 2))
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(xf.dtype).tiny), torch.ones_like(den))


class Deescalate(nn.Module):
    """``x - lambda * mean_tokens(x)``; the prefix mean if ``causal`` (x of shape B, T, d).

    ``lambda_`` outside [0, 1] raises :class:`ConfigError`, unless ``learnable`` (not clamped)."""

    def __init__(self, lambda_: float = 1.0, learnable: bool = False, causal: bool = False):
        super().__init__()
        self.causal = causal
        if not learnable and not 0.0 <= float(lambda_) <= 1.0:
            raise ConfigError(f"deescalate.lambda_={lambda_} must be in [0, 1] (0 none, 1 complete; learnable is not "
                              "clamped)")
        lam = torch.tensor(float(lambda_))
        if learnable:
            self.lambda_ = nn.Parameter(lam)
        else:
            self.register_buffer("lambda_", lam)

    def token_mean(self, x: Tensor) -> Tensor:
        """Mean over the token dims (all but batch and width), prefix mean if causal."""
        xf = _at_least_fp32(x)
        if self.causal:
            if x.dim() != 3:
                raise ValueError(f"causal de-escalation needs (batch, tokens, width), got {tuple(x.shape)}")
            count = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=xf.dtype)
            return xf.cumsum(1) / count.view(-1, 1)
        return xf.mean(dim=tuple(range(1, x.dim() - 1)), keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        return (_at_least_fp32(x) - self.lambda_ * self.token_mean(x)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


# name -> ``(cfg, model_causal) -> (placement, module | None)``; info ``active=False`` for none
DEESCALATIONS = Registry("deescalate.name", __name__, declares=("active", "keys"), call="(cfg, model_causal)", returns=(
    lambda t: isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str)
    and (t[1] is None or isinstance(t[1], nn.Module)), "(placement, module or None)"))


def make_deescalate(cfg, model_causal: bool) -> tuple[str, nn.Module | None]:
    """``(placement, module)`` for ``cfg`` (``deescalate`` group): ``("none", None)`` when
    ``cfg.name`` is none, else ``cfg.placement``, ``block`` (end of block) or ``ffn`` (FFN
    input). ``cfg.causal`` null follows the model."""
    return DEESCALATIONS.make(cfg.name, cfg, model_causal)


@DEESCALATIONS.register("none", active=False)
def no_deescalation(cfg, model_causal: bool) -> tuple[str, None]:
    return "none", None


@DEESCALATIONS.register("deescalate")
def deescalation(cfg, model_causal: bool) -> tuple[str, nn.Module]:
    placement = option_value(cfg.placement)
    if placement not in ("block", "ffn"):
        raise ValueError(f"deescalate.placement={placement!r} must be block or ffn")
    causal = model_causal if cfg.causal is None else bool(cfg.causal)
    return placement, Deescalate(cfg.lambda_, cfg.learnable, causal)
