"""Norm layers chosen by name (``norm`` config group): layernorm, rmsnorm, stablenorm, none."""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor, nn

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry, option_value


class StableNorm(nn.Module):
    """``gamma * d^alpha * x / sqrt(||x||^2 + eps)`` over the last dim (004 Eq. 2).

    ``alpha`` in [0, 0.5] (default 0.25, StableViT's, as under ``norm=stablenorm``): the output
    norm is ``d^alpha`` (times gamma); 0.5 is RMSNorm up to
    where eps enters (here ``eps`` sits beside ``||x||^2``, RMSNorm's beside ``mean(x^2)``, so
    StableNorm(alpha=0.5, eps) equals RMSNorm(eps / d)). ``alpha`` not a number in [0, 0.5], or
    ``eps`` negative, raises :class:`ConfigError` (``eps=0`` is allowed here; ``norm.eps`` must be > 0).

    ``eps_mode`` (docs/methods.md §5 decision): ``'sqrt'`` (default) follows the text, eps inside
    the root (004); ``'add'`` is the demo's ``||x|| + eps`` (004). ``eps``
    None is each mode's own (:func:`mode_eps`: 1e-5 under the root, the demo's 1e-8 added). A zero
    input (the first causal token after complete de-escalation, docs/methods.md §3) maps to 0
    with a finite gradient in both modes. Computed in fp32 under autocast.
    """

    def __init__(self, dim: int, alpha: float = 0.25, eps: float | None = None, eps_mode: str = "sqrt",
                 bias: bool = False):
        super().__init__()
        if not (isinstance(alpha, Real) and 0.0 <= alpha <= 0.5):
            raise ConfigError(f"StableNorm alpha={alpha!r} must be a number in [0, 0.5] (0.5 is RMSNorm)")
        if eps is not None and not (isinstance(eps, Real) and eps >= 0):
            raise ConfigError(f"StableNorm eps={eps!r} must be >= 0, or None for the eps_mode's default")
        if eps_mode not in ("sqrt", "add"):
            raise ConfigError(f"StableNorm eps_mode={eps_mode!r} must be 'sqrt' or 'add'")
        self.dim, self.alpha, self.eps, self.eps_mode = dim, alpha, mode_eps(eps, eps_mode), eps_mode
        self.scale = dim**alpha
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 in fp32, float64 kept
        sq = xf.pow(2).sum(-1, keepdim=True)
        if self.eps_mode == "sqrt":
            y = xf * torch.rsqrt(sq + self.eps)
        else:
            # vector_norm's backward is 0 at x = 0 where sqrt(sum x^2) would give NaN
            y = xf / (torch.linalg.vector_norm(xf, dim=-1, keepdim=True) + self.eps)
        y = (y * self.scale).to(x.dtype) * self.weight
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha={self.alpha}, eps={self.eps}, eps_mode={self.eps_mode}"


EPS_BY_MODE = {"sqrt": 1e-5, "add": 1e-8}  # 004: the text and the demo


def mode_eps(eps: float | None, eps_mode: str = "sqrt") -> float:
    """``eps``, or where it is None the default of ``eps_mode``: 1e-5 inside the root (the
    text), 1e-8 added to ``||x||`` (the demo; docs/methods.md §5)."""
    return EPS_BY_MODE[eps_mode] if eps is None else eps


def check_eps(eps, key: str) -> None:
    """The config's range for an eps key read by a builder (``norm.eps``, ``attention.eps``):
    > 0, or None for the eps mode's default (:func:`stabletrain.config.validate`'s message)."""
    if eps is not None and not (isinstance(eps, Real) and eps > 0):
        raise ConfigError(f"{key}={eps} must be > 0 or null")


NORMS = Registry("norm", __name__, declares=("layer", "keys"), call="(cfg, dim, *, bias, ln_eps)",
                 returns=(lambda m: isinstance(m, nn.Module), "the norm module (an nn.Module instance) of width dim"))


def make_norm(cfg, dim: int, *, bias: bool = True, ln_eps: float = 1e-5, **_factory_kwargs) -> nn.Module:
    """The norm ``cfg.name`` of width ``dim`` (``norm`` config group, docs/methods.md §5).

    ``ln_eps`` is the model family's LayerNorm eps (timm ViT 1e-6, Swin and nanoGPT 1e-5), kept
    so the default models stay identical to their reference; ``cfg.eps`` applies to rmsnorm and
    stablenorm (null: :func:`mode_eps`). ``bias=False`` drops the additive term (nanoGPT's LayerNorm).
    """
    return NORMS.make(cfg.name, cfg, dim, bias=bias, ln_eps=ln_eps)


def is_norm_layer(module: nn.Module) -> bool:
    """A normalisation layer: any registered norm's type or torch's own. Its vector ``weight``
    is a gain (no decay; AdamW² bounds it), whatever the layer is called."""
    return isinstance(module, _norm_types())


def _norm_types() -> tuple[type, ...]:
    own = tuple(e.info["layer"] for e in NORMS.entries() if e.info.get("layer") is not None)
    return own + (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


@NORMS.register("layernorm", layer=nn.LayerNorm)
def layernorm(cfg, dim: int, *, bias: bool, ln_eps: float) -> nn.Module:
    return nn.LayerNorm(dim, eps=ln_eps, bias=bias)


@NORMS.register("rmsnorm", layer=nn.RMSNorm)
def rmsnorm(cfg, dim: int, *, bias: bool, ln_eps: float) -> nn.Module:
    check_eps(cfg.eps, "norm.eps")
    return nn.RMSNorm(dim, eps=mode_eps(cfg.eps))


@NORMS.register("stablenorm", layer=StableNorm)
def stablenorm(cfg, dim: int, *, bias: bool, ln_eps: float) -> nn.Module:
    check_eps(cfg.eps, "norm.eps")
    return StableNorm(dim, alpha=cfg.alpha, eps=cfg.eps, eps_mode=option_value(cfg.eps_mode))


@NORMS.register("none")
def no_norm(cfg, dim: int, *, bias: bool, ln_eps: float) -> nn.Module:
    """Identity: only sensible with ``reparam=sigma``, which allows removing LayerNorm (001 App. C)."""
    return nn.Identity()
