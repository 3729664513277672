"""Weight initialisations chosen by name (``init`` config group; docs/methods.md §5 and §6).

``family`` (default) keeps each model's own init: timm ``trunc_normal(.02)`` for ViT/Swin,
GPT-2's ``N(0, .02)`` with residual projections scaled by ``1/sqrt(2 n_layer)``. The other
names re-draw every ``nn.Linear`` weight (biases set to 0) after the model is built:

- ``xavier``: ``N(0, std^2)``, ``std = gain * sqrt(2 / (n_in + n_out))`` (the AdamW² GPT
  recipe, 000 Table 2). Glorot's variance; drawn normal (not uniform) so that
  ``trunc_xavier`` is exactly its truncation.
- ``trunc_xavier``: the same normal truncated at ``+-2 std`` (our reading of 000 Table 2's
  "Truncated Xavier", ViT). As with timm's ``trunc_normal_``, ``std`` is the untruncated
  normal's; the drawn values' std is ``0.880 * std``.
- ``stable``: StableInit (004 Eq. 1), ``N(0, (gain / (sqrt(n_in) + sqrt(n_out)))^2)``,
  so ``E[sigma_max(W)] <= gain``.

Decisions:

- Only ``nn.Linear`` weights are touched, as StableInit's demo does (004): token
  and position embeddings, the patch-embedding conv, class token, Swin's relative-position
  tables and norms keep the family init; a tied ``lm_head`` (its weight is the embedding's)
  keeps the embedding's init; nanoGPT's residual-projection scaling is not applied (those
  projections are redrawn like every other linear layer).
- ``init.fused_qkv: slices`` (default): a fused ``qkv`` (``3d x d``) is three ``d x d``
  matrices that happen to share storage, each of q, k, v drawn as its own matrix with
  ``n_in = n_out = d`` (also timm's MoCo-v3 ViT init). ``matrix`` draws it as the one
  ``3d x d`` ``nn.Linear`` it is, as StableInit's demo does, which gives q, k, v a smaller
  std (``1/(sqrt(d) + sqrt(3d))`` instead of ``1/(2 sqrt(d))``).
- ``gain`` (``init.gain``, default 1.0) multiplies the std of all three; StableInit's paper
  suggests "smaller" for deeper networks without a value.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor, nn

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry, option_value
from stabletrain.layers.reparam import fused_qkv_layers, raw_weight

TRUNC_STDS = 2.0  # trunc_xavier cuts at +-2 std (our reading)

# name -> the matrix init ``(w, gain) -> w``, drawn in place; ``std=`` declares the untruncated
# std ``(n_in, n_out, gain) -> float`` it draws with. ``family`` keeps the model's own init.
INITS = Registry("init", __name__, declares=("std", "keys"), call="(weight, gain)")


def _xavier_std(n_in: int, n_out: int, gain: float) -> float:
    return gain * math.sqrt(2.0 / (n_in + n_out))


def _stable_std(n_in: int, n_out: int, gain: float) -> float:
    return gain / (math.sqrt(n_in) + math.sqrt(n_out))


@INITS.register("family")
def family(w: Tensor, gain: float = 1.0) -> Tensor:
    return w


@INITS.register("xavier", std=_xavier_std)
def xavier(w: Tensor, gain: float = 1.0) -> Tensor:
    return nn.init.normal_(w, std=_xavier_std(w.shape[1], w.shape[0], gain))


@INITS.register("trunc_xavier", std=_xavier_std)
def trunc_xavier(w: Tensor, gain: float = 1.0) -> Tensor:
    std = _xavier_std(w.shape[1], w.shape[0], gain)
    return nn.init.trunc_normal_(w, std=std, a=-TRUNC_STDS * std, b=TRUNC_STDS * std)


@INITS.register("stable", std=_stable_std)
def stable(w: Tensor, gain: float = 1.0) -> Tensor:
    return nn.init.normal_(w, std=_stable_std(w.shape[1], w.shape[0], gain))


def init_std(name: str, n_in: int, n_out: int, gain: float = 1.0) -> float:
    """The (untruncated) std that init ``name`` draws an ``n_out x n_in`` matrix with."""
    std = INITS.entry(name).info.get("std")
    if std is None:
        raise ConfigError(f"init={option_value(name)} has no std; choose one of: "
                          f"{', '.join(e.name for e in INITS.entries() if 'std' in e.info)}")
    return std(n_in, n_out, gain)


@torch.no_grad()
def init_matrix_(w: Tensor, name: str, gain: float = 1.0, kwargs: dict | None = None) -> Tensor:
    """Re-draw the matrix ``w`` (``n_out x n_in``, may be a view) in place with init ``name``;
    ``kwargs`` (``init.kwargs``) go to an init of the user's own. An init that returns a new
    tensor (``xavier_normal_(w) * scale``) instead of writing ``w`` has it copied in: dropped,
    its scale was silently lost while the start line named it."""
    out = INITS.get(name)(w, gain, **(kwargs or {}))
    if out is None or out is w or (torch.is_tensor(out) and out.data_ptr() == w.data_ptr()
                                   and out.shape == w.shape):
        return w
    if not torch.is_tensor(out) or out.shape != w.shape:
        got = f"a tensor of shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(f"init={option_value(name)} returned {got} for a weight of shape {tuple(w.shape)}: "
                          "an init writes the weight it is given in place, or returns a tensor of its shape")
    return w.copy_(out)


@torch.no_grad()
def apply_init(model: nn.Module, init_cfg) -> nn.Module:
    """Re-initialise ``model``'s linear layers per ``init_cfg`` (``name``, ``gain``); returns it.
    ``gain`` <= 0 or a ``fused_qkv`` other than slices or matrix raises :class:`ConfigError`."""
    name = option_value(init_cfg.name)
    if INITS.get(name) is family:
        return model
    if not (isinstance(init_cfg.gain, Real) and init_cfg.gain > 0):
        raise ConfigError(f"init.gain={init_cfg.gain} must be > 0")
    fused_qkv = option_value(getattr(init_cfg, "fused_qkv", "slices"))
    if fused_qkv not in ("slices", "matrix"):
        raise ConfigError(f"init.fused_qkv={fused_qkv} is not an option: use slices or matrix")
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    fused = fused_qkv_layers(model) if fused_qkv == "slices" else set()
    kwargs = dict(getattr(init_cfg, "kwargs", None) or {})
    for mod in model.modules():
        if not isinstance(mod, nn.Linear):
            continue
        w = raw_weight(mod)
        if id(w) in tied:
            continue
        for block in (w.chunk(3, dim=0) if id(mod) in fused else (w,)):
            init_matrix_(block, name, init_cfg.gain, kwargs)
        if mod.bias is not None:
            nn.init.zeros_(mod.bias)
    return model
